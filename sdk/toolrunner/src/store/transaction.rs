//! A transaction of the store's own database that a handler's business
//! writes share with the changes that settle its call
//! ([`CallContext::transaction`](crate::CallContext::transaction)): the
//! executor adds the final receipt to it and commits once, so the
//! business rows and the receipt are both stored or both absent.
//!
//! Each handler closure runs inside a savepoint of its own, released when
//! it returns `Ok` and rolled back when it returns `Err` (the same on both
//! stores); a savepoint that is gone when the closure returns means that
//! the closure ended the transaction itself (its own `COMMIT` or
//! `ROLLBACK`), and nothing more is written on it (`docs/protocol.md`,
//! choice 70).
use super::write::{self, Conn};
use super::{Change, LocalCall, StoreError};

/// An open transaction of the store's database (see
/// [`Store::begin`](super::Store::begin)). Dropped without being
/// committed, it rolls back.
pub struct StoreTransaction {
    pub(super) inner: Inner,
    /// SQLite: this transaction's turn among handlers' transactions, held
    /// until it ends (see `SqliteStore::begin`).
    pub(super) turn: Option<tokio::sync::OwnedSemaphorePermit>,
}

/// The backend's transaction.
pub(super) enum Inner {
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
    #[cfg(feature = "postgres")]
    Postgres(super::postgres::HandlerTx),
}

/// The savepoint each handler closure runs in.
const CLOSURE: &str = "toolrunner_closure";

/// The executor's own savepoint, opened right after the transaction's
/// `BEGIN` and never touched by a closure: while it is there, the
/// transaction is still the executor's (a closure that ended it with a
/// `COMMIT` or `ROLLBACK` of its own took it along). Unlike a closure's
/// savepoint, which the executor itself releases when the closure returns,
/// it tells this even of a closure cut off while its savepoint was being
/// released.
const CALL: &str = "toolrunner_call";

/// How a handler closure's savepoint ended
/// ([`StoreTransaction::close_closure`]).
#[derive(Debug)]
pub(crate) enum Closed {
    /// Released (the closure returned `Ok`) or rolled back to (`Err`): the
    /// transaction goes on.
    Kept,
    /// The savepoint is gone: the closure ended the transaction itself
    /// (its own `COMMIT` or `ROLLBACK`), and what it wrote may be stored.
    Broken(String),
    /// The transaction is whole but must not commit: on PostgreSQL a
    /// statement of the closure failed (aborting the transaction) and the
    /// closure returned `Ok` all the same. Rolled back to its savepoint;
    /// the whole transaction is rolled back with the call.
    Spoiled(String),
}

impl std::fmt::Debug for StoreTransaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backend = match &self.inner {
            Inner::Sqlite(_) => "sqlite",
            #[cfg(feature = "postgres")]
            Inner::Postgres(_) => "postgres",
        };
        f.debug_struct("StoreTransaction")
            .field("backend", &backend)
            .finish()
    }
}

impl StoreTransaction {
    /// A transaction of the backend's.
    pub(super) fn new(inner: Inner) -> StoreTransaction {
        StoreTransaction { inner, turn: None }
    }

