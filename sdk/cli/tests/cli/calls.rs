//! `calls list` and `calls show`.

use super::*;

// ---------------------------------------------------------------- calls list

#[test]
fn calls_list_json_has_every_summary_field_and_no_grant() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "list", "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["calls"]));
    let calls = v["calls"].as_array().expect("calls array");
    assert_eq!(calls.len(), 5, "{v}");
    let summary_keys = keys(&[
        "run_id",
        "call_id",
        "tool_name",
        "state",
        "operation_key",
        "assignment_id",
        "subject",
        "reason",
        "outcome",
        "created_at",
        "updated_at",
    ]);
    for c in calls {
        assert_eq!(key_set(c), summary_keys, "{c}");
    }
    let by_id = |id: &str| {
        calls
            .iter()
            .find(|c| c["call_id"] == json!(id))
            .unwrap_or_else(|| panic!("{id} listed"))
            .clone()
    };
    let recon = by_id("call_recon");
    assert_eq!(recon["run_id"], json!("run_1"));
    assert_eq!(recon["tool_name"], json!(TOOL));
    assert_eq!(recon["state"], json!("reconciliation_required"));
    assert_eq!(recon["operation_key"], json!("op_call_recon"));
    assert_eq!(recon["assignment_id"], json!("asg_call_recon"));
    assert_eq!(recon["subject"], json!("user_42"));
    assert_eq!(recon["reason"], json!("handler failed after accepted"));
    for t in ["created_at", "updated_at"] {
        let s = recon[t].as_str().expect("a timestamp string");
        assert!(
            chrono::DateTime::parse_from_rfc3339(s).is_ok(),
            "{t} is RFC 3339: {s}"
        );
    }
    let states: BTreeSet<&str> = calls
        .iter()
        .map(|c| c["state"].as_str().expect("state"))
        .collect();
    assert_eq!(
        states,
        BTreeSet::from([
            "reconciliation_required",
            "rejected",
            "delivered",
            "settled",
            "claiming"
        ])
    );
    let claiming = by_id("call_claiming");
    assert_eq!(claiming["assignment_id"], Value::Null);
    assert_eq!(claiming["subject"], Value::Null);
    assert_eq!(claiming["reason"], Value::Null);
    assert_eq!(by_id("call_delivered")["tool_name"], json!("tasks.read"));
}

#[test]
fn calls_list_human_shows_a_table_and_a_count_without_the_grant() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "list"]);
    out.code(0).no_grant();
    for s in [
        "call",
        "tool",
        "state",
        "updated",
        "reason",
        RECON,
        REJECTED,
        DELIVERED,
        SETTLED,
        CLAIMING,
        "reconciliation_required",
        "handler failed after accepted",
        "5 calls",
    ] {
        assert!(out.stdout.contains(s), "{s:?} in\n{}", out.stdout);
    }
}

/// Adds `run_4/call_failed`: delivered, its final receipt `failed`.
fn add_failed_call(f: &Fixture) -> &'static str {
    let call = local_call(
        Some(assignment("run_4", "call_failed", TOOL, None)),
        "run_4",
        "call_failed",
        TOOL,
        LocalState::Delivered,
        2,
    );
    let receipts = vec![
        receipt(
            &call,
            ReceiptKind::Accepted,
            0,
            ReceiptStatus::Delivered,
            json!({}),
        ),
        receipt(
            &call,
            ReceiptKind::Failed,
            1,
            ReceiptStatus::Delivered,
            json!({"error": {"code": "declined", "message": "card declined"}}),
        ),
    ];
    let mut changes = vec![Change::InsertCall(call)];
    changes.extend(receipts.into_iter().map(Change::AddReceipt));
    f.commit(changes);
    "run_4/call_failed"
}

