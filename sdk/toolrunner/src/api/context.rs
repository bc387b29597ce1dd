//! What a handler knows about the call it runs.
use std::sync::Arc;

use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::api::handler::ToolError;
use crate::api::transaction::{Ended, Transaction, TransactionSlot};
use crate::store::{Closed, LocalCall, StoreError, StoreTransaction};

/// Whether this build carries the planted bug `zombie` (a commit point that
/// skips the lease check; `docs/simulation.md`).
const PLANTED_ZOMBIE: bool = cfg!(toolrunner_planted = "zombie");

/// Fencing: whether a process whose identity's lease is `live` (or not)
/// may go past a commit point. Whoever takes an identity over waits out
/// the commit window from the old holder's lapse, counting on every older
/// process to stop at its next look. The model (`testing::model`) asks
/// the same function.
pub(crate) fn may_act(live: bool) -> bool {
    live || PLANTED_ZOMBIE
}

/// Fencing: whether a connect waits until the identity's lease is
/// confirmed (a process whose identity moved on never connects).
pub(crate) fn confirms_before_connect() -> bool {
    !PLANTED_ZOMBIE
}

/// A call of a run: the pair the platform names it by.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct CallKey {
    pub(crate) run_id: String,
    pub(crate) call_id: String,
}

impl CallKey {
    pub(crate) fn of(call: &LocalCall) -> CallKey {
        CallKey {
            run_id: call.run_id.clone(),
            call_id: call.call_id.clone(),
        }
    }
}

/// What a [`CallContext`] asks of the executor that runs its call. The
/// handler API owns this trait and the runner implements it (the shape of
/// tokio's `Schedule`), so that the API depends on nothing of the runner.
#[async_trait::async_trait]
pub(crate) trait CallHost: Send + Sync {
    /// Stores, then sends, a progress receipt of the call.
    async fn progress(
        &self,
        key: &CallKey,
        assignment_id: &str,
        message: &str,
        fraction: Option<f64>,
        data: serde_json::Value,
    ) -> Result<(), ProgressError>;
    /// Whether a test's crash plan stops the process at this point.
    fn crashes_at(&self, point: &str) -> bool;
    /// Whether the executor identity's lease is live (always, on a store
    /// of one process).
    fn lease_live(&self) -> bool;
    /// A heartbeat now: the platform still knows the executor and the
    /// call is not cancelled.
    async fn lease_check(&self) -> Result<(), CommitPointError>;
    /// The executor identity's fencing token, on a shared store.
    fn fencing_token(&self) -> Option<u64>;
    /// Begins a transaction of the store's own database.
    async fn begin(&self) -> Result<StoreTransaction, StoreError>;
    /// How long a handler's transaction may stay open on a SQLite store
    /// (it holds the store's write lock meanwhile).
    fn sqlite_transaction_timeout(&self) -> std::time::Duration;
}

/// Why [`CallContext::commit_point`] said no. (It converts into the right
/// [`ToolError`] with `?`; it is deliberately not a `std::error::Error`,
/// which would make it an unknown outcome instead.)
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CommitPointError {
    /// The run was cancelled: do not take the irreversible step.
    Cancelled,
    /// The executor's lease is not live: do not take the irreversible step now.
    LeaseLost,
}

impl std::fmt::Display for CommitPointError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            CommitPointError::Cancelled => "the run was cancelled",
            CommitPointError::LeaseLost => "the executor's lease is not live",
        })
    }
}

impl From<CommitPointError> for ToolError {
    /// Stopping at a commit point means nothing irreversible happened.
    fn from(e: CommitPointError) -> Self {
        match e {
            CommitPointError::Cancelled => {
                ToolError::cancelled("the run was cancelled before the irreversible step")
            }
            CommitPointError::LeaseLost => {
                ToolError::retry("the lease was lost before the irreversible step")
            }
        }
    }
}

/// A progress receipt: a message for the model and the user, and
/// optionally how far along (0–1) and data.
#[derive(Debug, Clone, PartialEq)]
#[must_use]
pub struct Progress {
    message: String,
    fraction: Option<f64>,
    data: Value,
}

