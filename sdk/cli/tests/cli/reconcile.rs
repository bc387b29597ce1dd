//! `reconcile resolve`, `reconcile compensated` and `reconcile close`.

use super::*;

// ---------------------------------------------------------------- reconcile resolve

/// Asserts the effects of a successful resolve of `run_1/call_recon` and
/// returns the new receipt's body.
#[track_caller]
fn assert_resolved(f: &Fixture, receipt_id: &str, kind: &str, who: &str, evidence: &str) -> Value {
    let call = f.call(RECON);
    assert_eq!(call.state, LocalState::Settled);
    assert_eq!(call.next_sequence, 3, "the sequence advanced");
    assert_eq!(call.report, None);
    let reason = call.reason.expect("a reason");
    assert!(
        reason.contains(who) && reason.contains(evidence),
        "{reason}"
    );
    let receipts = f.receipts(RECON);
    assert_eq!(receipts.len(), 3, "exactly one new receipt");
    let new = receipts
        .iter()
        .find(|r| r.receipt_id == receipt_id)
        .expect("the new receipt is stored");
    assert_eq!(new.kind.as_str(), kind);
    assert_eq!(new.sequence, 2, "sequence = the previous next_sequence");
    assert_eq!(new.status, ReceiptStatus::Pending);
    assert_eq!(new.attempts, 0);
    assert_eq!(new.assignment_id, "asg_call_recon");
    assert!(
        new.receipt_id.starts_with("rcp_"),
        "a new receipt id: {}",
        new.receipt_id
    );
    let body: Value = serde_json::from_str(&new.body).expect("JSON body");
    assert_eq!(body["receipt_id"], json!(receipt_id));
    assert_eq!(body["executor_id"], json!(EXECUTOR));
    assert_eq!(body["assignment_id"], json!("asg_call_recon"));
    assert_eq!(body["sequence"], json!(2));
    assert_eq!(body["kind"], json!(kind));
    assert!(!new.body.contains(GRANT));
    body
}

/// The "resolved by operator" event's detail (the evidence, as JSON).
fn resolution_note(f: &Fixture, call_ref: &str) -> Value {
    let events = f.events(call_ref);
    let notes: Vec<&Event> = events
        .iter()
        .filter(|e| e.what() == "resolved by operator")
        .collect();
    assert_eq!(notes.len(), 1, "{events:?}");
    let detail = notes[0].detail().expect("the note has a detail");
    serde_json::from_str(detail).expect("the detail is the evidence as JSON")
}

#[test]
fn resolve_completed_from_a_file_settles_the_call_with_a_new_receipt() {
    let f = Fixture::seeded();
    let result = f.write("result.json", "{\"entry\": 42}\n");
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "ledger shows entry 42 for op_call_recon",
        "--who",
        "alice",
        "--reference",
        "LEDGER-7",
        "--json",
    ]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["receipt_id", "state", "delivered"]));
    assert_eq!(v["state"], json!("settled"));
    assert_eq!(v["delivered"], json!(false), "no platform was given");
    let receipt_id = v["receipt_id"].as_str().expect("receipt_id");
    let body = assert_resolved(
        &f,
        receipt_id,
        "completed",
        "alice",
        "ledger shows entry 42 for op_call_recon",
    );
    assert_eq!(body["result"], json!({"entry": 42}));

    let note = resolution_note(&f, RECON);
    assert_eq!(note["who"], json!("alice"));
    assert_eq!(
        note["why"],
        json!("ledger shows entry 42 for op_call_recon")
    );
    assert_eq!(note["reference"], json!("LEDGER-7"));

    // `calls show` tells the same story.
    let show = f.run(&["calls", "show", RECON, "--json"]);
    show.code(0).no_grant();
    let t = show.json();
    assert_eq!(t["call"]["state"], json!("settled"));
    let last = t["receipts"].as_array().expect("receipts").last().cloned();
    let last = last.expect("a receipt");
    assert_eq!(last["receipt_id"], json!(receipt_id));
    assert_eq!(last["status"], json!("pending"));
    assert_eq!(last["sequence"], json!(2));
    let events = t["events"].as_array().expect("events");
    let note = events
        .iter()
        .find(|e| e["what"] == json!("resolved by operator"))
        .expect("resolved by operator in the timeline");
    let detail = note["detail"].as_str().expect("detail");
    assert!(
        detail.contains("ledger shows entry 42 for op_call_recon")
            && detail.contains("alice")
            && detail.contains("LEDGER-7"),
        "{detail}"
    );
    assert!(events.iter().any(|e| e["what"] == json!("settled")), "{t}");
    // The outbox now holds it.
    let status = f.run(&["outbox", "status", "--json"]);
    status.code(0);
    assert!(
        status.json()["pending"]
            .as_array()
            .expect("pending")
            .iter()
            .any(|r| r["receipt_id"] == json!(receipt_id))
    );
}