/// `delivered` says the final receipt reached the platform, not how the
/// call ended: the list shows the outcome beside it.
#[test]
fn calls_list_shows_how_each_call_ended() {
    let f = Fixture::seeded();
    let failed = add_failed_call(&f);
    let out = f.run(&["calls", "list", "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    let outcome = |id: &str| {
        v["calls"]
            .as_array()
            .expect("calls")
            .iter()
            .find(|c| c["call_id"] == json!(id))
            .unwrap_or_else(|| panic!("{id} listed: {v}"))["outcome"]
            .clone()
    };
    assert_eq!(outcome("call_failed"), json!("failed"), "{v}");
    assert_eq!(outcome("call_delivered"), json!("completed"));
    assert_eq!(outcome("call_settled"), json!("completed"));
    assert_eq!(outcome("call_rejected"), json!("completed"));
    assert_eq!(outcome("call_recon"), Value::Null);
    assert_eq!(outcome("call_claiming"), Value::Null);

    let human = f.run(&["calls", "list"]);
    human.code(0);
    assert!(human.stdout.contains("outcome"), "{}", human.stdout);
    let row = human
        .stdout
        .lines()
        .find(|l| l.contains(failed))
        .unwrap_or_else(|| panic!("{failed} in\n{}", human.stdout));
    assert!(
        row.contains(" delivered ") && row.contains(" failed "),
        "the row says delivered and failed: {row}"
    );
    let row = human
        .stdout
        .lines()
        .find(|l| l.contains(DELIVERED))
        .expect("the delivered call");
    assert!(row.contains(" completed "), "{row}");
}

#[test]
fn calls_list_filters_by_state_and_refuses_an_unknown_state() {
    let f = Fixture::seeded();
    for (state, want) in [
        ("reconciliation_required", RECON),
        ("rejected", REJECTED),
        ("delivered", DELIVERED),
        ("settled", SETTLED),
        ("claiming", CLAIMING),
    ] {
        let out = f.run(&["calls", "list", "--state", state, "--json"]);
        out.code(0);
        let v = out.json();
        let calls = v["calls"].as_array().expect("calls");
        assert_eq!(calls.len(), 1, "--state {state}: {v}");
        let c = &calls[0];
        assert_eq!(
            format!(
                "{}/{}",
                c["run_id"].as_str().unwrap_or_default(),
                c["call_id"].as_str().unwrap_or_default()
            ),
            want
        );
        assert_eq!(c["state"], json!(state));
    }
    let none = f.run(&["calls", "list", "--state", "compensated", "--json"]);
    none.code(0);
    assert_eq!(none.json(), json!({"calls": []}));
    let human = f.run(&["calls", "list", "--state", "rejected"]);
    human.code(0);
    assert!(human.stdout.contains("1 calls"), "{}", human.stdout);

    let bad = f.run(&["calls", "list", "--state", "stuck"]);
    bad.code(2);
    assert!(bad.stdout.is_empty(), "{}", bad.stdout);
    assert!(bad.stderr.contains("stuck"), "{}", bad.stderr);
    assert!(
        bad.stderr.contains("reconciliation_required") && bad.stderr.contains("compensated"),
        "the error lists the states: {}",
        bad.stderr
    );
}

#[test]
fn calls_list_filters_by_tool() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "list", "--tool", "tasks.read", "--json"]);
    out.code(0);
    let v = out.json();
    let calls = v["calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["call_id"], json!("call_delivered"));

    let out = f.run(&["calls", "list", "--tool", TOOL, "--json"]);
    out.code(0);
    assert_eq!(out.json()["calls"].as_array().expect("calls").len(), 4);

    let out = f.run(&[
        "calls", "list", "--tool", TOOL, "--state", "settled", "--json",
    ]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["calls"].as_array().expect("calls").len(), 1, "{v}");
    assert_eq!(v["calls"][0]["call_id"], json!("call_settled"));

    let out = f.run(&["calls", "list", "--tool", "no.such.tool", "--json"]);
    out.code(0);
    assert_eq!(out.json(), json!({"calls": []}));
}

#[test]
fn calls_list_older_than_compares_with_the_last_change() {
    let f = Fixture::seeded();
    std::thread::sleep(Duration::from_millis(20));
    let all = f.run(&["calls", "list", "--older-than", "0s", "--json"]);
    all.code(0);
    assert_eq!(all.json()["calls"].as_array().expect("calls").len(), 5);

    let fresh = f.run(&["calls", "list", "--older-than", "1h", "--json"]);
    fresh.code(0);
    assert_eq!(fresh.json(), json!({"calls": []}));

    let combined = f.run(&[
        "calls",
        "list",
        "--older-than",
        "0s",
        "--state",
        "rejected",
        "--json",
    ]);
    combined.code(0);
    assert_eq!(combined.json()["calls"].as_array().expect("calls").len(), 1);

    f.run(&["calls", "list", "--older-than", "soon"]).code(2);
}