impl Progress {
    /// A progress receipt with this message.
    pub fn new(message: impl Into<String>) -> Progress {
        Progress {
            message: message.into(),
            fraction: None,
            data: Value::Null,
        }
    }

    /// How far along, 0 to 1 (a value outside is clamped; NaN is dropped).
    pub fn fraction(mut self, fraction: f64) -> Progress {
        self.fraction = (!fraction.is_nan()).then(|| fraction.clamp(0.0, 1.0));
        self
    }

    /// Data for whoever reads the progress.
    pub fn data(mut self, data: Value) -> Progress {
        self.data = data;
        self
    }
}

impl From<&str> for Progress {
    fn from(message: &str) -> Progress {
        Progress::new(message)
    }
}

impl From<String> for Progress {
    fn from(message: String) -> Progress {
        Progress::new(message)
    }
}

/// Why a progress report was not stored (nor sent).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ProgressError {
    /// The call is no longer running for this handler (it settled, its
    /// run was cancelled, or its assignment moved on, in which case the
    /// state may still be `running`, for another attempt): stop reporting.
    #[error(
        "progress was not stored: the call no longer runs for this handler (it is {})",
        state.map_or("gone", crate::store::LocalState::as_str)
    )]
    #[non_exhaustive]
    NotRunning {
        /// The call's local state now (`None` if the store no longer
        /// holds it).
        state: Option<crate::store::LocalState>,
    },
    /// The call's transaction is open on a SQLite store, whose write lock
    /// the progress receipt would wait for: report progress before
    /// [`CallContext::transaction`].
    #[error(
        "progress cannot be stored while the call's transaction holds the SQLite store's write lock: report it before ctx.transaction(…)"
    )]
    TransactionOpen,
    /// The store failed: whether the report was kept is unknown.
    #[error("progress could not be stored: {0}")]
    Store(#[source] crate::Error),
}

/// The context of one call: owned and cheap to clone, so a handler may
/// hand it to tasks of its own.
///
/// # Examples
///
/// ```rust,no_run
/// use toolrunner::{CallContext, ToolError};
///
/// async fn transfer(ctx: CallContext, amount: u64) -> Result<String, ToolError> {
///     ctx.progress("checking the balance").await?;
///     if ctx.is_cancelled() {
///         return Err(ToolError::cancelled("the run was cancelled before anything moved"));
///     }
///     ctx.commit_point().await?; // right before the irreversible step
///     // Downstream, the operation key is the idempotency key.
///     Ok(format!("moved {amount} with key {}", ctx.operation_key()))
/// }
/// ```
#[derive(Clone)]
pub struct CallContext {
    host: Arc<dyn CallHost>,
    /// Whether the tool's effects all go through the call's transaction.
    transactional: bool,
    pub(crate) key: CallKey,
    pub(crate) assignment_id: String,
    pub(crate) operation_key: String,
    pub(crate) subject: String,
    pub(crate) agent_id: String,
    pub(crate) agent_version: String,
    pub(crate) tool_name: String,
    pub(crate) cancel: CancellationToken,
    /// The call's transaction, once the handler opened it, until the
    /// executor ends it with the call.
    pub(crate) transaction: Arc<tokio::sync::Mutex<TransactionSlot>>,
    /// Whether that transaction is open on SQLite (it holds the write lock).
    sqlite_open: Arc<std::sync::atomic::AtomicBool>,
    /// The handler attempt this context was handed to.
    attempt: u64,
    /// The attempt running now, and the token that ends it (and cuts off
    /// a transaction closure still running for it).
    attempts: Arc<std::sync::Mutex<Attempts>>,
}

/// The handler attempt of a call running now (see
/// [`CallContext::end_attempt`]).
#[derive(Default)]
pub(crate) struct Attempts {
    number: u64,
    over: CancellationToken,
    /// The executor's task that runs the call is gone (the executor
    /// stopped, or was dropped, before it ended the call's transaction):
    /// nobody will commit or roll back what a closure leaves.
    gone: bool,
}

