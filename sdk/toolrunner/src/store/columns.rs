//! How the store's values are written in and read back from columns, the
//! same for every backend: times as RFC 3339 text, states and reports by
//! name, the assignment as JSON, sequences as signed 64-bit integers, and
//! free text with each NUL character as `␀` (U+2400).
use std::borrow::Cow;

use super::{Change, LocalCall, LocalState, PendingReport, StoreError, Timestamp};

/// A stored value that does not decode.
pub(super) fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// A stored time (RFC 3339).
pub(super) fn time(s: &str) -> Result<Timestamp, StoreError> {
    chrono::DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| corrupt(format!("time {s:?}: {e}")))
}

/// A stored state name (the schema's CHECK admits only known ones).
pub(super) fn parse_state(name: &str) -> Result<LocalState, StoreError> {
    LocalState::parse(name).ok_or_else(|| corrupt(format!("unknown call state {name}")))
}

/// A sequence or count as the column holds it.
pub(super) fn seq(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// A state still to report, by name.
pub(super) fn report_str(r: Option<PendingReport>) -> Option<&'static str> {
    r.map(|r| match r {
        PendingReport::ReconciliationRequired => "reconciliation_required",
        PendingReport::PendingDelivery => "pending_delivery",
        PendingReport::Released => "released",
    })
}

/// The call's assignment as JSON (grant included).
pub(super) fn assignment_json(c: &LocalCall) -> Result<Option<String>, StoreError> {
    c.assignment
        .as_ref()
        .map(serde_json::to_string)
        .transpose()
        .map_err(|e| StoreError::Corrupt(e.to_string()))
}

/// What a NUL character of free text is stored as: PostgreSQL's `text`
/// refuses NUL, and every backend stores the same text.
const NUL_SHOWN_AS: &str = "\u{2400}";

/// `changes` as every backend stores them (see [`storable`]), borrowed
/// when no free text holds a NUL character (nearly always).
pub(super) fn storable_changes(changes: &[Change]) -> Cow<'_, [Change]> {
    if changes
        .iter()
        .all(|c| texts(c).iter().all(|t| !t.contains('\0')))
    {
        return Cow::Borrowed(changes);
    }
    Cow::Owned(
        changes
            .iter()
            .cloned()
            .map(|mut c| {
                for t in texts_mut(&mut c) {
                    if t.contains('\0') {
                        *t = t.replace('\0', NUL_SHOWN_AS);
                    }
                }
                c
            })
            .collect(),
    )
}

/// The free text of a change that comes from outside the SDK (a handler's
/// or the platform's reason, an error, an operator's note).
fn texts(change: &Change) -> Vec<&String> {
    match change {
        Change::InsertCall(c) | Change::UpdateCall { call: c, .. } => c.reason.iter().collect(),
        Change::AddReceipt(r) => r.last_error.iter().collect(),
        Change::ReceiptStatus { error, .. } => error.iter().collect(),
        Change::SettlePending { error, .. } => vec![error],
        Change::Note { what, detail, .. } => std::iter::once(what).chain(detail).collect(),
        Change::AddAttempt(_) | Change::Prune { .. } | Change::Probe { .. } => Vec::new(),
    }
}

/// [`texts`], to change.
fn texts_mut(change: &mut Change) -> Vec<&mut String> {
    match change {
        Change::InsertCall(c) | Change::UpdateCall { call: c, .. } => c.reason.iter_mut().collect(),
        Change::AddReceipt(r) => r.last_error.iter_mut().collect(),
        Change::ReceiptStatus { error, .. } => error.iter_mut().collect(),
        Change::SettlePending { error, .. } => vec![error],
        Change::Note { what, detail, .. } => std::iter::once(what).chain(detail).collect(),
        Change::AddAttempt(_) | Change::Prune { .. } | Change::Probe { .. } => Vec::new(),
    }
}

/// Free text as every backend stores it (each NUL character as `␀`).
pub(super) fn free_text(s: &str) -> String {
    s.replace('\0', NUL_SHOWN_AS)
}
