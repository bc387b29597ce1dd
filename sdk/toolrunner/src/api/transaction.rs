//! The call's transaction, as a handler reaches it inside
//! [`CallContext::transaction`](crate::CallContext::transaction): the one
//! module of the handler API that names sqlx (the connection the handler
//! writes its business rows on; only the store begins, commits and rolls
//! it back).

use crate::api::handler::ToolError;
use crate::store::StoreTransaction;

/// The call's transaction as a handler reaches it, inside
/// [`CallContext::transaction`](crate::CallContext::transaction): run the business writes on
/// [`sqlite`](Self::sqlite) or `postgres` (the `postgres` feature),
/// whichever the store is. The executor commits it with the final receipt,
/// or rolls it back.
pub struct Transaction {
    pub(crate) inner: StoreTransaction,
}

/// Where a call's transaction is kept between a handler's
/// [`CallContext::transaction`](crate::CallContext::transaction) closures.
#[derive(Default)]
pub(crate) struct TransactionSlot {
    pub(crate) tx: Option<Transaction>,
    /// The executor ended it with the call: no closure runs any more.
    pub(crate) ended: bool,
    /// A closure was interrupted half-way: it must not commit.
    pub(crate) interrupted: bool,
}

impl TransactionSlot {
    /// Ends the transaction for good when nobody will commit it: dropped,
    /// it rolls back as its connection goes back to its pool.
    pub(crate) fn abandon(&mut self) {
        self.ended = true;
        self.interrupted = false;
        drop(self.tx.take());
    }
}

impl std::fmt::Debug for Transaction {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transaction")
            .field("backend", &self.inner.backend())
            .finish()
    }
}

impl Transaction {
    /// The transaction's connection, when the store is SQLite.
    ///
    /// # Errors
    /// [`ToolError::failed`] with code `wrong_store` when the store is not
    /// SQLite (nothing was written).
    pub fn sqlite(&mut self) -> Result<&mut sqlx::SqliteConnection, ToolError> {
        let backend = self.inner.backend();
        self.inner
            .sqlite()
            .ok_or_else(|| wrong_store("SQLite", backend))
    }

    /// The transaction's connection, when the store is PostgreSQL (the
    /// `postgres` feature).
    ///
    /// # Errors
    /// [`ToolError::failed`] with code `wrong_store` when the store is not
    /// PostgreSQL (nothing was written).
    #[cfg(feature = "postgres")]
    pub fn postgres(&mut self) -> Result<&mut sqlx::PgConnection, ToolError> {
        let backend = self.inner.backend();
        self.inner
            .postgres()
            .ok_or_else(|| wrong_store("PostgreSQL", backend))
    }
}

fn wrong_store(wanted: &str, backend: &str) -> ToolError {
    ToolError::failed(
        "wrong_store",
        format!("the handler wrote for {wanted}, but the executor's store is {backend}"),
    )
}