#[test]
fn resolve_completed_from_stdin_prints_a_human_line() {
    let f = Fixture::seeded();
    let out = f.run_stdin(
        &[
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            "-",
            "--evidence",
            "ledger entry 7 exists",
            "--who",
            "bob",
        ],
        "{\"entry\": 7}",
    );
    out.code(0).no_grant();
    assert!(
        out.stdout
            .starts_with("resolved run_1/call_recon: receipt rcp_"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("(state settled)"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("the running executor's outbox delivers it"),
        "{}",
        out.stdout
    );
    let receipt_id = out
        .stdout
        .split_whitespace()
        .find(|w| w.starts_with("rcp_"))
        .expect("the receipt id is printed");
    let body = assert_resolved(&f, receipt_id, "completed", "bob", "ledger entry 7 exists");
    assert_eq!(body["result"], json!({"entry": 7}));
    let note = resolution_note(&f, RECON);
    assert_eq!(note["who"], json!("bob"));
    assert_eq!(note["reference"], Value::Null);
}

#[test]
fn resolve_failed_sends_the_code_and_message() {
    let f = Fixture::seeded();
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--failed",
        "not_performed",
        "--message",
        "the entry was not posted",
        "--evidence",
        "no entry for op_call_recon",
        "--who",
        "carol",
        "--reference",
        "TICKET-9",
        "--json",
    ]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["state"], json!("settled"));
    let body = assert_resolved(
        &f,
        v["receipt_id"].as_str().expect("id"),
        "failed",
        "carol",
        "no entry for op_call_recon",
    );
    assert_eq!(
        body["error"],
        json!({"code": "not_performed", "message": "the entry was not posted"})
    );
    assert!(body.get("result").is_none());
    let note = resolution_note(&f, RECON);
    assert_eq!(note["reference"], json!("TICKET-9"));
}

#[test]
fn resolve_cancelled_sends_the_reason() {
    let f = Fixture::seeded();
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "customer withdrew",
        "--evidence",
        "ticket 88",
        "--who",
        "dave",
        "--json",
    ]);
    out.code(0);
    let v = out.json();
    let body = assert_resolved(
        &f,
        v["receipt_id"].as_str().expect("id"),
        "cancelled",
        "dave",
        "ticket 88",
    );
    assert_eq!(body["reason"], json!("customer withdrew"));
}

#[test]
fn resolve_without_who_takes_user_then_operator() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 1}"#);
    let out = run_cmd(toolrunner().env("USER", "erin").args([
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "checked",
        "--db",
        f.db(),
    ]));
    out.code(0);
    assert_eq!(resolution_note(&f, RECON)["who"], json!("erin"));

    let g = Fixture::seeded();
    let out = run_cmd(toolrunner().env_remove("USER").args([
        "reconcile",
        "compensated",
        REJECTED,
        "--evidence",
        "refund re_1",
        "--db",
        g.db(),
    ]));
    out.code(0);
    let reason = g.call(REJECTED).reason.expect("reason");
    assert!(reason.contains("operator"), "{reason}");
}

