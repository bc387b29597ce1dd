//! The run step: the handler under its timeout, and its outcome settled (in
//! the handler's own transaction for a transactional tool).

use super::*;
use crate::api::transaction::Ended;

/// Runs the handler (after `accepted: true`) and saves its outcome.
pub(super) async fn run(
    core: &Arc<Core>,
    call: LocalCall,
    resumed: bool,
    cancel: &CancellationToken,
) -> Result<(LocalCall, Option<OutboxReceipt>), Pause> {
    let key = CallKey::of(&call);
    let asg = assignment(&call)?;
    let id = asg.assignment_id.clone();
    let tool = core.tools.get(&call.tool_name).cloned();
    let effect = tool.as_ref().map(|t| t.effect());
    let stop = match machine::resume::on_running(effect, resumed) {
        OnRunning::Run => None,
        OnRunning::Settle(event) => Some(event),
        // A transactional tool runs again by the rule of a re-run: after a
        // live heartbeat (which also brings any cancellation of its run),
        // with no cancellation seen, and the platform asked right before.
        OnRunning::CheckLease => {
            if super::super::connection::lease_check(core).await.is_err() {
                return Err(Pause::waits(
                    "a transactional call to run again waits for a live lease",
                ));
            }
            let cancelled = cancel.is_cancelled() || core.was_cancelled(&key);
            let mut again = machine::resume::transactional_again(cancelled, None)?;
            if again == Again::AskPlatform {
                let said = still_runs(core, &call, asg).await;
                again = machine::resume::transactional_again(cancelled, Some(said))?;
                match said {
                    Some(StillRuns::Ended) => {
                        tracing::info!(run_id = %key.run_id, call_id = %key.call_id, "the platform ended the transactional call: not run again");
                        core.remember_ended(&key);
                    }
                    Some(StillRuns::Forgotten) => {
                        tracing::info!(run_id = %key.run_id, call_id = %key.call_id, "the platform no longer knows the transactional call's run: not run again");
                        core.remember_ended(&key);
                    }
                    _ => {}
                }
            }
            match again {
                Again::Settle(event) => Some(event),
                Again::Run => None,
                // (The platform was asked: it is never asked twice.)
                Again::AskPlatform => {
                    return Err(Pause::waits(
                        "a transactional call to run again waits until the platform says that it still runs",
                    ));
                }
            }
        }
    };
    let Some(tool) = tool.filter(|_| stop.is_none()) else {
        let event = stop.unwrap_or_else(|| Event::OutcomeUnknown {
            why: "no tool".to_owned(),
            evidence: None,
        });
        let moved = core
            .advance(&key, Reads::Row, while_in(LocalState::Running, id, event))
            .await?;
        return Ok((row(moved)?, None));
    };
    if core.life.is_halted() {
        return Err(Pause::Halted);
    }
    let ctx = super::super::host::context_of(core, &call, asg, cancel.clone());
    // Dropped before the transaction is ended below (the executor stopped
    // or was lost): no kept task holds the call's transaction open.
    let _ends = ctx.ends_with_task();
    let started = std::time::Instant::now();
    let outcome = attempt_handler(core, tool.as_ref(), &ctx, asg)
        .instrument(tracing::info_span!("toolrunner.handler"))
        .await;
    let ran_for = started.elapsed().as_secs_f64();
    // The transaction the handler opened, if it did: committed below with
    // a `completed` receipt, rolled back otherwise (before the call's
    // settlement is stored).
    let (outcome, transaction, broken) = match ctx.end_transaction().await {
        Ended::None => (outcome, None, None),
        Ended::Open(t) => (outcome, Some(t), None),
        Ended::RolledBack { tx, why } => {
            if let Some(tx) = tx {
                tx.rollback().await;
            }
            // Rolled back: the handler's own definite failure stands;
            // anything else is unknown (a transactional tool's: nothing
            // was written).
            let outcome = match outcome {
                Err(e @ (ToolError::Failed { .. } | ToolError::Cancelled { .. })) => Err(e),
                _ => Err(ToolError::unknown(why)),
            };
            (outcome, None, None)
        }
        // A closure ended the transaction itself: nothing is settled on its
        // connection, and since what it wrote may be stored, the outcome
        // is unknown whatever the handler said (a transactional tool's
        // too), settled through the store's own fenced writes.
        Ended::Broken { tx, why } => {
            if let Some(tx) = tx {
                tx.rollback().await;
            }
            (outcome, None, Some(why))
        }
    };
    core.crash_point("after_handler")?;
    let transactional = tool.effect() == Effect::Transactional;
    let event = match broken {
        Some(why) => Event::OutcomeUnknown {
            why,
            evidence: None,
        },
        None if tool.effect() == Effect::Read => read_outcome_event(asg, outcome),
        None => outcome_event(asg, outcome, transactional),
    };
    let completed = matches!(&event, Event::HandlerFinished { outcome } if outcome.kind == ReceiptKind::Completed);
    // What the handler said, if its outcome is not the one stored.
    let said = match &event {
        Event::HandlerFinished { outcome } => outcome.kind.as_str(),
        _ => "reconciliation_required",
    };
    let transaction = match transaction {
        Some(tx) if !completed => {
            tx.rollback().await;
            None
        }
        tx => tx,
    };
    let moved = match transaction {
        Some(tx) => commit_in(core, &key, asg, tx, event.clone(), transactional).await?,
        None => {
            core.advance_from(
                &key,
                Some(Some(call.clone())),
                Reads::Row,
                while_in(LocalState::Running, id, event.clone()),
            )
            .await?
        }
    };
    // Counted once its outcome is stored, as stored (a transactional
    // tool's `completed` whose transaction could not be written is a
    // failure; a transactional call whose transaction did not commit is
    // counted when it runs again). When an operator settled the call
    // while the handler ran, what the handler said; a settlement that
    // could not be stored at all is not counted (the call is resumed by
    // the crash table).
    let stored = match &moved {
        Advanced::Moved { call, receipt } => telemetry::outcome_of(call.state, receipt.as_ref()).0,
        Advanced::Stayed(_) => said,
    };
    telemetry::tool_finished(&core.cfg.executor_id, &call.tool_name, stored, ran_for);
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
                .ok_or_else(|| Pause::waits("the call left the store"))
        }
    }
}

