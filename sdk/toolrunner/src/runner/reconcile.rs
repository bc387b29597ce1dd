//! Automatic reconciliation: a call whose outcome is unknown is looked up by
//! its operation key through the tool's `reconcile` hook, at once, again on
//! a schedule with backoff, and at start-up.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use tokio_util::sync::CancellationToken;
use toolrunner_protocol::wire::ReceiptKind;

use super::{CallKey, Core, call, checks, outbox};
use crate::context::CallContext;
use crate::handler::Reconciled;
use crate::store::{CallFilter, Change, LocalCall, LocalState};

/// What an automatic check did.
#[allow(clippy::large_enum_variant)] // returned once per check
pub(crate) enum Checked {
    /// The call moved on (settled, or back to running for a re-run).
    Moved(LocalCall),
    /// Still unknown: a human decides.
    Stays,
}

/// Asks the tool's `reconcile` hook about one call in
/// `reconciliation_required`.
pub(crate) async fn check(core: &Arc<Core>, mut call: LocalCall) -> Result<Checked, String> {
    let (Some(tool), Some(asg)) = (
        core.tools.get(&call.tool_name).cloned(),
        call.assignment.clone(),
    ) else {
        return Ok(Checked::Stays);
    };
    if !core.cfg.auto_reconcile {
        return Ok(Checked::Stays);
    }
    let ctx = CallContext::new(core, &call, &asg, CancellationToken::new());
    let found = tool.reconcile(&ctx).await;
    let guard = Change::Expect {
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        states: vec![LocalState::ReconciliationRequired],
    };
    let (kind, extra, why) = match found {
        Reconciled::Unknown => {
            let note = Change::Note {
                run_id: call.run_id.clone(),
                call_id: call.call_id.clone(),
                what: "automatic check: unknown".into(),
                detail: None,
            };
            let _ = core.commit(vec![note], None).await;
            return Ok(Checked::Stays);
        }
        Reconciled::Happened(result) => {
            if let Err(e) = checks::check_output(&asg, &result) {
                let note = Change::Note {
                    run_id: call.run_id.clone(),
                    call_id: call.call_id.clone(),
                    what: "automatic check: result refused".into(),
                    detail: Some(e),
                };
                let _ = core.commit(vec![note], None).await;
                return Ok(Checked::Stays);
            }
            (
                ReceiptKind::Completed,
                json!({"result": result}),
                "automatic check: the operation happened",
            )
        }
        Reconciled::DidNotHappen if tool.rerun_when_not_performed() => {
            // Run again only with a live lease (its heartbeat also brings any
            // cancellation of the run): otherwise wait for the next check.
            if super::connection::lease_check(core).await.is_err() {
                return Ok(Checked::Stays);
            }
            call.state = LocalState::Running;
            call.reason =
                Some("automatic check: the operation did not happen; running it again".into());
            call.report = None;
            core.commit(vec![guard, Change::PutCall(call.clone())], Some(&call))
                .await
                .map_err(|e| e.to_string())?;
            return Ok(Checked::Moved(call));
        }
        Reconciled::DidNotHappen => (
            ReceiptKind::Failed,
            json!({"error": {"code": "not_performed", "message": "the operation was not performed"}}),
            "automatic check: the operation did not happen",
        ),
    };
    call.reason = Some(why.into());
    let call = call::save_final_guarded(core, call, kind, extra, Some(guard)).await?;
    Ok(Checked::Moved(call))
}

/// Checks every `reconciliation_required` call now and then, with backoff
/// per call (first pass at start-up).
pub(crate) async fn reconcile_loop(core: Arc<Core>) {
    let mut next: HashMap<CallKey, (Instant, Duration)> = HashMap::new();
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
                    .unwrap_or((now, core.cfg.reconcile_interval));
                if due > now {
                    continue;
                }
                let Some(token) = core.activate(&key) else {
                    continue;
                };
                // Re-read: the call may have been settled since the listing.
                let c = match core.store.call(&key.run_id, &key.call_id).await {
                    Ok(Some(fresh)) if fresh.state == LocalState::ReconciliationRequired => fresh,
                    _ => {
                        core.deactivate(&key);
                        continue;
                    }
                };
                match check(&core, c).await {
                    Ok(Checked::Moved(moved)) => {
                        next.remove(&key);
                        if moved.state == LocalState::Running {
                            // Still activated: the new task takes it over.
                            let permit = core.slots.clone().try_acquire_owned().ok();
                            call::spawn_activated(core.clone(), moved, false, permit, token);
                            continue;
                        }
                        outbox::deliver_call(&core, &key).await;
                    }
                    _ => {
                        next.insert(
                            key.clone(),
                            (now + wait, (wait * 2).min(Duration::from_secs(3600))),
                        );
                    }
                }
                core.deactivate(&key);
            }
        }
        tokio::select! {
            _ = core.done.cancelled() => return,
            _ = tokio::time::sleep(core.cfg.reconcile_interval.min(Duration::from_secs(5))) => {}
        }
    }
}
