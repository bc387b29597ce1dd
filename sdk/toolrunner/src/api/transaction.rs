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
    /// The transaction stayed open past its bound (SQLite): rolled back
    /// (or to roll back, while `tx` still holds it), and why.
    pub(crate) expired: Option<String>,
    /// A closure ended the transaction itself (its own `COMMIT` or
    /// `ROLLBACK`), and why: the call's outcome is unknown, for every
    /// attempt from then on.
    pub(crate) broken: Option<String>,
    /// When the transaction must end (SQLite), and the task that ends it
    /// then if nothing else did.
    pub(crate) deadline: Option<tokio::time::Instant>,
    pub(crate) watchdog: Option<tokio::task::AbortHandle>,
}

impl TransactionSlot {
    /// Ends the transaction for good when nobody will commit it: dropped,
    /// it rolls back as its connection goes back to its pool.
    pub(crate) fn abandon(&mut self) {
        self.ended = true;
        self.interrupted = false;
        self.stop_watchdog();
        drop(self.tx.take());
    }

    /// The transaction's bound no longer applies (it ended).
    pub(crate) fn stop_watchdog(&mut self) {
        self.deadline = None;
        if let Some(w) = self.watchdog.take() {
            w.abort();
        }
    }
}

/// How a call's transaction ended with a handler attempt
/// ([`CallContext::end_attempt`](crate::CallContext)).
pub(crate) enum Ended {
    /// The handler opened none.
    None,
    /// Open and whole: committed with the final receipt, or rolled back.
    Open(StoreTransaction),
    /// It must not commit (a closure was cut off half-way, or it stayed
    /// open past its bound): rolled back already, or `tx` to roll back.
    RolledBack {
        tx: Option<StoreTransaction>,
        why: String,
    },
    /// A closure ended it itself: what it wrote may be stored, so the
    /// call's outcome is unknown; nothing more is written on `tx`.
    Broken {
        tx: Option<StoreTransaction>,
        why: String,
    },
}

impl Ended {
    /// Rolls back what is left of an attempt that will not commit (and
    /// waits for it: its locks go now).
    pub(crate) async fn discard(self) {
        match self {
            Ended::Open(tx)
            | Ended::RolledBack { tx: Some(tx), .. }
            | Ended::Broken { tx: Some(tx), .. } => tx.rollback().await,
            _ => {}
        }
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