/// Ends the call's transaction when the executor's task that runs the call
/// is dropped without ending it (the executor stopped or was lost): the
/// attempt is over, a closure still running in a task that kept the
/// context is cut off, and the transaction is rolled back (by whoever
/// holds it last), so no kept task holds the store.
pub(crate) struct EndsWithTask {
    attempts: Arc<std::sync::Mutex<Attempts>>,
    transaction: Arc<tokio::sync::Mutex<TransactionSlot>>,
}

impl Drop for EndsWithTask {
    fn drop(&mut self) {
        {
            let mut attempts = self
                .attempts
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            attempts.gone = true;
            attempts.over.cancel();
        }
        // A task inside a closure holds the slot: it rolls the
        // transaction back itself as it is cut off.
        if let Ok(mut slot) = self.transaction.try_lock() {
            slot.abandon();
        }
    }
}

tokio::task_local! {
    /// The call (run id, call id) whose transaction closure this task is
    /// inside, to refuse a nested `ctx.transaction` at once.
    static INSIDE: (String, String);
}

impl std::fmt::Debug for CallContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CallContext")
            .field("run_id", &self.key.run_id)
            .field("call_id", &self.key.call_id)
            .field("tool_name", &self.tool_name)
            .finish_non_exhaustive()
    }
}

impl CallContext {
    pub(crate) fn new(
        host: Arc<dyn CallHost>,
        transactional: bool,
        call: &LocalCall,
        asg: &toolrunner_protocol::wire::Assignment,
        cancel: CancellationToken,
    ) -> CallContext {
        CallContext {
            host,
            transactional,
            key: CallKey::of(call),
            assignment_id: asg.assignment_id.clone(),
            operation_key: call.operation_key.clone(),
            subject: asg.subject.clone(),
            agent_id: asg.agent_id.clone(),
            agent_version: asg.agent_version.clone(),
            tool_name: asg.tool_name.clone(),
            cancel,
            transaction: Arc::default(),
            sqlite_open: Arc::default(),
            attempt: 0,
            attempts: Arc::default(),
        }
    }

    /// Ties the call's transaction to the executor's task that runs the
    /// call: dropped, the guard ends it (see [`EndsWithTask`]).
    pub(crate) fn ends_with_task(&self) -> EndsWithTask {
        EndsWithTask {
            attempts: self.attempts.clone(),
            transaction: self.transaction.clone(),
        }
    }

    /// Whether the executor's task that runs the call is gone.
    fn gone(&self) -> bool {
        self.attempts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .gone
    }

    /// This context for the call's next handler attempt (after
    /// [`end_attempt`](Self::end_attempt)): clones kept from an earlier
    /// attempt reach no transaction any more.
    pub(crate) fn next_attempt(&self) -> CallContext {
        let mut attempts = self.attempts.lock().expect("not poisoned");
        attempts.number += 1;
        attempts.over = CancellationToken::new();
        CallContext {
            attempt: attempts.number,
            ..self.clone()
        }
    }

    /// Ends the handler attempt running now: a transaction closure still
    /// running for it (in a task that kept a clone of this context) is cut
    /// off, and the transaction taken for the executor, which commits it
    /// with the final receipt or rolls it back (see [`Ended`]: a closure
    /// interrupted half-way, or a transaction past its bound, must not
    /// commit; one a closure ended itself leaves the outcome unknown).
    pub(crate) async fn end_attempt(&self) -> Ended {
        self.attempts.lock().expect("not poisoned").over.cancel();
        let mut slot = self.transaction.lock().await;
        self.sqlite_open
            .store(false, std::sync::atomic::Ordering::SeqCst);
        slot.stop_watchdog();
        let interrupted = std::mem::take(&mut slot.interrupted);
        let expired = slot.expired.take();
        let mut tx = slot.tx.take().map(|t| t.inner);
        // A closure that did not come back (it panicked, was dropped or cut
        // off) may have ended the transaction before it stopped: only its
        // savepoint tells whether nothing of it is stored.
        if interrupted
            && slot.broken.is_none()
            && let Some(t) = tx.as_mut()
            && let Closed::Broken(why) = t.probe_closure().await
        {
            tracing::error!(run_id = %self.key.run_id, call_id = %self.key.call_id, error = %why, "a transaction closure ended the call's transaction itself: the outcome is unknown");
            slot.broken = Some(why);
        }
        if let Some(why) = &slot.broken {
            // Sticky: no later attempt runs on a call whose effect may be
            // stored.
            return Ended::Broken {
                tx,
                why: why.clone(),
            };
        }
        match (tx, expired) {
            (tx, Some(why)) => Ended::RolledBack { tx, why },
            (Some(tx), None) if interrupted => Ended::RolledBack {
                tx: Some(tx),
                why: "the call's transaction was interrupted half-way (a dropped or panicking ctx.transaction)".into(),
            },
            (Some(tx), None) => Ended::Open(tx),
            (None, None) => Ended::None,
        }
    }