#[test]
fn resolve_usage_errors_exit_2_and_change_nothing() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 1}"#);
    let before = f.snapshot(RECON);
    let missing_file = f.path("missing.json");
    let missing_file = missing_file.to_str().expect("utf-8");
    let cases: Vec<Vec<&str>> = vec![
        // --evidence is required
        vec!["reconcile", "resolve", RECON, "--completed", &result],
        // no outcome at all
        vec!["reconcile", "resolve", RECON, "--evidence", "x"],
        // two outcomes
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            &result,
            "--cancelled",
            "--reason",
            "r",
            "--evidence",
            "x",
        ],
        // --failed needs --message
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--failed",
            "not_performed",
            "--evidence",
            "x",
        ],
        // --cancelled needs --reason
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--cancelled",
            "--evidence",
            "x",
        ],
        // a malformed call reference
        vec![
            "reconcile",
            "resolve",
            "call_recon",
            "--completed",
            &result,
            "--evidence",
            "x",
        ],
        // an unreadable result file
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            missing_file,
            "--evidence",
            "x",
        ],
        // --base-url without --token
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            &result,
            "--evidence",
            "x",
            "--base-url",
            "http://127.0.0.1:9",
        ],
        // no call at all
        vec![
            "reconcile",
            "resolve",
            "--completed",
            &result,
            "--evidence",
            "x",
        ],
    ];
    for c in cases {
        let out = f.run(&c);
        out.code(2);
        assert!(out.stdout.is_empty(), "{c:?}: {}", out.stdout);
        assert!(!out.stderr.is_empty(), "{c:?} says why");
        assert_eq!(f.snapshot(RECON), before, "{c:?} changed the store");
    }
    let out = f.run(&["reconcile", "resolve", RECON, "--completed", &result]);
    assert!(out.stderr.contains("--evidence"), "{}", out.stderr);
}

#[test]
fn resolve_refuses_a_result_that_breaks_the_output_schema_and_changes_nothing() {
    let f = Fixture::seeded();
    let before = f.snapshot(RECON);
    for (name, text) in [
        ("wrong_type.json", r#"{"entry": "forty-two"}"#),
        ("missing.json", r#"{"amount": 42}"#),
        ("not_object.json", "[1, 2]"),
    ] {
        let file = f.write(name, text);
        let out = f.run(&[
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            &file,
            "--evidence",
            "checked",
            "--json",
        ]);
        out.code(1);
        assert!(out.stdout.is_empty(), "{name}: {}", out.stdout);
        assert!(
            out.stderr.starts_with("refused:") && out.stderr.contains("output_schema"),
            "{name}: {}",
            out.stderr
        );
        assert_eq!(f.snapshot(RECON), before, "{name} changed the store");
        let call = f.call(RECON);
        assert_eq!(call.state, LocalState::ReconciliationRequired);
        assert_eq!(
            call.reason.as_deref(),
            Some("handler failed after accepted")
        );
        assert!(
            !f.events(RECON)
                .iter()
                .any(|e| e.what() == "resolved by operator")
        );
    }
    // Text that is not acceptable JSON is refused as well.
    let file = f.write("garbage.json", "{\"entry\": 1,");
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &file,
        "--evidence",
        "checked",
    ]);
    out.code(1);
    assert_eq!(f.snapshot(RECON), before);
    let file = f.write("dup.json", r#"{"entry": 1, "entry": 2}"#);
    f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &file,
        "--evidence",
        "checked",
    ])
    .code(1);
    assert_eq!(f.snapshot(RECON), before);
}

#[test]
fn resolve_refuses_blank_evidence() {
    let f = Fixture::seeded();
    let before = f.snapshot(RECON);
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "r",
        "--evidence",
        "   ",
    ]);
    out.code(1);
    assert!(out.stderr.contains("--evidence"), "{}", out.stderr);
    assert_eq!(f.snapshot(RECON), before);
}

#[test]
fn resolve_refuses_calls_in_other_states_and_unknown_calls() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 1}"#);
    for (call, state) in [
        (DELIVERED, "delivered"),
        (SETTLED, "settled"),
        (CLAIMING, "claiming"),
    ] {
        let before = f.snapshot(call);
        let out = f.run(&[
            "reconcile",
            "resolve",
            call,
            "--completed",
            &result,
            "--evidence",
            "checked",
        ]);
        out.code(1);
        assert!(out.stdout.is_empty());
        assert!(
            out.stderr.contains(&format!("is {state}"))
                && out.stderr.contains("reconciliation_required"),
            "{call}: the reason is given: {}",
            out.stderr
        );
        assert_eq!(f.snapshot(call), before, "{call} changed");
    }
    let out = f.run(&[
        "reconcile",
        "resolve",
        "run_1/call_nope",
        "--completed",
        &result,
        "--evidence",
        "checked",
    ]);
    out.code(1);
    assert!(out.stderr.contains("run_1/call_nope"), "{}", out.stderr);
}