    /// Runs one statement of the store's own (a savepoint's).
    async fn statement(&mut self, sql: &str) -> Result<(), sqlx::Error> {
        match &mut self.inner {
            Inner::Sqlite(tx) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                    .execute(&mut **tx)
                    .await?;
            }
            #[cfg(feature = "postgres")]
            Inner::Postgres(tx) => {
                sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned()))
                    .execute(tx.conn())
                    .await?;
            }
        }
        Ok(())
    }

    /// Opens the executor's own savepoint ([`CALL`]), right after the
    /// transaction began (before any closure runs in it).
    ///
    /// # Errors
    /// The database failed.
    pub(crate) async fn open_call(&mut self) -> Result<(), StoreError> {
        self.statement(&format!("SAVEPOINT {CALL}"))
            .await
            .map_err(StoreError::from)
    }

    /// Opens the savepoint a handler closure runs in.
    ///
    /// # Errors
    /// The database failed: on PostgreSQL, an earlier closure's failed
    /// statement (which that closure returned `Ok` after) aborted the
    /// transaction.
    pub(crate) async fn open_closure(&mut self) -> Result<(), StoreError> {
        self.statement(&format!("SAVEPOINT {CLOSURE}"))
            .await
            .map_err(StoreError::from)
    }

    /// Ends the savepoint of a closure that returned (`ok`: released;
    /// otherwise rolled back to, so none of its writes stay, on either
    /// store). A PostgreSQL transaction that a failed statement aborted,
    /// whose closure returned `Ok` all the same, stays aborted (it cannot
    /// commit). Any other failure means that the savepoint is gone: the
    /// closure ended the transaction itself.
    pub(crate) async fn close_closure(&mut self, ok: bool) -> Closed {
        let ended = if ok {
            match self
                .statement(&format!("RELEASE SAVEPOINT {CLOSURE}"))
                .await
            {
                // 25P02: in a failed transaction: a statement failed after
                // the closure's savepoint (and the transaction is the
                // executor's), or the closure ended the transaction and
                // began another that failed. The savepoint tells.
                Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("25P02") => {
                    return match self.probe_closure().await {
                        Closed::Kept => Closed::Spoiled(
                            "a statement of the handler's closure failed and the closure returned Ok all the same: the call's transaction cannot commit, and is rolled back".into(),
                        ),
                        other => other,
                    };
                }
                other => other,
            }
        } else {
            match self
                .statement(&format!("ROLLBACK TO SAVEPOINT {CLOSURE}"))
                .await
            {
                Ok(()) => {
                    self.statement(&format!("RELEASE SAVEPOINT {CLOSURE}"))
                        .await
                }
                Err(e) => Err(e),
            }
        };
        match ended {
            Ok(()) => Closed::Kept,
            Err(e) => Closed::Broken(format!(
                "the handler's closure ended the call's transaction itself (a COMMIT or ROLLBACK of its own on the transaction's connection; its savepoint is gone: {e}): what it wrote may be stored, so the outcome is unknown; never end the transaction inside ctx.transaction"
            )),
        }
    }

    /// Whether the transaction of a closure that did not come back (it
    /// panicked, was dropped or cut off, or ran past its bound) is still
    /// the executor's: the executor's own savepoint ([`CALL`]) is there,
    /// and rolled back to (nothing of the call's transaction stays, and it
    /// is rolled back whole; `Kept`), or gone (`Broken`: the closure ended
    /// the transaction itself before it stopped, and what it wrote may be
    /// stored). Not the closure's own savepoint: a closure cut off while
    /// the executor released it would look as if it ended the transaction.
    pub(crate) async fn probe_closure(&mut self) -> Closed {
        match self
            .statement(&format!("ROLLBACK TO SAVEPOINT {CALL}"))
            .await
        {
            Ok(()) => Closed::Kept,
            Err(e) => Closed::Broken(format!(
                "the handler's closure ended the call's transaction itself before it stopped (a COMMIT or ROLLBACK of its own on the transaction's connection; its savepoint is gone: {e}): what it wrote may be stored, so the outcome is unknown; never end the transaction inside ctx.transaction"
            )),
        }
    }

    pub(crate) fn sqlite(&mut self) -> Option<&mut sqlx::SqliteConnection> {
        match &mut self.inner {
            Inner::Sqlite(tx) => Some(&mut **tx),
            #[cfg(feature = "postgres")]
            Inner::Postgres(_) => None,
        }
    }

    /// The connection, if the store is PostgreSQL.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(&mut self) -> Option<&mut sqlx::PgConnection> {
        match &mut self.inner {
            Inner::Postgres(tx) => Some(tx.conn()),
            Inner::Sqlite(_) => None,
        }
    }

    /// Rolls it back now (dropped, it would roll back only when its
    /// connection next goes back to its pool); a failure leaves that to the
    /// pool, which closes a connection it cannot reset.
    pub(crate) async fn rollback(self) {
        let rolled = match self.inner {
            Inner::Sqlite(tx) => tx.rollback().await,
            #[cfg(feature = "postgres")]
            Inner::Postgres(tx) => tx.tx.rollback().await,
        };
        if let Err(e) = rolled {
            tracing::warn!(error = %e, "the call's transaction did not roll back cleanly");
        }
    }

    /// The name of the backend (for errors that say which one it is).
    pub(crate) fn backend(&self) -> &'static str {
        match &self.inner {
            Inner::Sqlite(_) => "SQLite",
            #[cfg(feature = "postgres")]
            Inner::Postgres(_) => "PostgreSQL",
        }
    }

    /// The call's row as this transaction sees it, locked until the
    /// transaction ends (on SQLite the transaction holds the database's
    /// write lock; on PostgreSQL the row is read `FOR UPDATE`): a decision
    /// taken on it cannot be overtaken before the commit. The first
    /// statement of a settlement: on PostgreSQL the store's own session
    /// settings are asserted again first (`SET LOCAL`: a handler's `SET
    /// search_path` or `SET session_replication_role` changes nothing of
    /// the settlement), and the fencing token is checked again.
    ///
    /// # Errors
    /// The database failed (the handler's own statements may have aborted
    /// the transaction), or the identity is fenced.
    pub(crate) async fn locked_call(
        &mut self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Option<LocalCall>, StoreError> {
        match &mut self.inner {
            Inner::Sqlite(tx) => {
                drop_temporary_objects(tx).await?;
                let row = sqlx::query("SELECT * FROM calls WHERE run_id = $1 AND call_id = $2")
                    .bind(run_id)
                    .bind(call_id)
                    .fetch_optional(&mut **tx)
                    .await?;
                row.as_ref().map(super::rows::call_row).transpose()
            }
            #[cfg(feature = "postgres")]
            Inner::Postgres(tx) => {
                tx.restore().await?;
                let row = sqlx::query(
                    "SELECT * FROM calls WHERE run_id = $1 AND call_id = $2 FOR UPDATE",
                )
                .bind(run_id)
                .bind(call_id)
                .fetch_optional(tx.conn())
                .await?;
                row.as_ref().map(super::rows::call_row).transpose()
            }
        }
    }

    /// Applies `changes` in this transaction, after whatever the handler
    /// wrote, and commits it.
    ///
    /// # Errors
    /// [`TxError::NotWritten`] when a change failed before the `COMMIT`
    /// (nothing of the transaction is stored: a lost compare-and-set, a
    /// transaction the handler's own failed statement aborted);
    /// [`TxError::Unknown`] when the `COMMIT` itself failed (re-read).
    pub(crate) async fn commit_with(mut self, changes: &[Change]) -> Result<(), TxError> {
        let changes = &*super::columns::storable_changes(changes);
        let applied = match &mut self.inner {
            Inner::Sqlite(tx) => apply_all(&mut super::sqlx_conn::SqliteTx(tx), changes).await,
            #[cfg(feature = "postgres")]
            Inner::Postgres(tx) => apply_all(&mut super::sqlx_conn::Pg(tx.conn()), changes).await,
        };
        if let Err(e) = applied {
            // Rolled back now, not when the connection is next used: its
            // locks (SQLite's write lock, the call's row) go at once.
            self.rollback().await;
            return Err(TxError::NotWritten(e));
        }
        let committed = match self.inner {
            Inner::Sqlite(tx) => tx.commit().await,
            #[cfg(feature = "postgres")]
            Inner::Postgres(tx) => tx.tx.commit().await,
        };
        committed.map_err(|e| TxError::Unknown(e.into()))
    }
}

