//! Automatic reconciliation: every call whose outcome is unknown is
//! checked ([`call::reconcile`](super::call)) at start-up, then again on a
//! schedule with backoff per call.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::call::{Checked, check};
use super::{CallKey, Core, Pause, dispatch, outbox};
use crate::store::{CallFilter, LocalState};

/// Checks every `reconciliation_required` call now and then, with backoff
/// per call (first pass at start-up).
pub(crate) async fn reconcile_loop(core: Arc<Core>) {
    let mut next: HashMap<CallKey, (Instant, Duration)> = HashMap::new();
    // Calls not asked yet after a takeover, and when they may be.
    let mut not_yet: HashMap<CallKey, Instant> = HashMap::new();
    loop {
        let filter = CallFilter {
            states: vec![LocalState::ReconciliationRequired],
            ..CallFilter::default()
        };
        if let Ok(calls) = core.store.calls(&filter).await {
            for c in calls {
                let key = CallKey::of(&c);
                let now = Instant::now();
                let (due, wait) = next
                    .get(&key)
                    .copied()
                    .unwrap_or((now, core.cfg.timing.reconcile_interval));
                if due > now {
                    continue;
                }
                let Some(active) = core.activate(&key) else {
                    continue;
                };
                // Re-read: the call may have been settled since the listing.
                let c = match core.store.call(&key.run_id, &key.call_id).await {
                    Ok(Some(fresh)) if fresh.state == LocalState::ReconciliationRequired => fresh,
                    _ => continue,
                };
                let checked = super::unwind::catch(check(&core, c, &active.token))
                    .await
                    .unwrap_or_else(|panic| {
                        Err(Pause::waits(format!("the check panicked: {panic}")))
                    });
                match checked {
                    Ok(Checked::Moved(moved)) => {
                        next.remove(&key);
                        if moved.state == LocalState::Running {
                            // Still activated: the new task takes it over.
                            let permit = core.calls.slots.clone().try_acquire_owned().ok();
                            dispatch::submit_activated(&core, permit, active, Some(moved), true);
                            continue;
                        }
                        outbox::deliver_call(&core, &key, Some(moved)).await;
                    }
                    Ok(Checked::NotYet(after)) => {
                        next.insert(key.clone(), (after, wait));
                        not_yet.insert(key.clone(), after);
                    }
                    _ => {
                        next.insert(
                            key.clone(),
                            (now + wait, (wait * 2).min(Duration::from_secs(3600))),
                        );
                    }
                }
                drop(active);
            }
        }
        // The next pass: the usual interval, or sooner when a call not
        // asked yet after a takeover may be asked before it.
        let now = Instant::now();
        not_yet.retain(|_, after| *after > now);
        let soonest = not_yet.values().min().copied();
        let mut pause = core
            .cfg
            .timing
            .reconcile_interval
            .min(Duration::from_secs(5));
        if let Some(due) = soonest {
            pause = pause.min(due - now);
        }
        tokio::select! {
            _ = core.life.halted() => return,
            _ = tokio::time::sleep(pause.max(Duration::from_millis(10))) => {}
        }
    }
}
