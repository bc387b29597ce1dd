//! One call, step by step: claim → checks → accepted → handler → final
//! receipt → delivery. Each step starts from the stored row and ends with a
//! transition of the lifecycle, so the same code resumes a call after a
//! crash, and a step that lost a race to another writer stops.
use std::sync::Arc;

use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use toolrunner_protocol::wire::{Assignment, CallState, Claim, Claimed, ReceiptKind};
use tracing::Instrument;

use super::flow::{Held, ToolHold};
use super::machine::accept::{OnAccepted, OnSaved, Saved};
use super::machine::claim::OnClaim;
use super::machine::resume::{Again, OnRunning, StillRuns};
use super::machine::step::Step;
use super::{
    Active, CallKey, Core, Pause, answers, checks, connection, machine, outbox, telemetry,
};
use crate::api::context::CallContext;
use crate::api::handler::{Effect, ErasedTool, ToolError};
use crate::lifecycle::{self, Advanced, Event, FinalReceipt, InTransaction, Reads};
use crate::net::client::ClientError;
use crate::store::{LocalCall, LocalState, OutboxReceipt, ReceiptStatus, StoreTransaction};

mod accept;
mod claim;
mod reconcile;
mod run;

use accept::accept;
use claim::claim;
pub(crate) use reconcile::{Checked, check};
use run::run;

