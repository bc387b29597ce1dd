//! A rolling restart on PostgreSQL: three `ledger` processes, each with an
//! executor identity of its own in the shared database (the ledger's
//! default identity lease, no takeover grace), serve one binding under a
//! steady stream of calls; each in turn is sent SIGTERM, drains and exits
//! 0, and is started again with the same executor id, twice round. As on
//! SQLite (`tests/support/rolling.rs`: every call completes, no effect
//! twice, no call waits for the platform's lease to lapse, the longest
//! handover printed), and: every drain released its identity's lease (it
//! left nothing), so the restart took it at once instead of waiting for it
//! to lapse.

#[path = "../support/rolling.rs"]
mod common;

/// The `ledger` example's binary and its publication (shared with
/// `chaos`).
pub(crate) use common::ledger::{Published, Serving, ledger_binary, publish_ledger, spawn};

use anyhow::{Context, Result};
use sqlx::Connection;
use toolrunner::testing::store::{PgStore, Store};

/// The shared database; every executor's store in its identity's schema.
struct Postgres {
    url: String,
}

impl common::Backend for Postgres {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn db(&self, _id: &str) -> String {
        self.url.clone()
    }

    /// The drain left nothing, so it let the identity go: the restart
    /// takes the lease at once, without waiting for it to lapse.
    async fn drained(&self, id: &str) -> Result<Option<String>> {
        let mut conn = sqlx::PgConnection::connect(&self.url).await?;
        let row: Option<(bool, String)> = sqlx::query_as(
            "SELECT released, holder FROM toolrunner_leases.executor_leases WHERE executor_id = $1",
        )
        .bind(id)
        .fetch_optional(&mut conn)
        .await?;
        conn.close().await?;
        let (released, holder) = row.with_context(|| format!("{id} has no lease row"))?;
        Ok((!released).then(|| {
            format!(
                "{id} exited 0 from its drain without releasing its identity's lease (held by {holder}): its restart waits for the lease to lapse"
            )
        }))
    }

    async fn store(&self, id: &str) -> Result<Box<dyn Store>> {
        Ok(Box::new(
            PgStore::connect_in_schema(&self.url, &PgStore::identity_schema(id)).await?,
        ))
    }
}

/// The rolling restart, with identities of its own (dropped afterwards).
pub(crate) async fn three_executors_restarted_in_turn_on_postgres(url: &str) -> Result<()> {
    let tag = format!("{:08x}", rand::random::<u32>());
    let ids: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("rolling-{n}-{tag}"))
        .collect();
    let backend = Postgres {
        url: url.to_owned(),
    };
    let outcome = common::rolling_restart(&backend, &ids).await;
    super::clean_up(url, &ids).await?;
    outcome
}
