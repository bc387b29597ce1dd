//! Answers tolerate what they do not know: a state, a status, an outcome or
//! a frame type of a later protocol version reads as `Unknown` instead of
//! failing the whole answer.

use serde_json::json;
use toolrunner_protocol::wire::{
    CallState, ExecutorStatus, ReceiptAnswer, ReportAnswer, ReportOutcome, RunStatus, StreamFrame,
};

#[test]
fn unknown_values_in_answers_read_as_unknown() {
    let state: CallState = serde_json::from_value(json!("paused")).expect("parses");
    assert_eq!(state, CallState::Unknown);
    assert!(!state.is_terminal());
    let status: RunStatus = serde_json::from_value(json!("archived")).expect("parses");
    assert_eq!(status, RunStatus::Unknown);
    let exec: ExecutorStatus = serde_json::from_value(json!("hibernating")).expect("parses");
    assert_eq!(exec, ExecutorStatus::Unknown);
    let frame: StreamFrame =
        serde_json::from_value(json!({"type": "call.snoozed", "run_id": "run_1"})).expect("parses");
    assert_eq!(frame, StreamFrame::Unknown);
    let answer: ReportAnswer = serde_json::from_value(json!({"updated": 0, "results": [
        {"run_id": "run_1", "call_id": "call_1", "outcome": "deferred"}]}))
    .expect("a whole report answer parses");
    assert_eq!(answer.results[0].outcome, ReportOutcome::Unknown);
    let receipt: ReceiptAnswer = serde_json::from_value(
        json!({"receipt_id": "rcp_1", "replayed": false, "call_state": "paused"}),
    )
    .expect("a receipt answer parses");
    assert_eq!(receipt.call_state, CallState::Unknown);
    // The states it knows still read as themselves.
    let known: CallState =
        serde_json::from_value(json!("reconciliation_required")).expect("parses");
    assert_eq!(known, CallState::ReconciliationRequired);
}