/// Drives one call until it is final or must wait (platform unreachable,
/// capacity). Only the dispatch queue calls it ([`super::dispatch`]).
/// A call this task finds `running` is resumed as after a crash: only the
/// task that moved a call to `running` itself may start its handler
/// (`confirmed`). `known` is the row as the caller just wrote it, if it
/// did (saves the first read; the compare-and-set of each step still
/// guards it).
pub(super) async fn drive(
    core: Arc<Core>,
    confirmed: bool,
    // Boxed: held across every await of the drive (its key slot's mutex
    // and its permit would size every call in flight).
    mut held: Box<Held>,
    active: Active,
    known: Option<Box<LocalCall>>,
) {
    let key = active.key.clone();
    // Boxed while the drive holds it: a row moved out of a local still
    // takes its room in the future (rust-lang/rust#59123), so the drive
    // keeps a pointer and the steps' future holds the row.
    let row = match known {
        Some(c) => Ok(c),
        None => read(&core, &key).await.map(Box::new),
    };
    let (span, ended) = match row {
        Ok(call) => {
            let span = telemetry::call_span(
                &core.cfg.executor_id,
                &call,
                core.tools.get(&call.tool_name).map(|t| t.effect()),
            );
            // The steps' future is made inside the select, so the call's
            // state is held once (not also in a local moved into it).
            let ended = tokio::select! {
                biased;
                // The executor stopped (dropped, crashed, detached): stop
                // where we are, as a lost process would; the span says the
                // work was cut.
                _ = core.life.halted() => {
                    telemetry::finish(&span, "interrupted", None);
                    return;
                }
                r = steps(&core, &key, *call, confirmed, &active.token, &held.tool).instrument(span.clone()) => r,
            };
            (span, ended)
        }
        // The row could not be read: the span says which call paused.
        Err(e) => {
            let span = tracing::info_span!(
                "execute_tool",
                otel.name = "execute_tool",
                gen_ai.operation.name = "execute_tool",
                gen_ai.tool.call.id = key.call_id.as_str(),
                toolrunner.run_id = key.run_id.as_str(),
                toolrunner.executor_id = core.cfg.executor_id.as_str(),
                toolrunner.outcome = tracing::field::Empty,
                error.type = tracing::field::Empty,
                otel.status_code = tracing::field::Empty,
            );
            if core.life.is_halted() {
                // Stopped meanwhile: as above.
                telemetry::finish(&span, "interrupted", None);
                return;
            }
            (span, Err(e))
        }
    };
    match &ended {
        Ok((outcome, error_type)) => telemetry::finish(&span, outcome, error_type.as_deref()),
        Err(Pause::Halted) => {}
        Err(_) => telemetry::finish(&span, "paused", None),
    }
    let result = ended.map(|_| ());
    if let Err(e) = result
        && e != Pause::Halted
    {
        tracing::warn!(run_id = %key.run_id, call_id = %key.call_id, error = %e, "call paused; it resumes from the store");
        if matches!(e, Pause::Deferred(_)) {
            // The platform has no capacity (or this executor drains): give
            // the capacity slot to another call, and keep this one off for
            // a while rather than asking again at once (its tool's slot is
            // parked below: the call may still be claimed).
            drop(held.capacity.take());
            tokio::select! {
                _ = core.life.halted() => {}
                _ = tokio::time::sleep(core.cfg.timing.poll_interval.clamp(
                    std::time::Duration::from_millis(50),
                    std::time::Duration::from_secs(1),
                )) => {}
            }
        }
        // A paused call may still be claimed (or running) on the platform:
        // it keeps its tool's slot until it is picked up again.
        core.calls.flow.park(
            &core.cfg.executor_id,
            key.clone(),
            std::mem::take(&mut held.tool),
        );
        // The claim loop resumes it (the guard's drop wakes the loop).
        core.calls
            .paused
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
    // What it held goes back before the guard's drop wakes the claimer.
    drop(held);
    drop(active);
}

/// The stored row of a call.
async fn read(core: &Core, key: &CallKey) -> Result<LocalCall, Pause> {
    core.store
        .call(&key.run_id, &key.call_id)
        .await?
        .ok_or_else(|| {
            Pause::waits(format!(
                "call {}/{} is not in the store",
                key.run_id, key.call_id
            ))
        })
}

/// The row after a transition (moved or not).
fn row(advanced: Advanced) -> Result<LocalCall, Pause> {
    match advanced {
        Advanced::Moved { call, .. } | Advanced::Stayed(Some(call)) => Ok(call),
        Advanced::Stayed(None) => Err(Pause::waits("the call left the store")),
    }
}

/// The steps of one call. `confirmed` is true while the row's `running`
/// was written by this very task (its own `accepted: true`, or its own
/// automatic check allowing a re-run): only then may the handler start. A
/// `running` row found any other way is resumed as after a crash (a write
/// tool goes to `reconciliation_required`, a read tool runs again).
async fn steps(
    core: &Arc<Core>,
    key: &CallKey,
    mut call: LocalCall,
    mut confirmed: bool,
    cancel: &CancellationToken,
    hold: &ToolHold,
) -> Result<(&'static str, Option<String>), Pause> {
    let mut checked = false;
    // The `accepted` this task's claim just saved with the assignment.
    let mut saved_accepted: Option<OutboxReceipt> = None;
    // The final receipt this task's run just saved, if it did.
    let mut saved_final: Option<OutboxReceipt> = None;
    // The last final receipt this pass saved (a refusal's `failed` too),
    // for the span's outcome.
    let mut final_seen: Option<OutboxReceipt> = None;
    // Each step's future is boxed where it is awaited: the steps run one at
    // a time, and unboxed the largest (run, 12 KiB) would size the future
    // of every call in flight (`tests::a_call_s_future_stays_small`).
    loop {
        let before = (call.state, call.version);
        let next = match machine::step::next(call.state, checked) {
            Step::Claim => {
                confirmed = false;
                let (next, saved) = Box::pin(
                    claim(core, call, hold).instrument(tracing::info_span!("toolrunner.claim")),
                )
                .await?;
                if let Some(r) = saved.as_ref().filter(|r| r.kind.is_final()) {
                    final_seen = Some(r.clone());
                }
                saved_accepted = saved.filter(|r| r.kind == ReceiptKind::Accepted);
                next
            }
            Step::Accept => {
                let accepting = accept(core, call, saved_accepted.take(), hold)
                    .instrument(tracing::info_span!("toolrunner.accepted"));
                let (next, mine) = Box::pin(accepting).await?;
                confirmed = mine;
                next
            }
            Step::Run => {
                let (next, receipt) = Box::pin(run(core, call, !confirmed, cancel)).await?;
                // One confirmation starts one handler: a call found
                // `running` again is resumed as after a crash.
                confirmed = false;
                if let Some(r) = receipt.as_ref().filter(|r| r.kind.is_final()) {
                    final_seen = Some(r.clone());
                }
                saved_final = receipt;
                next
            }
            Step::Deliver => {
                // A call whose final receipt went out has nothing to
                // report; one that could not deliver may (the outbox loop
                // sends other calls' reports).
                let outcome = match &final_seen {
                    Some(r) => telemetry::outcome_of(call.state, Some(r)),
                    None => outcome_in_store(core, &call).await,
                };
                let first = tracing::info_span!("toolrunner.deliver");
                let delivery = match saved_final.take() {
                    // Nothing before it but the `accepted`, which went out
                    // before the handler: sent as saved, without reading
                    // the outbox.
                    Some(r) if r.sequence == 1 => {
                        Box::pin(outbox::deliver_one(core, &r, Some(call)).instrument(first)).await
                    }
                    _ => {
                        Box::pin(outbox::deliver_call(core, key, Some(call)).instrument(first))
                            .await
                    }
                };
                if delivery != outbox::Delivery::Delivered {
                    Box::pin(outbox::flush_reports(core)).await;
                }
                return Ok(outcome);
            }
            Step::Check => {
                checked = true;
                match Box::pin(reconcile::check(core, call.clone(), cancel)).await? {
                    Checked::Moved(next) => {
                        confirmed = next.state == LocalState::Running;
                        next
                    }
                    Checked::Stays | Checked::NotYet(_) => call,
                }
            }
            Step::Done => {
                Box::pin(outbox::flush_reports(core)).await;
                return Ok(outcome_in_store(core, &call).await);
            }
        };
        if (next.state, next.version) == before && next.state != LocalState::ReconciliationRequired
        {
            // Nothing moved (another writer had the call, or the step waits).
            return Ok(("waiting", None));
        }
        call = next;
    }
}

/// The outcome of a call this pass did not settle itself (its hook or a
/// former process did): the kind of its last final receipt, if it has
/// one; else the state it is in.
async fn outcome_in_store(core: &Core, call: &LocalCall) -> (&'static str, Option<String>) {
    if matches!(call.state, LocalState::Settled | LocalState::Delivered)
        && let Ok(receipts) = core.store.receipts(&call.run_id, &call.call_id).await
        && let Some(last) = receipts.iter().rev().find(|r| r.kind.is_final())
    {
        return telemetry::outcome_of(call.state, Some(last));
    }
    telemetry::outcome_of(call.state, None)
}

/// The call's current assignment, or an error naming the state.
fn assignment(call: &LocalCall) -> Result<&Assignment, Pause> {
    call.assignment
        .as_ref()
        .ok_or_else(|| Pause::waits(format!("an {} call has no assignment", call.state.as_str())))
}

/// Decides `event` if the call is still in `state` with `assignment_id`.
fn while_in(
    state: LocalState,
    assignment_id: String,
    event: Event,
) -> impl FnMut(&crate::lifecycle::Snapshot) -> Option<Event> {
    move |s| {
        s.call
            .as_ref()
            .filter(|c| {
                c.state == state
                    && c.assignment
                        .as_ref()
                        .is_some_and(|a| a.assignment_id == assignment_id)
            })
            .map(|_| event.clone())
    }
}

#[cfg(test)]
mod tests {

    use crate::runner::CallKey;
    use crate::runner::template::Template;

    /// At most this many bytes in the future of one call's drive (each
    /// call in flight holds one). Today 2,528 (debug), down from 4,592:
    /// the row handed to the drive is boxed until the steps take it (a
    /// `LocalCall` is 512 bytes, and a value moved out of a local still
    /// takes its room in a future, rust-lang/rust#59123), and the steps'
    /// future is made inside the select instead of in a local moved into
    /// it; what the call holds of its limits (`Held`) is boxed too (2,592
    /// with it inline, once per-key limits came). The steps themselves are 2,064 bytes; each step's own future
    /// is boxed where it is awaited (claim, accept and run are 9.5 to 12
    /// KiB each, and only one runs at a time).
    const MOST_BYTES: usize = 2560;

    /// The drive of one call, as the dispatch queue spawns it, stays small:
    /// a step that holds a large value across an `.await` makes every call
    /// in flight pay for it.
    #[tokio::test]
    async fn a_call_s_future_stays_small() {
        let (_dir, core) = Template::core_for_tests().await;
        let key = CallKey {
            run_id: "run_1".into(),
            call_id: "call_1".into(),
        };
        let active = core.activate(&key).expect("no task drives the call yet");
        let drive = super::drive(core.clone(), false, Box::default(), active, None);
        let bytes = std::mem::size_of_val(&drive);
        println!("a call's drive future: {bytes} bytes");
        assert!(
            bytes <= MOST_BYTES,
            "a call's drive future takes {bytes} bytes (at most {MOST_BYTES}): box the step that grew it, or keep its large values out of the state held across an .await"
        );
    }
}
