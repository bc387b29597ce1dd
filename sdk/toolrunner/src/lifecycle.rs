//! The call lifecycle, written once: the local states, the table of allowed
//! transitions, and [`advance`], the only function that changes a call row.
//!
//! Every other module asks for a transition by naming an [`Event`]; none
//! assigns a state. [`plan`] turns the stored row and the event into the
//! new row and everything written with it (receipts, receipt marks,
//! attempts, timeline entries); [`advance`] commits that as a
//! compare-and-set on the row's `version`. A lost race is re-read and
//! re-decided, never overwritten. `docs/architecture.md` shows [`TABLE`] as
//! a diagram; a test keeps the two the same.
use std::time::Duration;

use serde_json::{Value, json};
use toolrunner_protocol::wire::{Assignment, CallState, ReceiptKind};

use crate::store::{
    Attempt, Change, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus, Store,
    StoreError, StoreTransaction, Timestamp, TxError, now,
};

use LocalState::{
    Abandoned, Assigned, Claiming, Compensated, Delivered, Orphaned, ReconciliationRequired,
    Rejected, Released, Running, Settled,
};

/// Where a transition leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum To {
    /// The call stays in its state (only other columns change).
    Same,
    /// The call enters this state.
    State(LocalState),
}

/// One row of the transition table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rule {
    /// The event's name.
    pub(crate) event: &'static str,
    /// The states it may happen in; empty: a call the store does not hold yet.
    pub(crate) from: &'static [LocalState],
    /// Where it leads.
    pub(crate) to: To,
    /// What it writes besides the row: receipts, reports, timeline.
    #[cfg_attr(not(test), allow(dead_code))] // rendered into the docs by a test
    pub(crate) writes: &'static str,
}

const NEW: &[LocalState] = &[];
const REPORTING: &[LocalState] = &[ReconciliationRequired, Settled, Abandoned, Released];

