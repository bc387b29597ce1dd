//! The claim step: the operation key saved, the claim sent, its answer
//! recorded with the first checks.

use super::*;

/// Claim with the saved key. A refusal means nothing ran. Answers the row
/// after the claim, and the receipt saved with its assignment (`accepted`,
/// or the `failed` of a refusal before start), if one was.
pub(super) async fn claim(
    core: &Arc<Core>,
    call: LocalCall,
    hold: &ToolHold,
) -> Result<(LocalCall, Option<OutboxReceipt>), Pause> {
    if core.life.is_stopping() {
        // The key stays saved: the next start claims with it.
        return Err(Pause::waits(
            "shutting down: the claim waits for the next start",
        ));
    }
    if !core.lease.live() {
        return Err(Pause::LeaseNotLive);
    }
    let key = CallKey::of(&call);
    let used = call.operation_key.clone();
    let mut tries = 0;
    let claimed = loop {
        if tries > 0 && core.life.is_stopping() {
            // A drain began while the claim was asked again: it waits, with
            // its key, for the next start.
            return Err(Pause::waits(
                "shutting down: the claim waits for the next start",
            ));
        }
        let connection_id = connection::connection_id(core)
            .await
            .map_err(|e| Pause::waits(e.to_string()))?;
        let body = Claim {
            executor_id: core.cfg.executor_id.clone(),
            connection_id: connection_id.clone(),
            operation_key: used.clone(),
        };
        let live = || core.lease.live();
        let sent = std::time::Instant::now();
        let answer = core
            .client
            .claim(&call.run_id, &call.call_id, &body, &live)
            .await;
        let answered = !matches!(
            answer,
            Err(ClientError::Unreachable(_) | ClientError::NotReady(_))
        );
        if answered {
            let id = &core.cfg.executor_id;
            telemetry::claim_answered(id, &call.tool_name, sent.elapsed().as_secs_f64());
        }
        match answer {
            Ok(c) => {
                match c.call_state {
                    CallState::Pending => {
                        telemetry::claim_refused(&core.cfg.executor_id, "pending")
                    }
                    s if s.is_terminal() => {
                        telemetry::claim_refused(&core.cfg.executor_id, "call_ended");
                        core.calls.approvals.close(&key, "the call ended").await;
                    }
                    _ => {}
                }
                break c;
            }
            // Asked again on a new connection: not a refusal (yet).
            Err(e) if tries < 3 && connection::handle_refusal(core, &connection_id, &e).await => {
                tries += 1
            }
            Err(e) => {
                telemetry::claim_refused(&core.cfg.executor_id, &refusal_reason(&e));
                if e.code() == Some("run_terminated") {
                    core.calls.approvals.close(&key, "the run ended").await;
                }
                return claim_failed(core, &key, &used, e).await;
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
    let mut asked_approval = false;
    let then = if fresh && claimed.call_state == CallState::Claimed {
        Some(
            match first_checks(core, &call.tool_name, &claimed.assignment).await {
                // The call's concurrency key at its limit: the claim goes
                // back with nothing saved and nothing run, and backs off.
                Ok(()) if !key_allows(core, &key, &claimed.assignment, hold).await => {
                    Event::KeyLimited
                }
                // The tool's rate: the token reserved before the claim
                // becomes this `accepted`, or, lapsed (slow checks) or none
                // free, the claim goes back with nothing saved and nothing
                // run.
                Ok(())
                    if !token_or_lapse(
                        core,
                        &key,
                        &call.tool_name,
                        hold,
                        &claimed.assignment.assignment_id,
                    )
                    .await =>
                {
                    Event::RateLapsed
                }
                Ok(()) => Event::AcceptedSaved,
                Err((checks::AWAITS_APPROVAL, reason)) => {
                    // The request is stored (or asked again later): the
                    // claim is not yet saved as given back.
                    core.crash_point("after_approval_stored")?;
                    asked_approval = true;
                    Event::ApprovalAsked { reason }
                }
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
            let refused_before = s.accepted_refused(&claimed.assignment.assignment_id);
            Some(machine::claim::answered(&claimed, refused_before))
        })
        .await?;
    let (call, receipt) = match moved {
        Advanced::Moved { call, receipt } => (call, receipt),
        other => (row(other)?, None),
    };
    if call.assignment.is_some() && matches!(call.state, LocalState::Assigned | LocalState::Settled)
    {
        core.crash_point("after_assignment_saved")?;
    }
    if asked_approval && call.state == LocalState::Released {
        // Given back to wait for a person: its `released` not yet sent.
        core.crash_point("after_approval_released_saved")?;
    }
    match &receipt {
        Some(r) if r.kind == ReceiptKind::Accepted => core.crash_point("after_accepted_saved")?,
        Some(_) => core.crash_point("after_final_saved")?,
        None => {}
    }
    Ok((call, receipt))
}

/// A claim that did not take the call: why, and what it leaves (nothing
/// ran in any case).
async fn claim_failed(
    core: &Arc<Core>,
    key: &CallKey,
    used: &str,
    e: ClientError,
) -> Result<(LocalCall, Option<OutboxReceipt>), Pause> {
    let failed: Result<Claimed, ClientError> = Err(e);
    match machine::claim::on_reply(&answers::reply(&failed)) {
        // (Only an answer is recorded; a failure never comes here.)
        OnClaim::Record => Err(Pause::waits("the claim failed without an answer")),
        OnClaim::Wait(pause) => Err(pause),
        OnClaim::Configuration(pause) => {
            if let Err(e) = failed {
                core.fail(crate::Error::from(e));
            }
            Err(pause)
        }
        OnClaim::Refused(event) => {
            let moved = core
                .advance(key, Reads::Row, |s| {
                    s.call
                        .as_ref()
                        .filter(|c| c.state == LocalState::Claiming && c.operation_key == used)
                        .map(|_| event.clone())
                })
                .await?;
            row(moved).map(|c| (c, None))
        }
    }
}

/// Why a claim did not take the call, as a bounded label: the contract's
/// claim error codes, `lease_not_live` when nothing was sent, or
/// `unreachable` / `other`.
fn refusal_reason(e: &ClientError) -> String {
    match e {
        ClientError::NotReady(_) => "lease_not_live".into(),
        ClientError::Unreachable(_) => "unreachable".into(),
        _ => match (e.code(), e.status()) {
            (Some(code), _) if telemetry::REFUSAL_CODES.contains(&code) => code.into(),
            (_, Some(404)) => "not_found".into(),
            (_, Some(401)) => "unauthorized".into(),
            _ => "other".into(),
        },
    }
}

/// The checks before anything runs, for a call of `tool_name` (refused if
/// this executor does not serve the tool).
/// The token of the tool's rate for the first `accepted` of
/// `assignment_id`; `false`: none (lapsed, or none free), the claim goes
/// back and the call backs off.
pub(super) async fn token_or_lapse(
    core: &Core,
    key: &CallKey,
    tool: &str,
    hold: &ToolHold,
    assignment_id: &str,
) -> bool {
    if hold.take_token(assignment_id).await.is_ok() {
        return true;
    }
    core.calls.flow.lapsed(&core.cfg.executor_id, key, tool);
    telemetry::flow_released(&core.cfg.executor_id, tool, "rate_lapsed");
    false
}

/// After the claim, before `accepted`: a slot of the call's concurrency
/// key, taken into `hold` (`false`: the key is at its limit; the claim
/// goes back and the call backs off). A tool without a key function needs
/// none.
pub(super) async fn key_allows(
    core: &Core,
    key: &CallKey,
    asg: &Assignment,
    hold: &ToolHold,
) -> bool {
    let Some(tool) = core.tools.get(&asg.tool_name) else {
        return true;
    };
    let value = match tool.concurrency_key(&asg.arguments) {
        None => return true,
        Some(Ok(value)) => value,
        Some(Err(e)) => {
            // The checks read the arguments as the tool's type already:
            // not reached, but never a reason to hold the call back.
            tracing::warn!(error = %e, "the concurrency key could not be computed from the arguments: the call runs without its key's limit");
            return true;
        }
    };
    // Held and logged by its digest, never as the arguments' data.
    let value = crate::runner::flow::key_digest(&value);
    let flow = &core.calls.flow;
    let holder = core.flow_holder();
    if flow
        .take_key(holder.as_ref(), key, &asg.tool_name, &value, hold)
        .await
    {
        return true;
    }
    flow.key_limited(&core.cfg.executor_id, key, &asg.tool_name, &value);
    telemetry::flow_released(&core.cfg.executor_id, &asg.tool_name, "key_limited");
    false
}

pub(super) async fn first_checks(
    core: &Core,
    tool_name: &str,
    asg: &Assignment,
) -> Result<(), checks::Refusal> {
    let checked = async {
        match core.tools.get(tool_name).cloned() {
            None => Err((
                "forbidden",
                "this executor does not serve the tool".to_owned(),
            )),
            Some(tool) => checks::before_start(core, tool.as_ref(), asg).await,
        }
    };
    let span = tracing::info_span!(
        "toolrunner.checks",
        toolrunner.refused = tracing::field::Empty,
        toolrunner.approval = tracing::field::Empty
    );
    let verdict = checked.instrument(span.clone()).await;
    match &verdict {
        Err((checks::AWAITS_APPROVAL, _)) => {
            span.record("toolrunner.approval", "waiting");
        }
        Err((code, _)) => {
            span.record("toolrunner.refused", *code);
        }
        Ok(()) => {}
    }
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_not_sent_for_a_lapsed_lease_is_its_own_reason() {
        let not_sent = ClientError::NotReady("POST /v1/runs/r/tool-calls/c/claim".into());
        assert_eq!(refusal_reason(&not_sent), "lease_not_live");
        let down = ClientError::Unreachable(
            "POST /v1/runs/r/tool-calls/c/claim: connection refused".into(),
        );
        assert_eq!(refusal_reason(&down), "unreachable");
    }
}
