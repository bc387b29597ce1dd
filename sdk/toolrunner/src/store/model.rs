//! The store's model: the rows it keeps (calls, receipts, attempts, the
//! timeline), their states, and the changes a commit applies. The
//! lifecycle plans on it; the backends write and read it.
use serde::{Deserialize, Serialize};
use toolrunner_protocol::wire::{Assignment, ReceiptKind};

#[allow(unused_imports)] // for the documentation's links
use super::Store;

/// How long an executor identity's lease on a shared PostgreSQL database
/// lasts after each renewal, unless the builder sets another.
pub(crate) const DEFAULT_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(3);

/// A tool's commit window unless it sets another (the handler API's
/// `DEFAULT_COMMIT_WINDOW` is this one): what a lease row records for a
/// holder whose tools are not known to the store.
pub(crate) const DEFAULT_COMMIT_WINDOW: std::time::Duration = std::time::Duration::from_secs(30);

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
    /// Every local state, in the order of a call's life (a slice: a state
    /// added later does not change its type).
    ///
    /// ```
    /// use toolrunner::LocalState;
    /// let all: &'static [LocalState] = LocalState::ALL;
    /// assert!(all.contains(&LocalState::ReconciliationRequired));
    /// ```
    pub const ALL: &'static [LocalState] = &ALL_STATES;

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
#[derive(Clone, PartialEq)]
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

toolrunner_protocol::debug_without_payloads!(OutboxReceipt { receipt_id, run_id, call_id, assignment_id, kind, sequence, status, attempts, last_error, created_at, delivered_at } hiding { body });

/// One entry of a call's timeline.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Event {
    pub(crate) at: Timestamp,
    pub(crate) what: String,
    pub(crate) detail: Option<String>,
}

toolrunner_protocol::debug_without_payloads!(Event { at, what } hiding { detail });

impl Event {
    /// When it happened.
    pub fn at(&self) -> Timestamp {
        self.at
    }

    /// What happened: a state name or an action (`operator_resolved`, …).
    pub fn what(&self) -> &str {
        &self.what
    }

    /// Details, when there are any.
    pub fn detail(&self) -> Option<&str> {
        self.detail.as_deref()
    }
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
    /// Inserts a call row; fails with [`StoreError::Conflict`](super::StoreError::Conflict) if it exists.
    InsertCall(LocalCall),
    /// Replaces a call row if, and only if, its stored `version` is
    /// `expect_version` (the new row carries `expect_version + 1`); fails
    /// with [`StoreError::Conflict`](super::StoreError::Conflict) otherwise.
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
    /// The store's health probe: its one row written with `at` (a real
    /// write, so that its commit shows the store takes writes).
    Probe {
        /// When.
        at: Timestamp,
    },
}

/// One attempt at a call: every operation key and every assignment a call
/// ever had is kept, for the operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Attempt {
    pub(crate) run_id: String,
    pub(crate) call_id: String,
    pub(crate) operation_key: String,
    pub(crate) executor_id: Option<String>,
    pub(crate) assignment_id: Option<String>,
    pub(crate) created_at: Timestamp,
}

impl Attempt {
    /// An attempt row to seed a store with (the testing seam,
    /// [`testing::store`](crate::testing::store)).
    #[cfg(feature = "testing")]
    pub fn seed(
        run_id: &str,
        call_id: &str,
        operation_key: &str,
        executor_id: Option<&str>,
        assignment_id: Option<&str>,
        created_at: Timestamp,
    ) -> Attempt {
        Attempt {
            run_id: run_id.to_owned(),
            call_id: call_id.to_owned(),
            operation_key: operation_key.to_owned(),
            executor_id: executor_id.map(str::to_owned),
            assignment_id: assignment_id.map(str::to_owned),
            created_at,
        }
    }

    /// The run.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// The call.
    pub fn call_id(&self) -> &str {
        &self.call_id
    }

    /// The operation key of the claim.
    pub fn operation_key(&self) -> &str {
        &self.operation_key
    }

    /// The executor id that claimed (unknown for attempts recorded before
    /// the store kept them).
    pub fn executor_id(&self) -> Option<&str> {
        self.executor_id.as_deref()
    }

    /// The assignment the claim got (none while the claim is unanswered).
    pub fn assignment_id(&self) -> Option<&str> {
        self.assignment_id.as_deref()
    }

    /// When the attempt began (or got its assignment).
    pub fn created_at(&self) -> Timestamp {
        self.created_at
    }
}

/// Which calls to list: every call by default, narrowed by each method.
///
/// ```
/// use toolrunner::{CallFilter, LocalState};
/// let waiting = CallFilter::new()
///     .state(LocalState::ReconciliationRequired)
///     .tool_name("payments.charge");
/// # let _ = waiting;
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
#[must_use]
pub struct CallFilter {
    pub(crate) states: Vec<LocalState>,
    pub(crate) tool_name: Option<String>,
    pub(crate) updated_before: Option<Timestamp>,
    pub(crate) pending_report: bool,
}

impl CallFilter {
    /// Every call.
    pub fn new() -> CallFilter {
        CallFilter::default()
    }

    /// Also calls in `state` (all states while none is given).
    pub fn state(mut self, state: LocalState) -> CallFilter {
        self.states.push(state);
        self
    }

    /// Only calls in one of `states` (all states if empty).
    pub fn states(mut self, states: impl IntoIterator<Item = LocalState>) -> CallFilter {
        self.states = states.into_iter().collect();
        self
    }

    /// Only calls of this tool.
    pub fn tool_name(mut self, name: impl Into<String>) -> CallFilter {
        self.tool_name = Some(name.into());
        self
    }

    /// Only calls last changed before `t`.
    pub fn updated_before(mut self, t: Timestamp) -> CallFilter {
        self.updated_before = Some(t);
        self
    }

    /// Only calls with a state still to report to the platform.
    pub fn pending_report(mut self, only: bool) -> CallFilter {
        self.pending_report = only;
        self
    }
}