/// Every allowed transition. A transition not listed here is refused.
///
/// Besides what each row writes, every transition into a state other than
/// `assigned` or `claiming` marks a still `pending` `accepted` of the call
/// `superseded` (an `accepted` is sent only by the accept step, while its
/// call waits for the answer), and every change of state adds a timeline
/// entry named after the new state.
pub(crate) const TABLE: &[Rule] = &[
    Rule {
        event: "discovered",
        from: NEW,
        to: To::State(Claiming),
        writes: "attempt: a new random operation key, saved before the claim is sent",
    },
    Rule {
        event: "retried",
        from: &[Abandoned, Released],
        to: To::State(Claiming),
        writes: "attempt: a new operation key (the call is pending again); report cleared",
    },
    Rule {
        event: "claim_refused",
        from: &[Claiming],
        to: To::State(Abandoned),
        writes: "reason; nothing ran",
    },
    Rule {
        event: "claim_answered",
        from: &[Claiming],
        to: To::State(Assigned),
        writes: "assignment; attempt (key, assignment); a replaced assignment's pending receipts superseded and the sequence reset",
    },
    Rule {
        event: "claim_found_running",
        from: &[Claiming],
        to: To::State(ReconciliationRequired),
        writes: "assignment; next sequence at least 1 (the platform holds `accepted`); report `reconciliation_required` if the platform says running",
    },
    Rule {
        event: "claim_found_ended",
        from: &[Claiming],
        to: To::State(Abandoned),
        writes: "assignment; nothing ran here",
    },
    Rule {
        event: "claim_returned_refused",
        from: &[Claiming],
        to: To::State(Abandoned),
        writes: "report `released`: the platform kept an assignment whose `accepted` it refused; give it back",
    },
    Rule {
        event: "refused_before_start",
        from: &[Assigned],
        to: To::State(Settled),
        writes: "final `failed` at sequence 0 (`invalid_arguments`, `digest_mismatch`, `forbidden`)",
    },
    Rule {
        event: "accepted_saved",
        from: &[Assigned],
        to: To::Same,
        writes: "receipt `accepted` at sequence 0",
    },
    Rule {
        event: "accept_confirmed",
        from: &[Assigned],
        to: To::State(Running),
        writes: "`accepted` delivered: side effects may start",
    },
    Rule {
        event: "accept_refused_pending",
        from: &[Assigned],
        to: To::State(Claiming),
        writes: "`accepted` rejected; claim again with the same key (the call may be pending again)",
    },
    Rule {
        event: "accept_refused",
        from: &[Assigned],
        to: To::State(Abandoned),
        writes: "`accepted` rejected; nothing ran",
    },
    Rule {
        event: "claim_lapsed",
        from: &[Assigned],
        to: To::State(Claiming),
        writes: "reason (the claim lapsed while away; the claim's answer decides about the saved `accepted`)",
    },
    Rule {
        event: "progress_saved",
        from: &[Running, ReconciliationRequired],
        to: To::Same,
        writes: "receipt `progress` at the next sequence",
    },
    Rule {
        event: "handler_finished",
        from: &[Running],
        to: To::State(Settled),
        writes: "final receipt (`completed`, `failed`, `cancelled`) at the next sequence",
    },
    Rule {
        event: "outcome_unknown",
        from: &[Running],
        to: To::State(ReconciliationRequired),
        writes: "report `reconciliation_required`; the evidence (a refused output) in the timeline",
    },
    Rule {
        event: "delivered",
        from: &[Settled],
        to: To::State(Delivered),
        writes: "final receipt delivered; report cleared",
    },
    Rule {
        event: "delivery_deferred",
        from: &[Settled],
        to: To::Same,
        writes: "report `pending_delivery`",
    },
    Rule {
        event: "final_refused_nothing_ran",
        from: &[Settled],
        to: To::State(Abandoned),
        writes: "the sequence-0 `failed` rejected: nothing ran",
    },
    Rule {
        event: "final_rejected",
        from: &[Settled],
        to: To::State(Rejected),
        writes: "final receipt rejected (`run_terminated`, `call_already_terminal`): compensation may be due",
    },
    Rule {
        event: "final_orphaned",
        from: &[Settled],
        to: To::State(Orphaned),
        writes: "final receipt orphaned (`404`)",
    },
    Rule {
        event: "final_refused",
        from: &[Settled],
        to: To::State(ReconciliationRequired),
        writes: "final receipt rejected (`400`, `413`, conflicts); report `reconciliation_required`",
    },
    Rule {
        event: "reported",
        from: REPORTING,
        to: To::Same,
        writes: "report cleared (the platform answered it)",
    },
    Rule {
        event: "unknown_to_platform",
        from: REPORTING,
        to: To::State(Orphaned),
        writes: "report cleared; pending receipts orphaned; from `reconciliation_required`, the outcome stays unknown (timeline `orphaned_outcome_unknown`: kept until an operator closes it)",
    },
    Rule {
        event: "give_back",
        from: &[Abandoned, Released],
        to: To::Same,
        writes: "report `released` (the platform still holds a claim that settled here)",
    },
    Rule {
        event: "outstanding_claimed",
        from: NEW,
        to: To::State(Released),
        writes: "report `released` (a claim this store never saw: never executed)",
    },
    Rule {
        event: "outstanding_running",
        from: NEW,
        to: To::State(ReconciliationRequired),
        writes: "report `reconciliation_required`, reason `unknown_to_executor`",
    },
    Rule {
        event: "outstanding_reconciling",
        from: NEW,
        to: To::State(ReconciliationRequired),
        writes: "reason `unknown_to_executor`",
    },
    Rule {
        event: "hook_happened",
        from: &[ReconciliationRequired],
        to: To::State(Settled),
        writes: "final `completed` with the hook's result",
    },
    Rule {
        event: "hook_did_not_happen",
        from: &[ReconciliationRequired],
        to: To::State(Settled),
        writes: "final `failed` with code `not_performed`",
    },
    Rule {
        event: "hook_rerun",
        from: &[ReconciliationRequired],
        to: To::State(Running),
        writes: "only if this assignment's `accepted` was confirmed here; report cleared",
    },
    Rule {
        event: "hook_run_cancelled",
        from: &[ReconciliationRequired],
        to: To::State(Abandoned),
        writes: "report cleared: it did not happen and the run was cancelled, nothing to send",
    },
    Rule {
        event: "transactional_ended",
        from: &[Running],
        to: To::State(Abandoned),
        writes: "report cleared: a transactional call whose writes never committed, ended by the platform while its handler was not running (no longer outstanding, or its run cancelled): nothing ran, nothing to send",
    },
    Rule {
        event: "operator_closed",
        from: &[Orphaned],
        to: To::Same,
        writes: "only an orphaned call whose outcome was unknown: the operator's evidence in the timeline (`operator_closed`); nothing is sent (the platform no longer knows the call), and retention may prune it",
    },
    Rule {
        event: "operator_resolved",
        from: &[ReconciliationRequired, Rejected],
        to: To::State(Settled),
        writes: "final receipt with a new id; the operator's evidence in the timeline",
    },
    Rule {
        event: "operator_compensated",
        from: &[Rejected],
        to: To::State(Compensated),
        writes: "the operator's evidence in the timeline",
    },
];