    /// Ends the call's last handler attempt (see
    /// [`end_attempt`](Self::end_attempt)); from then on every
    /// `transaction` of this call is refused.
    pub(crate) async fn end_transaction(&self) -> Ended {
        let ended = self.end_attempt().await;
        self.transaction.lock().await.ended = true;
        ended
    }

    /// The stable operation key: pass it downstream as the idempotency key
    /// of the side effect (e.g. a payment provider's `Idempotency-Key`).
    pub fn operation_key(&self) -> &str {
        &self.operation_key
    }

    /// The platform's assignment this call runs under (one per claim).
    pub fn assignment_id(&self) -> &str {
        &self.assignment_id
    }

    /// The run.
    pub fn run_id(&self) -> &str {
        &self.key.run_id
    }

    /// The call.
    pub fn call_id(&self) -> &str {
        &self.key.call_id
    }

    /// Whom the run acts for.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The agent.
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// The agent version.
    pub fn agent_version(&self) -> &str {
        &self.agent_version
    }

    /// The tool.
    pub fn tool_name(&self) -> &str {
        &self.tool_name
    }

    /// Completes when the platform asks to cancel the call (its run was
    /// cancelled or expired). A handler that honours it stops and answers
    /// [`ToolError::cancelled`] if nothing happened yet.
    pub async fn cancelled(&self) {
        self.cancel.cancelled().await;
    }

    /// Whether the platform has asked to cancel the call.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }

