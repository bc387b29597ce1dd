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

mod columns;
#[cfg(feature = "postgres")]
mod postgres;
mod rows;
mod sqlite;
mod transaction;
pub(crate) mod write;

use serde::{Deserialize, Serialize};
use toolrunner_protocol::wire::{Assignment, ReceiptKind};

#[cfg(feature = "postgres")]
pub use postgres::PgStore;
pub use sqlite::{SqliteStore, StoreLock, WriterStats};
pub use transaction::StoreTransaction;
pub(crate) use transaction::TxError;

/// How long an executor identity's lease on a shared PostgreSQL database
/// lasts after each renewal, unless the builder sets another.
pub(crate) const DEFAULT_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(3);

/// A point in time: UTC, to the millisecond (stored as RFC 3339).
pub type Timestamp = chrono::DateTime<chrono::Utc>;

/// Now, to the millisecond (what a stored time holds).
pub(crate) fn now() -> Timestamp {
    let t = chrono::Utc::now();
    chrono::DurationRound::duration_trunc(t, chrono::TimeDelta::milliseconds(1)).unwrap_or(t)
}

/// Now, as RFC 3339 UTC with milliseconds (the form every stored time has).
pub(crate) fn now_rfc3339() -> String {
    rfc3339(&now())
}

/// A time as stored: RFC 3339 UTC with milliseconds.
pub(crate) fn rfc3339(t: &Timestamp) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// Where a call stands for this executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum LocalState {
    /// The operation key is saved; the claim is not answered yet.
    Claiming,
    /// The assignment is saved; `accepted` is not confirmed yet.
    Assigned,
    /// `accepted` was confirmed: the handler may have side effects.
    Running,
    /// A final receipt is saved and not yet delivered.
    Settled,
    /// The final receipt was delivered.
    Delivered,
    /// The claim or the acceptance was refused: nothing ran.
    Abandoned,
    /// The claim was given back before starting.
    Released,
    /// The platform refused a final receipt after the effect may have
    /// happened: an operator must look (compensation may be due).
    Rejected,
    /// The business outcome is unknown: an operator or an automatic check
    /// must settle it.
    ReconciliationRequired,
    /// The platform no longer knows the run.
    Orphaned,
    /// An operator recorded that a rejected effect was compensated.
    Compensated,
}

impl LocalState {
    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            LocalState::Claiming => "claiming",
            LocalState::Assigned => "assigned",
            LocalState::Running => "running",
            LocalState::Settled => "settled",
            LocalState::Delivered => "delivered",
            LocalState::Abandoned => "abandoned",
            LocalState::Released => "released",
            LocalState::Rejected => "rejected",
            LocalState::ReconciliationRequired => "reconciliation_required",
            LocalState::Orphaned => "orphaned",
            LocalState::Compensated => "compensated",
        }
    }

    /// Parses the stored spelling.
    pub fn parse(s: &str) -> Option<LocalState> {
        ALL_STATES.into_iter().find(|x| x.as_str() == s)
    }

    /// Whether the executor has nothing more to do for the call by itself.
    pub fn is_final(self) -> bool {
        matches!(
            self,
            LocalState::Delivered
                | LocalState::Abandoned
                | LocalState::Released
                | LocalState::Rejected
                | LocalState::ReconciliationRequired
                | LocalState::Orphaned
                | LocalState::Compensated
        )
    }
}

impl std::fmt::Display for LocalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for LocalState {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        LocalState::parse(s).ok_or_else(|| UnknownName {
            what: "call state",
            name: s.to_owned(),
        })
    }
}

/// A name that is not one of an enumeration's (`FromStr`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {name:?}")]
pub struct UnknownName {
    what: &'static str,
    name: String,
}

/// Every local state.
pub const ALL_STATES: [LocalState; 11] = [
    LocalState::Claiming,
    LocalState::Assigned,
    LocalState::Running,
    LocalState::Settled,
    LocalState::Delivered,
    LocalState::Abandoned,
    LocalState::Released,
    LocalState::Rejected,
    LocalState::ReconciliationRequired,
    LocalState::Orphaned,
    LocalState::Compensated,
];

/// A state still to be reported with `calls/report`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum PendingReport {
    /// `reconciliation_required`.
    ReconciliationRequired,
    /// `pending_delivery`.
    PendingDelivery,
    /// `released`.
    Released,
}

/// One call as this executor knows it.
#[derive(Debug, Clone, PartialEq)]
pub struct LocalCall {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// Tool.
    pub tool_name: String,
    /// Random per claim, saved before the claim is sent; also the
    /// idempotency key handlers pass downstream.
    pub operation_key: String,
    /// Where it stands.
    pub state: LocalState,
    /// The platform's assignment (its grant is a secret: never logged).
    pub assignment: Option<Assignment>,
    /// The sequence the next receipt gets.
    pub next_sequence: u64,
    /// Why it is in its state (errors, refusals).
    pub reason: Option<String>,
    /// A state still to report to the platform.
    pub report: Option<PendingReport>,
    /// When this store first held the call.
    pub created_at: Timestamp,
    /// When the row last changed.
    pub updated_at: Timestamp,
    /// Bumped by every transition: a change is a compare-and-set on it, so a
    /// decision taken on an old snapshot can never be written back.
    pub version: u64,
}

