//! The executor's durable store: calls, the receipt outbox, a timeline.
//!
//! Everything the executor must not forget goes through [`Store::commit`]
//! *before* the matching request is sent. The trait keeps the runner free of
//! SQL so that a second backend (PostgreSQL) can follow; [`SqliteStore`] is
//! the one shipped.

/// What makes a call prunable, the same on every backend (the cut-off and
/// the limit, whose placeholders differ, follow it): settled for good,
/// with nothing still to send or report, and nothing a person still needs
/// (see [`Change::Prune`]).
macro_rules! prunable_calls {
    () => {
        "SELECT run_id, call_id FROM calls
    WHERE (state IN ('delivered', 'abandoned', 'released', 'compensated')
           OR (state = 'orphaned'
               AND (NOT EXISTS (SELECT 1 FROM events e WHERE e.run_id = calls.run_id
                                AND e.call_id = calls.call_id AND e.what = 'orphaned_outcome_unknown')
                    OR EXISTS (SELECT 1 FROM events e WHERE e.run_id = calls.run_id
                               AND e.call_id = calls.call_id AND e.what = 'operator_closed'))))
      AND report IS NULL
      AND NOT EXISTS (SELECT 1 FROM receipts r WHERE r.run_id = calls.run_id
                      AND r.call_id = calls.call_id AND r.status = 'pending')"
    };
}

pub(crate) mod approvals;
mod columns;
pub(crate) mod flow;
#[cfg(feature = "postgres")]
mod postgres;
mod rows;
pub(crate) mod sealing;
mod sqlite;
mod sqlx_conn;
mod transaction;
pub(crate) mod write;

mod error;
mod model;

use toolrunner_protocol::wire::ReceiptKind;

pub use error::{DatabaseError, StoreError};
pub use model::{
    ALL_STATES, Attempt, CallFilter, Change, Event, LocalCall, LocalState, OutboxReceipt,
    PendingReport, ReceiptStatus, Timestamp, UnknownName,
};
pub(crate) use model::{DEFAULT_COMMIT_WINDOW, DEFAULT_LEASE_TTL, now, now_rfc3339, rfc3339};

#[cfg(feature = "postgres")]
pub(crate) use postgres::LapseWatch;
#[cfg(feature = "postgres")]
pub use postgres::PgStore;
#[cfg(all(feature = "postgres", feature = "failpoints", feature = "testing"))]
pub use postgres::WriterFaults;
#[cfg_attr(not(feature = "testing"), allow(unused_imports))] // the testing seam's (the bench)
pub use sqlite::WriterStats;
pub use sqlite::{SqliteStore, StoreLock};
pub use transaction::StoreTransaction;
pub(crate) use transaction::{Closed, TxError};

