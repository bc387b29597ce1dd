//! A transaction of the store's own database that a handler's business
//! writes share with the changes that settle its call
//! ([`CallContext::transaction`](crate::CallContext::transaction)): the
//! executor adds the final receipt to it and commits once, so the
//! business rows and the receipt are both stored or both absent.
use super::columns::{assignment_json, report_str, seq};
use super::{Change, LocalCall, StoreError, now_rfc3339, rfc3339};

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
                row.as_ref().map(super::sqlite::call_row).transpose()
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
                row.as_ref().map(super::postgres::call_row).transpose()
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
                apply_sqlite(&mut tx, changes)
                    .await
                    .map_err(TxError::NotWritten)?;
                tx.commit().await.map_err(|e| TxError::Unknown(e.into()))?;
            }
            #[cfg(feature = "postgres")]
            Inner::Postgres(mut tx) => {
                apply_postgres(&mut tx, changes)
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

/// The SQL the changes a handler's transaction carries have on both
/// backends (`$n` parameters, which SQLite takes too).
mod sql {
    /// A new call row (`$1`…`$12`).
    pub(super) const INSERT_CALL: &str = "INSERT INTO calls (run_id, call_id, tool_name, operation_key, state, assignment, next_sequence, reason, report, version, created_at, updated_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (run_id, call_id) DO NOTHING";
    /// A call row replaced if its version is `$13`.
    pub(super) const UPDATE_CALL: &str = "UPDATE calls SET tool_name = $3, operation_key = $4, state = $5, assignment = $6, next_sequence = $7,
           reason = $8, report = $9, version = $10, created_at = $11, updated_at = $12
         WHERE run_id = $1 AND call_id = $2 AND version = $13";
    /// A receipt (`$1`…`$12`).
    pub(super) const INSERT_RECEIPT: &str = "INSERT INTO receipts (receipt_id, run_id, call_id, assignment_id, kind, sequence, body, status, attempts, last_error, created_at, delivered_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";
    /// A timeline row.
    pub(super) const INSERT_EVENT: &str =
        "INSERT INTO events (run_id, call_id, at, what, detail) VALUES ($1, $2, $3, $4, $5)";
}

/// The timeline rows `changes` write, in order: their notes, and one per
/// receipt saved (as the store's own commits write them).
fn timeline(changes: &[Change]) -> Vec<[Option<String>; 5]> {
    let mut rows = Vec::new();
    for change in changes {
        match change {
            Change::AddReceipt(r) => rows.push([
                Some(r.run_id.clone()),
                Some(r.call_id.clone()),
                Some(now_rfc3339()),
                Some(format!("receipt {} saved", r.kind.as_str())),
                Some(r.receipt_id.clone()),
            ]),
            Change::Note {
                run_id,
                call_id,
                what,
                detail,
            } => rows.push([
                Some(run_id.clone()),
                Some(call_id.clone()),
                Some(now_rfc3339()),
                Some(what.clone()),
                detail.clone(),
            ]),
            _ => {}
        }
    }
    rows
}

/// A change a handler's transaction does not carry: only a call's own
/// transition (its row, its receipt, its timeline) is written there.
fn not_carried(change: &Change) -> StoreError {
    let what = match change {
        Change::ReceiptStatus { .. } => "a receipt's status",
        Change::SettlePending { .. } => "a settling of pending receipts",
        Change::AddAttempt(_) => "an attempt",
        Change::Prune { .. } => "a prune",
        _ => "this change",
    };
    StoreError::Refused(format!(
        "{what} is not written in a handler's transaction (only a call's row, its receipt and its timeline are)"
    ))
}

/// A constraint the schema enforces failed: a row that must never exist.
fn refused(e: sqlx::Error, what: &str) -> StoreError {
    use sqlx::error::ErrorKind;
    if let sqlx::Error::Database(d) = &e
        && matches!(
            d.kind(),
            ErrorKind::UniqueViolation
                | ErrorKind::ForeignKeyViolation
                | ErrorKind::NotNullViolation
                | ErrorKind::CheckViolation
        )
    {
        return StoreError::Refused(format!("{what}: {}", d.message()));
    }
    e.into()
}

/// Writes a call's transition (its row as a compare-and-set, its receipt,
/// its timeline) on one backend's connection; the same statements on both.
macro_rules! apply_in {
    ($name:ident, $conn:ty) => {
        async fn $name(conn: &mut $conn, changes: &[Change]) -> Result<(), StoreError> {
            for change in changes {
                let (statement, c, expect_version) = match change {
                    Change::InsertCall(c) => (sql::INSERT_CALL, c, None),
                    Change::UpdateCall {
                        expect_version,
                        call,
                    } => (sql::UPDATE_CALL, call, Some(*expect_version)),
                    Change::AddReceipt(r) => {
                        sqlx::query(sql::INSERT_RECEIPT)
                            .bind(&r.receipt_id)
                            .bind(&r.run_id)
                            .bind(&r.call_id)
                            .bind(&r.assignment_id)
                            .bind(r.kind.as_str())
                            .bind(seq(r.sequence))
                            .bind(&r.body)
                            .bind(r.status.as_str())
                            .bind(i64::from(r.attempts))
                            .bind(&r.last_error)
                            .bind(rfc3339(&r.created_at))
                            .bind(r.delivered_at.as_ref().map(rfc3339))
                            .execute(&mut *conn)
                            .await
                            .map_err(|e| refused(e, "receipt"))?;
                        continue;
                    }
                    Change::Note { .. } => continue,
                    other => return Err(not_carried(other)),
                };
                let mut query = sqlx::query(statement)
                    .bind(&c.run_id)
                    .bind(&c.call_id)
                    .bind(&c.tool_name)
                    .bind(&c.operation_key)
                    .bind(c.state.as_str())
                    .bind(assignment_json(c)?)
                    .bind(seq(c.next_sequence))
                    .bind(&c.reason)
                    .bind(report_str(c.report))
                    .bind(seq(c.version))
                    .bind(rfc3339(&c.created_at))
                    .bind(rfc3339(&c.updated_at));
                if let Some(v) = expect_version {
                    query = query.bind(seq(v));
                }
                let written = query
                    .execute(&mut *conn)
                    .await
                    .map_err(|e| refused(e, "call row"))?
                    .rows_affected();
                if written == 0 {
                    return Err(StoreError::Conflict(
                        format!("{}/{}", c.run_id, c.call_id),
                        match expect_version {
                            None => "the call is already stored".into(),
                            Some(v) => format!("it is no longer at version {v}"),
                        },
                    ));
                }
            }
            for [run_id, call_id, at, what, detail] in timeline(changes) {
                sqlx::query(sql::INSERT_EVENT)
                    .bind(run_id)
                    .bind(call_id)
                    .bind(at)
                    .bind(what)
                    .bind(detail)
                    .execute(&mut *conn)
                    .await?;
            }
            Ok(())
        }
    };
}

apply_in!(apply_sqlite, sqlx::SqliteConnection);
#[cfg(feature = "postgres")]
apply_in!(apply_postgres, sqlx::PgConnection);
