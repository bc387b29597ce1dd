//! The accept step: `accepted` saved, sent, and its answer acted on.

use super::*;

/// Checks, then `accepted`; the handler may start only on `accepted: true`.
/// The flag returned says whether this task itself moved the call to
/// `running`. `saved`: the `accepted` this task's claim saved with the
/// assignment, if it did (no read needed to find it).
pub(super) async fn accept(
    core: &Arc<Core>,
    call: LocalCall,
    saved: Option<OutboxReceipt>,
    hold: &ToolHold,
) -> Result<(LocalCall, bool), Pause> {
    let key = CallKey::of(&call);
    let asg = assignment(&call)?;
    let id = asg.assignment_id.clone();
    let stored = if let Some(r) = saved.filter(|r| r.assignment_id == id) {
        Some(r)
    } else {
        core.store
            .receipts(&call.run_id, &call.call_id)
            .await?
            .into_iter()
            .find(|r| r.assignment_id == id && r.kind == ReceiptKind::Accepted)
    };
    // The row as this task last saw it (the next transitions start from it).
    let mut known = call.clone();
    let saved = match &stored {
        None => Saved::None,
        Some(r) if matches!(r.status, ReceiptStatus::Pending | ReceiptStatus::Delivered) => {
            Saved::Sendable
        }
        Some(r) => Saved::Spent {
            receipt_id: r.receipt_id.clone(),
            status: r.status.as_str().to_owned(),
        },
    };
    let accepted = match (machine::accept::on_saved(&saved), stored) {
        (OnSaved::Send, Some(r)) => r,
        // Refused before, or never to be sent: claim again, and let the
        // platform's answer decide.
        (OnSaved::Reclaim(event), _) => {
            let moved = core
                .advance(&key, Reads::Row, while_in(LocalState::Assigned, id, event))
                .await?;
            return Ok((row(moved)?, false));
        }
        (OnSaved::Send | OnSaved::CheckThenSave, _) => {
            let refusal = super::claim::first_checks(core, &call.tool_name, asg)
                .await
                .err();
            if let Some((checks::AWAITS_APPROVAL, reason)) = refusal {
                core.crash_point("after_approval_stored")?;
                let event = Event::ApprovalAsked { reason };
                let moved = core
                    .advance(&key, Reads::Row, while_in(LocalState::Assigned, id, event))
                    .await?;
                let call = row(moved)?;
                if call.state == LocalState::Released {
                    core.crash_point("after_approval_released_saved")?;
                }
                return Ok((call, false));
            }
            if let Some((code, message)) = refusal {
                tracing::info!(code, "refused before start; nothing ran");
                let event = Event::RefusedBeforeStart {
                    code: code.to_owned(),
                    message,
                };
                let moved = core
                    .advance(&key, Reads::Row, while_in(LocalState::Assigned, id, event))
                    .await?;
                let call = row(moved)?;
                if call.state == LocalState::Settled {
                    core.crash_point("after_final_saved")?;
                }
                return Ok((call, false));
            }
            // The call's concurrency key: at its limit, the claim goes back
            // (nothing saved, nothing ran) and the call backs off.
            if !super::claim::key_allows(core, &key, asg, hold).await {
                let moved = core
                    .advance(
                        &key,
                        Reads::Row,
                        while_in(LocalState::Assigned, id, Event::KeyLimited),
                    )
                    .await?;
                return Ok((row(moved)?, false));
            }
            // The tool's rate: the token reserved at the claim becomes this
            // send, or, lapsed or none free, the claim goes back (nothing
            // saved, nothing ran) rather than an `accepted` outside the
            // window.
            if !super::claim::token_or_lapse(core, &key, &call.tool_name, hold, &id).await {
                let moved = core
                    .advance(
                        &key,
                        Reads::Row,
                        while_in(LocalState::Assigned, id, Event::RateLapsed),
                    )
                    .await?;
                return Ok((row(moved)?, false));
            }
            match core
                .advance_from(
                    &key,
                    Some(Some(call.clone())),
                    Reads::Row,
                    while_in(LocalState::Assigned, id.clone(), Event::AcceptedSaved),
                )
                .await?
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
    if !core.lease.live() {
        return Err(Pause::LeaseNotLive);
    }
    // Counted against the tool's rate until a window after its answer. An
    // `accepted` saved before (by this task's claim step, or before a
    // pause or a restart) waits for a free token if it has none: the call
    // is claimed already, and waits at most about a window.
    while hold.take_token(&id).await.is_err() {
        let wait = hold
            .token_frees_in()
            .unwrap_or(std::time::Duration::from_millis(50))
            .max(std::time::Duration::from_millis(5));
        tokio::time::sleep(wait).await;
    }
    let answer = core
        .client
        .receipt_if(
            &call.run_id,
            &call.call_id,
            &asg.grant,
            &accepted.body,
            &|| core.lease.live(),
        )
        .await;
    hold.token_answered().await;
    let event = match machine::accept::on_reply(&answers::reply(&answer), &accepted.receipt_id) {
        OnAccepted::Confirmed(event) => {
            core.crash_point("after_accepted_confirmed")?;
            // The platform holds the `accepted` a person's approval let
            // through (if one did): nothing consults the request again.
            core.calls.approvals.outcome_saved(&key).await;
            event
        }
        OnAccepted::Record(event) => {
            if matches!(event, Event::AcceptFoundReconciling { .. }) {
                tracing::warn!(run_id = %call.run_id, call_id = %call.call_id, "the platform holds this accepted and the call reconciliation_required (another store of this executor id reported it): resumed as after a crash");
            }
            event
        }
        OnAccepted::Wait(pause) => return Err(pause),
        OnAccepted::Configuration(pause) => {
            // Not a verdict on the call: keep the assignment and the saved
            // `accepted`, stop claiming, surface the configuration error.
            if let Err(e) = answer {
                core.fail(crate::Error::from(e));
            }
            return Err(pause);
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
        .await?;
    let mine = confirming && matches!(moved, Advanced::Moved { .. });
    Ok((row(moved)?, mine))
}
