//! `approvals list|show|approve|deny`: the `--json` shape, a decision
//! recorded once (a second approve exits 0 and changes nothing), an
//! approve after a deny or an expiry refused (exit 1).

use super::*;

/// A store with three requests: `run_a/call_wait` and `run_b/call_deny`
/// waiting, `run_c/call_old` expired.
fn store_with_requests(dir: &Path) -> String {
    let path = dir.join("approvals.db");
    let rt = runtime();
    rt.block_on(async {
        let store = SqliteStore::open_path(&path).await.expect("a store");
        drop(store);
        let url = format!("sqlite://{}", path.display());
        let pool = toolrunner::sqlx::SqlitePool::connect(&url)
            .await
            .expect("the store opens");
        for (run, call, expires) in [
            ("run_a", "call_wait", "2999-01-01T00:00:00.000Z"),
            ("run_b", "call_deny", "2999-01-01T00:00:00.000Z"),
            ("run_c", "call_old", "2001-01-01T00:00:01.000Z"),
        ] {
            toolrunner::sqlx::query(
                "INSERT INTO approvals (run_id, call_id, digest, tool, subject, agent_id,
                     agent_version, arguments, reason, executor_id, asked_at, expires_at, state)
                 VALUES (?, ?, 'sha256:abc', 'refunds.refund', 'user_42', 'agt_1', 'v1',
                     '{\"amount\":400000,\"note\":\"<b>x</b>\"}', 'over 1,000', ?,
                     '2001-01-01T00:00:00.000Z', ?, 'waiting')",
            )
            .bind(run)
            .bind(call)
            .bind(EXECUTOR)
            .bind(expires)
            .execute(&pool)
            .await
            .expect("a request stored");
        }
        pool.close().await;
    });
    path.to_str().expect("utf-8").to_owned()
}

fn approvals(db: &str, args: &[&str]) -> Out {
    run_cmd(toolrunner().arg("approvals").args(args).args(["--db", db]))
}

#[test]
fn approvals_list_json_names_each_request_and_its_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = store_with_requests(dir.path());
    let out = approvals(&db, &["list", "--json"]);
    out.code(0);
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["approvals"]));
    let all = v["approvals"].as_array().expect("an array");
    assert_eq!(all.len(), 3, "{v}");
    for r in all {
        for k in [
            "run_id",
            "call_id",
            "tool",
            "digest",
            "state",
            "reason",
            "arguments",
        ] {
            assert!(r.get(k).is_some(), "{k} missing: {r}");
        }
    }
    let state = |call: &str| {
        all.iter()
            .find(|r| r["call_id"] == json!(call))
            .map(|r| r["state"].clone())
            .unwrap_or_else(|| panic!("{call} listed"))
    };
    assert_eq!(state("call_wait"), json!("waiting"));
    assert_eq!(state("call_old"), json!("expired"));
    let shown = approvals(&db, &["show", "run_a/call_wait"]);
    shown.code(0);
    assert!(shown.stdout.contains("over 1,000"), "{}", shown.stdout);
    assert!(shown.stdout.contains("400000"), "{}", shown.stdout);
}

#[test]
fn an_approval_is_recorded_once_and_never_after_a_deny_or_an_expiry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = store_with_requests(dir.path());
    approvals(
        &db,
        &[
            "approve",
            "run_a/call_wait",
            "--who",
            "alice",
            "--note",
            "ok",
        ],
    )
    .code(0);
    let again = approvals(&db, &["approve", "run_a/call_wait", "--who", "bob"]);
    again.code(0);
    assert!(again.stdout.contains("already"), "{}", again.stdout);
    let v = approvals(&db, &["show", "run_a/call_wait", "--json"]).json();
    assert_eq!(v["state"], json!("approved"));
    assert_eq!(
        v["decided_by"],
        json!("alice"),
        "the second approve changed nothing"
    );
    assert_eq!(v["note"], json!("ok"));
    let deny_after = approvals(&db, &["deny", "run_a/call_wait", "--who", "carol"]);
    deny_after.code(1);

    approvals(&db, &["deny", "run_b/call_deny", "--who", "dana"]).code(0);
    let approve_after = approvals(&db, &["approve", "run_b/call_deny", "--who", "erin"]);
    approve_after.code(1);
    assert!(
        approve_after.stderr.contains("denied by dana"),
        "{}",
        approve_after.stderr
    );

    let expired = approvals(&db, &["approve", "run_c/call_old", "--who", "fay"]);
    expired.code(1);
    assert!(expired.stderr.contains("expired"), "{}", expired.stderr);
    let unknown = approvals(&db, &["approve", "run_x/call_x", "--who", "gus"]);
    unknown.code(1);
    assert!(
        unknown.stderr.contains("no approval request"),
        "{}",
        unknown.stderr
    );
    let nameless = approvals(&db, &["approve", "run_a/call_wait"]);
    nameless.code(2);
}