/// The executor's durable store.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Applies `changes` in one transaction; when it returns `Ok`, they are
    /// durable. After an `Err` the outcome is unknown: re-read.
    async fn commit(&self, changes: Vec<Change>) -> Result<(), StoreError>;
    /// One call.
    async fn call(&self, run_id: &str, call_id: &str) -> Result<Option<LocalCall>, StoreError>;
    /// Calls matching `filter`, oldest change first.
    async fn calls(&self, filter: &CallFilter) -> Result<Vec<LocalCall>, StoreError>;
    /// How many calls are in each state.
    async fn count_by_state(
        &self,
    ) -> Result<std::collections::BTreeMap<LocalState, u64>, StoreError>;
    /// A call's receipts in sequence order.
    async fn receipts(&self, run_id: &str, call_id: &str)
    -> Result<Vec<OutboxReceipt>, StoreError>;
    /// One receipt.
    async fn receipt(&self, receipt_id: &str) -> Result<Option<OutboxReceipt>, StoreError>;
    /// Every receipt with this status, oldest first.
    async fn receipts_with(&self, status: ReceiptStatus) -> Result<Vec<OutboxReceipt>, StoreError>;
    /// A call's timeline.
    async fn events(&self, run_id: &str, call_id: &str) -> Result<Vec<Event>, StoreError>;
    /// A call's attempts, oldest first.
    async fn attempts(&self, run_id: &str, call_id: &str) -> Result<Vec<Attempt>, StoreError>;

    /// Begins a transaction of the store's own database for a handler's
    /// business writes ([`CallContext::transaction`](crate::CallContext::transaction)):
    /// the executor adds the call's final receipt to it and commits once.
    /// On SQLite it takes the database's write lock at once (`BEGIN
    /// IMMEDIATE`) and holds it until the commit: the executor's own
    /// writes wait meanwhile. The default cannot.
    ///
    /// # Errors
    /// The store failed, or cannot share a transaction
    /// ([`StoreError::Unsupported`]).
    async fn begin(&self) -> Result<StoreTransaction, StoreError> {
        Err(StoreError::Unsupported(
            "this store cannot share a transaction with a handler".into(),
        ))
    }

    /// Sizes what handlers' transactions ([`begin`](Self::begin)) use for
    /// an executor of `capacity` (on PostgreSQL, their own pool), before
    /// the first one begins. The default does nothing.
    fn size_handler_transactions(&self, _capacity: u32) {}

    /// Deletes up to `limit` calls settled for good before
    /// `settled_before` (see [`Change::Prune`]) and says how many went.
    /// The default commits the change and cannot tell (`Ok(0)`).
    ///
    /// # Errors
    /// The store failed.
    async fn prune(&self, settled_before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        self.commit(vec![Change::Prune {
            settled_before,
            limit,
        }])
        .await?;
        Ok(0)
    }

    /// How each of `calls` ended, as far as this store knows: the kind of
    /// its latest final receipt (`completed`, `failed` or `cancelled`),
    /// for those that have one. The default reads each call's receipts.
    ///
    /// # Errors
    /// The store failed.
    async fn outcomes(
        &self,
        calls: &[CallKey],
    ) -> Result<std::collections::HashMap<CallKey, ReceiptKind>, StoreError> {
        let mut out = std::collections::HashMap::new();
        for (run_id, call_id) in calls {
            let receipts = self.receipts(run_id, call_id).await?;
            if let Some(r) = receipts.iter().rev().find(|r| r.kind.is_final()) {
                out.insert((run_id.clone(), call_id.clone()), r.kind);
            }
        }
        Ok(out)
    }

    /// Every executor id this store's calls were claimed by (from their
    /// attempts), sorted. The default knows none.
    ///
    /// # Errors
    /// The store failed.
    async fn executor_ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(Vec::new())
    }

    /// The receipts still to send (`pending`), without their bodies: how
    /// many, the oldest one's time, and the calls they belong to (an
    /// `accepted` counted, its call not listed: only the accept step sends
    /// it). The default reads every pending receipt.
    ///
    /// # Errors
    /// The store failed.
    async fn outbox_summary(&self) -> Result<OutboxSummary, StoreError> {
        let pending = self.receipts_with(ReceiptStatus::Pending).await?;
        let mut calls: Vec<(String, String)> = pending
            .iter()
            .filter(|r| r.kind != ReceiptKind::Accepted)
            .map(|r| (r.run_id.clone(), r.call_id.clone()))
            .collect();
        calls.sort();
        calls.dedup();
        Ok(OutboxSummary {
            pending: pending.len() as u64,
            oldest: pending.iter().map(|r| r.created_at).min(),
            calls,
        })
    }
}

/// A call, as `(run_id, call_id)`.
pub type CallKey = (String, String);

/// How many calls [`Store::outcomes`] looks up one by one (by the
/// receipts' call index) before it reads every final receipt's kind at
/// once instead.
pub(crate) const OUTCOMES_ONE_BY_ONE: usize = 64;

/// The kind of one call's latest final receipt (`$1` run, `$2` call).
pub(crate) const CALL_OUTCOME: &str = "SELECT kind FROM receipts
     WHERE run_id = $1 AND call_id = $2 AND kind IN ('completed', 'failed', 'cancelled')
     ORDER BY sequence DESC, created_at DESC LIMIT 1";

/// Every final receipt's call and kind, each call's in sequence order
/// (no bodies are read).
pub(crate) const FINAL_KINDS: &str = "SELECT run_id, call_id, kind FROM receipts
     WHERE kind IN ('completed', 'failed', 'cancelled')
     ORDER BY run_id, call_id, sequence, created_at";

/// Every executor id the store's calls were claimed by, sorted.
pub(crate) const EXECUTOR_IDS: &str = "SELECT DISTINCT executor_id FROM attempts
     WHERE executor_id IS NOT NULL ORDER BY executor_id";

/// A stored receipt kind.
pub(crate) fn parse_kind(kind: String) -> Result<ReceiptKind, StoreError> {
    serde_json::from_value::<ReceiptKind>(serde_json::Value::String(kind)).map_err(columns::corrupt)
}

/// The outcomes of `calls` among `(run_id, call_id, kind)` rows of
/// [`FINAL_KINDS`] (a call's later receipt wins).
pub(crate) fn outcomes_among(
    calls: &[CallKey],
    rows: impl IntoIterator<Item = (String, String, ReceiptKind)>,
) -> std::collections::HashMap<CallKey, ReceiptKind> {
    let wanted: std::collections::HashSet<&CallKey> = calls.iter().collect();
    let mut out = std::collections::HashMap::new();
    for (run_id, call_id, kind) in rows {
        let key = (run_id, call_id);
        if wanted.contains(&key) {
            out.insert(key, kind);
        }
    }
    out
}

/// The receipts still to send, in brief (see [`Store::outbox_summary`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct OutboxSummary {
    /// How many receipts are `pending`, `accepted` included.
    pub pending: u64,
    /// When the oldest of them was saved.
    pub oldest: Option<Timestamp>,
    /// The calls whose receipts (other than `accepted`) wait, as
    /// `(run_id, call_id)`.
    pub calls: Vec<(String, String)>,
}