/// Whether the platform still has the call running under this assignment,
/// asked right now with a replay of its claim (the same operation key:
/// idempotent, it changes nothing, and it answers the call's current state
/// even after its run ended, §10). `None`: it cannot tell now (asked again
/// when the call is resumed next).
async fn still_runs(core: &Arc<Core>, call: &LocalCall, asg: &Assignment) -> Option<StillRuns> {
    // Once more after a reconnect (a lapsed lease, a superseded connection).
    for _ in 0..2 {
        let connection_id = connection::connection_id(core).await.ok()?;
        let body = Claim {
            executor_id: core.cfg.executor_id.clone(),
            connection_id: connection_id.clone(),
            operation_key: call.operation_key.clone(),
        };
        let live = || core.lease.live();
        match core
            .client
            .claim(&call.run_id, &call.call_id, &body, &live)
            .await
        {
            Ok(c) if c.replayed && c.assignment.assignment_id == asg.assignment_id => {
                return match c.call_state {
                    CallState::Running | CallState::ReconciliationRequired => Some(StillRuns::Yes),
                    s if s.is_terminal() => Some(StillRuns::Ended),
                    other => {
                        tracing::warn!(run_id = %call.run_id, call_id = %call.call_id, state = other.as_str(), "the platform's answer does not say whether the transactional call still runs; it waits");
                        None
                    }
                };
            }
            Ok(c) => {
                // Not this assignment any more: never run it again. A new
                // claim (the platform had given the call back, which it
                // never does to a running call) is given back at once.
                tracing::error!(run_id = %call.run_id, call_id = %call.call_id, replayed = c.replayed, "the platform no longer holds the transactional call under its assignment: not run again");
                if !c.replayed {
                    give_back(core, &connection_id, call).await;
                }
                return Some(StillRuns::Ended);
            }
            Err(ClientError::Api(e)) if e.status == 404 || e.code() == "unknown_call" => {
                return Some(StillRuns::Forgotten);
            }
            Err(ClientError::Api(e))
                if matches!(
                    e.code(),
                    "already_claimed" | "call_not_claimable" | "run_terminated"
                ) =>
            {
                return Some(StillRuns::Ended);
            }
            Err(e) => {
                if !connection::handle_refusal(core, &connection_id, &e).await {
                    tracing::warn!(run_id = %call.run_id, call_id = %call.call_id, error = %e, "cannot ask the platform whether the transactional call still runs; it waits");
                    return None;
                }
            }
        }
    }
    None
}

/// Gives back a claim this executor will not run (a `released` report),
/// as far as the platform answers.
async fn give_back(core: &Arc<Core>, connection_id: &str, call: &LocalCall) {
    let body = toolrunner_protocol::wire::Report {
        connection_id: connection_id.to_owned(),
        calls: vec![toolrunner_protocol::wire::CallReport {
            run_id: call.run_id.clone(),
            call_id: call.call_id.clone(),
            state: toolrunner_protocol::wire::ReportState::Released,
            reason: None,
            receipt_id: None,
        }],
    };
    if let Err(e) = core.client.report(&core.cfg.executor_id, &body).await {
        tracing::warn!(run_id = %call.run_id, call_id = %call.call_id, error = %e, "could not give back a claim this executor will not run");
    }
}

