//! One call, step by step: claim → checks → accepted → handler → final
//! receipt → delivery. Each step starts from the stored row and ends with a
//! transition of the lifecycle, so the same code resumes a call after a
//! crash, and a step that lost a race to another writer stops.
use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use toolrunner_protocol::wire::{Assignment, CallState, Claim, ReceiptKind};
use tracing::Instrument;

use super::{Active, CallKey, Core, checks, connection, outbox};
use crate::api::context::{CallContext, ProgressError};
use crate::api::handler::{Effect, ErasedTool, ToolError};
use crate::lifecycle::{self, Advanced, Event, FinalReceipt, InTransaction, Reads};
use crate::net::client::ClientError;
use crate::store::{LocalCall, LocalState, OutboxReceipt, ReceiptStatus, StoreTransaction};

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
    mut permit: Option<OwnedSemaphorePermit>,
    active: Active,
    known: Option<LocalCall>,
) {
    let key = active.key.clone();
    let span = tracing::info_span!("call", run_id = %key.run_id, call_id = %key.call_id);
    let result = tokio::select! {
        biased;
        // The executor stopped (dropped, crashed, detached): stop where we
        // are, as a lost process would.
        _ = core.done.cancelled() => return,
        r = steps(&core, &key, known, confirmed, &active.token).instrument(span) => r,
    };
    if let Err(e) = result
        && e != super::CRASH
    {
        tracing::warn!(run_id = %key.run_id, call_id = %key.call_id, error = %e, "call paused; it resumes from the store");
        if e.starts_with(DEFERRED) {
            // The platform has no capacity (or this executor drains): give
            // the slot to another call, and keep this one off for a while
            // rather than asking again at once.
            drop(permit.take());
            tokio::select! {
                _ = core.done.cancelled() => {}
                _ = tokio::time::sleep(core.cfg.poll_interval.clamp(
                    std::time::Duration::from_millis(50),
                    std::time::Duration::from_secs(1),
                )) => {}
            }
        }
        // The claim loop resumes it (the guard's drop wakes the loop).
        core.paused.store(true, std::sync::atomic::Ordering::SeqCst);
    }
    drop(active);
    drop(permit);
}

/// How a claim the platform asked to defer ends its step.
const DEFERRED: &str = "claim deferred";

/// How a step that would take work ends while the lease is not live.
const LEASE_NOT_LIVE: &str =
    "the executor's lease is not live (it could not be renewed): the call waits";

/// Right before a request that takes work goes out (each attempt of it):
/// the lease is live.
fn lease_live(core: &Core) -> Result<(), String> {
    if core.lease_live() {
        Ok(())
    } else {
        Err(LEASE_NOT_LIVE.into())
    }
}

/// The stored row of a call.
async fn read(core: &Core, key: &CallKey) -> Result<LocalCall, String> {
    core.store
        .call(&key.run_id, &key.call_id)
        .await
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("call {}/{} is not in the store", key.run_id, key.call_id))
}