impl LocalCall {
    /// A call this executor has just learned of, in `state`, with nothing
    /// else known yet.
    pub(crate) fn new(
        run_id: String,
        call_id: String,
        tool_name: String,
        operation_key: String,
        state: LocalState,
    ) -> LocalCall {
        let now = now();
        LocalCall {
            run_id,
            call_id,
            tool_name,
            operation_key,
            state,
            assignment: None,
            next_sequence: 0,
            reason: None,
            report: None,
            created_at: now,
            updated_at: now,
            version: 0,
        }
    }
}

/// Delivery status of an outbox receipt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ReceiptStatus {
    /// Saved, not yet acknowledged.
    Pending,
    /// Acknowledged (`200`, new or replayed).
    Delivered,
    /// Refused by the platform; kept for the operator.
    Rejected,
    /// Never to be sent: its assignment was replaced.
    Superseded,
    /// The platform no longer knows the run.
    Orphaned,
}

impl ReceiptStatus {
    /// The stored spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            ReceiptStatus::Pending => "pending",
            ReceiptStatus::Delivered => "delivered",
            ReceiptStatus::Rejected => "rejected",
            ReceiptStatus::Superseded => "superseded",
            ReceiptStatus::Orphaned => "orphaned",
        }
    }

    /// Parses the stored spelling.
    pub fn parse(s: &str) -> Option<ReceiptStatus> {
        [
            Self::Pending,
            Self::Delivered,
            Self::Rejected,
            Self::Superseded,
            Self::Orphaned,
        ]
        .into_iter()
        .find(|x| x.as_str() == s)
    }
}

impl std::fmt::Display for ReceiptStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ReceiptStatus {
    type Err = UnknownName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ReceiptStatus::parse(s).ok_or_else(|| UnknownName {
            what: "receipt status",
            name: s.to_owned(),
        })
    }
}

/// A receipt in the outbox: the exact body is kept and re-sent as is.
#[derive(Debug, Clone, PartialEq)]
pub struct OutboxReceipt {
    /// Id (a UUIDv7 with `rcp_`).
    pub receipt_id: String,
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// Assignment it belongs to.
    pub assignment_id: String,
    /// Kind.
    pub kind: ReceiptKind,
    /// Sequence.
    pub sequence: u64,
    /// The request body, byte for byte.
    pub body: String,
    /// Delivery status.
    pub status: ReceiptStatus,
    /// Delivery attempts so far.
    pub attempts: u32,
    /// The last delivery error.
    pub last_error: Option<String>,
    /// When it was saved.
    pub created_at: Timestamp,
    /// When the platform acknowledged it.
    pub delivered_at: Option<Timestamp>,
}

/// One entry of a call's timeline.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// When.
    pub at: Timestamp,
    /// What happened (a state name or an action).
    pub what: String,
    /// Details.
    pub detail: Option<String>,
}

/// One change; a [`Store::commit`] applies a list in one transaction, and
/// fails it as a whole if any change fails.
///
/// Call rows change only through the lifecycle (`lifecycle.rs`), which
/// produces these; a store only applies them.
#[derive(Debug, Clone)]
#[non_exhaustive]
#[allow(clippy::large_enum_variant)] // short-lived values handed to the writer; boxing buys nothing
pub enum Change {
    /// Inserts a call row; fails with [`StoreError::Conflict`] if it exists.
    InsertCall(LocalCall),
    /// Replaces a call row if, and only if, its stored `version` is
    /// `expect_version` (the new row carries `expect_version + 1`); fails
    /// with [`StoreError::Conflict`] otherwise.
    UpdateCall {
        /// The version the change was decided on.
        expect_version: u64,
        /// The row as it is to be.
        call: LocalCall,
    },
    /// Adds a receipt to the outbox.
    AddReceipt(OutboxReceipt),
    /// Changes a `pending` receipt's delivery status (counting an attempt
    /// if `attempt`); a receipt that has left `pending` keeps its status.
    ReceiptStatus {
        /// Which.
        receipt_id: String,
        /// New status.
        status: ReceiptStatus,
        /// Error to record.
        error: Option<String>,
        /// Whether this was a delivery attempt.
        attempt: bool,
    },
    /// Marks every `pending` receipt of a call `status`, except those of
    /// the assignment `keep` and those of kind `except`.
    SettlePending {
        /// Run.
        run_id: String,
        /// Call.
        call_id: String,
        /// Receipts of this assignment stay as they are.
        keep: Option<String>,
        /// Receipts of these kinds stay as they are.
        only_kind: Option<ReceiptKind>,
        /// The new status.
        status: ReceiptStatus,
        /// Why.
        error: String,
    },
    /// Records an attempt: an operation key, and the assignment it got.
    AddAttempt(Attempt),
    /// A timeline entry.
    Note {
        /// Run.
        run_id: String,
        /// Call.
        call_id: String,
        /// What.
        what: String,
        /// Details.
        detail: Option<String>,
    },
    /// Deletes up to `limit` calls settled for good (delivered, abandoned,
    /// released, compensated, and orphaned with a known outcome or closed
    /// by an operator) whose last change is older than `settled_before`,
    /// with no receipt still to send and no state still to report: with
    /// their receipts, attempts and timeline. What needs a person is never
    /// pruned: a call waiting for reconciliation, a `rejected` call
    /// (compensation may be due), and an `orphaned` call whose outcome was
    /// unknown (timeline `orphaned_outcome_unknown`) until an operator
    /// closes it (timeline `operator_closed`).
    Prune {
        /// Only calls whose row last changed before this.
        settled_before: Timestamp,
        /// At most this many calls (one small transaction).
        limit: u32,
    },
}