/// A final receipt's content: its kind and the members it adds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct FinalReceipt {
    pub(crate) kind: ReceiptKind,
    pub(crate) extra: Value,
}

impl FinalReceipt {
    pub(crate) fn failed(code: &str, message: &str) -> FinalReceipt {
        FinalReceipt {
            kind: ReceiptKind::Failed,
            extra: json!({"error": {"code": code, "message": message}}),
        }
    }
}

/// Something that happened to a call. Each names one row of [`TABLE`].
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // short-lived
pub(crate) enum Event {
    /// A pending call this executor will claim.
    Discovered {
        tool_name: String,
        operation_key: String,
    },
    /// A call settled here before is pending again: a new attempt.
    Retried {
        tool_name: String,
        operation_key: String,
    },
    ClaimRefused {
        why: String,
    },
    ClaimAnswered {
        assignment: Assignment,
    },
    ClaimFoundRunning {
        assignment: Assignment,
        platform: CallState,
    },
    ClaimFoundEnded {
        assignment: Assignment,
        platform: CallState,
    },
    ClaimReturnedRefused {
        assignment: Assignment,
    },
    RefusedBeforeStart {
        code: String,
        message: String,
    },
    AcceptedSaved,
    AcceptConfirmed {
        receipt_id: String,
    },
    AcceptRefusedPending {
        receipt_id: String,
        why: String,
    },
    AcceptRefused {
        receipt_id: String,
        why: String,
    },
    ClaimLapsed,
    ProgressSaved {
        progress: Value,
    },
    HandlerFinished {
        outcome: FinalReceipt,
    },
    OutcomeUnknown {
        why: String,
        evidence: Option<String>,
    },
    Delivered {
        receipt_id: String,
    },
    DeliveryDeferred,
    FinalRefusedNothingRan {
        receipt_id: String,
        error: String,
    },
    FinalRejected {
        receipt_id: String,
        error: String,
    },
    FinalOrphaned {
        receipt_id: String,
        error: String,
    },
    FinalRefused {
        receipt_id: String,
        error: String,
    },
    Reported {
        outcome: String,
    },
    UnknownToPlatform {
        why: String,
    },
    GiveBack,
    OutstandingClaimed,
    OutstandingRunning,
    OutstandingReconciling,
    HookHappened {
        result: Value,
    },
    HookDidNotHappen,
    HookRerun,
    HookRunCancelled,
    /// A transactional call found `running` (none of its writes committed)
    /// that the platform ended meanwhile: it is not run again.
    TransactionalEnded,
    OperatorResolved {
        outcome: FinalReceipt,
        reason: String,
        evidence: String,
    },
    OperatorCompensated {
        reason: String,
        evidence: String,
    },
    /// An operator closes an orphaned call whose outcome was unknown.
    OperatorClosed {
        reason: String,
        evidence: String,
    },
}

/// The timeline entry of a call orphaned while its outcome was unknown
/// (retention keeps it until an operator closes it).
pub(crate) const OUTCOME_UNKNOWN_NOTE: &str = "orphaned_outcome_unknown";

/// The timeline entry of an operator's close of such a call.
pub(crate) const OPERATOR_CLOSED_NOTE: &str = "operator_closed";