    /// Stores, then sends, a progress receipt: a message, or a
    /// [`Progress`] with a fraction and data.
    ///
    /// ```rust,no_run
    /// # async fn demo(ctx: toolrunner::CallContext) -> Result<(), toolrunner::ProgressError> {
    /// use toolrunner::Progress;
    /// ctx.progress("validated").await?;
    /// ctx.progress(Progress::new("half way").fraction(0.5).data(serde_json::json!({"rows": 500}))).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// The progress could not be stored (it is then not sent either), the
    /// call is no longer running, or the call's transaction is open on a
    /// SQLite store (report progress before [`transaction`](Self::transaction)).
    pub async fn progress(&self, progress: impl Into<Progress>) -> Result<(), ProgressError> {
        // On SQLite the open transaction holds the write lock the progress
        // receipt would wait for: say so at once instead of waiting.
        if self.sqlite_open.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ProgressError::TransactionOpen);
        }
        let p = progress.into();
        self.host
            .progress(
                &self.key,
                &self.assignment_id,
                &p.message,
                p.fraction,
                p.data,
            )
            .await
    }

    /// Runs `writes` in the call's transaction in the store's own
    /// database, for the handler's business writes: the executor adds the
    /// call's `completed` receipt to that transaction and commits both at
    /// once when the handler returns `Ok`, so the business rows and the
    /// receipt are both stored or both absent, crash or not. An `Err` (or
    /// a panic, or a timeout) of the handler rolls it back. The first call
    /// begins the transaction; later calls of the same handler go on in
    /// it. Use it in a tool registered as
    /// [`Effect::Transactional`](crate::Effect::Transactional) (its outcome
    /// is then known, unless a closure ends the transaction itself, below);
    /// a write tool may use it too, but its other effects keep their own
    /// rules.
    ///
    /// Each `writes` runs inside a savepoint of its own: when it returns
    /// `Err`, none of its writes stay (on SQLite as on PostgreSQL), even if
    /// the handler then goes on and returns `Ok`; when it returns `Ok`, its
    /// writes stay in the transaction. Never end the transaction inside
    /// `writes` (`COMMIT`, `ROLLBACK`, or sqlx's own on the connection):
    /// the executor finds out when `writes` returns, settles nothing on
    /// that connection, and since what `writes` wrote may then be stored,
    /// the call's outcome is unknown (`reconciliation_required`, for its
    /// `reconcile` hook or a person), whatever the handler returns.
    ///
    /// The transaction is reached only inside `writes`, which this call
    /// awaits: it ends with its call. A task that kept a clone of the
    /// context and calls this after the handler returned is refused (the
    /// call has ended); one still inside `writes` when the handler returns
    /// is cut off there, and so is a `writes` interrupted half-way
    /// (dropped, or panicking): the transaction is rolled back, and the
    /// call fails (`transaction_rolled_back`) instead of committing part of
    /// it.
    ///
    /// The business tables live in the store's database. On SQLite, the
    /// executor's store file: the transaction holds its write lock from the
    /// first `writes` until the call's settlement, and every other write of
    /// the executor (and of an operator's tool) waits meanwhile, so it is
    /// bounded: at [`ExecutorBuilder::sqlite_transaction_timeout`](crate::ExecutorBuilder::sqlite_transaction_timeout)
    /// (1 s by default) it is rolled back, and the call fails
    /// `transaction_rolled_back`. Keep it short, and report progress
    /// before it. On PostgreSQL, the store's database, on a connection of
    /// the handlers' own pool (never the store's), closed once the call
    /// settled: what a handler sets on its session (`SET search_path`,
    /// `SET session_replication_role`, `SET ROLE`) reaches neither the
    /// store's own statements, which run on the store's settings, nor any
    /// other call. The connection's `search_path` is the executor
    /// identity's own schema: name the schema of shared business tables
    /// (`public.orders`), so every replica, and one that adopts another's
    /// identity, writes the same table.
    ///
    /// ```rust,no_run
    /// use toolrunner::{CallContext, ToolError, sqlx};
    ///
    /// async fn place(ctx: CallContext, amount: i64) -> Result<String, ToolError> {
    ///     let key = ctx.operation_key().to_owned();
    ///     ctx.transaction(async |tx| {
    ///         sqlx::query("INSERT INTO orders (operation_key, amount) VALUES ($1, $2)")
    ///             .bind(&key)
    ///             .bind(amount)
    ///             .execute(tx.sqlite()?)
    ///             .await
    ///             .map_err(|e| ToolError::failed("order_refused", e.to_string()))?;
    ///         Ok(())
    ///     })
    ///     .await?;
    ///     Ok(format!("order {key} placed"))
    /// }
    /// ```
    ///
    /// # Errors
    /// What `writes` returns; when the transaction cannot begin:
    /// [`ToolError::retry`] for a transactional tool (nothing happened),
    /// [`ToolError::unknown`] for another (it may have done something
    /// before); [`ToolError::unknown`] when the call has ended (its
    /// transaction was committed or rolled back with it), when the
    /// transaction was rolled back at its bound (SQLite), when an earlier
    /// `writes` ended it itself, and when `writes` ended it itself.
    pub async fn transaction<T>(
        &self,
        writes: impl AsyncFnOnce(&mut Transaction) -> Result<T, ToolError>,
    ) -> Result<T, ToolError> {
        let ended = || {
            ToolError::unknown(format!(
                "call {}/{} has ended: its transaction was committed or rolled back with it; use ctx.transaction only before the handler returns",
                self.key.run_id, self.key.call_id
            ))
        };
        let inside = INSIDE
            .try_with(|(run, call)| *run == self.key.run_id && *call == self.key.call_id)
            .unwrap_or(false);
        if inside {
            return Err(ToolError::unknown(
                "ctx.transaction was called inside its own closure: do the call's writes in one closure (the transaction is the same)",
            ));
        }
        let over = {
            let attempts = self.attempts.lock().expect("not poisoned");
            if attempts.number != self.attempt || attempts.over.is_cancelled() {
                return Err(ended());
            }
            attempts.over.clone()
        };
        let mut slot = tokio::select! {
            slot = self.transaction.lock() => slot,
            () = over.cancelled() => return Err(ended()),
        };
        if slot.ended || over.is_cancelled() {
            if self.gone() {
                slot.abandon();
            }
            return Err(ended());
        }
        if let Some(why) = slot.broken.as_ref().or(slot.expired.as_ref()) {
            return Err(ToolError::unknown(why.clone()));
        }
        if slot.interrupted {
            return Err(ToolError::unknown(
                "the call's transaction was interrupted half-way (a dropped or panicking ctx.transaction): it is rolled back when the handler returns",
            ));
        }
        if slot.tx.is_none() {
            let mut begun = self.host.begin().await.map_err(|e| {
                let why = format!("the store's transaction could not begin: {e}");
                // Nothing happened only if the tool's effects all go
                // through this transaction; a write tool may have done
                // something before.
                if self.transactional {
                    ToolError::retry(why)
                } else {
                    ToolError::unknown(why)
                }
            })?;
            // The executor's own savepoint, before any closure runs (cut
            // off here, the transaction is dropped and rolls back).
            if let Err(e) = begun.open_call().await {
                let why = format!("the store's transaction could not begin: {e}");
                return Err(if self.transactional {
                    ToolError::retry(why)
                } else {
                    ToolError::unknown(why)
                });
            }
            if begun.backend() == "SQLite" {
                self.sqlite_open
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                // It holds the store's write lock: it ends at its bound,
                // whatever the handler does meanwhile.
                let deadline = tokio::time::Instant::now() + self.host.sqlite_transaction_timeout();
                slot.deadline = Some(deadline);
                let expiring = expire(self.transaction.clone(), deadline, self.expired_why());
                slot.watchdog = Some(tokio::spawn(expiring).abort_handle());
            }
            slot.tx = Some(Transaction { inner: begun });
        }
        // Cleared only when `writes` comes back: dropped or unwound
        // half-way, the transaction is left marked.
        slot.interrupted = true;
        let deadline = slot.deadline;
        let tx = slot.tx.as_mut().expect("begun above");
        // Each closure in a savepoint of its own: released on `Ok`, rolled
        // back to on `Err`.
        if let Err(e) = tx.inner.open_closure().await {
            slot.interrupted = false;
            return Err(ToolError::unknown(format!(
                "the call's transaction cannot go on (an earlier closure's statement failed, and that closure returned Ok all the same): {e}"
            )));
        }
        let marker = (self.key.run_id.clone(), self.key.call_id.clone());
        let outcome = tokio::select! {
            // The end of the attempt first: a closure that finishes in the
            // same poll as the executor lets go is cut off all the same.
            biased;
            () = over.cancelled() => None,
            () = until(deadline) => Some(None),
            outcome = INSIDE.scope(marker, writes(tx)) => Some(Some(outcome)),
        };
        let outcome = match outcome {
            Some(Some(outcome)) => Some(outcome),
            None => None,
            Some(None) => {
                // Past its bound: rolled back now, the write lock freed;
                // unless the closure ended the transaction itself first.
                let mut why = self.expired_why();
                slot.interrupted = false;
                slot.stop_watchdog();
                if let Some(mut tx) = slot.tx.take() {
                    if let Closed::Broken(ended) = tx.inner.probe_closure().await {
                        tracing::error!(run_id = %self.key.run_id, call_id = %self.key.call_id, error = %ended, "a transaction closure ended the call's transaction itself: the outcome is unknown");
                        why = ended.clone();
                        slot.broken = Some(ended);
                    }
                    tx.inner.rollback().await;
                }
                if slot.broken.is_none() {
                    slot.expired = Some(why.clone());
                }
                return Err(ToolError::unknown(why));
            }
        };
        // The handler returned (or timed out, or the executor let go) while
        // a task that kept this context was still inside, or as it came
        // out: cut off, left interrupted (after `begin`, too).
        let Some(outcome) = outcome.filter(|_| !over.is_cancelled()) else {
            if self.gone() {
                // Nobody else will end it.
                slot.abandon();
            }
            return Err(ToolError::unknown(
                "the call's handler ended while this transaction closure ran: the transaction is rolled back",
            ));
        };
        let tx = slot.tx.as_mut().expect("begun above");
        match tx.inner.close_closure(outcome.is_ok()).await {
            Closed::Kept => {}
            Closed::Broken(why) => {
                tracing::error!(run_id = %self.key.run_id, call_id = %self.key.call_id, error = %why, "a transaction closure ended the call's transaction itself: the outcome is unknown");
                slot.interrupted = false;
                slot.broken = Some(why.clone());
                return Err(ToolError::unknown(why));
            }
            Closed::Spoiled(why) => {
                slot.interrupted = false;
                slot.expired = Some(why.clone());
                return Err(ToolError::unknown(why));
            }
        }
        slot.interrupted = false;
        outcome
    }

    /// Why a SQLite transaction past its bound was rolled back.
    fn expired_why(&self) -> String {
        let bound = self.host.sqlite_transaction_timeout();
        format!(
            "the call's transaction stayed open longer than {bound:?}, the bound of a handler's transaction on a SQLite store (it holds the store's write lock): it was rolled back; keep the transaction short, or raise ExecutorBuilder::sqlite_transaction_timeout"
        )
    }

    /// Checks, right now and unthrottled, that the run is not cancelled and
    /// the executor's lease is live. Call it right before an irreversible
    /// step; `?` turns a refusal into the right [`ToolError`].
    ///
    /// # Errors
    /// [`CommitPointError::Cancelled`] or [`CommitPointError::LeaseLost`].
    pub async fn commit_point(&self) -> Result<(), CommitPointError> {
        if self.host.crashes_at("commit_point") {
            return Err(CommitPointError::LeaseLost);
        }
        if self.cancel.is_cancelled() {
            return Err(CommitPointError::Cancelled);
        }
        // On a store shared by replicas, the identity's own lease must be
        // live too, before and after the heartbeat (a process frozen in
        // it must look again): whoever takes the identity over waits the
        // tool's commit window from its lapse.
        if !may_act(self.host.lease_live()) {
            return Err(CommitPointError::LeaseLost);
        }
        self.host.lease_check().await?;
        if !may_act(self.host.lease_live()) {
            return Err(CommitPointError::LeaseLost);
        }
        if self.cancel.is_cancelled() {
            return Err(CommitPointError::Cancelled);
        }
        Ok(())
    }

    /// The executor identity's fencing token, on a PostgreSQL store shared
    /// by replicas (`None` on a store of one process, such as SQLite's,
    /// which its file lock keeps to one writer). Every process that takes
    /// the identity, and every replica that adopts it, holds a greater one.
    ///
    /// Pass it downstream with [`operation_key`](Self::operation_key) when
    /// the downstream can fence: one that remembers the greatest token seen
    /// for a key (its lookup by the `reconcile` hook included) and refuses
    /// a smaller one closes the one case no executor can exclude alone, a
    /// process frozen between its commit point and its effect for longer
    /// than its lease and the tool's commit window.
    pub fn fencing_token(&self) -> Option<u64> {
        self.host.fencing_token()
    }
}

/// Completes at `deadline`, or never without one.
async fn until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Rolls the call's transaction back at `deadline` (its bound, on SQLite)
/// if it is still open then and no closure ended it first: the write lock
/// is freed whatever the handler does, and the call cannot commit.
async fn expire(
    slot: Arc<tokio::sync::Mutex<TransactionSlot>>,
    deadline: tokio::time::Instant,
    why: String,
) {
    tokio::time::sleep_until(deadline).await;
    let mut slot = slot.lock().await;
    if slot.deadline != Some(deadline) {
        return;
    }
    slot.deadline = None;
    slot.watchdog = None;
    if let Some(tx) = slot.tx.take() {
        tracing::warn!(error = %why, "a handler's transaction was rolled back at its bound");
        slot.expired = Some(why);
        tx.inner.rollback().await;
    }
}
