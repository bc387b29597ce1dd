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
                .await?;
            return Ok((row(moved)?, false));
        }
        None => {
            let refusal = super::claim::first_checks(core, &call.tool_name, asg)
                .await
                .err();
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
    if !core.lease_live() {
        return Err(Pause::LeaseNotLive);
    }
    let answer = core
        .client
        .receipt_if(
            &call.run_id,
            &call.call_id,
            &asg.grant,
            &accepted.body,
            &|| core.lease_live(),
        )
        .await;
    let event = match answer {
        Ok(answer) if answer.accepted == Some(true) => {
            core.crash_point("after_accepted_confirmed")?;
            Event::AcceptConfirmed {
                receipt_id: accepted.receipt_id,
            }
        }
        // A replay answered false while the platform holds the call
        // `reconciliation_required`: this `accepted` was confirmed once
        // (the call went `running` under this assignment; its answer was
        // lost: a crash, a dropped answer) and another store of this
        // executor id, which does not know the call, reported it since (a
        // lost store's replacement, a twin on another database: protocol
        // §4, "a call the local store does not know"). The platform waits
        // for a final receipt under this assignment, which only this store
        // holds: the call is where the crash table's "`accepted`
        // confirmed, no final receipt saved" leaves it, and is resumed so
        // (a write tool goes to `reconciliation_required`, a read tool runs
        // again, a transactional one runs again while the platform holds
        // it), never `abandoned` (docs/protocol.md, choice 76). It is not
        // `mine`: no handler starts as after its own confirmation.
        Ok(answer) if answer.replayed && answer.call_state == CallState::ReconciliationRequired => {
            tracing::warn!(run_id = %call.run_id, call_id = %call.call_id, "the platform holds this accepted and the call reconciliation_required (another store of this executor id reported it): resumed as after a crash");
            Event::AcceptFoundReconciling {
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
        Err(e @ (ClientError::Unreachable(_) | ClientError::NotReady(_))) => return Err(e.into()),
        Err(e) if e.status() == Some(401) || e.code() == Some("missing_scope") => {
            // Not a verdict on the call: keep the assignment and the saved
            // `accepted`, stop claiming, surface the configuration error.
            core.fail(crate::Error::from(e.clone()));
            return Err(Pause::waits(e.to_string()));
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
        .await?;
    let mine = confirming && matches!(moved, Advanced::Moved { .. });
    Ok((row(moved)?, mine))
}