impl Event {
    /// The name of its row in [`TABLE`].
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Event::Discovered { .. } => "discovered",
            Event::Retried { .. } => "retried",
            Event::ClaimRefused { .. } => "claim_refused",
            Event::ClaimAnswered { .. } => "claim_answered",
            Event::ClaimFoundRunning { .. } => "claim_found_running",
            Event::ClaimFoundEnded { .. } => "claim_found_ended",
            Event::ClaimReturnedRefused { .. } => "claim_returned_refused",
            Event::RefusedBeforeStart { .. } => "refused_before_start",
            Event::AcceptedSaved => "accepted_saved",
            Event::AcceptConfirmed { .. } => "accept_confirmed",
            Event::AcceptRefusedPending { .. } => "accept_refused_pending",
            Event::AcceptRefused { .. } => "accept_refused",
            Event::ClaimLapsed => "claim_lapsed",
            Event::ProgressSaved { .. } => "progress_saved",
            Event::HandlerFinished { .. } => "handler_finished",
            Event::OutcomeUnknown { .. } => "outcome_unknown",
            Event::Delivered { .. } => "delivered",
            Event::DeliveryDeferred => "delivery_deferred",
            Event::FinalRefusedNothingRan { .. } => "final_refused_nothing_ran",
            Event::FinalRejected { .. } => "final_rejected",
            Event::FinalOrphaned { .. } => "final_orphaned",
            Event::FinalRefused { .. } => "final_refused",
            Event::Reported { .. } => "reported",
            Event::UnknownToPlatform { .. } => "unknown_to_platform",
            Event::GiveBack => "give_back",
            Event::OutstandingClaimed => "outstanding_claimed",
            Event::OutstandingRunning => "outstanding_running",
            Event::OutstandingReconciling => "outstanding_reconciling",
            Event::HookHappened { .. } => "hook_happened",
            Event::HookDidNotHappen => "hook_did_not_happen",
            Event::HookRerun => "hook_rerun",
            Event::HookRunCancelled => "hook_run_cancelled",
            Event::TransactionalEnded => "transactional_ended",
            Event::OperatorResolved { .. } => "operator_resolved",
            Event::OperatorCompensated { .. } => "operator_compensated",
            Event::OperatorClosed { .. } => "operator_closed",
        }
    }
}

/// The table's row for an event.
pub(crate) fn rule(event: &str) -> Option<&'static Rule> {
    TABLE.iter().find(|r| r.event == event)
}

/// What [`plan`] sees: the stored row, and the call's receipts when the
/// event depends on them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Snapshot {
    pub(crate) call: Option<LocalCall>,
    pub(crate) receipts: Option<Vec<OutboxReceipt>>,
}

impl Snapshot {
    /// Whether `accepted` of the call's current assignment was confirmed
    /// by the platform to this store (`None`: receipts not read).
    pub(crate) fn accepted_confirmed(&self) -> Option<bool> {
        let asg = self
            .call
            .as_ref()?
            .assignment
            .as_ref()?
            .assignment_id
            .clone();
        let receipts = self.receipts.as_ref()?;
        Some(receipts.iter().any(|r| {
            r.kind == ReceiptKind::Accepted
                && r.assignment_id == asg
                && r.status == ReceiptStatus::Delivered
        }))
    }

    /// Whether `accepted` of `assignment_id` was refused by the platform.
    pub(crate) fn accepted_refused(&self, assignment_id: &str) -> bool {
        self.receipts.iter().flatten().any(|r| {
            r.kind == ReceiptKind::Accepted
                && r.assignment_id == assignment_id
                && r.status == ReceiptStatus::Rejected
        })
    }
}

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
fn receipt_id() -> String {
    format!("rcp_{}", uuid::Uuid::now_v7().simple())
}

/// A new operation key: random, never derived from the call.
pub(crate) fn operation_key() -> String {
    format!("op_{}", uuid::Uuid::new_v4().simple())
}

