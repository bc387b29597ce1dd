//! `outbox status` and `outbox redeliver` over a store.

use super::*;

// ---------------------------------------------------------------- outbox

#[test]
fn outbox_status_json_counts_every_status_and_lists_the_pending() {
    let f = Fixture::seeded();
    let out = f.run(&["outbox", "status", "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(
        key_set(&v),
        keys(&["by_status", "oldest_pending_at", "pending"])
    );
    assert_eq!(
        v["by_status"],
        json!({"pending": 1, "delivered": 6, "rejected": 1, "superseded": 0, "orphaned": 0})
    );
    let pending = v["pending"].as_array().expect("pending");
    assert_eq!(pending.len(), 1);
    let r = &pending[0];
    assert_eq!(
        key_set(r),
        keys(&[
            "receipt_id",
            "kind",
            "sequence",
            "assignment_id",
            "status",
            "attempts",
            "last_error",
            "created_at",
            "delivered_at",
            "body"
        ])
    );
    assert_eq!(r["receipt_id"], json!("rcp_call_settled_1"));
    assert_eq!(r["kind"], json!("completed"));
    assert_eq!(r["sequence"], json!(1));
    assert_eq!(r["assignment_id"], json!("asg_call_settled"));
    assert_eq!(r["status"], json!("pending"));
    assert_eq!(r["attempts"], json!(3));
    assert_eq!(
        r["last_error"],
        json!("POST /runs/run_2/...: could not connect")
    );
    assert_eq!(r["delivered_at"], Value::Null);
    assert_eq!(v["oldest_pending_at"], r["created_at"]);
    let body: Value = serde_json::from_str(r["body"].as_str().expect("body")).expect("JSON");
    assert_eq!(body["result"], json!({"entry": 3}));
}

#[test]
fn outbox_status_human_shows_counts_and_the_undelivered() {
    let f = Fixture::seeded();
    let out = f.run(&["outbox", "status"]);
    out.code(0).no_grant();
    for s in [
        "status",
        "receipts",
        "pending",
        "delivered",
        "rejected",
        "superseded",
        "orphaned",
        "oldest undelivered: 20",
        "rcp_call_settled_1",
        "completed",
        "could not connect",
    ] {
        assert!(out.stdout.contains(s), "{s:?} in\n{}", out.stdout);
    }
}

#[test]
fn outbox_status_of_an_empty_store() {
    let f = Fixture::empty();
    let out = f.run(&["outbox", "status", "--json"]);
    out.code(0);
    assert_eq!(
        out.json(),
        json!({"by_status": {"pending": 0, "delivered": 0, "rejected": 0, "superseded": 0,
                             "orphaned": 0},
               "oldest_pending_at": null, "pending": []})
    );
    let human = f.run(&["outbox", "status"]);
    human.code(0);
    assert!(
        human.stdout.contains("oldest undelivered: none"),
        "{}",
        human.stdout
    );
    let list = f.run(&["calls", "list", "--json"]);
    list.code(0);
    assert_eq!(list.json(), json!({"calls": []}));
}

#[test]
fn outbox_redeliver_usage_errors_and_refusals() {
    let f = Fixture::seeded();
    let before = f.snapshot(SETTLED);
    let out = f.run(&["outbox", "redeliver"]);
    out.code(2);
    assert!(out.stderr.contains("--all"), "{}", out.stderr);
    let out = f.run(&["outbox", "redeliver", "--all"]);
    out.code(2);
    assert!(out.stderr.contains("--base-url"), "{}", out.stderr);
    let out = f.run(&["outbox", "redeliver", "rcp_call_settled_1"]);
    out.code(2);
    assert!(out.stderr.contains("--base-url"), "{}", out.stderr);
    // --base-url without --token
    f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        "http://127.0.0.1:9",
    ])
    .code(2);
    // --all and an id
    f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "rcp_call_settled_1",
        "--base-url",
        "http://127.0.0.1:9",
        "--token",
        EXEC,
    ])
    .code(2);
    assert_eq!(f.snapshot(SETTLED), before);

    let platform = ["--base-url", "http://127.0.0.1:9", "--token", EXEC];
    let out = f.run(&[&["outbox", "redeliver", "rcp_nope"][..], &platform[..]].concat());
    out.code(1);
    assert!(out.stderr.contains("rcp_nope"), "{}", out.stderr);
    let out = f.run(
        &[
            &["outbox", "redeliver", "rcp_call_delivered_1"][..],
            &platform[..],
        ]
        .concat(),
    );
    out.code(1);
    assert!(out.stderr.contains("not pending"), "{}", out.stderr);
    assert_eq!(f.snapshot(SETTLED), before);
}

#[test]
fn outbox_redeliver_to_a_platform_that_does_not_know_the_run_orphans_it() {
    let p = Platform::start();
    let f = Fixture::seeded();
    let out = f.run(&[
        "outbox",
        "redeliver",
        "rcp_call_settled_1",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0).no_grant();
    assert_eq!(
        out.stdout, "rcp_call_settled_1: orphaned\n1 receipts sent\n",
        "{}",
        out.stderr
    );
    assert_eq!(f.call(SETTLED).state, LocalState::Orphaned);
}
