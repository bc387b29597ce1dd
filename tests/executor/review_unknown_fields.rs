//! Review finding: `CallRef` (used in answers: the heartbeat's
//! `cancel_requested`, the disconnect's `released` / `retained`) is
//! `deny_unknown_fields`, so an answer whose items carry one more field is
//! refused as a whole. §1: "clients ignore unknown fields in answers".
//! The SDK's client turns such a `200` into "unreachable": the heartbeat's
//! cancellations are lost (and `commit_point()` reports `LeaseLost`).

use toolrunner::protocol::wire::{Disconnected, HeartbeatAnswer};

#[test]
fn a_heartbeat_answer_with_an_extra_item_field_parses() {
    let answer = r#"{"lease_expires_at": "2025-01-01T00:00:00.000Z",
        "heartbeat_interval_ms": 5000,
        "cancel_requested": [{"run_id": "run_1", "call_id": "call_1",
                              "reason": "run_cancelled"}]}"#;
    let parsed = serde_json::from_str::<HeartbeatAnswer>(answer);
    assert!(parsed.is_ok(), "refused: {parsed:?}");
}

#[test]
fn a_disconnect_answer_with_an_extra_item_field_parses() {
    let answer = r#"{"released": [{"run_id": "run_1", "call_id": "call_1",
                                   "assignment_id": "asg_1"}], "retained": []}"#;
    let parsed = serde_json::from_str::<Disconnected>(answer);
    assert!(parsed.is_ok(), "refused: {parsed:?}");
}
