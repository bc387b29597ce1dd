//! Rows for the store's own tests: a call and a receipt of run `run_1`.

use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{LocalCall, LocalState, OutboxReceipt, ReceiptStatus, Timestamp};

/// The time the rows carry unless a test says otherwise.
pub(crate) const TIME: &str = "2026-12-01T00:00:00.000Z";

/// A time.
pub(crate) fn at(t: &str) -> Timestamp {
    t.parse().expect("a time")
}

/// The suffix of `call_N` (`N`), or the whole id.
fn short(call_id: &str) -> &str {
    call_id.strip_prefix("call_").unwrap_or(call_id)
}

/// Call `call_id` of `run_1`, key `op_N`, next sequence 1.
pub(crate) fn call(call_id: &str, state: LocalState, version: u64) -> LocalCall {
    LocalCall {
        run_id: "run_1".into(),
        call_id: call_id.into(),
        tool_name: "t".into(),
        operation_key: format!("op_{}", short(call_id)),
        state,
        assignment: None,
        next_sequence: 1,
        reason: None,
        report: None,
        created_at: at(TIME),
        updated_at: at(TIME),
        version,
    }
}

/// Receipt `receipt_id` of `call_id`, under assignment `asg_N`.
pub(crate) fn receipt(
    call_id: &str,
    receipt_id: &str,
    kind: ReceiptKind,
    sequence: u64,
    status: ReceiptStatus,
) -> OutboxReceipt {
    OutboxReceipt {
        receipt_id: receipt_id.into(),
        run_id: "run_1".into(),
        call_id: call_id.into(),
        assignment_id: format!("asg_{}", short(call_id)),
        kind,
        sequence,
        body: "{}".into(),
        status,
        attempts: 0,
        last_error: None,
        created_at: at(TIME),
        delivered_at: None,
    }
}
