//! Replicas on one PostgreSQL database, for the PostgreSQL suite
//! (`tests/postgres.rs`):
//!
//! - `chaos`: three `ledger` processes killed and paused (SIGSTOP past the
//!   grace, then SIGCONT) at random, one of them down longer than the
//!   grace and adopted, every one restarted with its own id and serving
//!   again;
//! - `takeover`: one executor process per identity in this process, their
//!   database and platform connections through pausable proxies
//!   (`pause`), for each way a takeover can go wrong;
//! - `rolling`: three `ledger` processes, each sent SIGTERM in turn and
//!   started again with its own id, under a steady stream of calls;
//! - `health`: the lease in the health report and the metrics, and
//!   readiness while the database does not answer;
//! - `console`: the operator console over one database with three
//!   identities;
//! - `unlike`: replicas with unlike settings (lease lengths, graces,
//!   `auto_reconcile`), a release followed by a restart, a step of the
//!   database's clock, twins of one id on two databases;
//! - `flow`: three `ledger` processes with one tool's limits, global
//!   across them (and with a replica killed and another paused);
//! - `approvals`: a request decided once by approvers clicking at once,
//!   and the call it allows run once although the replica acting on it
//!   died before its `accepted`;
//! - here: the fencing token itself.

pub(crate) mod approvals;
pub(crate) mod chaos;
pub(crate) mod console;
pub(crate) mod flow;
pub(crate) mod health;
pub(crate) mod pause;
#[path = "../../examples/support/proxy.rs"]
mod proxy;
pub(crate) mod rolling;
pub(crate) mod takeover;
pub(crate) mod unlike;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use sqlx::Connection;
use toolrunner::platform::Platform;
use toolrunner::testing::store::{CallFilter, LocalState, PgStore, Store};
use toolrunner_devserver::DevServer;

/// A lease row: `(token, holder, adopted_by, milliseconds since renewed)`.
pub(crate) type LeaseRow = (i64, String, Option<String>, i64);

pub(crate) async fn lease(url: &str, id: &str) -> Result<Option<LeaseRow>> {
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let row = sqlx::query_as(
        "SELECT token, holder, adopted_by,
            (EXTRACT(EPOCH FROM clock_timestamp() - renewed_at) * 1000)::BIGINT
         FROM toolrunner_leases.executor_leases WHERE executor_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut conn)
    .await?;
    conn.close().await?;
    Ok(row)
}

/// Drops what the test left in the shared database.
pub(crate) async fn clean_up(url: &str, ids: &[String]) -> Result<()> {
    let mut conn = sqlx::PgConnection::connect(url).await?;
    for id in ids {
        let schema = PgStore::identity_schema(id);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&mut conn)
        .await?;
        sqlx::query("DELETE FROM toolrunner_leases.executor_leases WHERE executor_id = $1")
            .bind(id)
            .execute(&mut conn)
            .await?;
    }
    conn.close().await?;
    Ok(())
}

/// Every write checks the identity's fencing token: once a newer process
/// (or an adopter) took the lease, the older one's writes are refused, and
/// nothing of them is stored; the newer one writes.
pub(crate) async fn a_write_with_an_older_token_is_refused(url: &str) -> Result<()> {
    use toolrunner::testing::store::{Change, StoreError};
    let id = format!("fence-{:08x}", rand::random::<u32>());
    let binding = format!("bnd_{:08x}", rand::random::<u32>());
    let old = PgStore::connect_as(url, &id, &binding, "ins_old").await?;
    let call = |n: &str| {
        Change::InsertCall(super::store_contract::rows::call(
            n,
            LocalState::Claiming,
            0,
        ))
    };
    old.commit(vec![call("call_before")]).await?;
    let new = PgStore::connect_as(url, &id, &binding, "ins_new").await?;
    let refused = old.commit(vec![call("call_zombie")]).await;
    ensure!(
        matches!(refused, Err(StoreError::Fenced(_))),
        "the older process's write was not refused: {refused:?}"
    );
    ensure!(
        new.call("run_1", "call_zombie").await?.is_none(),
        "the refused write is stored"
    );
    new.commit(vec![call("call_after")]).await?;
    let mut calls: Vec<String> = new
        .calls(&CallFilter::default())
        .await?
        .into_iter()
        .map(|c| c.call_id)
        .collect();
    calls.sort();
    ensure!(
        calls == ["call_after", "call_before"],
        "the calls stored: {calls:?}"
    );
    clean_up(url, &[id]).await
}

