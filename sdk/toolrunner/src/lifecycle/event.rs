//! The events a transition names, and the snapshot of a call they are
//! decided on.

use super::*;

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
#[derive(Debug, Clone, PartialEq)]
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
    /// The tool's rate token lapsed before `accepted` was saved: the claim
    /// is given back, nothing ran.
    RateLapsed,
    /// The call's concurrency key is at its limit: the claim is given
    /// back before `accepted`, nothing ran.
    KeyLimited,
    /// The product asked for a person's approval: the claim is given back
    /// before `accepted`, nothing ran, and the request waits in the store.
    ApprovalAsked {
        reason: String,
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
    /// The saved `accepted`, replayed, is answered `accepted: false` with
    /// `replayed: true` and the call `reconciliation_required`: the
    /// platform confirmed it once (the answer was lost) and waits for a
    /// final receipt under this assignment (another store of this executor
    /// id reported the call it did not know, `unknown_to_executor`).
    /// Nothing started here: the call is resumed as after a crash.
    AcceptFoundReconciling {
        receipt_id: String,
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
    /// The hook found the operation not performed, and the platform no
    /// longer knows the run (`400 unknown_call` on the check before a
    /// re-run).
    HookRunForgotten {
        why: String,
    },
    /// A transactional call found `running` (none of its writes committed)
    /// that the platform ended meanwhile: it is not run again.
    TransactionalEnded,
    /// A transactional call to run again whose run the platform no longer
    /// knows (`404`, `400 unknown_call` on its replayed claim): none of its
    /// writes was committed.
    TransactionalForgotten,
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

/// The timeline entry of an operator's redelivery, with the evidence.
pub(crate) const OPERATOR_REDELIVERED_NOTE: &str = "operator_redelivered";

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
            Event::RateLapsed => "rate_lapsed",
            Event::KeyLimited => "key_limited",
            Event::ApprovalAsked { .. } => "approval_asked",
            Event::AcceptedSaved => "accepted_saved",
            Event::AcceptConfirmed { .. } => "accept_confirmed",
            Event::AcceptRefusedPending { .. } => "accept_refused_pending",
            Event::AcceptRefused { .. } => "accept_refused",
            Event::AcceptFoundReconciling { .. } => "accept_found_reconciling",
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
            Event::HookRunForgotten { .. } => "hook_run_forgotten",
            Event::TransactionalEnded => "transactional_ended",
            Event::TransactionalForgotten => "transactional_forgotten",
            Event::OperatorResolved { .. } => "operator_resolved",
            Event::OperatorCompensated { .. } => "operator_compensated",
            Event::OperatorClosed { .. } => "operator_closed",
        }
    }
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