#[test]
fn calls_list_is_ordered_oldest_change_first() {
    let f = Fixture::seeded();
    f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "withdrawn",
        "--evidence",
        "ticket 3",
    ])
    .code(0);
    let out = f.run(&["calls", "list", "--json"]);
    out.code(0);
    let v = out.json();
    let calls = v["calls"].as_array().expect("calls");
    let updated: Vec<&str> = calls
        .iter()
        .map(|c| c["updated_at"].as_str().expect("updated_at"))
        .collect();
    let mut sorted = updated.clone();
    sorted.sort_unstable();
    assert_eq!(updated, sorted, "oldest change first: {v}");
    assert_eq!(
        calls.last().expect("a call")["call_id"],
        json!("call_recon"),
        "the call just resolved changed last: {v}"
    );
}

#[test]
fn calls_list_older_than_a_huge_age_lists_nothing_and_does_not_crash() {
    // An age beyond the calendar cannot match any call: the answer is an
    // empty list (or a usage error), never a panic and never every call.
    let f = Fixture::seeded();
    let mut wrong = Vec::new();
    // 300000 years: `now - age` leaves chrono's calendar; 5e9 years: the age
    // does not fit a chrono duration at all.
    for age in ["300000years", "5000000000years"] {
        let out = f.run(&["calls", "list", "--older-than", age, "--json"]);
        match out.code {
            0 => {
                let listed = out.json()["calls"].as_array().map_or(0, Vec::len);
                if listed != 0 {
                    wrong.push(format!("--older-than {age}: exit 0 listing {listed} calls"));
                }
            }
            2 => {}
            code => wrong.push(format!(
                "--older-than {age}: exit {code}: {}",
                out.stderr.lines().take(2).collect::<Vec<_>>().join(" | ")
            )),
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn a_not_a_store_file_is_a_setup_error_and_stays_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("notes.db");
    std::fs::write(&file, "hello, not a database").expect("write");
    let out = run(&["calls", "list", "--db", file.to_str().expect("utf-8")]);
    out.code(2);
    assert!(out.stdout.is_empty());
    assert_eq!(
        std::fs::read_to_string(&file).expect("read"),
        "hello, not a database"
    );
    run(&[
        "outbox",
        "status",
        "--db",
        dir.path().to_str().expect("utf-8"),
    ])
    .code(2);
}

#[test]
fn a_store_path_with_a_percent_sign_opens_that_very_file() {
    // `--db` takes a path; the CLI checks that this path exists and then
    // opens `sqlite://PATH`, whose path part sqlx percent-decodes. The
    // operator must see the store they named, not a new empty one.
    let f = Fixture::seeded();
    let odd = f.path("exec%41.db");
    std::fs::copy(&f.db, &odd).expect("copy the store");
    for suffix in ["-wal", "-shm"] {
        let side = PathBuf::from(format!("{}{suffix}", f.db.display()));
        if side.exists() {
            std::fs::copy(&side, format!("{}{suffix}", odd.display())).expect("copy");
        }
    }
    let out = run(&[
        "calls",
        "list",
        "--json",
        "--db",
        odd.to_str().expect("utf-8"),
    ]);
    out.code(0);
    assert_eq!(
        out.json()["calls"].as_array().expect("calls").len(),
        5,
        "the CLI read another store than {}",
        odd.display()
    );
    assert!(
        !f.path("execA.db").exists(),
        "the CLI created a new store at the percent-decoded path execA.db"
    );
}

#[test]
fn every_store_command_without_a_store_is_a_setup_error_and_creates_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.db");
    let missing = missing.to_str().expect("utf-8");
    let result = dir.path().join("r.json");
    std::fs::write(&result, r#"{"entry": 1}"#).expect("write");
    let result = result.to_str().expect("utf-8");
    let commands: Vec<Vec<&str>> = vec![
        vec!["calls", "list"],
        vec!["calls", "list", "--json"],
        vec!["calls", "show", RECON],
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            result,
            "--evidence",
            "checked",
        ],
        vec![
            "reconcile",
            "compensated",
            REJECTED,
            "--evidence",
            "checked",
        ],
        vec!["outbox", "status"],
        vec![
            "outbox",
            "redeliver",
            "--all",
            "--base-url",
            "http://127.0.0.1:9",
            "--token",
            "t",
        ],
    ];
    for c in commands {
        let out = run_cmd(toolrunner().args(&c).args(["--db", missing]));
        out.code(2);
        assert!(out.stdout.is_empty(), "{c:?}: {}", out.stdout);
        assert!(
            out.stderr.contains("no executor store at") && out.stderr.contains(missing),
            "{c:?}: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains("--db"),
            "the message says how to fix it: {}",
            out.stderr
        );
        assert!(
            !Path::new(missing).exists(),
            "{c:?} created a store at {missing}"
        );
    }
    // The default is ./toolrunner.db in the working directory.
    let out = run_cmd(toolrunner().current_dir(dir.path()).args(["calls", "list"]));
    out.code(2);
    assert!(out.stderr.contains("toolrunner.db"), "{}", out.stderr);
    assert!(!dir.path().join("toolrunner.db").exists());
}

#[test]
fn the_store_comes_from_toolrunner_db_or_a_sqlite_url() {
    let f = Fixture::seeded();
    let out = run_cmd(
        toolrunner()
            .env("TOOLRUNNER_DB", f.db())
            .args(["calls", "list", "--json"]),
    );
    out.code(0);
    assert_eq!(out.json()["calls"].as_array().expect("calls").len(), 5);
    let url = f.url();
    let out = run(&["calls", "list", "--json", "--db", &url]);
    out.code(0);
    assert_eq!(out.json()["calls"].as_array().expect("calls").len(), 5);
}

// ---------------------------------------------------------------- calls show

#[test]
fn calls_show_json_is_the_whole_timeline() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", RECON, "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(
        key_set(&v),
        keys(&["call", "receipts", "events", "attempts"])
    );

    let c = &v["call"];
    assert_eq!(
        key_set(c),
        keys(&[
            "run_id",
            "call_id",
            "tool_name",
            "state",
            "operation_key",
            "assignment_id",
            "subject",
            "reason",
            "outcome",
            "created_at",
            "updated_at"
        ])
    );
    assert_eq!(c["run_id"], json!("run_1"));
    assert_eq!(c["call_id"], json!("call_recon"));
    assert_eq!(c["state"], json!("reconciliation_required"));
    assert_eq!(c["operation_key"], json!("op_call_recon"));
    assert_eq!(c["assignment_id"], json!("asg_call_recon"));
    assert_eq!(c["subject"], json!("user_42"));

    let receipts = v["receipts"].as_array().expect("receipts");
    assert_eq!(receipts.len(), 2, "{v}");
    let receipt_keys = keys(&[
        "receipt_id",
        "kind",
        "sequence",
        "assignment_id",
        "status",
        "attempts",
        "last_error",
        "created_at",
        "delivered_at",
        "body",
    ]);
    for r in receipts {
        assert_eq!(key_set(r), receipt_keys, "{r}");
        assert_eq!(r["assignment_id"], json!("asg_call_recon"));
        assert_eq!(r["status"], json!("delivered"));
        assert_eq!(r["attempts"], json!(1));
        assert_eq!(r["last_error"], Value::Null);
        assert!(r["delivered_at"].is_string(), "{r}");
        // The exact stored bytes, as a string.
        let body: Value =
            serde_json::from_str(r["body"].as_str().expect("body is a string")).expect("JSON");
        assert_eq!(body["executor_id"], json!(EXECUTOR));
        assert_eq!(body["receipt_id"], r["receipt_id"]);
        assert_eq!(body["sequence"], r["sequence"]);
    }
    assert_eq!(receipts[0]["receipt_id"], json!("rcp_call_recon_0"));
    assert_eq!(receipts[0]["kind"], json!("accepted"));
    assert_eq!(receipts[0]["sequence"], json!(0));
    assert_eq!(receipts[1]["kind"], json!("progress"));
    assert_eq!(receipts[1]["sequence"], json!(1));

    let events = v["events"].as_array().expect("events");
    assert!(!events.is_empty());
    for e in events {
        assert_eq!(key_set(e), keys(&["at", "what", "detail"]), "{e}");
        assert!(e["at"].is_string());
    }
    let state_event = events
        .iter()
        .find(|e| e["what"] == json!("reconciliation_required"))
        .expect("the state change is in the timeline");
    assert_eq!(
        state_event["detail"],
        json!("handler failed after accepted")
    );
    assert!(
        events
            .iter()
            .any(|e| e["what"] == json!("receipt accepted saved")
                && e["detail"] == json!("rcp_call_recon_0")),
        "{v}"
    );
}