/// Saves the call's `completed` (`event`) in the handler's own
/// transaction, after its business writes, and commits once: both are
/// stored or neither is. The decision is taken on the row as the
/// transaction itself reads it, locked until the commit, so a change
/// committed meanwhile (a progress receipt) cannot make it stale.
pub(super) async fn commit_in(
    core: &Arc<Core>,
    key: &CallKey,
    asg: &Assignment,
    tx: StoreTransaction,
    event: Event,
    transactional: bool,
) -> Result<Advanced, Pause> {
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
        || core.life.is_halted(),
    )
    .await;
    match ended {
        InTransaction::Done(advanced) => Ok(advanced),
        InTransaction::NotWritten(e) => {
            let event = not_written(e.to_string());
            Ok(core
                .advance(key, Reads::Row, while_in(LocalState::Running, id, event))
                .await?)
        }
        InTransaction::Refused(e) => Err(Pause::Waits(e)),
        InTransaction::Halted => Err(Pause::Halted),
        // Not stored: the call waits in `running`, and is resumed as after
        // a crash (a transactional tool runs again).
        InTransaction::Lost(e) => Err(Pause::waits(format!(
            "the handler's transaction did not commit, so nothing of it is stored: {e}"
        ))),
    }
}

/// The lifecycle event for a handler's outcome. A transactional tool's
/// outcome is never unknown here (a closure that ended the transaction
/// itself was settled unknown before): whatever went wrong rolled its
/// transaction back, so nothing was written, and the call fails.
pub(super) fn outcome_event(
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

/// A read tool's outcome: a read has no effect to be unsure about (the
/// contract lets reads run again, §"Recovery" 7), so what would page a
/// person for a write (an error, a panic, a timeout, each retried first as
/// [`ToolError::Retry`] is by `attempt_handler`; a result its schema
/// refuses) fails the call with a code and a message safe for the model;
/// the cause is logged
/// (`docs/protocol.md`, choice 75).
fn read_outcome_event(asg: &Assignment, outcome: Result<Value, ToolError>) -> Event {
    match outcome_event_of(asg, outcome) {
        Event::OutcomeUnknown { why, .. } => {
            tracing::warn!(error = %why, "the read tool failed: the call fails (read_failed)");
            Event::HandlerFinished {
                outcome: FinalReceipt::failed(READ_FAILED, READ_FAILED_MESSAGE),
            }
        }
        event => event,
    }
}

/// The code of a read tool's call that failed with no business failure
/// of its own.
pub(crate) const READ_FAILED: &str = "read_failed";

/// Its message, for the model: no cause (an error's text may carry
/// internals), which the executor's log has.
const READ_FAILED_MESSAGE: &str =
    "the tool could not read what was asked; it may work if asked again later";

pub(super) fn outcome_event_of(asg: &Assignment, outcome: Result<Value, ToolError>) -> Event {
    match outcome {
        Ok(result) => match checks::check_output(asg, &result) {
            Ok(()) => Event::HandlerFinished {
                outcome: FinalReceipt {
                    kind: ReceiptKind::Completed,
                    extra: json!({ "result": result }),
                },
            },
            Err(why) => Event::OutcomeUnknown {
                why: why.0,
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

pub(super) async fn attempt_handler(
    core: &Arc<Core>,
    tool: &dyn ErasedTool,
    ctx: &CallContext,
    asg: &Assignment,
) -> Result<Value, ToolError> {
    let mut attempt = 0;
    let mut current = ctx.clone();
    let read = tool.effect() == Effect::Read;
    loop {
        // A handler starts only on a live lease: whoever takes the identity
        // over waits the tool's commit window from its lapse.
        if let Err(e) = core.lease_live_or_stopped().await {
            return Err(ToolError::unknown(e.to_string()));
        }
        let result = tokio::time::timeout(
            core.cfg.timing.handler_timeout,
            guarded(tool, &current, asg.arguments.clone()),
        )
        .await;
        let result = match result {
            Ok(r) => r,
            Err(_) => Err(ToolError::unknown(format!(
                "the handler timed out after {:?}",
                core.cfg.timing.handler_timeout
            ))),
        };
        let result = match result {
            // A read's error, panic or timeout changed nothing: it is
            // tried again as a retry is, then fails (read_outcome_event).
            Err(ToolError::Unknown { error, .. })
                if read && attempt + 1 < core.cfg.timing.retry_attempts =>
            {
                Err(ToolError::retry(error))
            }
            result => result,
        };
        match result {
            Err(ToolError::Retry { reason, .. })
                if attempt + 1 < core.cfg.timing.retry_attempts =>
            {
                tracing::info!(attempt, %reason, "handler asked to retry; nothing happened");
                // Its transaction, if it opened one, is rolled back; the
                // next attempt begins another, and clones kept from this
                // one reach it no more.
                match current.end_attempt().await {
                    // A closure ended the transaction itself: its effect
                    // may be stored, so nothing runs again.
                    Ended::Broken { tx, why } => {
                        if let Some(tx) = tx {
                            tx.rollback().await;
                        }
                        return Err(ToolError::unknown(why));
                    }
                    ended => ended.discard().await,
                }
                current = current.next_attempt();
                tokio::time::sleep(super::super::retry_delay(core, attempt)).await;
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
pub(super) async fn guarded(
    tool: &dyn ErasedTool,
    ctx: &CallContext,
    arguments: Value,
) -> Result<Value, ToolError> {
    super::super::unwind::catch(tool.call(ctx, arguments))
        .await
        .unwrap_or_else(|_| Err(ToolError::unknown("the handler panicked")))
}