/// The row after a transition (moved or not).
fn row(advanced: Advanced) -> Result<LocalCall, String> {
    match advanced {
        Advanced::Moved { call, .. } | Advanced::Stayed(Some(call)) => Ok(call),
        Advanced::Stayed(None) => Err("the call left the store".into()),
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
    known: Option<LocalCall>,
    mut confirmed: bool,
    cancel: &CancellationToken,
) -> Result<(), String> {
    let mut checked = false;
    // The `accepted` this task's claim just saved with the assignment.
    let mut saved_accepted: Option<OutboxReceipt> = None;
    // The final receipt this task's run just saved, if it did.
    let mut saved_final: Option<OutboxReceipt> = None;
    let mut call = match known {
        Some(c) => c,
        None => read(core, key).await?,
    };
    loop {
        let before = (call.state, call.version);
        let next = match call.state {
            LocalState::Claiming => {
                confirmed = false;
                let (next, saved) = Box::pin(claim(core, call)).await?;
                saved_accepted = saved.filter(|r| r.kind == ReceiptKind::Accepted);
                next
            }
            LocalState::Assigned => {
                let (next, mine) = Box::pin(accept(core, call, saved_accepted.take())).await?;
                confirmed = mine;
                next
            }
            LocalState::Running => {
                let (next, receipt) = Box::pin(run(core, call, !confirmed, cancel)).await?;
                // One confirmation starts one handler: a call found
                // `running` again is resumed as after a crash.
                confirmed = false;
                saved_final = receipt;
                next
            }
            LocalState::Settled => {
                // A call whose final receipt went out has nothing to
                // report; one that could not deliver may (the outbox loop
                // sends other calls' reports).
                let delivery = match saved_final.take() {
                    // Nothing before it but the `accepted`, which went out
                    // before the handler: sent as saved, without reading
                    // the outbox.
                    Some(r) if r.sequence == 1 => {
                        Box::pin(outbox::deliver_one(core, &r, Some(call))).await
                    }
                    _ => Box::pin(outbox::deliver_call(core, key, Some(call))).await,
                };
                if delivery != outbox::Delivery::Delivered {
                    Box::pin(outbox::flush_reports(core)).await;
                }
                return Ok(());
            }
            LocalState::ReconciliationRequired if !checked => {
                checked = true;
                match Box::pin(super::reconcile::check(core, call.clone(), cancel)).await? {
                    super::reconcile::Checked::Moved(next) => {
                        confirmed = next.state == LocalState::Running;
                        next
                    }
                    super::reconcile::Checked::Stays | super::reconcile::Checked::NotYet(_) => call,
                }
            }
            _ => {
                Box::pin(outbox::flush_reports(core)).await;
                return Ok(());
            }
        };
        if (next.state, next.version) == before && next.state != LocalState::ReconciliationRequired
        {
            // Nothing moved (another writer had the call, or the step waits).
            return Ok(());
        }
        call = next;
    }
}

/// Claim with the saved key. A refusal means nothing ran. Answers the row
/// after the claim, and the receipt saved with its assignment (`accepted`,
/// or the `failed` of a refusal before start), if one was.
async fn claim(
    core: &Arc<Core>,
    call: LocalCall,
) -> Result<(LocalCall, Option<OutboxReceipt>), String> {
    if core.stop.is_cancelled() {
        // The key stays saved: the next start claims with it.
        return Err("shutting down: the claim waits for the next start".into());
    }
    if !core.lease_live() {
        return Err(LEASE_NOT_LIVE.into());
    }
    let key = CallKey::of(&call);
    let used = call.operation_key.clone();
    let mut tries = 0;
    let claimed = loop {
        let connection_id = connection::connection_id(core)
            .await
            .map_err(|e| e.to_string())?;
        let body = Claim {
            executor_id: core.cfg.executor_id.clone(),
            connection_id: connection_id.clone(),
            operation_key: used.clone(),
        };
        let live = || lease_live(core);
        match core
            .client
            .claim(&call.run_id, &call.call_id, &body, &live)
            .await
        {
            Ok(c) => break c,
            Err(e) if tries < 3 && connection::handle_refusal(core, &connection_id, &e).await => {
                tries += 1
            }
            Err(ClientError::Unreachable(m)) => return Err(m),
            Err(e) => {
                if e.status() == Some(401) || e.code() == Some("missing_scope") {
                    core.fail(crate::Error::from(e.clone()));
                    return Err(e.to_string());
                }
                return match e.code() {
                    Some("capacity_exhausted" | "executor_draining") => {
                        Err(format!("{DEFERRED}: {e}"))
                    }
                    Some("lease_expired" | "connection_superseded") => Err(e.to_string()),
                    _ => {
                        let why = format!("claim refused, nothing ran: {e}");
                        let event = Event::ClaimRefused { why };
                        let moved = core
                            .advance(&key, Reads::Row, |s| {
                                s.call
                                    .as_ref()
                                    .filter(|c| {
                                        c.state == LocalState::Claiming && c.operation_key == used
                                    })
                                    .map(|_| event.clone())
                            })
                            .await
                            .map_err(|e| e.to_string())?;
                        row(moved).map(|c| (c, None))
                    }
                };
            }
        }
    };
    core.crash_point("after_claim_answer")?;
    let fresh = call.assignment.is_none();
    let reads = if fresh {
        Reads::Row
    } else {
        Reads::RowAndReceipts
    };
    // A first assignment is checked at once, and saved with what the
    // checks decide (`accepted`, or the refusal's `failed`): one durable
    // step instead of two. A crash before it leaves the call `claiming`
    // with its key, and the same claim brings the same assignment back.
    let then = if fresh && claimed.call_state == CallState::Claimed {
        Some(
            match first_checks(core, &call.tool_name, &claimed.assignment).await {
                Ok(()) => Event::AcceptedSaved,
                Err((code, message)) => {
                    tracing::info!(code, "refused before start; nothing ran");
                    Event::RefusedBeforeStart {
                        code: code.to_owned(),
                        message,
                    }
                }
            },
        )
    } else {
        None
    };
    let moved = core
        .advance_then(&key, Some(Some(call.clone())), reads, then, |s| {
            s.call
                .as_ref()
                .filter(|c| c.state == LocalState::Claiming && c.operation_key == used)?;
            let assignment = claimed.assignment.clone();
            Some(match claimed.call_state {
                CallState::Claimed if s.accepted_refused(&assignment.assignment_id) => {
                    Event::ClaimReturnedRefused { assignment }
                }
                CallState::Claimed => Event::ClaimAnswered { assignment },
                CallState::Pending => Event::ClaimRefused {
                    why: "the claim came back pending: nothing ran".into(),
                },
                st if st.is_terminal() => Event::ClaimFoundEnded {
                    assignment,
                    platform: st,
                },
                st => Event::ClaimFoundRunning {
                    assignment,
                    platform: st,
                },
            })
        })
        .await
        .map_err(|e| e.to_string())?;
    let (call, receipt) = match moved {
        Advanced::Moved { call, receipt } => (call, receipt),
        other => (row(other)?, None),
    };
    if call.assignment.is_some() && matches!(call.state, LocalState::Assigned | LocalState::Settled)
    {
        core.crash_point("after_assignment_saved")?;
    }
    match &receipt {
        Some(r) if r.kind == ReceiptKind::Accepted => core.crash_point("after_accepted_saved")?,
        Some(_) => core.crash_point("after_final_saved")?,
        None => {}
    }
    Ok((call, receipt))
}

/// The checks before anything runs, for a call of `tool_name` (refused if
/// this executor does not serve the tool).
async fn first_checks(
    core: &Core,
    tool_name: &str,
    asg: &Assignment,
) -> Result<(), checks::Refusal> {
    match core.tools.get(tool_name).cloned() {
        None => Err((
            "forbidden",
            "this executor does not serve the tool".to_owned(),
        )),
        Some(tool) => checks::before_start(core, tool.as_ref(), asg).await,
    }
}

/// The call's current assignment, or an error naming the state.
fn assignment(call: &LocalCall) -> Result<&Assignment, String> {
    call.assignment
        .as_ref()
        .ok_or_else(|| format!("an {} call has its assignment", call.state.as_str()))
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

/// Checks, then `accepted`; the handler may start only on `accepted: true`.
/// The flag returned says whether this task itself moved the call to
/// `running`. `saved`: the `accepted` this task's claim saved with the
/// assignment, if it did (no read needed to find it).
async fn accept(
    core: &Arc<Core>,
    call: LocalCall,
    saved: Option<OutboxReceipt>,
) -> Result<(LocalCall, bool), String> {
    let key = CallKey::of(&call);
    let asg = assignment(&call)?;
    let id = asg.assignment_id.clone();
    let stored = if let Some(r) = saved.filter(|r| r.assignment_id == id) {
        Some(r)
    } else {
        core.store
            .receipts(&call.run_id, &call.call_id)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .find(|r| r.assignment_id == id && r.kind == ReceiptKind::Accepted)
    };
    // The row as this task last saw it (the next transitions start from it).
    let mut known = call.clone();
    let accepted = match stored {
        Some(r) if matches!(r.status, ReceiptStatus::Pending | ReceiptStatus::Delivered) => r,
        Some(r) => {
            // Refused before, or never to be sent: claim again, and let the
            // platform's answer decide.
            let why = format!("the saved accepted is {}", r.status.as_str());
            let event = Event::AcceptRefusedPending {
                receipt_id: r.receipt_id,
                why,
            };
            let moved = core
                .advance(&key, Reads::Row, while_in(LocalState::Assigned, id, event))
                .await
                .map_err(|e| e.to_string())?;
            return Ok((row(moved)?, false));
        }
        None => {
            let refusal = first_checks(core, &call.tool_name, asg).await.err();
            if let Some((code, message)) = refusal {
                tracing::info!(code, "refused before start; nothing ran");
                let event = Event::RefusedBeforeStart {
                    code: code.to_owned(),
                    message,
                };
                let moved = core
                    .advance(&key, Reads::Row, while_in(LocalState::Assigned, id, event))
                    .await
                    .map_err(|e| e.to_string())?;
                let call = row(moved)?;
                if call.state == LocalState::Settled {
                    core.crash_point("after_final_saved")?;
                }
                return Ok((call, false));
            }
            match core
                .advance_from(
                    &key,
                    Some(Some(call.clone())),
                    Reads::Row,
                    while_in(LocalState::Assigned, id.clone(), Event::AcceptedSaved),
                )
                .await
                .map_err(|e| e.to_string())?
            {
                Advanced::Moved {
                    receipt: Some(r),
                    call: saved,
                } => {
                    core.crash_point("after_accepted_saved")?;
                    known = saved;
                    r
                }
                other => return Ok((row(other)?, false)),
            }
        }
    };
    // No handler may start on a lease that lapsed: the call waits,
    // `assigned`, with its `accepted` saved.
    if !core.lease_live() {
        return Err(LEASE_NOT_LIVE.into());
    }
    let answer = core
        .client
        .receipt_if(
            &call.run_id,
            &call.call_id,
            &asg.grant,
            &accepted.body,
            &|| lease_live(core),
        )
        .await;
    let event = match answer {
        Ok(answer) if answer.accepted == Some(true) => {
            core.crash_point("after_accepted_confirmed")?;
            Event::AcceptConfirmed {
                receipt_id: accepted.receipt_id,
            }
        }
        Ok(answer) => {
            let why = format!(
                "accepted answered false (call {})",
                answer.call_state.as_str()
            );
            if answer.call_state == CallState::Pending {
                Event::AcceptRefusedPending {
                    receipt_id: accepted.receipt_id,
                    why,
                }
            } else {
                Event::AcceptRefused {
                    receipt_id: accepted.receipt_id,
                    why,
                }
            }
        }
        Err(ClientError::Unreachable(m)) => return Err(m),
        Err(e) if e.status() == Some(401) || e.code() == Some("missing_scope") => {
            // Not a verdict on the call: keep the assignment and the saved
            // `accepted`, stop claiming, surface the configuration error.
            core.fail(crate::Error::from(e.clone()));
            return Err(e.to_string());
        }
        Err(e) => {
            let why = format!("accepted refused: {e}");
            if e.code() == Some("invalid_grant") {
                Event::AcceptRefusedPending {
                    receipt_id: accepted.receipt_id,
                    why,
                }
            } else {
                Event::AcceptRefused {
                    receipt_id: accepted.receipt_id,
                    why,
                }
            }
        }
    };
    let confirming = matches!(event, Event::AcceptConfirmed { .. });
    let moved = core
        .advance_from(
            &key,
            Some(Some(known)),
            Reads::Row,
            while_in(LocalState::Assigned, id, event),
        )
        .await
        .map_err(|e| e.to_string())?;
    let mine = confirming && matches!(moved, Advanced::Moved { .. });
    Ok((row(moved)?, mine))
}

/// Whether this build re-runs a write tool after a crash: a deliberate
/// bug, compiled only with `RUSTFLAGS='--cfg toolrunner_planted="rerun"'`,
/// which the simulation must catch (`docs/simulation.md`).
const PLANTED_RERUN: bool = cfg!(toolrunner_planted = "rerun");

/// Runs the handler (after `accepted: true`) and saves its outcome.
async fn run(
    core: &Arc<Core>,
    call: LocalCall,
    resumed: bool,
    cancel: &CancellationToken,
) -> Result<(LocalCall, Option<OutboxReceipt>), String> {
    let key = CallKey::of(&call);
    let asg = assignment(&call)?;
    let id = asg.assignment_id.clone();
    let tool = core.tools.get(&call.tool_name).cloned();
    let unknown = |why: &str| Event::OutcomeUnknown {
        why: why.to_owned(),
        evidence: None,
    };
    let stop = match &tool {
        None => Some(unknown(
            "running call of a tool this executor does not serve",
        )),
        // A transactional tool's writes commit with its final receipt: a
        // `running` row means none of them is stored, so it runs again.
        Some(t) if resumed && t.effect() == Effect::Write && !PLANTED_RERUN => Some(unknown(
            "the process stopped after accepted: the outcome is unknown",
        )),
        // A transactional tool runs again by the rule of a re-run: after a
        // live heartbeat (which also brings any cancellation of its run),
        // with no cancellation seen.
        Some(t) if resumed && t.effect() == Effect::Transactional => {
            if super::connection::lease_check(core).await.is_err() {
                return Err("a transactional call to run again waits for a live lease".into());
            }
            let cancelled = cancel.is_cancelled() || core.was_cancelled(&key);
            (cancelled && !super::recovery::PLANTED_RESUME).then_some(Event::TransactionalEnded)
        }
        Some(_) => None,
    };
    let Some(tool) = tool.filter(|_| stop.is_none()) else {
        let event = stop.unwrap_or_else(|| unknown("no tool"));
        let moved = core
            .advance(&key, Reads::Row, while_in(LocalState::Running, id, event))
            .await
            .map_err(|e| e.to_string())?;
        return Ok((row(moved)?, None));
    };
    if core.fence.is_cancelled() {
        return Err(super::CRASH.into());
    }
    let ctx = super::host::context_of(core, &call, asg, cancel.clone());
    // Dropped before the transaction is ended below (the executor stopped
    // or was lost): no kept task holds the call's transaction open.
    let _ends = ctx.ends_with_task();
    let outcome = attempt_handler(core, tool.as_ref(), &ctx, asg).await;
    // The transaction the handler opened, if it did: committed below with
    // a `completed` receipt, rolled back otherwise (before the call's
    // settlement is stored).
    let (outcome, transaction) = match ctx.end_transaction().await {
        Ok(t) => (outcome, t),
        Err(interrupted) => {
            interrupted.rollback().await;
            // Rolled back: the handler's own definite failure stands;
            // anything else is unknown (a transactional tool's: nothing
            // was written).
            let outcome = match outcome {
                Err(e @ (ToolError::Failed { .. } | ToolError::Cancelled { .. })) => Err(e),
                _ => Err(ToolError::unknown(
                    "the call's transaction was interrupted half-way (a dropped or panicking ctx.transaction)",
                )),
            };
            (outcome, None)
        }
    };
    core.crash_point("after_handler")?;
    let transactional = tool.effect() == Effect::Transactional;
    let event = outcome_event(asg, outcome, transactional);
    let completed = matches!(&event, Event::HandlerFinished { outcome } if outcome.kind == ReceiptKind::Completed);
    let transaction = match transaction {
        Some(tx) if !completed => {
            tx.rollback().await;
            None
        }
        tx => tx,
    };
    let moved = match transaction {
        Some(tx) => commit_in(core, &key, asg, tx, event.clone(), transactional).await?,
        None => core
            .advance_from(
                &key,
                Some(Some(call.clone())),
                Reads::Row,
                while_in(LocalState::Running, id, event.clone()),
            )
            .await
            .map_err(|e| e.to_string())?,
    };
    match moved {
        Advanced::Moved { call, receipt } => {
            if receipt.is_some() {
                core.crash_point("after_final_saved")?;
            }
            Ok((call, receipt))
        }
        Advanced::Stayed(now) => {
            // The call moved on while the handler ran (an operator settled
            // it): keep what the handler said, for the operator.
            let detail = format!("{event:?}");
            let _ = crate::lifecycle::note(
                core.store.as_ref(),
                (&key.run_id, &key.call_id),
                "handler outcome after the call moved on",
                Some(detail),
            )
            .await;
            now.map(|c| (c, None))
                .ok_or_else(|| "the call left the store".into())
        }
    }
}

/// Saves the call's `completed` (`event`) in the handler's own
/// transaction, after its business writes, and commits once: both are
/// stored or neither is. The decision is taken on the row as the
/// transaction itself reads it, locked until the commit, so a change
/// committed meanwhile (a progress receipt) cannot make it stale.
async fn commit_in(
    core: &Arc<Core>,
    key: &CallKey,
    asg: &Assignment,
    tx: StoreTransaction,
    event: Event,
    transactional: bool,
) -> Result<Advanced, String> {
    let id = asg.assignment_id.clone();
    // Nothing of the transaction is stored: the call settles as a handler
    // whose writes were lost (a transactional tool fails; a write tool's
    // other effects are unknown).
    let not_written = |e: String| {
        let why = format!("the call's transaction could not be written: {e}");
        outcome_event(asg, Err(ToolError::unknown(why)), transactional)
    };
    let held = |c: &LocalCall| {
        c.state == LocalState::Running
            && c.assignment
                .as_ref()
                .is_some_and(|a| a.assignment_id == asg.assignment_id)
    };
    let ended = lifecycle::advance_in(
        core.store.as_ref(),
        tx,
        &core.cfg.executor_id,
        (&key.run_id, &key.call_id),
        // The call moved on while the handler ran: its writes roll back.
        |now| now.call.as_ref().is_some_and(held).then_some(event),
        || core.fence.is_cancelled(),
    )
    .await;
    match ended {
        InTransaction::Done(advanced) => Ok(advanced),
        InTransaction::NotWritten(e) => {
            let event = not_written(e.to_string());
            core.advance(key, Reads::Row, while_in(LocalState::Running, id, event))
                .await
                .map_err(|e| e.to_string())
        }
        InTransaction::Refused(e) => Err(e),
        InTransaction::Halted => Err(super::CRASH.into()),
        // Not stored: the call waits in `running`, and is resumed as after
        // a crash (a transactional tool runs again).
        InTransaction::Lost(e) => Err(format!(
            "the handler's transaction did not commit, so nothing of it is stored: {e}"
        )),
    }
}

/// The lifecycle event for a handler's outcome. A transactional tool's
/// outcome is never unknown: whatever went wrong rolled its transaction
/// back, so nothing was written, and the call fails.
fn outcome_event(
    asg: &Assignment,
    outcome: Result<Value, ToolError>,
    transactional: bool,
) -> Event {
    match outcome_event_of(asg, outcome) {
        Event::OutcomeUnknown { why, .. } if transactional => {
            tracing::warn!(error = %why, "the call's transaction was rolled back: the call fails (transaction_rolled_back)");
            Event::HandlerFinished {
                outcome: FinalReceipt::failed(
                    "transaction_rolled_back",
                    &format!("{why}; the tool's transaction was rolled back: nothing was written"),
                ),
            }
        }
        Event::OutcomeUnknown { why, evidence } => {
            tracing::warn!(error = %why, "the outcome is unknown: reconciliation required");
            Event::OutcomeUnknown { why, evidence }
        }
        event => event,
    }
}

fn outcome_event_of(asg: &Assignment, outcome: Result<Value, ToolError>) -> Event {
    match outcome {
        Ok(result) => match checks::check_output(asg, &result) {
            Ok(()) => Event::HandlerFinished {
                outcome: FinalReceipt {
                    kind: ReceiptKind::Completed,
                    extra: json!({ "result": result }),
                },
            },
            Err(why) => Event::OutcomeUnknown {
                why,
                evidence: Some(result.to_string()),
            },
        },
        Err(ToolError::Failed { code, message }) => Event::HandlerFinished {
            outcome: FinalReceipt::failed(&code, &message),
        },
        Err(ToolError::Cancelled { reason }) => Event::HandlerFinished {
            outcome: FinalReceipt {
                kind: ReceiptKind::Cancelled,
                extra: json!({ "reason": reason }),
            },
        },
        Err(ToolError::Retry { reason, .. } | ToolError::Unknown { error: reason, .. }) => {
            Event::OutcomeUnknown {
                why: reason,
                evidence: None,
            }
        }
    }
}

async fn attempt_handler(
    core: &Arc<Core>,
    tool: &dyn ErasedTool,
    ctx: &CallContext,
    asg: &Assignment,
) -> Result<Value, ToolError> {
    let mut attempt = 0;
    let mut current = ctx.clone();
    loop {
        // A handler starts only on a live lease: whoever takes the identity
        // over waits the tool's commit window from its lapse.
        if let Err(e) = core.lease_live_or_stopped().await {
            return Err(ToolError::unknown(e));
        }
        let result = tokio::time::timeout(
            core.cfg.handler_timeout,
            guarded(tool, &current, asg.arguments.clone()),
        )
        .await;
        let result = match result {
            Ok(r) => r,
            Err(_) => Err(ToolError::unknown(format!(
                "the handler timed out after {:?}",
                core.cfg.handler_timeout
            ))),
        };
        match result {
            Err(ToolError::Retry { reason, .. }) if attempt + 1 < core.cfg.retry_attempts => {
                tracing::info!(attempt, %reason, "handler asked to retry; nothing happened");
                // Its transaction, if it opened one, is rolled back; the
                // next attempt begins another, and clones kept from this
                // one reach it no more.
                if let Ok(Some(tx)) | Err(tx) = current.end_attempt().await {
                    tx.rollback().await;
                }
                current = current.next_attempt();
                tokio::time::sleep(super::pause(core, attempt)).await;
                attempt += 1;
            }
            Err(ToolError::Retry { reason, .. }) => {
                tracing::warn!(%reason, "retries exhausted");
                return Err(ToolError::failed(
                    "retries_exhausted",
                    format!("the tool could not complete after {} attempts", attempt + 1),
                ));
            }
            other => return other,
        }
    }
}

/// Runs the handler so that a panic is an unknown outcome, not a crash.
async fn guarded(
    tool: &dyn ErasedTool,
    ctx: &CallContext,
    arguments: Value,
) -> Result<Value, ToolError> {
    super::unwind::catch(tool.call(ctx, arguments))
        .await
        .unwrap_or_else(|_| Err(ToolError::unknown("the handler panicked")))
}

/// Stores, then sends, a progress receipt (`CallContext::progress`).
pub(crate) async fn progress(
    core: &Arc<Core>,
    key: &CallKey,
    assignment_id: &str,
    message: &str,
    fraction: Option<f64>,
    data: Value,
) -> Result<(), ProgressError> {
    let event = Event::ProgressSaved {
        progress: json!({"message": message, "fraction": fraction, "data": data}),
    };
    let moved = core
        .advance(key, Reads::Row, |s| {
            s.call
                .as_ref()
                .filter(|c| {
                    matches!(
                        c.state,
                        LocalState::Running | LocalState::ReconciliationRequired
                    ) && c
                        .assignment
                        .as_ref()
                        .is_some_and(|a| a.assignment_id == assignment_id)
                })
                .map(|_| event.clone())
        })
        .await
        .map_err(|e| ProgressError(e.to_string()))?;
    match moved {
        Advanced::Moved {
            receipt: Some(r), ..
        } => {
            outbox::deliver_one(core, &r, None).await;
            Ok(())
        }
        Advanced::Moved { .. } => Err(ProgressError("no receipt was written".into())),
        Advanced::Stayed(now) => Err(ProgressError(format!(
            "the call is {}, no longer running",
            now.map_or("gone", |c| c.state.as_str())
        ))),
    }
}