/// The store at a URL, without a process lock (operators' tools): a
/// PostgreSQL store for a `postgres://` URL, SQLite otherwise.
pub(crate) async fn open(url: &str) -> crate::Result<std::sync::Arc<dyn Store>> {
    if is_postgres(url) {
        return open_postgres(url).await;
    }
    Ok(std::sync::Arc::new(SqliteStore::open(url).await?))
}

/// Every executor identity on the PostgreSQL database at `url`, with the
/// schema of its store, by executor id (operators' tools).
#[cfg(feature = "postgres")]
pub(crate) async fn postgres_identities(url: &str) -> crate::Result<Vec<(String, String)>> {
    Ok(PgStore::identities(url).await?)
}

/// The store in `schema` of the PostgreSQL database at `url`, without a
/// lease (operators' tools).
#[cfg(feature = "postgres")]
pub(crate) async fn open_postgres_schema(
    url: &str,
    schema: &str,
) -> crate::Result<std::sync::Arc<dyn Store>> {
    Ok(std::sync::Arc::new(
        PgStore::open_in_schema(url, schema).await?,
    ))
}

/// The flow limits shared by every replica of the PostgreSQL database at
/// `url` (operators' tools): its database-wide schema migrated if new.
#[cfg(feature = "postgres")]
pub(crate) async fn open_shared_flow(
    url: &str,
) -> crate::Result<std::sync::Arc<dyn flow::SharedFlow>> {
    Ok(std::sync::Arc::new(PgStore::open_shared_flow(url).await?))
}

/// The approval requests of the store at `url`: a SQLite store's own, or
/// those every replica of a PostgreSQL database shares (operators' tools:
/// the store is migrated first if this version never ran there).
pub(crate) async fn open_approvals(
    url: &str,
) -> crate::Result<std::sync::Arc<dyn approvals::ApprovalBook>> {
    if is_postgres(url) {
        return open_postgres_approvals(url).await;
    }
    Ok(std::sync::Arc::new(
        SqliteStore::open(url).await?.approvals(),
    ))
}

#[cfg(feature = "postgres")]
async fn open_postgres_approvals(
    url: &str,
) -> crate::Result<std::sync::Arc<dyn approvals::ApprovalBook>> {
    Ok(std::sync::Arc::new(PgStore::open_approvals(url).await?))
}

/// Without the `postgres` feature a `postgres://` URL is a missing feature.
#[cfg(not(feature = "postgres"))]
async fn open_postgres_approvals(
    _url: &str,
) -> crate::Result<std::sync::Arc<dyn approvals::ApprovalBook>> {
    Err(crate::error::missing_feature(
        "a postgres:// store",
        "postgres",
    ))
}

/// Without the `postgres` feature a `postgres://` URL is a missing feature.
#[cfg(not(feature = "postgres"))]
pub(crate) async fn open_shared_flow(
    _url: &str,
) -> crate::Result<std::sync::Arc<dyn flow::SharedFlow>> {
    Err(crate::error::missing_feature(
        "a postgres:// store",
        "postgres",
    ))
}

/// Without the `postgres` feature a `postgres://` URL is a missing feature.
#[cfg(not(feature = "postgres"))]
pub(crate) async fn postgres_identities(_url: &str) -> crate::Result<Vec<(String, String)>> {
    Err(crate::error::missing_feature(
        "a postgres:// store",
        "postgres",
    ))
}

/// Without the `postgres` feature a `postgres://` URL is a missing feature.
#[cfg(not(feature = "postgres"))]
pub(crate) async fn open_postgres_schema(
    _url: &str,
    _schema: &str,
) -> crate::Result<std::sync::Arc<dyn Store>> {
    Err(crate::error::missing_feature(
        "a postgres:// store",
        "postgres",
    ))
}

/// One transaction carried the commits of `jobs` callers (group commit):
/// the histogram `toolrunner_store_calls_per_commit`.
pub(crate) fn committed_together(jobs: usize) {
    metrics::histogram!("toolrunner_store_calls_per_commit").record(jobs as f64);
}

/// Whether a store URL names a PostgreSQL database.
pub(crate) fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

/// The PostgreSQL store at `url`.
#[cfg(feature = "postgres")]
async fn open_postgres(url: &str) -> crate::Result<std::sync::Arc<dyn Store>> {
    Ok(std::sync::Arc::new(PgStore::connect(url).await?))
}

/// Without the `postgres` feature a `postgres://` URL is a mistake to
/// explain, not a file name.
#[cfg(not(feature = "postgres"))]
async fn open_postgres(_url: &str) -> crate::Result<std::sync::Arc<dyn Store>> {
    Err(crate::error::missing_feature(
        "a postgres:// store",
        "postgres",
    ))
}
