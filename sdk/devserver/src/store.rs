//! SQLite persistence of the platform's records. Only this module touches sqlx.
use std::collections::BTreeSet;
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Row, SqlitePool};

use crate::engine::State;
use crate::engine::model::Table;

/// The platform's database: in memory unless a file is given.
pub(crate) struct Store {
    pool: SqlitePool,
    seq: i64,
}

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

impl Store {
    /// Opens (and migrates) the database.
    pub(crate) async fn open(path: Option<&Path>) -> Result<Store, sqlx::Error> {
        let options = match path {
            Some(p) => SqliteConnectOptions::new()
                .filename(p)
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .synchronous(SqliteSynchronous::Full),
            None => SqliteConnectOptions::from_str("sqlite::memory:")?,
        }
        .busy_timeout(Duration::from_secs(5));
        // One connection: every write is serialized by the state lock anyway,
        // and an in-memory database lives exactly as long as its connection.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(options)
            .await?;
        MIGRATOR.run(&pool).await?;
        Ok(Store { pool, seq: 0 })
    }

    /// Loads every record into a fresh state.
    pub(crate) async fn load(&mut self) -> Result<State, StoreError> {
        let mut state = State::default();
        for table in Table::ALL {
            let sql = format!("SELECT seq, doc FROM {} ORDER BY seq", table.name());
            for row in sqlx::query(sqlx::AssertSqlSafe(sql))
                .fetch_all(&self.pool)
                .await?
            {
                let seq: i64 = row.try_get("seq")?;
                let doc: String = row.try_get("doc")?;
                self.seq = self.seq.max(seq);
                state
                    .load_record(table, &doc)
                    .map_err(StoreError::Corrupt)?;
            }
        }
        state.reindex();
        Ok(state)
    }

    /// Writes the given records in one transaction.
    pub(crate) async fn save(
        &mut self,
        state: &State,
        dirty: BTreeSet<(Table, String)>,
    ) -> Result<(), StoreError> {
        if dirty.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await?;
        for (table, id) in dirty {
            let Some(doc) = state.record_json(table, &id) else {
                // Changed and gone: a forgotten run's records.
                let sql = format!("DELETE FROM {} WHERE id = ?1", table.name());
                sqlx::query(sqlx::AssertSqlSafe(sql))
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                continue;
            };
            self.seq += 1;
            let sql = format!(
                "INSERT INTO {} (id, seq, doc) VALUES (?1, ?2, ?3) \
                 ON CONFLICT(id) DO UPDATE SET doc = excluded.doc",
                table.name()
            );
            sqlx::query(sqlx::AssertSqlSafe(sql))
                .bind(&id)
                .bind(self.seq)
                .bind(doc)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Closes the pool (a file database is checkpointed).
    pub(crate) async fn close(&self) {
        self.pool.close().await;
    }
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    #[error("database error: {0}")]
    Sql(#[from] sqlx::Error),
    #[error("a stored record does not parse: {0}")]
    Corrupt(serde_json::Error),
}
