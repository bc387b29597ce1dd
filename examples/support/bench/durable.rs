//! The durable side's store: a SQLite file or a PostgreSQL schema, and what
//! its writer did.

use super::*;

/// What the durable side's store did: changes asked for, transactions,
/// checkpoints and fsyncs.
pub(crate) struct StoreStats {
    pub(crate) jobs: u64,
    pub(crate) transactions: u64,
    pub(crate) checkpoints: u64,
    pub(crate) fsyncs: u64,
}

/// The durable side's store: a SQLite file, or (`--store-url`) a schema of
/// its own in a PostgreSQL database.
pub(crate) enum DurableStore {
    Sqlite {
        store: SqliteStore,
        _lock: toolrunner::testing::store::StoreLock,
    },
    #[cfg(feature = "postgres")]
    Postgres {
        store: Box<toolrunner::testing::store::PgStore>,
        url: String,
        schema: String,
        wal_syncs: i64,
    },
}

impl DurableStore {
    pub(crate) async fn open(dir: &std::path::Path, url: Option<&str>) -> Result<DurableStore> {
        match url {
            None => {
                let path = dir.join("executor.db");
                let lock = SqliteStore::lock_path(&path)?;
                Ok(DurableStore::Sqlite {
                    store: SqliteStore::open_path(&path).await?,
                    _lock: lock,
                })
            }
            #[cfg(feature = "postgres")]
            Some(url) => {
                let schema = format!("bench_{:08x}", rand::random::<u32>());
                toolrunner::testing::store::PgStore::connect_in_schema(url, &schema).await?;
                // Held as the executor holds it: every write checks the
                // identity's fencing token first.
                let sep = if url.contains('?') { '&' } else { '?' };
                let in_schema = format!("{url}{sep}options=-c%20search_path%3D{schema}");
                let store = toolrunner::testing::store::PgStore::connect_as(
                    &in_schema,
                    &format!("bench-durable-{schema}"),
                    "bnd_bench",
                    "ins_bench",
                )
                .await?;
                let wal_syncs = pg_wal_syncs(url).await?;
                Ok(DurableStore::Postgres {
                    store: Box::new(store),
                    url: url.to_owned(),
                    schema,
                    wal_syncs,
                })
            }
            #[cfg(not(feature = "postgres"))]
            Some(_) => bail!(
                "--store-url needs the postgres feature: cargo run --release --features postgres --example bench -- …"
            ),
        }
    }

    pub(crate) fn store(&self) -> Arc<dyn Store> {
        match self {
            DurableStore::Sqlite { store, .. } => Arc::new(store.clone()),
            #[cfg(feature = "postgres")]
            DurableStore::Postgres { store, .. } => Arc::new((**store).clone()),
        }
    }

    /// `jobs`: the commits the executor asked for (each its own
    /// transaction on PostgreSQL, which groups their WAL flushes itself;
    /// the SQLite writer counts its own).
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub(crate) async fn stats(&self, jobs: u64) -> Result<StoreStats> {
        match self {
            DurableStore::Sqlite { store, .. } => {
                let s = store.writer_stats();
                Ok(StoreStats {
                    jobs: s.jobs,
                    transactions: s.transactions,
                    checkpoints: s.checkpoints,
                    fsyncs: s.fsyncs,
                })
            }
            #[cfg(feature = "postgres")]
            DurableStore::Postgres {
                store,
                url,
                wal_syncs,
                ..
            } => {
                let now = pg_wal_syncs(url).await?;
                // The writer's own count (group commit puts several commits
                // of the store in one transaction).
                let s = store.writer_stats();
                Ok(StoreStats {
                    jobs: s.jobs.max(jobs),
                    transactions: s.transactions,
                    checkpoints: 0,
                    fsyncs: u64::try_from(now - wal_syncs).unwrap_or(0),
                })
            }
        }
    }

    /// Drops the PostgreSQL schema (a SQLite file goes with its directory).
    pub(crate) async fn close(self) -> Result<()> {
        match self {
            DurableStore::Sqlite { .. } => Ok(()),
            #[cfg(feature = "postgres")]
            DurableStore::Postgres { url, schema, .. } => {
                use sqlx::Connection;
                let mut conn = sqlx::PgConnection::connect(&url).await?;
                // The name is ours: `bench_` and hex digits.
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                    .execute(&mut conn)
                    .await?;
                sqlx::query("DELETE FROM toolrunner_leases.executor_leases WHERE executor_id = $1")
                    .bind(format!("bench-durable-{schema}"))
                    .execute(&mut conn)
                    .await?;
                conn.close().await?;
                Ok(())
            }
        }
    }
}

/// The server's WAL syncs so far (`pg_stat_wal`, the whole server).
#[cfg(feature = "postgres")]
pub(crate) async fn pg_wal_syncs(url: &str) -> Result<i64> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let n: i64 = sqlx::query_scalar("SELECT wal_sync FROM pg_stat_wal")
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(n)
}