/// A receipt of the call's current assignment at its next sequence.
fn receipt_for(
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

fn mark(receipt_id: &str, status: ReceiptStatus, error: Option<String>, attempt: bool) -> Change {
    Change::ReceiptStatus {
        receipt_id: receipt_id.to_owned(),
        status,
        error,
        attempt,
    }
}

fn attempt(call: &LocalCall, given: &Given<'_>, assignment: Option<&Assignment>) -> Change {
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
const EVIDENCE_BYTES: usize = 64 * 1024;

fn clip(mut s: String) -> String {
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
        None => LocalCall::new(
            key.0.to_owned(),
            key.1.to_owned(),
            String::new(),
            String::new(),
            Claiming,
        ),
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
struct Draft {
    call: LocalCall,
    changes: Vec<Change>,
    receipt: Option<OutboxReceipt>,
    note: Option<(String, Option<String>)>,
}

/// The event's own part of a plan: what it sets on the row and what it
/// writes with it (the state itself comes from the table, in
/// [`plan_with`]).
fn apply_event(
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
            d.call.reason = Some("the d.call is pending again: a new attempt".into());
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
            d.changes.push(Change::SettlePending {
                run_id: d.call.run_id.clone(),
                call_id: d.call.call_id.clone(),
                keep: None,
                only_kind: None,
                status: ReceiptStatus::Orphaned,
                error: why,
            });
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
                "the platform ended the d.call while its transactional handler was not running: none of its writes was committed".into(),
            );
        }
        Event::HookRunCancelled => {
            d.call.report = None;
            d.call.reason = Some(
                "automatic check: the operation did not happen, and the run was cancelled".into(),
            );
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

/// How [`advance`] ended.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // short-lived, returned once per transition
pub(crate) enum Advanced {
    /// The transition is durable: the row as it now is, and the receipt it
    /// wrote, if any.
    Moved {
        call: LocalCall,
        receipt: Option<OutboxReceipt>,
    },
    /// Nothing to do (the decision said so, or the table refused the event
    /// from the stored state): the row as it is.
    Stayed(Option<LocalCall>),
}

/// Whether [`advance`] reads the call's receipts before deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reads {
    Row,
    RowAndReceipts,
    /// The receipts with a fresh row only: the decision on the caller's
    /// own row (see [`advance_from`]) does without them.
    ReceiptsUnlessKnown,
}

/// The only way a call row changes: reads the call, asks `decide` for the
/// event, plans it and commits it as a compare-and-set on the row's
/// version. When another writer changed the call first, it reads and
/// decides again; a decision is never written over a newer row.
///
/// # Errors
/// The store failed (after retries with backoff for passing failures); the
/// call is then as the store last holds it.
pub(crate) async fn advance(
    store: &dyn Store,
    executor_id: &str,
    key: (&str, &str),
    reads: Reads,
    decide: impl FnMut(&Snapshot) -> Option<Event>,
) -> Result<Advanced, StoreError> {
    advance_from(store, executor_id, key, None, reads, decide).await
}

/// [`advance`] starting from the row as the caller last saw it (`known`;
/// `Some(None)`: the caller knows the call is not stored), which saves a
/// read. The known row is trusted only to write: the compare-and-set on its
/// version refuses it if the row moved on, and a decision not to move (or
/// one the table refuses) is taken again on a fresh read.
///
/// # Errors
/// As [`advance`].
pub(crate) async fn advance_from(
    store: &dyn Store,
    executor_id: &str,
    key: (&str, &str),
    known: Option<Option<LocalCall>>,
    reads: Reads,
    decide: impl FnMut(&Snapshot) -> Option<Event>,
) -> Result<Advanced, StoreError> {
    advance_then(store, executor_id, key, known, reads, decide, None).await
}

/// [`advance_from`], and when the decided event leads where the table
/// allows `then`, `then` too, in the same commit: the state between the
/// two is never stored alone (a crash leaves both or neither). The
/// answer is the row after both (or after the first, if the table
/// refuses `then` from where the first led).
///
/// # Errors
/// As [`advance`].
pub(crate) async fn advance_then(
    store: &dyn Store,
    executor_id: &str,
    key: (&str, &str),
    mut known: Option<Option<LocalCall>>,
    reads: Reads,
    mut decide: impl FnMut(&Snapshot) -> Option<Event>,
    then: Option<Event>,
) -> Result<Advanced, StoreError> {
    let mut failures = 0u32;
    let mut races = 0u32;
    loop {
        let guess = known.take();
        let guessed = guess.is_some();
        let call = match guess {
            Some(row) => row,
            None => store.call(key.0, key.1).await?,
        };
        let snapshot = Snapshot {
            call,
            receipts: match reads {
                Reads::Row => None,
                Reads::ReceiptsUnlessKnown if guessed => None,
                Reads::RowAndReceipts | Reads::ReceiptsUnlessKnown => {
                    Some(store.receipts(key.0, key.1).await?)
                }
            },
        };
        let Some(event) = decide(&snapshot) else {
            if guessed {
                continue;
            }
            return Ok(Advanced::Stayed(snapshot.call));
        };
        let name = event.name();
        let mut plan = match plan(&snapshot, key, event, executor_id) {
            Ok(p) => p,
            Err(_) if guessed => continue,
            Err(e) => {
                tracing::warn!(run_id = key.0, call_id = key.1, error = %e, "transition refused by the lifecycle table");
                return Ok(Advanced::Stayed(snapshot.call));
            }
        };
        if let Some(next) = &then {
            let between = Snapshot {
                call: Some(plan.call.clone()),
                receipts: None,
            };
            if let Ok(second) = self::plan(&between, key, next.clone(), executor_id) {
                plan.changes.extend(second.changes);
                plan.call = second.call;
                plan.receipt = second.receipt;
            }
        }
        let started = std::time::Instant::now();
        // The changes go to the store; what a retry needs is the plan's
        // row and receipt, which stay.
        let result = store.commit(std::mem::take(&mut plan.changes)).await;
        metrics::histogram!("toolrunner_store_commit_seconds")
            .record(started.elapsed().as_secs_f64());
        let committed = match result {
            Ok(()) => true,
            Err(StoreError::Conflict(..)) if guessed || races < 50 => {
                races += u32::from(!guessed);
                tracing::debug!(
                    run_id = key.0,
                    call_id = key.1,
                    event = name,
                    "lost a race for the call; deciding again"
                );
                continue;
            }
            Err(
                e @ (StoreError::Refused(_)
                | StoreError::Closed
                | StoreError::Fenced(_)
                | StoreError::Conflict(..)),
            ) => {
                tracing::error!(run_id = key.0, call_id = key.1, event = name, error = %e, "transition not written");
                return Err(e);
            }
            // A commit reported as failed may have happened (an interrupted
            // COMMIT): look before trying again.
            Err(e) => match landed(store, key, &plan).await {
                Ok(true) => {
                    tracing::warn!(error = %e, "a commit reported an error but its changes are stored");
                    true
                }
                _ if failures < 8 => {
                    tracing::warn!(error = %e, attempt = failures, "store commit failed; trying again");
                    tokio::time::sleep(Duration::from_millis(20u64 << failures.min(6))).await;
                    failures += 1;
                    continue;
                }
                _ => return Err(e),
            },
        };
        debug_assert!(committed);
        metrics::counter!("toolrunner_call_transitions_total", "event" => name, "state" => plan.call.state.as_str())
            .increment(1);
        return Ok(Advanced::Moved {
            call: plan.call,
            receipt: plan.receipt,
        });
    }
}

/// How [`advance_in`] ended.
#[allow(clippy::large_enum_variant)] // short-lived, returned once per call
pub(crate) enum InTransaction {
    /// The transition is committed with the handler's writes, or the call
    /// stayed where it was (`decide` declined) and the transaction rolled
    /// back.
    Done(Advanced),
    /// Nothing of the transaction is stored: reading the row or writing a
    /// change failed before the `COMMIT` (a lost compare-and-set, a
    /// transaction the handler's own failed statement aborted).
    NotWritten(StoreError),
    /// The table refuses the event from the stored state: nothing stored.
    Refused(String),
    /// The process was fenced before the commit: nothing stored.
    Halted,
    /// The `COMMIT` failed and the store does not hold the transition:
    /// nothing of the transaction is stored.
    Lost(StoreError),
}

/// [`advance`] inside a handler's own transaction `tx`, after its
/// business writes: the row is read as the transaction sees it, locked
/// until it ends (so a change committed meanwhile cannot make the decision
/// stale), `decide` names the event, and the transition is written into
/// `tx` and committed once with the handler's writes: both are stored or
/// neither is. `halted` is asked right before the commit (a fenced process
/// writes nothing).
pub(crate) async fn advance_in(
    store: &dyn Store,
    mut tx: StoreTransaction,
    executor_id: &str,
    key: (&str, &str),
    decide: impl FnOnce(&Snapshot) -> Option<Event>,
    halted: impl Fn() -> bool,
) -> InTransaction {
    let call = match tx.locked_call(key.0, key.1).await {
        Ok(c) => c,
        Err(e) => return InTransaction::NotWritten(e),
    };
    let snapshot = Snapshot {
        call,
        receipts: None,
    };
    let Some(event) = decide(&snapshot) else {
        return InTransaction::Done(Advanced::Stayed(snapshot.call));
    };
    let name = event.name();
    let plan = match plan(&snapshot, key, event, executor_id) {
        Ok(p) => p,
        Err(e) => return InTransaction::Refused(e.to_string()),
    };
    if halted() {
        return InTransaction::Halted;
    }
    let started = std::time::Instant::now();
    let result = tx.commit_with(&plan.changes).await;
    metrics::histogram!("toolrunner_store_commit_seconds").record(started.elapsed().as_secs_f64());
    match result {
        Ok(()) => {}
        Err(TxError::NotWritten(e)) => return InTransaction::NotWritten(e),
        // An interrupted `COMMIT`: only the store tells whether it is there.
        Err(TxError::Unknown(e)) => match landed(store, key, &plan).await {
            Ok(true) => {
                tracing::warn!(error = %e, "the transaction reported an error but it is stored");
            }
            _ => return InTransaction::Lost(e),
        },
    }
    metrics::counter!("toolrunner_call_transitions_total", "event" => name, "state" => plan.call.state.as_str())
        .increment(1);
    InTransaction::Done(Advanced::Moved {
        call: plan.call,
        receipt: plan.receipt,
    })
}

/// Records a delivery attempt of one receipt and its new status (the
/// call's row does not change): the only writer of a receipt's status
/// outside a transition.
///
/// # Errors
/// The store failed.
pub(crate) async fn mark_receipt(
    store: &dyn Store,
    receipt_id: &str,
    status: ReceiptStatus,
    error: Option<String>,
) -> Result<(), StoreError> {
    store
        .commit(vec![mark(receipt_id, status, error, true)])
        .await
}

/// Whether `plan` is what the store now holds: its very row (version and
/// time of the change) and, if it wrote one, its very receipt.
async fn landed(store: &dyn Store, key: (&str, &str), plan: &Plan) -> Result<bool, StoreError> {
    let row = store.call(key.0, key.1).await?;
    let same_row = row.is_some_and(|now| {
        now.version == plan.call.version
            && now.state == plan.call.state
            && now.updated_at == plan.call.updated_at
    });
    if !same_row {
        return Ok(false);
    }
    match &plan.receipt {
        Some(r) => Ok(store.receipt(&r.receipt_id).await?.is_some()),
        None => Ok(true),
    }
}

/// Adds a timeline entry that changes nothing else.
pub(crate) async fn note(
    store: &dyn Store,
    key: (&str, &str),
    what: &str,
    detail: Option<String>,
) -> Result<(), StoreError> {
    store
        .commit(vec![Change::Note {
            run_id: key.0.to_owned(),
            call_id: key.1.to_owned(),
            what: what.to_owned(),
            detail,
        }])
        .await
}

/// The table as Markdown, followed by a Mermaid state diagram: the text
/// `docs/architecture.md` carries between its lifecycle markers.
#[cfg(test)]
pub(crate) fn table_markdown() -> String {
    let mut out = String::from("| event | from | to | also writes |\n|---|---|---|---|\n");
    for r in TABLE {
        let from = if r.from.is_empty() {
            "(not stored yet)".to_owned()
        } else {
            r.from
                .iter()
                .map(|s| format!("`{}`", s.as_str()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let to = match r.to {
            To::Same => "(same)".to_owned(),
            To::State(s) => format!("`{}`", s.as_str()),
        };
        out.push_str(&format!(
            "| `{}` | {from} | {to} | {} |\n",
            r.event, r.writes
        ));
    }
    out.push_str("\n```mermaid\nstateDiagram-v2\n");
    for r in TABLE {
        let to = match r.to {
            To::Same => continue,
            To::State(s) => s.as_str(),
        };
        if r.from.is_empty() {
            out.push_str(&format!("    [*] --> {to}: {}\n", r.event));
        }
        for f in r.from {
            out.push_str(&format!("    {} --> {to}: {}\n", f.as_str(), r.event));
        }
    }
    out.push_str("```\n");
    out
}

#[cfg(test)]
mod tests;
