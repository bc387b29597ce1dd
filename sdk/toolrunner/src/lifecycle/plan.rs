//! The plan of a transition: pure, from the stored row, the event and what
//! is given (the clock, the ids).

use super::*;

/// A transition the table does not allow from the stored state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("transition {event} is not allowed from {from}")]
pub(crate) struct NotAllowed {
    pub(crate) event: &'static str,
    pub(crate) from: &'static str,
}

/// A planned transition: the new row and everything written with it, in
/// one commit.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) call: LocalCall,
    pub(crate) changes: Vec<Change>,
    pub(crate) receipt: Option<OutboxReceipt>,
}

/// A new receipt id (UUIDv7).
pub(super) fn receipt_id() -> String {
    format!("rcp_{}", uuid::Uuid::now_v7().simple())
}

/// A new operation key: random, never derived from the call.
pub(crate) fn operation_key() -> String {
    format!("op_{}", uuid::Uuid::new_v4().simple())
}

/// A receipt of the call's current assignment at its next sequence.
pub(super) fn receipt_for(
    given: &Given<'_>,
    call: &LocalCall,
    kind: ReceiptKind,
    extra: Value,
) -> Result<OutboxReceipt, NotAllowed> {
    let executor_id = given.executor_id;
    let asg = call.assignment.as_ref().ok_or(NotAllowed {
        event: "receipt without an assignment",
        from: call.state.as_str(),
    })?;
    let id = given.receipt_id.clone();
    let mut body = json!({
        "receipt_id": id, "executor_id": executor_id, "assignment_id": asg.assignment_id,
        "sequence": call.next_sequence, "kind": kind.as_str(),
    });
    if let (Some(b), Value::Object(extra)) = (body.as_object_mut(), extra) {
        b.extend(extra);
    }
    Ok(OutboxReceipt {
        receipt_id: id,
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        assignment_id: asg.assignment_id.clone(),
        kind,
        sequence: call.next_sequence,
        body: body.to_string(),
        status: ReceiptStatus::Pending,
        attempts: 0,
        last_error: None,
        created_at: given.now,
        delivered_at: None,
    })
}

pub(crate) fn mark(
    receipt_id: &str,
    status: ReceiptStatus,
    error: Option<String>,
    attempt: bool,
) -> Change {
    Change::ReceiptStatus {
        receipt_id: receipt_id.to_owned(),
        status,
        error,
        attempt,
    }
}

/// Every still pending receipt of `call` marked orphaned (the platform no
/// longer knows its run), with `why`.
fn orphan_pending(call: &LocalCall, why: String) -> Change {
    Change::SettlePending {
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        keep: None,
        only_kind: None,
        status: ReceiptStatus::Orphaned,
        error: why,
    }
}

pub(super) fn attempt(
    call: &LocalCall,
    given: &Given<'_>,
    assignment: Option<&Assignment>,
) -> Change {
    let executor_id = given.executor_id;
    Change::AddAttempt(Attempt {
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        operation_key: call.operation_key.clone(),
        executor_id: Some(executor_id.to_owned()),
        assignment_id: assignment.map(|a| a.assignment_id.clone()),
        created_at: given.now,
    })
}

/// The longest evidence kept in one timeline entry.
pub(super) const EVIDENCE_BYTES: usize = 64 * 1024;

pub(super) fn clip(mut s: String) -> String {
    if s.len() > EVIDENCE_BYTES {
        let mut end = EVIDENCE_BYTES;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push_str("… (cut)");
    }
    s
}

/// Plans `event` on the stored call. Pure: it reads nothing and writes
/// nothing; [`advance`] commits the plan.
///
/// # Errors
/// [`NotAllowed`] when the table has no row for the event from the stored
/// state, or the event's own condition does not hold.
pub(crate) fn plan(
    snapshot: &Snapshot,
    key: (&str, &str),
    event: Event,
    executor_id: &str,
) -> Result<Plan, NotAllowed> {
    plan_with(snapshot, key, event, &Given::now(executor_id))
}