/// A running executor whose identity moves on (here a newer process of the
/// same id takes the lease, as an adoption does) stops by itself, saying
/// why, and its store refuses its writes from then on.
pub(crate) async fn a_running_executor_whose_lease_moved_on_stops(url: &str) -> Result<()> {
    let id = format!("moved-{:08x}", rand::random::<u32>());
    let server = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let admin = Platform::new(&server.base_url(), "dev-admin")?;
    let agent = admin.create_agent("moved").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "moved", &["moved.echo"])
        .await?;
    let running = toolrunner::Executor::builder()
        .base_url(server.base_url())
        .token("dev-executor")
        .executor_id(&id)
        .binding_id(&binding.binding_id)
        .store_url(url)
        .allow_all()
        .tool(toolrunner::tool::read("moved.echo", echo).describe("Echoes."))
        .build()?
        .start()
        .await?;
    // The identity moves on (as when a restart of it takes it back from
    // this process as from an adopter).
    let mut conn = sqlx::PgConnection::connect(url).await?;
    // As a session of this version (the lease table refuses a lease write
    // of an older one).
    sqlx::query("SET toolrunner.lease_format = '2'")
        .execute(&mut conn)
        .await?;
    sqlx::query(
        "UPDATE toolrunner_leases.executor_leases SET token = token + 1, holder = 'ins_newer' WHERE executor_id = $1",
    )
    .bind(&id)
    .execute(&mut conn)
    .await?;
    conn.close().await?;
    let stopped = tokio::time::timeout(Duration::from_secs(10), running.wait())
        .await
        .context("the executor did not stop within 10 s of losing its lease")?;
    let why = stopped.err().context("it stopped without an error")?;
    ensure!(
        why.to_string().contains("lost its lease"),
        "it stopped for another reason: {why}"
    );
    drop(running);
    server.shutdown().await;
    clean_up(url, &[id]).await
}

/// `moved.echo` arguments and result.
#[toolrunner::schema]
#[derive(serde::Deserialize, serde::Serialize)]
struct Echo {
    /// Anything.
    text: String,
}

async fn echo(_ctx: toolrunner::CallContext, input: Echo) -> Result<Echo, toolrunner::ToolError> {
    Ok(input)
}

/// A process frozen while it held sqlx's migration lock (an advisory lock
/// named after the database, which sqlx's migrator takes even when nothing
/// is left to apply) holds back no opening of a store that is migrated
/// already. In a database of its own, since the lock is the whole
/// database's: a store that still needs its migrations waits for it (the
/// test's check that it holds the lock sqlx takes).
pub(crate) async fn a_frozen_migration_holds_no_store_back(url: &str) -> Result<()> {
    let name = format!("toolrunner_lock_{:08x}", rand::random::<u32>());
    let mut admin = sqlx::PgConnection::connect(url).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await?;
    let db_url = with_database(url, &name);
    let outcome = async {
        drop(PgStore::connect_in_schema(&db_url, "migrated").await?);
        let mut frozen = sqlx::PgConnection::connect(&db_url).await?;
        sqlx::query("SELECT pg_advisory_lock($1)")
            .bind(0x3d32_ad9e_i64 * i64::from(crc32(name.as_bytes())))
            .execute(&mut frozen)
            .await?;
        let fresh = tokio::time::timeout(
            Duration::from_secs(1),
            PgStore::connect_in_schema(&db_url, "fresh"),
        )
        .await;
        ensure!(
            fresh.is_err(),
            "a store that needs its migrations opened while the database's migration lock was held: the test holds the wrong lock"
        );
        let again = tokio::time::timeout(
            Duration::from_secs(5),
            PgStore::connect_in_schema(&db_url, "migrated"),
        )
        .await
        .context("a migrated store waited for the migration lock of a frozen process")?;
        drop(again?);
        frozen.close().await?;
        Ok(())
    }
    .await;
    let dropped = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE {name} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await;
    outcome.and(dropped.map(drop).map_err(Into::into))
}

/// `url` naming the database `name` instead of its own.
fn with_database(url: &str, name: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL");
    let host_end = rest.find('/').unwrap_or(rest.len());
    let query = rest[host_end..]
        .find('?')
        .map_or("", |i| &rest[host_end + i..]);
    format!("{scheme}://{}/{name}{query}", &rest[..host_end])
}

/// CRC-32 (ISO-HDLC), as sqlx names its migration lock with.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                (c >> 1) ^ 0xedb8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A store whose URL puts a fresh schema before a migrated one on its
/// `search_path` is migrated in the fresh one (the first: where its tables
/// are created), not taken for migrated because the later one is.
pub(crate) async fn a_fresh_schema_before_a_migrated_one_is_migrated(url: &str) -> Result<()> {
    let tag = format!("{:08x}", rand::random::<u32>());
    let (base, fresh) = (format!("mig_base_{tag}"), format!("mig_fresh_{tag}"));
    let outcome = async {
        drop(PgStore::connect_in_schema(url, &base).await?);
        let mut conn = sqlx::PgConnection::connect(url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {fresh}")))
            .execute(&mut conn)
            .await?;
        let sep = if url.contains('?') { '&' } else { '?' };
        let both = format!("{url}{sep}options=-c%20search_path%3D{fresh}%2C{base}");
        drop(PgStore::connect(&both).await?);
        let calls: Option<String> = sqlx::query_scalar("SELECT to_regclass($1)::TEXT")
            .bind(format!("{fresh}.calls"))
            .fetch_one(&mut conn)
            .await?;
        conn.close().await?;
        ensure!(
            calls.is_some(),
            "the fresh schema {fresh} was not migrated: the store took {base}'s migrations for its own"
        );
        Ok(())
    }
    .await;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    for schema in [&base, &fresh] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&mut conn)
        .await?;
    }
    conn.close().await?;
    outcome
}