#[test]
fn calls_show_pending_and_rejected_receipts_carry_attempts_and_errors() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", SETTLED, "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    let r = &v["receipts"][1];
    assert_eq!(r["kind"], json!("completed"));
    assert_eq!(r["status"], json!("pending"));
    assert_eq!(r["attempts"], json!(3));
    assert_eq!(
        r["last_error"],
        json!("POST /runs/run_2/...: could not connect")
    );
    assert_eq!(r["delivered_at"], Value::Null);

    let out = f.run(&["calls", "show", CLAIMING, "--json"]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["receipts"], json!([]));
    assert_eq!(v["call"]["assignment_id"], Value::Null);
    assert_eq!(v["call"]["subject"], Value::Null);
}

#[test]
fn calls_show_human_prints_the_call_its_receipts_and_its_timeline() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", REJECTED]);
    out.code(0).no_grant();
    let s = &out.stdout;
    for want in [
        REJECTED,
        TOOL,
        "rejected",
        "op_call_rejected",
        "asg_call_rejected",
        "user_42",
        "receipts",
        "timeline",
        "rcp_call_rejected_0",
        "rcp_call_rejected_1",
        "409 run_terminated: the run was cancelled",
        "receipt completed saved",
        "executor_id",
    ] {
        assert!(s.contains(want), "{want:?} in\n{s}");
    }
    let receipts_at = s.find("receipts").expect("receipts section");
    let timeline_at = s.find("timeline").expect("timeline section");
    assert!(receipts_at < timeline_at);
}