#[test]
fn resolve_refuses_a_call_without_assignment_or_executor_id() {
    let f = Fixture::seeded();
    // reconciliation_required, but no receipt names the executor.
    let orphan = local_call(
        Some(assignment(
            "run_4",
            "call_quiet",
            TOOL,
            Some(entry_schema()),
        )),
        "run_4",
        "call_quiet",
        TOOL,
        LocalState::ReconciliationRequired,
        1,
    );
    // reconciliation_required without an assignment in this store.
    let bare = local_call(
        None,
        "run_4",
        "call_bare",
        TOOL,
        LocalState::ReconciliationRequired,
        0,
    );
    f.commit(vec![Change::InsertCall(orphan), Change::InsertCall(bare)]);
    let result = f.write("r.json", r#"{"entry": 1}"#);
    for (call, why) in [
        ("run_4/call_quiet", "executor id"),
        ("run_4/call_bare", "no assignment"),
    ] {
        let before = f.snapshot(call);
        let out = f.run(&[
            "reconcile",
            "resolve",
            call,
            "--completed",
            &result,
            "--evidence",
            "checked",
        ]);
        out.code(1);
        assert!(out.stderr.contains(why), "{call}: {}", out.stderr);
        assert_eq!(f.snapshot(call), before, "{call} changed");
    }
}

#[test]
fn a_second_resolve_of_the_same_call_is_refused() {
    let f = Fixture::seeded();
    let first = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "withdrawn",
        "--evidence",
        "ticket 1",
        "--json",
    ]);
    first.code(0);
    let after_first = f.snapshot(RECON);
    let result = f.write("r.json", r#"{"entry": 1}"#);
    let second = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "ticket 2",
        "--json",
    ]);
    second.code(1);
    assert!(second.stdout.is_empty());
    assert!(second.stderr.contains("is settled"), "{}", second.stderr);
    assert_eq!(f.snapshot(RECON), after_first);
    assert_eq!(f.receipts(RECON).len(), 3);
    let note = resolution_note(&f, RECON);
    assert_eq!(note["why"], json!("ticket 1"));
}

#[test]
fn resolve_of_a_rejected_call_is_allowed() {
    // The reconciler settles `rejected` calls too (a new final receipt).
    let f = Fixture::seeded();
    let out = f.run(&[
        "reconcile",
        "resolve",
        REJECTED,
        "--failed",
        "not_performed",
        "--message",
        "nothing happened",
        "--evidence",
        "no entry",
        "--json",
    ]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["state"], json!("settled"));
    let receipts = f.receipts(REJECTED);
    let new = receipts.last().expect("receipt");
    assert_eq!(new.receipt_id, v["receipt_id"].as_str().expect("id"));
    assert_eq!(new.sequence, 2);
}

#[test]
fn resolve_with_an_unreachable_platform_keeps_the_receipt_for_the_outbox() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 5}"#);
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "checked",
        "--base-url",
        "http://127.0.0.1:9",
        "--token",
        EXEC,
        "--json",
    ]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(v["delivered"], json!(false));
    assert_eq!(v["state"], json!("settled"));
    let receipts = f.receipts(RECON);
    let new = receipts.last().expect("receipt");
    assert_eq!(new.status, ReceiptStatus::Pending);
    assert!(new.attempts >= 1, "the attempt is counted");
    assert!(new.last_error.is_some());
}

// ---------------------------------------------------------------- reconcile compensated