/// One attempt at a call: every operation key and every assignment a call
/// ever had is kept, for the operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attempt {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// The operation key of the claim.
    pub operation_key: String,
    /// The executor id that claimed (unknown for attempts recorded before
    /// the store kept them).
    pub executor_id: Option<String>,
    /// The assignment the claim got (none while the claim is unanswered).
    pub assignment_id: Option<String>,
    /// When the attempt began (or got its assignment).
    pub created_at: Timestamp,
}

/// Which calls to list.
#[derive(Debug, Clone, Default)]
pub struct CallFilter {
    /// Only these states (all if empty).
    pub states: Vec<LocalState>,
    /// Only this tool.
    pub tool_name: Option<String>,
    /// Only calls last changed before this time.
    pub updated_before: Option<Timestamp>,
    /// Only calls with a state still to report.
    pub pending_report: bool,
}

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database answered an error.
    #[error("store database error: {0}")]
    Database(DatabaseError),
    /// The migrations failed.
    #[error("store migration failed: {0}")]
    Migrate(DatabaseError),
    /// A stored row does not parse.
    #[error("store row is corrupt: {0}")]
    Corrupt(String),
    /// A compare-and-set lost: someone else changed the call first (or a
    /// constraint refused a row that must never exist).
    #[error("call {0} changed under this write: {1}")]
    Conflict(String, String),
    /// The store's lock file cannot be created or locked.
    #[error("cannot lock the store: {0}")]
    Lock(String),
    /// Another process holds the store (two executors must never drive one
    /// store file).
    #[error(
        "store {path} is in use by another executor process (it holds the lock file {path}-lock); give every executor process its own store file"
    )]
    Locked {
        /// The store file.
        path: String,
    },
    /// The schema refused a row that must never exist (a second live final
    /// for a call, two receipts with one assignment and sequence, …): a bug
    /// caught before it wrote a second truth.
    #[error("store refused an impossible row: {0}")]
    Refused(String),
    /// The writer task is gone (the store was closed).
    #[error("store writer has stopped")]
    Closed,
    /// Another replica holds this executor identity now (it adopted it, or
    /// a newer process of it started): this process must stop, and its
    /// writes are refused.
    #[error("{0}")]
    Fenced(String),
    /// Another live process holds this executor identity on the shared
    /// database (it keeps renewing its lease): two processes were started
    /// with one executor id. The running one serves on.
    #[error("{0}")]
    InUse(String),
    /// This store cannot do what was asked (a store of your own that
    /// keeps the trait's default [`Store::begin`]).
    #[error("{0}")]
    Unsupported(String),
}

/// What the database said (its cause is the source; the database library
/// stays out of the public API).
#[derive(Debug)]
pub struct DatabaseError(Box<dyn std::error::Error + Send + Sync>);

impl DatabaseError {
    /// A database failure told in words (no cause to keep).
    pub(crate) fn said(why: impl Into<String>) -> DatabaseError {
        DatabaseError(why.into().into())
    }
}

impl std::fmt::Display for DatabaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for DatabaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

#[doc(hidden)]
impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Database(DatabaseError(Box::new(e)))
    }
}

#[doc(hidden)]
impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        StoreError::Migrate(DatabaseError(Box::new(e)))
    }
}

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

impl From<StoreError> for crate::Error {
    fn from(e: StoreError) -> Self {
        crate::Error::new(crate::error::Kind::Store, e.to_string()).with_source(e)
    }
}

/// The store at a URL, without a process lock (operators' tools): a
/// PostgreSQL store for a `postgres://` URL, SQLite otherwise.
pub(crate) async fn open(url: &str) -> crate::Result<std::sync::Arc<dyn Store>> {
    if is_postgres(url) {
        return open_postgres(url).await;
    }
    Ok(std::sync::Arc::new(SqliteStore::open(url).await?))
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
    Err(crate::Error::new(
        crate::error::Kind::Configuration,
        "a postgres:// store needs the `postgres` feature: toolrunner = { version = \"…\", features = [\"postgres\"] }",
    ))
}
