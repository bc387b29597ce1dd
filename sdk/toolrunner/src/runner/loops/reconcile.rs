//! Automatic reconciliation: every call whose outcome is unknown is
//! checked (`runner/call/reconcile.rs`, started by the dispatch queue) at
//! start-up, then again on a schedule with backoff per call.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::dispatch::{self, CheckEnd, Work};
use super::super::{CallKey, Core};
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
                // Checked one at a time, in the order listed: the loop waits
                // for each check before it hands over the next.
                let ended = dispatch::done(&core, |done| Work::Check {
                    active,
                    call: Box::new(c),
                    done,
                })
                .await;
                match ended {
                    Some(CheckEnd::Moved) => {
                        next.remove(&key);
                    }
                    Some(CheckEnd::NotYet(after)) => {
                        next.insert(key.clone(), (after, wait));
                        not_yet.insert(key.clone(), after);
                    }
                    // The executor halted: nothing more is checked.
                    None if core.life.is_halted() => return,
                    // Still unknown, or the check could not finish (it
                    // panicked outside the hook's own guard).
                    Some(CheckEnd::Again) | None => {
                        next.insert(
                            key.clone(),
                            (now + wait, (wait * 2).min(Duration::from_secs(3600))),
                        );
                    }
                }
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
