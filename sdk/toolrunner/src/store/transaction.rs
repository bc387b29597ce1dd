//! A transaction of the store's own database that a handler's business
//! writes share with the changes that settle its call
//! ([`CallContext::transaction`](crate::CallContext::transaction)): the
//! executor adds the final receipt to it and commits once, so the
//! business rows and the receipt are both stored or both absent.
use super::write::{self, Conn};
use super::{Change, LocalCall, StoreError};

/// An open transaction of the store's database (see
/// [`Store::begin`](super::Store::begin)). Dropped without being
/// committed, it rolls back.
pub struct StoreTransaction {
    pub(super) inner: Inner,
}

/// The backend's transaction.
pub(super) enum Inner {
    Sqlite(sqlx::Transaction<'static, sqlx::Sqlite>),
    #[cfg(feature = "postgres")]
    Postgres(sqlx::Transaction<'static, sqlx::Postgres>),
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
    /// The connection, if the store is SQLite.
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
            Inner::Postgres(tx) => Some(&mut **tx),
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
            Inner::Postgres(tx) => tx.rollback().await,
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
    /// taken on it cannot be overtaken before the commit.
    ///
    /// # Errors
    /// The database failed (the handler's own statements may have aborted
    /// the transaction).
    pub(crate) async fn locked_call(
        &mut self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Option<LocalCall>, StoreError> {
        match &mut self.inner {
            Inner::Sqlite(tx) => {
                let row = sqlx::query("SELECT * FROM calls WHERE run_id = $1 AND call_id = $2")
                    .bind(run_id)
                    .bind(call_id)
                    .fetch_optional(&mut **tx)
                    .await?;
                row.as_ref().map(super::rows::call_row).transpose()
            }
            #[cfg(feature = "postgres")]
            Inner::Postgres(tx) => {
                let row = sqlx::query(
                    "SELECT * FROM calls WHERE run_id = $1 AND call_id = $2 FOR UPDATE",
                )
                .bind(run_id)
                .bind(call_id)
                .fetch_optional(&mut **tx)
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
    pub(crate) async fn commit_with(self, changes: &[Change]) -> Result<(), TxError> {
        let changes = &*super::columns::storable_changes(changes);
        match self.inner {
            Inner::Sqlite(mut tx) => {
                apply_all(&mut super::sqlx_conn::SqliteTx(&mut tx), changes)
                    .await
                    .map_err(TxError::NotWritten)?;
                tx.commit().await.map_err(|e| TxError::Unknown(e.into()))?;
            }
            #[cfg(feature = "postgres")]
            Inner::Postgres(mut tx) => {
                apply_all(&mut super::sqlx_conn::Pg(&mut tx), changes)
                    .await
                    .map_err(TxError::NotWritten)?;
                tx.commit().await.map_err(|e| TxError::Unknown(e.into()))?;
            }
        }
        Ok(())
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

/// Applies a call's changes and its timeline on one connection.
async fn apply_all<C: Conn>(conn: &mut C, changes: &[Change]) -> Result<(), StoreError> {
    let mut notes = Vec::new();
    for change in changes {
        write::apply(conn, change, &mut notes).await?;
    }
    write::write_notes(conn, notes).await
}