/// The arguments the model gave, as the console shows them; never the
/// grant, and not in the stable JSON.
#[test]
fn calls_show_human_prints_the_arguments() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", RECON]);
    out.code(0).no_grant();
    let line = out
        .stdout
        .lines()
        .find(|l| l.starts_with("arguments"))
        .unwrap_or_else(|| panic!("no arguments line in\n{}", out.stdout));
    assert_eq!(line, r#"arguments     {"amount":5}"#);
    // A call not assigned yet has none.
    let out = f.run(&["calls", "show", CLAIMING]);
    out.code(0);
    assert!(
        out.stdout.lines().any(|l| l == "arguments     -"),
        "{}",
        out.stdout
    );
    // The stable JSON is unchanged: no arguments there.
    let v = f.run(&["calls", "show", RECON, "--json"]).json();
    assert!(v.get("arguments").is_none() && v["call"].get("arguments").is_none());
}

#[test]
fn calls_show_refuses_an_unknown_call_and_rejects_a_malformed_reference() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", "run_1/call_nope"]);
    out.code(1);
    assert!(out.stdout.is_empty());
    assert!(
        out.stderr.contains("run_1/call_nope"),
        "the message names the call: {}",
        out.stderr
    );
    f.run(&["calls", "show", "run_9/call_recon", "--json"])
        .code(1);
    for bad in ["call_recon", "run_1/", "/call_recon", ""] {
        let out = f.run(&["calls", "show", bad]);
        out.code(2);
        assert!(
            out.stderr.contains("RUN_ID/CALL_ID"),
            "{bad:?}: {}",
            out.stderr
        );
    }
    run(&["calls", "show"]).code(2);
}
