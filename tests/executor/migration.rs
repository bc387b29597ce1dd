//! A store written by the executor before the lifecycle migration
//! (`tests/fixtures/store-v1`, one call in each unsettled state) opens,
//! migrates, and every call settles as the crash table says; and the
//! migration mends older rows that the new schema refuses.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use toolrunner::testing::store::{LocalState, ReceiptStatus, SqliteStore, Store};
use toolrunner::{CallContext, Effect, Executor, Reconciled, Tool, ToolError, async_trait};
use toolrunner_devserver::DevServer;

use crate::fixture::{bounded, str_of};

const FIXTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/store-v1");

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct Input {
    /// What the handler does.
    memo: String,
}

#[derive(Debug, Serialize, schemars::JsonSchema)]
struct Output {
    /// The memo.
    memo: String,
}

/// The fixture's tool: its handler runs only for `ok`; its hook finds the
/// `boom` effect and knows the `hang` one never happened.
struct FixtureTool(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

#[async_trait]
impl Tool for FixtureTool {
    type Input = Input;
    type Output = Output;
    fn name(&self) -> &str {
        "fixture.write"
    }
    fn description(&self) -> &str {
        "fixture write tool"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, ctx: &CallContext, input: Input) -> Result<Output, ToolError> {
        self.0
            .lock()
            .expect("not poisoned")
            .push(ctx.call_id().to_owned());
        Ok(Output { memo: input.memo })
    }
    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Output> {
        let ids: Value = serde_json::from_str(
            &std::fs::read_to_string(Path::new(FIXTURE).join("ids.json")).expect("ids"),
        )
        .expect("json");
        if ctx.call_id() == ids["calls"]["reconciliation_required"]["call_id"] {
            Reconciled::Happened(Output {
                memo: "boom".into(),
            })
        } else {
            Reconciled::DidNotHappen
        }
    }
}

fn copy_fixture(to: &Path) -> Result<Value> {
    for f in ["executor.db", "platform.db"] {
        std::fs::copy(Path::new(FIXTURE).join(f), to.join(f)).with_context(|| f.to_owned())?;
    }
    Ok(serde_json::from_str(&std::fs::read_to_string(
        Path::new(FIXTURE).join("ids.json"),
    )?)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_written_before_the_lifecycle_migration_migrates_and_its_calls_settle() -> Result<()>
{
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir()?;
    let ids = copy_fixture(dir.path())?;
    let server = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .db_path(dir.path().join("platform.db"))
        .lease_ttl_ms(3_000)
        .heartbeat_interval_ms(500)
        .start()
        .await?;
    let store_url = format!("sqlite://{}", dir.path().join("executor.db").display());
    let runs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let running = Executor::builder()
        .base_url(server.base_url())
        .token(str_of(&ids, "executor_token")?)
        .executor_id(str_of(&ids, "executor_id")?)
        .binding_id(str_of(&ids, "binding_id")?)
        .store_url(&store_url)
        .poll_interval(Duration::from_millis(50))
        .reconcile_interval(Duration::from_millis(100))
        .backoff(Duration::from_millis(20), Duration::from_millis(200), 4)
        .allow_all()
        .tool(FixtureTool(runs.clone()))
        .build()?
        .start()
        .await?;
    let platform =
        toolrunner::platform::Platform::new(&server.base_url(), &str_of(&ids, "admin_token")?)?;
    let expected = [
        ("delivered", "completed"),
        ("reconciliation_required", "completed"),
        ("running", "failed"),
        ("assigned", "completed"),
        ("claiming", "completed"),
        ("settled", "completed"),
    ];
    let store = SqliteStore::open(&store_url).await?;
    for (name, state) in expected {
        let call = &ids["calls"][name];
        let (run_id, call_id) = (str_of(call, "run_id")?, str_of(call, "call_id")?);
        let seen = bounded(Duration::from_secs(20), name, async {
            loop {
                let run = platform.run(&run_id).await.expect("platform answers");
                let c = serde_json::to_value(&run.tool_calls[0]).expect("json");
                let local = store.call(&run_id, &call_id).await.expect("readable");
                if c["state"] == state
                    && local
                        .as_ref()
                        .is_some_and(|l| l.state == LocalState::Delivered)
                {
                    return c;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        if name == "running" {
            assert_eq!(
                seen["receipts"][1]["body"]["error"]["code"],
                json!("not_performed"),
                "{seen}"
            );
        }
        // Nothing is left undelivered, and every attempt is on record.
        for r in store.receipts(&run_id, &call_id).await? {
            assert_ne!(r.status, ReceiptStatus::Pending, "{name}: {r:?}");
        }
        assert!(
            !store.attempts(&run_id, &call_id).await?.is_empty(),
            "{name}: the migration keeps the attempt"
        );
    }
    // The handler ran for the two calls that never started, and only them.
    let mut ran = runs.lock().expect("not poisoned").clone();
    ran.sort();
    let mut want = vec![
        str_of(&ids["calls"]["assigned"], "call_id")?,
        str_of(&ids["calls"]["claiming"], "call_id")?,
    ];
    want.sort();
    assert_eq!(ran, want);
    running
        .shutdown(toolrunner::Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    server.shutdown().await;
    Ok(())
}

/// Rows an older store could hold that the new schema refuses are mended
/// by the migration: an `accepted` left pending by a settled claim is
/// superseded, a second receipt under one `(assignment_id, sequence)` is
/// set aside, a second live final is marked rejected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_migration_mends_rows_the_new_schema_refuses() -> Result<()> {
    use sqlx::Connection;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("old.db");
    // The first migration alone, as main had it.
    let first = tempfile::tempdir()?;
    std::fs::copy(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/sdk/toolrunner/migrations/sqlite/20261129000001_executor_store.sql"
        ),
        first.path().join("20261129000001_executor_store.sql"),
    )?;
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true);
    let mut conn = sqlx::SqliteConnection::connect_with(&options).await?;
    sqlx::migrate::Migrator::new(first.path())
        .await?
        .run(&mut conn)
        .await?;
    let now = "2026-11-30T00:00:00.000Z";
    let call = |call: &str, state: &str| {
        format!(
            "INSERT INTO calls VALUES ('run_1', '{call}', 't', 'op_{call}', '{state}', '{{\"assignment_id\":\"asg_{call}\"}}', 2, NULL, NULL, '{now}', '{now}')"
        )
    };
    let receipt = |id: &str, call: &str, kind: &str, seq: u64, status: &str, at: &str| {
        format!(
            "INSERT INTO receipts VALUES ('{id}', 'run_1', '{call}', 'asg_{call}', '{kind}', {seq}, '{{\"executor_id\":\"exe_old\"}}', '{status}', 1, NULL, '{at}', NULL)"
        )
    };
    for sql in [
        call("abandoned", "abandoned"),
        receipt("rcp_a0", "abandoned", "accepted", 0, "pending", now),
        call("dup", "reconciliation_required"),
        receipt("rcp_d0", "dup", "accepted", 0, "delivered", now),
        receipt(
            "rcp_d1",
            "dup",
            "progress",
            1,
            "delivered",
            "2026-11-30T00:00:01.000Z",
        ),
        receipt(
            "rcp_d2",
            "dup",
            "completed",
            1,
            "rejected",
            "2026-11-30T00:00:02.000Z",
        ),
        call("twice", "settled"),
        receipt("rcp_t0", "twice", "accepted", 0, "delivered", now),
        receipt(
            "rcp_t1",
            "twice",
            "completed",
            1,
            "delivered",
            "2026-11-30T00:00:01.000Z",
        ),
        receipt(
            "rcp_t2",
            "twice",
            "failed",
            2,
            "pending",
            "2026-11-30T00:00:02.000Z",
        ),
        // A pending final that reused a progress receipt's sequence.
        call("aside", "settled"),
        receipt("rcp_s0", "aside", "accepted", 0, "delivered", now),
        receipt(
            "rcp_s1",
            "aside",
            "progress",
            1,
            "delivered",
            "2026-11-30T00:00:01.000Z",
        ),
        receipt(
            "rcp_s2",
            "aside",
            "completed",
            1,
            "pending",
            "2026-11-30T00:00:02.000Z",
        ),
        // The later final is the one the platform has.
        call("later", "settled"),
        receipt("rcp_l0", "later", "accepted", 0, "delivered", now),
        receipt(
            "rcp_l1",
            "later",
            "completed",
            1,
            "pending",
            "2026-11-30T00:00:01.000Z",
        ),
        receipt(
            "rcp_l2",
            "later",
            "completed",
            2,
            "delivered",
            "2026-11-30T00:00:02.000Z",
        ),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut conn)
            .await?;
    }
    conn.close().await?;

    let store = SqliteStore::open_path(&path).await?;
    let status = |id: &'static str| {
        let store = store.clone();
        async move { store.receipt(id).await.expect("readable").map(|r| r.status) }
    };
    assert_eq!(status("rcp_a0").await, Some(ReceiptStatus::Superseded));
    assert_eq!(status("rcp_d1").await, Some(ReceiptStatus::Delivered));
    assert_eq!(status("rcp_d2").await, None, "set aside");
    assert_eq!(status("rcp_t1").await, Some(ReceiptStatus::Delivered));
    assert_eq!(status("rcp_t2").await, Some(ReceiptStatus::Rejected));
    assert_eq!(status("rcp_s2").await, None, "set aside");
    assert_eq!(status("rcp_l1").await, Some(ReceiptStatus::Rejected));
    assert_eq!(status("rcp_l2").await, Some(ReceiptStatus::Delivered));
    let mut conn = sqlx::SqliteConnection::connect_with(&options).await?;
    let aside: Vec<(String, String)> =
        sqlx::query_as("SELECT receipt_id, why FROM receipts_set_aside ORDER BY receipt_id")
            .fetch_all(&mut conn)
            .await?;
    let ids: Vec<&str> = aside.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["rcp_d2", "rcp_s2"]);
    // The calls follow their receipts: no call waits for a receipt that was
    // set aside, and the next sequence comes after every stored one.
    let calls: Vec<(String, String, Option<String>, i64)> =
        sqlx::query_as("SELECT call_id, state, report, next_sequence FROM calls ORDER BY call_id")
            .fetch_all(&mut conn)
            .await?;
    let expected = [
        ("abandoned", "abandoned", None, 2),
        (
            "aside",
            "reconciliation_required",
            Some("reconciliation_required"),
            2,
        ),
        ("dup", "reconciliation_required", None, 2),
        ("later", "delivered", None, 3),
        ("twice", "delivered", None, 3),
    ];
    let expected: Vec<(String, String, Option<String>, i64)> = expected
        .iter()
        .map(|(c, s, r, n)| ((*c).into(), (*s).into(), r.map(str::to_owned), *n))
        .collect();
    assert_eq!(calls, expected);
    // The schema now refuses what must never exist.
    for bad in [
        "UPDATE calls SET state = 'lost' WHERE call_id = 'dup'",
        "UPDATE calls SET next_sequence = -1 WHERE call_id = 'dup'",
        "UPDATE receipts SET status = 'sent' WHERE receipt_id = 'rcp_d0'",
        "UPDATE receipts SET sequence = 0 WHERE receipt_id = 'rcp_d1'",
        "UPDATE receipts SET status = 'pending' WHERE receipt_id = 'rcp_t2'",
        "INSERT INTO receipts VALUES ('rcp_x', 'run_1', 'nope', 'asg_nope', 'progress', 1, '{}', 'pending', 0, NULL, '2026-11-30', NULL)",
        "INSERT INTO receipts VALUES ('rcp_y', 'run_1', 'dup', 'asg_dup', 'accepted', 5, '{}', 'pending', 0, NULL, '2026-11-30', NULL)",
    ] {
        let refused = sqlx::query("PRAGMA foreign_keys = ON")
            .execute(&mut conn)
            .await
            .and(sqlx::query(bad).execute(&mut conn).await);
        assert!(refused.is_err(), "the schema accepted: {bad}");
    }
    Ok(())
}

/// Orphaned calls whose outcome an older version left unknown, without
/// the timeline entry retention keeps them by: the migration
/// `…_unknown_outcome_orphans` marks them, so retention keeps them until an
/// operator closes them (the store contract's
/// `retention_keeps_the_unknown_outcome_orphans_an_older_version_wrote`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unknown_outcome_orphans_an_older_version_wrote_are_kept_after_the_migration()
-> Result<()> {
    use sqlx::Connection;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("older.db");
    let older = crate::store_contract::older_migrations("sqlite")?;
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true);
    let mut conn = sqlx::SqliteConnection::connect_with(&options).await?;
    sqlx::migrate::Migrator::new(older.path())
        .await?
        .run(&mut conn)
        .await?;
    for sql in crate::store_contract::older_orphans() {
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .execute(&mut conn)
            .await?;
    }
    conn.close().await?;
    let store = SqliteStore::open_path(&path).await?;
    crate::store_contract::retention_keeps_the_unknown_outcome_orphans_an_older_version_wrote(
        &store,
    )
    .await
}