/// How [`StoreTransaction::commit_with`] failed.
#[derive(Debug)]
pub(crate) enum TxError {
    /// Before the `COMMIT`: nothing of the transaction is stored.
    NotWritten(StoreError),
    /// At the `COMMIT`: stored or not, only a re-read tells.
    Unknown(StoreError),
}

impl std::fmt::Display for TxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TxError::NotWritten(e) => write!(f, "not written: {e}"),
            TxError::Unknown(e) => write!(f, "the commit failed: {e}"),
        }
    }
}

/// SQLite: drops whatever the handler made in the connection's temporary
/// schema (tables, views, triggers), which SQLite searches before the
/// store's own for an unqualified name: a handler's temporary `calls` or
/// `receipts` would take the settlement's writes. The connection is closed
/// after the call anyway, and the handler is done with it.
async fn drop_temporary_objects(
    tx: &mut sqlx::Transaction<'static, sqlx::Sqlite>,
) -> Result<(), StoreError> {
    let made: Vec<(String, String)> = sqlx::query_as(
        "SELECT type, name FROM sqlite_temp_master
          WHERE type IN ('trigger', 'view', 'table') AND substr(name, 1, 7) <> 'sqlite_'
          ORDER BY CASE type WHEN 'trigger' THEN 0 WHEN 'view' THEN 1 ELSE 2 END",
    )
    .fetch_all(&mut **tx)
    .await?;
    for (kind, name) in made {
        let kind = match kind.as_str() {
            "trigger" => "TRIGGER",
            "view" => "VIEW",
            _ => "TABLE",
        };
        let quoted = name.replace('"', "\"\"");
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "DROP {kind} IF EXISTS temp.\"{quoted}\""
        )))
        .execute(&mut **tx)
        .await?;
    }
    Ok(())
}

/// Applies a call's changes and its timeline on one connection.
async fn apply_all<C: Conn>(conn: &mut C, changes: &[Change]) -> Result<(), StoreError> {
    let mut notes = Vec::new();
    for change in changes {
        write::apply(conn, change, &mut notes).await?;
    }
    write::write_notes(conn, notes).await
}
