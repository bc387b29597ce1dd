//! How the store's values are written in and read back from columns, the
//! same for every backend: times as RFC 3339 text, states and reports by
//! name, the assignment as JSON, sequences as signed 64-bit integers.
use super::{LocalCall, LocalState, PendingReport, StoreError, Timestamp};

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