/// What a plan is given from outside, so that [`plan_with`] is a pure
/// function of its arguments: who plans, the time, and the id of the
/// receipt the transition may write.
#[derive(Debug, Clone)]
pub(crate) struct Given<'a> {
    pub(crate) executor_id: &'a str,
    pub(crate) now: Timestamp,
    pub(crate) receipt_id: String,
}

impl<'a> Given<'a> {
    /// The clock's time and a new receipt id.
    pub(crate) fn now(executor_id: &'a str) -> Given<'a> {
        Given {
            executor_id,
            now: now(),
            receipt_id: receipt_id(),
        }
    }
}

/// [`plan`] with the clock and the ids passed in: the same arguments give
/// the same plan.
///
/// # Errors
/// As [`plan`].
pub(crate) fn plan_with(
    snapshot: &Snapshot,
    key: (&str, &str),
    event: Event,
    given: &Given<'_>,
) -> Result<Plan, NotAllowed> {
    let name = event.name();
    let rule = rule(name).ok_or(NotAllowed {
        event: name,
        from: "any state (no such row)",
    })?;
    let current = snapshot.call.as_ref();
    let refuse = |from: &'static str| NotAllowed { event: name, from };
    let allowed = match current {
        None => rule.from.is_empty(),
        Some(c) => rule.from.contains(&c.state),
    };
    if !allowed {
        return Err(refuse(
            current.map_or("a call not yet stored", |c| c.state.as_str()),
        ));
    }
    let now = given.now;
    let call = match current {
        Some(c) => c.clone(),
        None => LocalCall {
            // The time given, not the clock's: the same arguments, the
            // same plan.
            created_at: now,
            ..LocalCall::new(
                key.0.to_owned(),
                key.1.to_owned(),
                String::new(),
                String::new(),
                Claiming,
            )
        },
    };
    let from_state = current.map(|c| c.state);
    let mut draft = Draft {
        call,
        changes: Vec::new(),
        receipt: None,
        note: None,
    };
    apply_event(&mut draft, event, snapshot, from_state, given)?;
    let Draft {
        mut call,
        mut changes,
        receipt,
        note,
    } = draft;
    // The state comes from the table, and from nowhere else.
    if let To::State(s) = rule.to {
        call.state = s;
    }
    // An `accepted` is saved only in `assigned`, so only a call leaving
    // `assigned` or `claiming` can hold one that will never be sent.
    if matches!(from_state, Some(Assigned | Claiming)) && !matches!(call.state, Assigned | Claiming)
    {
        changes.push(Change::SettlePending {
            run_id: call.run_id.clone(),
            call_id: call.call_id.clone(),
            keep: None,
            only_kind: Some(ReceiptKind::Accepted),
            status: ReceiptStatus::Superseded,
            error: format!("never sent: the call went {}", call.state.as_str()),
        });
    }
    call.version = current.map_or(0, |c| c.version + 1);
    call.updated_at = now;
    let key = (call.run_id.clone(), call.call_id.clone());
    let timeline = |what: String, detail: Option<String>| Change::Note {
        run_id: key.0.clone(),
        call_id: key.1.clone(),
        what,
        detail,
    };
    let mut all = Vec::with_capacity(changes.len() + 4);
    all.push(match current {
        None => Change::InsertCall(call.clone()),
        Some(c) => Change::UpdateCall {
            expect_version: c.version,
            call: call.clone(),
        },
    });
    if let Some(r) = &receipt {
        all.push(Change::AddReceipt(r.clone()));
    }
    all.extend(changes);
    if let Some((what, detail)) = note {
        all.push(timeline(what, detail));
    }
    if from_state != Some(call.state) {
        all.push(timeline(
            call.state.as_str().to_owned(),
            call.reason.clone(),
        ));
    }
    Ok(Plan {
        call,
        changes: all,
        receipt,
    })
}

/// What a transition writes, as its event fills it in ([`apply_event`]).
pub(super) struct Draft {
    call: LocalCall,
    changes: Vec<Change>,
    receipt: Option<OutboxReceipt>,
    note: Option<(String, Option<String>)>,
}

/// The event's own part of a plan: what it sets on the row and what it
/// writes with it (the state itself comes from the table, in
/// [`plan_with`]).
pub(super) fn apply_event(
    d: &mut Draft,
    event: Event,
    snapshot: &Snapshot,
    from_state: Option<LocalState>,
    given: &Given<'_>,
) -> Result<(), NotAllowed> {
    let name = event.name();
    let refuse = |from: &'static str| NotAllowed { event: name, from };
    match event {
        Event::Discovered {
            tool_name,
            operation_key,
        } => {
            d.call.tool_name = tool_name;
            d.call.operation_key = operation_key;
            d.call.reason = None;
            d.changes.push(attempt(&d.call, given, None));
        }
        Event::Retried {
            tool_name,
            operation_key,
        } => {
            d.call.tool_name = tool_name;
            d.call.operation_key = operation_key;
            d.call.assignment = None;
            d.call.next_sequence = 0;
            d.call.report = None;
            d.call.reason = Some("the call is pending again: a new attempt".into());
            d.changes.push(attempt(&d.call, given, None));
        }
        Event::ClaimRefused { why } => d.call.reason = Some(why),
        Event::ClaimAnswered { assignment } => {
            let replaced = d
                .call
                .assignment
                .as_ref()
                .is_none_or(|a| a.assignment_id != assignment.assignment_id);
            if replaced {
                // A fresh assignment replaces a released one: the old
                // one's unsent receipts are never sent.
                d.changes.push(Change::SettlePending {
                    run_id: d.call.run_id.clone(),
                    call_id: d.call.call_id.clone(),
                    keep: Some(assignment.assignment_id.clone()),
                    only_kind: None,
                    status: ReceiptStatus::Superseded,
                    error: "assignment replaced".into(),
                });
                d.call.next_sequence = 0;
                d.changes.push(attempt(&d.call, given, Some(&assignment)));
            }
            d.call.assignment = Some(assignment);
            d.call.reason = None;
        }
        Event::ClaimFoundRunning {
            assignment,
            platform,
        } => {
            if d.call
                .assignment
                .as_ref()
                .is_none_or(|a| a.assignment_id != assignment.assignment_id)
            {
                d.changes.push(attempt(&d.call, given, Some(&assignment)));
            }
            d.call.assignment = Some(assignment);
            // The platform holds an `accepted` at sequence 0.
            d.call.next_sequence = d.call.next_sequence.max(1);
            d.call.reason = Some(format!(
                "the claim came back {} but this store never saw it accepted",
                platform.as_str()
            ));
            d.call.report =
                (platform == CallState::Running).then_some(PendingReport::ReconciliationRequired);
        }
        Event::ClaimFoundEnded {
            assignment,
            platform,
        } => {
            d.call.reason = Some(format!(
                "the claim came back {}; nothing ran here",
                platform.as_str()
            ));
            d.call.assignment = Some(assignment);
        }
        Event::ClaimReturnedRefused { assignment } => {
            d.call.reason = Some(
                "the platform kept an assignment whose accepted it refused: given back".into(),
            );
            d.call.assignment = Some(assignment);
            d.call.report = Some(PendingReport::Released);
        }
        Event::RefusedBeforeStart { code, message } => {
            if d.call.next_sequence != 0 {
                return Err(refuse("assigned with `accepted` already saved"));
            }
            d.call.reason = Some(format!("refused before start ({code}): {message}"));
            let r = receipt_for(
                given,
                &d.call,
                ReceiptKind::Failed,
                json!({"error": {"code": code, "message": message}}),
            )?;
            d.call.next_sequence += 1;
            d.receipt = Some(r);
        }
        Event::RateLapsed => {
            if d.call.next_sequence != 0 {
                return Err(refuse("assigned with `accepted` already saved"));
            }
            d.call.reason =
                Some("given back: the tool's rate token lapsed before `accepted` was saved".into());
            d.call.report = Some(PendingReport::Released);
        }
        Event::KeyLimited => {
            if d.call.next_sequence != 0 {
                return Err(refuse("assigned with `accepted` already saved"));
            }
            d.call.reason = Some(
                "given back: the call's concurrency key was at its limit before `accepted` was saved"
                    .into(),
            );
            d.call.report = Some(PendingReport::Released);
        }
        Event::ApprovalAsked { reason } => {
            if d.call.next_sequence != 0 {
                return Err(refuse("assigned with `accepted` already saved"));
            }
            d.call.reason = Some(format!(
                "given back: waiting for a person's approval ({reason})"
            ));
            d.call.report = Some(PendingReport::Released);
        }
        Event::AcceptedSaved => {
            if d.call.next_sequence != 0 {
                return Err(refuse("assigned with `accepted` already saved"));
            }
            let r = receipt_for(given, &d.call, ReceiptKind::Accepted, json!({}))?;
            d.call.next_sequence = 1;
            d.receipt = Some(r);
        }
        Event::AcceptConfirmed { receipt_id } => {
            d.changes
                .push(mark(&receipt_id, ReceiptStatus::Delivered, None, true));
            d.call.reason = None;
        }
        Event::AcceptRefusedPending { receipt_id, why }
        | Event::AcceptRefused { receipt_id, why } => {
            d.changes.push(mark(
                &receipt_id,
                ReceiptStatus::Rejected,
                Some(why.clone()),
                true,
            ));
            d.call.reason = Some(why);
        }
        Event::AcceptFoundReconciling { receipt_id } => {
            // The platform holds this very `accepted` (a replay): it was
            // confirmed once, and the call is this assignment's.
            d.changes
                .push(mark(&receipt_id, ReceiptStatus::Delivered, None, true));
            d.call.reason = Some(
                "accepted was confirmed and its answer lost; the platform holds the call reconciliation_required (another store of this executor id reported it): resumed as after a crash".into(),
            );
        }
        Event::ClaimLapsed => {
            d.call.reason = Some("the claim may have lapsed while the executor was away".into());
        }
        Event::ProgressSaved { progress } => {
            let r = receipt_for(
                given,
                &d.call,
                ReceiptKind::Progress,
                json!({ "progress": progress }),
            )?;
            d.call.next_sequence += 1;
            d.receipt = Some(r);
        }
        Event::HandlerFinished { outcome } => {
            let r = receipt_for(given, &d.call, outcome.kind, outcome.extra)?;
            d.call.next_sequence += 1;
            d.call.report = None;
            d.call.reason = Some(format!("the handler returned {}", outcome.kind.as_str()));
            d.receipt = Some(r);
        }
        Event::OutcomeUnknown { why, evidence } => {
            d.call.report = Some(PendingReport::ReconciliationRequired);
            d.call.reason = Some(why.clone());
            if let Some(evidence) = evidence {
                d.note = Some((
                    "evidence kept".into(),
                    Some(clip(format!("{why}; the output was: {evidence}"))),
                ));
            }
        }
        Event::Delivered { receipt_id } => {
            d.changes
                .push(mark(&receipt_id, ReceiptStatus::Delivered, None, true));
            d.call.report = None;
        }
        Event::DeliveryDeferred => {
            if d.call.report.is_none() {
                d.call.report = Some(PendingReport::PendingDelivery);
            }
        }
        Event::FinalRefusedNothingRan { receipt_id, error }
        | Event::FinalRejected { receipt_id, error } => {
            d.changes.push(mark(
                &receipt_id,
                ReceiptStatus::Rejected,
                Some(error.clone()),
                true,
            ));
            d.call.report = None;
            d.call.reason = Some(error);
        }
        Event::FinalOrphaned { receipt_id, error } => {
            d.changes.push(mark(
                &receipt_id,
                ReceiptStatus::Orphaned,
                Some(error.clone()),
                true,
            ));
            d.call.report = None;
            d.call.reason = Some(error);
        }
        Event::FinalRefused { receipt_id, error } => {
            d.changes.push(mark(
                &receipt_id,
                ReceiptStatus::Rejected,
                Some(error.clone()),
                true,
            ));
            d.call.report = Some(PendingReport::ReconciliationRequired);
            d.call.reason = Some(error);
        }
        Event::Reported { outcome } => {
            d.call.report = None;
            d.note = Some(("reported".into(), Some(outcome)));
        }
        Event::UnknownToPlatform { why } => {
            d.call.report = None;
            d.call.reason = Some(why.clone());
            if from_state == Some(ReconciliationRequired) {
                d.note = Some((OUTCOME_UNKNOWN_NOTE.into(), Some(why.clone())));
            }
            d.changes.push(orphan_pending(&d.call, why));
        }
        Event::GiveBack => {
            d.call.report = Some(PendingReport::Released);
            d.note = Some((
                "give back".into(),
                Some("the platform still holds the claim".into()),
            ));
        }
        Event::OutstandingClaimed => {
            d.call.reason =
                Some("claimed by this executor id but unknown to its store: released".into());
            d.call.report = Some(PendingReport::Released);
        }
        Event::OutstandingRunning => {
            d.call.reason = Some("unknown_to_executor".into());
            d.call.report = Some(PendingReport::ReconciliationRequired);
        }
        Event::OutstandingReconciling => {
            d.call.reason = Some("unknown_to_executor".into());
        }
        Event::HookHappened { result } => {
            let r = receipt_for(
                given,
                &d.call,
                ReceiptKind::Completed,
                json!({"result": result}),
            )?;
            d.call.next_sequence += 1;
            d.call.report = None;
            d.call.reason = Some("automatic check: the operation happened".into());
            d.receipt = Some(r);
        }
        Event::HookDidNotHappen => {
            let f = FinalReceipt::failed("not_performed", "the operation was not performed");
            let r = receipt_for(given, &d.call, f.kind, f.extra)?;
            d.call.next_sequence += 1;
            d.call.report = None;
            d.call.reason = Some("automatic check: the operation did not happen".into());
            d.receipt = Some(r);
        }
        Event::HookRerun => {
            if snapshot.accepted_confirmed() != Some(true) {
                return Err(refuse(
                    "reconciliation_required without a confirmed `accepted`",
                ));
            }
            d.call.report = None;
            d.call.reason =
                Some("automatic check: the operation did not happen; running it again".into());
        }
        Event::TransactionalEnded => {
            d.call.report = None;
            d.call.reason = Some(
                "the platform ended the call while its transactional handler was not running: none of its writes was committed".into(),
            );
        }
        Event::TransactionalForgotten => {
            // Orphaned as after a `404` on a final receipt, with the
            // outcome known: none of its writes was committed, so no
            // `orphaned_outcome_unknown`.
            d.call.report = None;
            let why = "the platform no longer knows the run of this transactional call, whose handler was not running: none of its writes was committed".to_owned();
            d.call.reason = Some(why.clone());
            d.changes.push(orphan_pending(&d.call, why));
        }
        Event::HookRunCancelled => {
            d.call.report = None;
            d.call.reason = Some(
                "automatic check: the operation did not happen, and the run was cancelled".into(),
            );
        }
        Event::HookRunForgotten { why } => {
            // Orphaned as after a `404` on a final receipt, with the
            // outcome known: nothing ran, so no `orphaned_outcome_unknown`.
            d.call.report = None;
            d.call.reason = Some(
                "automatic check: the operation did not happen, and the platform no longer knows the run".into(),
            );
            d.changes.push(orphan_pending(&d.call, why));
        }
        Event::OperatorResolved {
            outcome,
            reason,
            evidence,
        } => {
            let r = receipt_for(given, &d.call, outcome.kind, outcome.extra)?;
            d.call.next_sequence += 1;
            d.call.report = None;
            d.call.reason = Some(reason);
            d.note = Some(("resolved by operator".into(), Some(evidence)));
            d.receipt = Some(r);
        }
        Event::OperatorCompensated { reason, evidence } => {
            d.call.reason = Some(reason);
            d.note = Some(("compensated".into(), Some(evidence)));
        }
        Event::OperatorClosed { reason, evidence } => {
            // Only the unknown-outcome ones: the `Reconciler` reads the
            // timeline first.
            d.call.reason = Some(reason);
            d.note = Some((OPERATOR_CLOSED_NOTE.into(), Some(evidence)));
        }
    }
    Ok(())
}
