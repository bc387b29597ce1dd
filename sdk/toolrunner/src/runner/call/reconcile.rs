//! The automatic check of a call whose outcome is unknown: the tool's
//! `reconcile` hook looks it up by its operation key. A step of the call
//! (the drive takes it once a call is `reconciliation_required`); the
//! reconciliation loop (`runner/loops/reconcile.rs`) asks it again on a
//! schedule.
use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::super::{CallKey, Core, Pause, checks, outbox};
use crate::api::handler::Reconciled;
use crate::lifecycle::{self, Advanced, Event, Reads, Snapshot};
use crate::store::{LocalCall, LocalState, StoreError};

/// What an automatic check did.
#[allow(clippy::large_enum_variant)] // returned once per check
pub(crate) enum Checked {
    /// The call moved on (settled, or back to running for a re-run).
    Moved(LocalCall),
    /// Still unknown: a human decides.
    Stays,
    /// Not asked yet: the identity was taken over, and its old holder may
    /// still be finishing the effect until then.
    NotYet(Instant),
}

/// Whether `accepted` of the call's current assignment was confirmed to
/// this store.
async fn accepted_confirmed(core: &Core, call: &LocalCall) -> Result<bool, StoreError> {
    let receipts = core.store.receipts(&call.run_id, &call.call_id).await?;
    let snapshot = Snapshot {
        call: Some(call.clone()),
        receipts: Some(receipts),
    };
    Ok(snapshot.accepted_confirmed() == Some(true))
}

/// Asks the tool's `reconcile` hook about one call in
/// `reconciliation_required`. `cancel` is the call's token while this
/// process drives it.
pub(crate) async fn check(
    core: &Arc<Core>,
    call: LocalCall,
    cancel: &CancellationToken,
) -> Result<Checked, Pause> {
    let span = super::super::telemetry::call_work_span!(
        "toolrunner.reconcile",
        core.cfg.executor_id.as_str(),
        call.run_id.as_str(),
        call.call_id.as_str()
    );
    let checked = check_now(core, call, cancel).instrument(span.clone()).await;
    let outcome = match &checked {
        Ok(Checked::Moved(next)) => next.state.as_str(),
        Ok(Checked::Stays) => "stays",
        Ok(Checked::NotYet(_)) => "not_yet",
        Err(_) => "paused",
    };
    span.record("toolrunner.outcome", outcome);
    checked
}

/// [`check`], inside its span.
async fn check_now(
    core: &Arc<Core>,
    call: LocalCall,
    cancel: &CancellationToken,
) -> Result<Checked, Pause> {
    let (Some(tool), Some(asg)) = (
        core.tools.get(&call.tool_name).cloned(),
        call.assignment.clone(),
    ) else {
        return Ok(Checked::Stays);
    };
    if !core.cfg.auto_reconcile {
        return Ok(Checked::Stays);
    }
    // After a takeover, the hook is asked only once the old holder's lease
    // lapsed plus the tool's commit window: an effect it was making is
    // made by then, and the hook finds it (never `not_performed`).
    if let Some(after) = core.lease.hooks_after(tool.commit_window())
        && Instant::now() < after
    {
        tracing::info!(run_id = %call.run_id, call_id = %call.call_id, wait_ms = (after - Instant::now()).as_millis() as u64, "the executor identity was taken over: the reconcile hook waits for the old holder's commit window");
        return Ok(Checked::NotYet(after));
    }
    let key = CallKey::of(&call);
    let at = (key.run_id.as_str(), key.call_id.as_str());
    let ctx = super::super::host::context_of(core, &call, &asg, cancel.clone());
    let _ends = ctx.ends_with_task();
    let found = super::super::unwind::catch(tool.reconcile(&ctx)).await;
    // A transaction the hook opened ends with its check, before anything
    // is stored for the call.
    ctx.end_transaction().await.discard().await;
    let found = match found {
        Ok(found) => found,
        Err(panic) => {
            tracing::error!(%panic, "the reconcile hook panicked; the call waits for a human or the next check");
            let _ = lifecycle::note(
                core.store.as_ref(),
                at,
                "automatic check: the hook panicked",
                Some(panic.0),
            )
            .await;
            return Ok(Checked::Stays);
        }
    };
    let event = match found {
        Reconciled::Unknown => {
            let _ =
                lifecycle::note(core.store.as_ref(), at, "automatic check: unknown", None).await;
            return Ok(Checked::Stays);
        }
        Reconciled::Happened(result) => {
            if let Err(e) = checks::check_output(&asg, &result) {
                let _ = lifecycle::note(
                    core.store.as_ref(),
                    at,
                    "automatic check: result refused",
                    Some(e.0),
                )
                .await;
                return Ok(Checked::Stays);
            }
            Event::HookHappened { result }
        }
        Reconciled::DidNotHappen if tool.rerun_when_not_performed() => {
            if !accepted_confirmed(core, &call).await? {
                // Never run under an assignment whose `accepted` this store
                // did not see confirmed: settle "not performed" instead.
                Event::HookDidNotHappen
            } else {
                // Run again only with a live lease; its heartbeat also
                // brings any cancellation of the run.
                if super::connection::lease_check(core).await.is_err() {
                    return Ok(Checked::Stays);
                }
                if cancel.is_cancelled() || core.was_cancelled(&key) {
                    Event::HookRunCancelled
                } else {
                    // The cancel notice may have been lost with its
                    // heartbeat answer: the platform says whether the call
                    // is still this executor's.
                    match outbox::still_bound(core, &call).await {
                        None => {
                            let _ = lifecycle::note(
                                core.store.as_ref(),
                                at,
                                "automatic check: did not happen; the platform could not say whether it may run again",
                                None,
                            )
                            .await;
                            return Ok(Checked::Stays);
                        }
                        Some(outbox::Bound::Yes) => Event::HookRerun,
                        Some(outbox::Bound::Ended) => {
                            tracing::info!(run_id = %call.run_id, call_id = %call.call_id, "the platform ended the call: not run again");
                            core.remember_ended(&key);
                            Event::HookRunCancelled
                        }
                        Some(outbox::Bound::Forgotten(why)) => {
                            tracing::warn!(run_id = %call.run_id, call_id = %call.call_id, "the platform does not know this call: orphaned, not run again");
                            core.remember_ended(&key);
                            Event::HookRunForgotten { why }
                        }
                    }
                }
            }
        }
        Reconciled::DidNotHappen => Event::HookDidNotHappen,
    };
    let reads = if matches!(event, Event::HookRerun) {
        Reads::RowAndReceipts
    } else {
        Reads::Row
    };
    let moved = core
        .advance(&key, reads, |s| {
            // Only on the attempt the hook was asked about.
            s.call
                .as_ref()
                .filter(|c| {
                    c.state == LocalState::ReconciliationRequired
                        && c.operation_key == call.operation_key
                })
                .map(|_| event.clone())
        })
        .await?;
    match moved {
        Advanced::Moved { call, receipt } => {
            if receipt.is_some() {
                core.crash_point("after_final_saved")?;
            }
            Ok(Checked::Moved(call))
        }
        Advanced::Stayed(_) => Ok(Checked::Stays),
    }
}