#[test]
fn compensated_records_a_rejected_call() {
    let f = Fixture::seeded();
    let receipts_before = f.receipts(REJECTED).len();
    let out = f.run(&[
        "reconcile",
        "compensated",
        REJECTED,
        "--evidence",
        "refund re_77 issued",
        "--reference",
        "re_77",
        "--who",
        "frank",
    ]);
    out.code(0).no_grant();
    assert_eq!(
        out.stdout.trim(),
        "recorded run_1/call_rejected as compensated"
    );
    let call = f.call(REJECTED);
    assert_eq!(call.state, LocalState::Compensated);
    let reason = call.reason.expect("reason");
    assert!(
        reason.contains("frank") && reason.contains("refund re_77 issued"),
        "{reason}"
    );
    assert_eq!(f.receipts(REJECTED).len(), receipts_before, "no receipt");
    let events = f.events(REJECTED);
    let note = events
        .iter()
        .find(|e| e.what() == "compensated" && e.detail().is_some_and(|d| d.contains("re_77")))
        .expect("the evidence is in the timeline");
    let detail: Value = serde_json::from_str(note.detail().expect("detail")).expect("JSON");
    assert_eq!(
        detail,
        json!({"who": "frank", "why": "refund re_77 issued", "reference": "re_77"})
    );

    let list = f.run(&["calls", "list", "--state", "compensated", "--json"]);
    list.code(0);
    assert_eq!(list.json()["calls"][0]["call_id"], json!("call_rejected"));

    // Only once.
    let again = f.run(&["reconcile", "compensated", REJECTED, "--evidence", "again"]);
    again.code(1);
    assert!(again.stderr.contains("is compensated"), "{}", again.stderr);
}

#[test]
fn compensated_refuses_every_other_state() {
    let f = Fixture::seeded();
    for (call, state) in [
        (RECON, "reconciliation_required"),
        (DELIVERED, "delivered"),
        (SETTLED, "settled"),
        (CLAIMING, "claiming"),
    ] {
        let before = f.snapshot(call);
        let out = f.run(&["reconcile", "compensated", call, "--evidence", "refund"]);
        out.code(1);
        assert!(out.stdout.is_empty());
        assert!(
            out.stderr.contains(&format!("is {state}")) && out.stderr.contains("rejected"),
            "{call}: {}",
            out.stderr
        );
        assert_eq!(f.snapshot(call), before, "{call} changed");
    }
    f.run(&[
        "reconcile",
        "compensated",
        "run_1/call_nope",
        "--evidence",
        "refund",
    ])
    .code(1);
    let before = f.snapshot(REJECTED);
    f.run(&["reconcile", "compensated", REJECTED]).code(2);
    f.run(&["reconcile", "compensated", "nope", "--evidence", "refund"])
        .code(2);
    f.run(&["reconcile", "compensated", REJECTED, "--evidence", ""])
        .code(1);
    assert_eq!(f.snapshot(REJECTED), before);
}

// ---------------------------------------------------------------- reconcile close

#[test]
fn close_settles_an_unknown_outcome_orphaned_call_with_evidence_and_refuses_others() {
    let f = Fixture::seeded();
    let unknown = local_call(None, "run_9", "call_unknown", TOOL, LocalState::Orphaned, 0);
    let known = local_call(None, "run_9", "call_known", TOOL, LocalState::Orphaned, 0);
    f.commit(vec![
        Change::InsertCall(unknown),
        Change::Note {
            run_id: "run_9".into(),
            call_id: "call_unknown".into(),
            what: "orphaned_outcome_unknown".into(),
            detail: None,
        },
        Change::InsertCall(known),
    ]);
    let before = f.snapshot("run_9/call_known");
    let refused = f.run(&[
        "reconcile",
        "close",
        "run_9/call_known",
        "--evidence",
        "checked",
    ]);
    refused.code(1);
    assert!(
        refused
            .stderr
            .contains("only orphaned calls whose outcome was unknown"),
        "{}",
        refused.stderr
    );
    assert_eq!(
        f.snapshot("run_9/call_known"),
        before,
        "a refused close changed the call"
    );
    let out = f.run(&[
        "reconcile",
        "close",
        "run_9/call_unknown",
        "--evidence",
        "the provider has no charge for this key",
        "--who",
        "ops",
    ]);
    out.code(0);
    assert!(
        out.stdout.contains("closed run_9/call_unknown"),
        "{}",
        out.stdout
    );
    let shown = f.run(&["calls", "show", "run_9/call_unknown", "--json"]);
    shown.code(0);
    assert!(
        shown.stdout.contains("operator_closed")
            && shown
                .stdout
                .contains("the provider has no charge for this key"),
        "{}",
        shown.stdout
    );
    let again = f.run(&[
        "reconcile",
        "close",
        "run_9/call_unknown",
        "--evidence",
        "again",
    ]);
    again.code(1);
    assert!(again.stderr.contains("closed already"), "{}", again.stderr);
}
