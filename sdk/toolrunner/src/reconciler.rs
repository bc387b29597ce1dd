//! The operator's API over the store: list, show a timeline, resolve with
//! evidence, record a compensation, redeliver, export. Products can build
//! admin pages on it; the `toolrunner` CLI is one.
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use toolrunner_protocol::tooldef::Schema;
use toolrunner_protocol::wire::ReceiptKind;

use crate::error::{Error, Kind, Result};
use crate::lifecycle::{self, Advanced, Event, FinalReceipt, Reads};
use crate::net::client::{Backoff, Client};
use crate::runner::outbox::{Delivery, deliver};
use crate::store::approvals::{ApprovalBook, ApprovalRow, Stored};
use crate::store::{
    Attempt, CallFilter, Event as TimelineEvent, LocalCall, LocalState, OutboxReceipt,
    ReceiptStatus, SqliteStore, Store, Timestamp,
};

/// One call as an operator sees it (no secrets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CallSummary {
    pub(crate) run_id: String,
    pub(crate) call_id: String,
    pub(crate) tool_name: String,
    pub(crate) state: LocalState,
    pub(crate) operation_key: String,
    pub(crate) assignment_id: Option<String>,
    pub(crate) subject: Option<String>,
    pub(crate) reason: Option<String>,
    /// Added later: JSON written before it reads as none.
    #[serde(default)]
    pub(crate) outcome: Option<ReceiptKind>,
    pub(crate) created_at: Timestamp,
    pub(crate) updated_at: Timestamp,
}

impl CallSummary {
    /// Run.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Call.
    pub fn call_id(&self) -> &str {
        &self.call_id
    }

    /// Tool.
    pub fn tool_name(&self) -> &str {
        &self.tool_name
    }

    /// Local state.
    pub fn state(&self) -> LocalState {
        self.state
    }

    /// The operation key (the idempotency key handlers passed downstream).
    pub fn operation_key(&self) -> &str {
        &self.operation_key
    }

    /// The assignment, if any.
    pub fn assignment_id(&self) -> Option<&str> {
        self.assignment_id.as_deref()
    }

    /// Whom the run acts for.
    pub fn subject(&self) -> Option<&str> {
        self.subject.as_deref()
    }

    /// Why it is in its state.
    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// How the call ended as far as this store knows: the kind of its
    /// latest final receipt (`completed`, `failed` or `cancelled`, whether
    /// delivered yet or not, an operator's included), or `None` while it
    /// has none. The state says where that receipt is (`settled`: saved,
    /// `delivered`: the platform took it, `rejected`: the platform refused
    /// it), this says what it said.
    pub fn outcome(&self) -> Option<ReceiptKind> {
        self.outcome
    }

    /// When this store first held the call.
    pub fn created_at(&self) -> Timestamp {
        self.created_at
    }

    /// When it last changed.
    pub fn updated_at(&self) -> Timestamp {
        self.updated_at
    }
}

impl CallSummary {
    /// The operator's view of a stored call.
    pub(crate) fn from_row(c: &LocalCall) -> Self {
        CallSummary {
            run_id: c.run_id.clone(),
            call_id: c.call_id.clone(),
            tool_name: c.tool_name.clone(),
            state: c.state,
            operation_key: c.operation_key.clone(),
            assignment_id: c.assignment.as_ref().map(|a| a.assignment_id.clone()),
            subject: c.assignment.as_ref().map(|a| a.subject.clone()),
            reason: c.reason.clone(),
            outcome: None,
            created_at: c.created_at,
            updated_at: c.updated_at,
        }
    }
}

/// Whether a call in `state` may hold a final receipt (an outcome).
fn may_have_outcome(state: LocalState) -> bool {
    !matches!(
        state,
        LocalState::Claiming
            | LocalState::Assigned
            | LocalState::Running
            | LocalState::ReconciliationRequired
    )
}

/// A receipt as stored in the outbox, with its exact body.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ReceiptView {
    /// Not in the stable JSON (a receipt is shown under its call there).
    #[serde(skip)]
    pub(crate) run_id: String,
    /// As `run_id`.
    #[serde(skip)]
    pub(crate) call_id: String,
    pub(crate) receipt_id: String,
    pub(crate) kind: ReceiptKind,
    pub(crate) sequence: u64,
    pub(crate) assignment_id: String,
    pub(crate) status: ReceiptStatus,
    pub(crate) attempts: u32,
    pub(crate) last_error: Option<String>,
    pub(crate) created_at: Timestamp,
    pub(crate) delivered_at: Option<Timestamp>,
    pub(crate) body: String,
}

toolrunner_protocol::debug_without_payloads!(ReceiptView { run_id, call_id, receipt_id, kind, sequence, assignment_id, status, attempts, last_error, created_at, delivered_at } hiding { body });

impl ReceiptView {
    /// The run of its call.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Its call.
    pub fn call_id(&self) -> &str {
        &self.call_id
    }

    /// Id.
    pub fn receipt_id(&self) -> &str {
        &self.receipt_id
    }

    /// Kind.
    pub fn kind(&self) -> ReceiptKind {
        self.kind
    }

    /// Sequence.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Assignment.
    pub fn assignment_id(&self) -> &str {
        &self.assignment_id
    }

    /// Delivery status.
    pub fn status(&self) -> ReceiptStatus {
        self.status
    }

    /// Delivery attempts.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Last delivery error.
    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    /// When it was saved.
    pub fn created_at(&self) -> Timestamp {
        self.created_at
    }

    /// When the platform acknowledged it.
    pub fn delivered_at(&self) -> Option<Timestamp> {
        self.delivered_at
    }

    /// The stored bytes, exactly as sent.
    pub fn body(&self) -> &str {
        &self.body
    }
}

impl ReceiptView {
    /// The operator's view of a stored receipt.
    pub(crate) fn from_row(r: &OutboxReceipt) -> Self {
        ReceiptView {
            run_id: r.run_id.clone(),
            call_id: r.call_id.clone(),
            receipt_id: r.receipt_id.clone(),
            kind: r.kind,
            sequence: r.sequence,
            assignment_id: r.assignment_id.clone(),
            status: r.status,
            attempts: r.attempts,
            last_error: r.last_error.clone(),
            created_at: r.created_at,
            delivered_at: r.delivered_at,
            body: r.body.clone(),
        }
    }
}

/// Everything known about one call. Its `Debug` shows the arguments' size
/// only.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Timeline {
    pub(crate) call: CallSummary,
    /// Not in the stable JSON (`calls show --json` prints no arguments).
    #[serde(skip)]
    pub(crate) arguments: Option<Value>,
    pub(crate) receipts: Vec<ReceiptView>,
    pub(crate) events: Vec<TimelineEvent>,
    pub(crate) attempts: Vec<Attempt>,
}

toolrunner_protocol::debug_without_payloads!(Timeline { call, receipts, events, attempts } hiding { arguments });

impl Timeline {
    /// The call.
    pub fn call(&self) -> &CallSummary {
        &self.call
    }

    /// Its receipts in sequence order.
    pub fn receipts(&self) -> &[ReceiptView] {
        &self.receipts
    }

    /// Every state change and action, oldest first.
    pub fn events(&self) -> &[TimelineEvent] {
        &self.events
    }

    /// Every operation key and assignment the call had, oldest first.
    pub fn attempts(&self) -> &[Attempt] {
        &self.attempts
    }

    /// The arguments the model gave, as the stored assignment holds them
    /// (none before the call was assigned). Product data: shown to an
    /// operator on purpose, never logged, and not part of the timeline's
    /// JSON.
    pub fn arguments(&self) -> Option<&Value> {
        self.arguments.as_ref()
    }

    /// Whether [`Reconciler::close`] would take the call: `orphaned` while
    /// its outcome was unknown, and not closed yet.
    pub fn closable(&self) -> bool {
        closable(self.call.state, &self.events)
    }

    /// The result of the call's latest `completed` receipt, if it has one.
    pub fn result(&self) -> Option<Value> {
        self.receipts
            .iter()
            .rev()
            .filter(|r| r.kind == ReceiptKind::Completed)
            .find_map(|r| serde_json::from_str::<Value>(&r.body).ok())
            .and_then(|mut body| body.get_mut("result").map(Value::take))
    }
}

/// How an operator settles a call. Its `Debug` shows the size of a result,
/// a message or a reason, never its text.
#[derive(Clone, PartialEq)]
#[non_exhaustive]
pub enum Outcome {
    /// The effect happened with this result (checked against `output_schema`).
    Completed(Value),
    /// A confirmed business failure.
    Failed {
        /// Code.
        code: String,
        /// Short message for the model.
        message: String,
    },
    /// A confirmed business cancellation.
    Cancelled {
        /// Why.
        reason: String,
    },
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Outcome::Completed(result) => f
                .debug_tuple("Completed")
                .field(&toolrunner_protocol::redact::Redacted::of(result))
                .finish(),
            Outcome::Failed { code, message } => f
                .debug_struct("Failed")
                .field("code", code)
                .field(
                    "message",
                    &toolrunner_protocol::redact::Redacted::of(message),
                )
                .finish(),
            Outcome::Cancelled { reason } => f
                .debug_struct("Cancelled")
                .field("reason", &toolrunner_protocol::redact::Redacted::of(reason))
                .finish(),
        }
    }
}

/// Who decided, why, and where the proof is.
///
/// ```
/// let evidence = toolrunner::Evidence::new("on-call", "the provider shows the charge")
///     .with_reference("INC-7");
/// # let _ = evidence;
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Evidence {
    pub(crate) who: String,
    pub(crate) why: String,
    pub(crate) reference: Option<String>,
}

impl Evidence {
    /// Evidence given by `who` (the operator), saying `why` the outcome is
    /// right. [`Reconciler::resolve`], [`compensated`](Reconciler::compensated)
    /// and [`close`](Reconciler::close) refuse it when either is blank.
    pub fn new(who: impl Into<String>, why: impl Into<String>) -> Evidence {
        Evidence {
            who: who.into(),
            why: why.into(),
            reference: None,
        }
    }

    /// Refused unless it names who decided and says why.
    pub(crate) fn check(&self) -> Result<()> {
        if self.who.trim().is_empty() {
            return Err(refused(
                "the evidence names nobody: say who decided (the CLI's --who)",
            ));
        }
        if self.why.trim().is_empty() {
            return Err(refused(
                "the evidence says nothing: say what was checked (the CLI's --evidence)",
            ));
        }
        Ok(())
    }

    /// Where the proof is: a ticket, a provider's transaction id, ….
    #[must_use]
    pub fn with_reference(mut self, reference: impl Into<String>) -> Evidence {
        self.reference = Some(reference.into());
        self
    }

    /// Operator.
    pub fn who(&self) -> &str {
        &self.who
    }

    /// Why this outcome is right.
    pub fn why(&self) -> &str {
        &self.why
    }

    /// The reference (ticket, provider transaction id, …), if one was given.
    pub fn reference(&self) -> Option<&str> {
        self.reference.as_deref()
    }
}

/// What a resolve did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Resolved {
    pub(crate) receipt_id: String,
    pub(crate) state: LocalState,
    pub(crate) delivered: bool,
}

impl Resolved {
    /// The new final receipt.
    pub fn receipt_id(&self) -> &str {
        &self.receipt_id
    }

    /// The call's local state afterwards.
    pub fn state(&self) -> LocalState {
        self.state
    }

    /// Whether it was delivered now (otherwise the running executor's
    /// outbox delivers it).
    pub fn delivered(&self) -> bool {
        self.delivered
    }
}

/// Counts of the outbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct OutboxStatus {
    pub(crate) by_status: std::collections::BTreeMap<String, usize>,
    pub(crate) oldest_pending_at: Option<Timestamp>,
    pub(crate) pending: Vec<ReceiptView>,
}

impl OutboxStatus {
    /// Receipts by delivery status.
    pub fn by_status(&self) -> &std::collections::BTreeMap<String, usize> {
        &self.by_status
    }

    /// The oldest undelivered receipt's creation time.
    pub fn oldest_pending_at(&self) -> Option<Timestamp> {
        self.oldest_pending_at
    }

    /// The undelivered receipts.
    pub fn pending(&self) -> &[ReceiptView] {
        &self.pending
    }
}

/// Whether [`Reconciler::close`] takes a call in `state` with this
/// timeline: `orphaned` while its outcome was unknown, not closed yet.
fn closable(state: LocalState, events: &[TimelineEvent]) -> bool {
    let has = |what: &str| events.iter().any(|e| e.what == what);
    state == LocalState::Orphaned
        && has(lifecycle::OUTCOME_UNKNOWN_NOTE)
        && !has(lifecycle::OPERATOR_CLOSED_NOTE)
}

/// Why a request was refused (exit code 1 in the CLI).
fn refused(msg: impl Into<String>) -> Error {
    Error::new(Kind::Refused, msg)
}

/// The operator's API over an executor's store.
///
/// # Examples
///
/// ```rust,no_run
/// # async fn demo() -> toolrunner::Result<()> {
/// use toolrunner::{CallFilter, Evidence, LocalState, Outcome, Reconciler};
///
/// let reconciler = Reconciler::open("sqlite:///var/lib/app/toolrunner.db")
///     .await?
///     .with_platform("https://platform.example", "…")?;
/// let waiting = reconciler
///     .list(&CallFilter::new().state(LocalState::ReconciliationRequired))
///     .await?;
/// for call in waiting {
///     // Look call.operation_key() up in the business system first.
///     let evidence = Evidence::new("on-call", "the provider shows the charge").with_reference("INC-7");
///     let outcome = Outcome::Completed(serde_json::json!({"charge_id": "ch_9"}));
///     reconciler.resolve(call.run_id(), call.call_id(), outcome, &evidence).await?;
/// }
/// # Ok(()) }
/// ```
pub struct Reconciler {
    store: Arc<dyn Store>,
    client: Option<Client>,
    /// The store's approval requests (a call's timeline shows its own).
    approvals: Option<Arc<dyn ApprovalBook>>,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("delivers", &self.client.is_some())
            .finish_non_exhaustive()
    }
}

impl Reconciler {
    /// Opens the store at a `sqlite://PATH` URL (safe beside a running
    /// executor: WAL readers, and writes go through guarded transactions),
    /// or, with the `postgres` feature, a `postgres://` URL.
    ///
    /// # Errors
    /// The store cannot be opened.
    pub async fn open(store_url: &str) -> Result<Reconciler> {
        Ok(Reconciler {
            store: crate::store::open(store_url).await?,
            client: None,
            approvals: Some(crate::store::open_approvals(store_url).await?),
        })
    }

    /// Opens the store in the file at `path` (taken literally).
    ///
    /// # Errors
    /// The store cannot be opened.
    pub async fn open_path(path: &std::path::Path) -> Result<Reconciler> {
        let store = SqliteStore::open_path(path).await?;
        Ok(Reconciler {
            approvals: Some(Arc::new(store.approvals())),
            store: Arc::new(store),
            client: None,
        })
    }

    /// One reconciler for each executor identity on the PostgreSQL
    /// database at `store_url` (feature `postgres`), by executor id: every
    /// identity that ever held a lease there, each over its own schema.
    ///
    /// # Errors
    /// The database cannot be reached, a store cannot be opened, or the
    /// `postgres` feature is off.
    pub async fn open_each_identity(store_url: &str) -> Result<Vec<(String, Reconciler)>> {
        let mut out = Vec::new();
        for (id, schema) in Self::identities(store_url).await? {
            out.push((id, Self::open_identity(store_url, &schema).await?));
        }
        Ok(out)
    }

    /// The executor identities on the PostgreSQL database at `store_url`,
    /// each with the schema of its store, by executor id.
    pub(crate) async fn identities(store_url: &str) -> Result<Vec<(String, String)>> {
        crate::store::postgres_identities(store_url).await
    }

    /// The reconciler of the store in `schema` on the PostgreSQL database
    /// at `store_url`.
    pub(crate) async fn open_identity(store_url: &str, schema: &str) -> Result<Reconciler> {
        Ok(Reconciler {
            store: crate::store::open_postgres_schema(store_url, schema).await?,
            client: None,
            // One identity of many (the console): its timelines leave the
            // database-wide approval requests out (one pool each would
            // crowd the server).
            approvals: None,
        })
    }

    /// The approval requests of this reconciler's store (none for one
    /// identity of a PostgreSQL database opened by the console: the
    /// database's are read once, not once per identity).
    #[cfg(feature = "console")]
    pub(crate) fn approval_book(&self) -> Option<Arc<dyn ApprovalBook>> {
        self.approvals.clone()
    }

    /// Whether resolve and redeliver send receipts themselves
    /// ([`with_platform`](Self::with_platform) was given).
    pub fn delivers(&self) -> bool {
        self.client.is_some()
    }

    /// Over a store of the testing seam ([`testing::store`](crate::testing::store)).
    #[cfg(feature = "testing")]
    pub fn new(store: Arc<dyn Store>) -> Reconciler {
        Reconciler {
            store,
            client: None,
            approvals: None,
        }
    }

    /// Lets resolve and redeliver send receipts to the platform themselves.
    ///
    /// # Errors
    /// The base URL ends in `/v1` (toolrunner adds it to every path), or
    /// the HTTP client cannot be built.
    pub fn with_platform(mut self, base_url: &str, token: &str) -> Result<Reconciler> {
        let backoff = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            attempts: 4,
        };
        crate::net::platform::check_base_url_path(base_url)
            .map_err(|m| Error::new(Kind::Builder, m))?;
        let client = Client::new(base_url, token, Duration::from_secs(10), backoff)
            .map_err(|e| Error::new(Kind::Builder, format!("cannot build the HTTP client: {e}")))?;
        self.client = Some(client);
        Ok(self)
    }

    /// Calls matching `filter`.
    ///
    /// # Errors
    /// The store failed.
    pub async fn list(&self, filter: &CallFilter) -> Result<Vec<CallSummary>> {
        let rows = self.store.calls(filter).await?;
        let ended: Vec<(String, String)> = rows
            .iter()
            .filter(|c| may_have_outcome(c.state))
            .map(|c| (c.run_id.clone(), c.call_id.clone()))
            .collect();
        let mut outcomes = if ended.is_empty() {
            std::collections::HashMap::new()
        } else {
            self.store.outcomes(&ended).await?
        };
        Ok(rows
            .iter()
            .map(|c| {
                let mut summary = CallSummary::from_row(c);
                summary.outcome = outcomes.remove(&(c.run_id.clone(), c.call_id.clone()));
                summary
            })
            .collect())
    }

    /// Every executor id whose calls this store holds (from their
    /// attempts), sorted: which executor a store file belongs to (the
    /// console labels a store by them).
    ///
    /// # Errors
    /// The store failed.
    pub async fn executor_ids(&self) -> Result<Vec<String>> {
        Ok(self.store.executor_ids().await?)
    }

    async fn load(&self, run_id: &str, call_id: &str) -> Result<LocalCall> {
        self.store
            .call(run_id, call_id)
            .await?
            .ok_or_else(|| refused(format!("this store has no call {run_id}/{call_id}")))
    }

    /// One call's whole timeline.
    ///
    /// # Errors
    /// Unknown call, or the store failed.
    pub async fn show(&self, run_id: &str, call_id: &str) -> Result<Timeline> {
        let call = self.load(run_id, call_id).await?;
        let receipts = self.store.receipts(run_id, call_id).await?;
        let mut events = self.store.events(run_id, call_id).await?;
        if let Some(book) = &self.approvals {
            events.extend(approval_events(&book.of_call(run_id, call_id).await?));
            events.sort_by_key(|e| e.at);
        }
        let attempts = self.store.attempts(run_id, call_id).await?;
        let mut summary = CallSummary::from_row(&call);
        // As `list` says it: a call waiting for reconciliation has no
        // outcome yet, whatever final receipt the platform refused.
        summary.outcome = receipts
            .iter()
            .rev()
            .find(|r| r.kind.is_final())
            .map(|r| r.kind)
            .filter(|_| may_have_outcome(call.state));
        Ok(Timeline {
            arguments: call.assignment.as_ref().map(|a| a.arguments.clone()),
            call: summary,
            receipts: receipts.iter().map(ReceiptView::from_row).collect(),
            events,
            attempts,
        })
    }

    /// Settles a call in `reconciliation_required` or `rejected` with a new
    /// final receipt (a new `receipt_id`), written through the outbox, and
    /// delivers it if a platform is set.
    ///
    /// # Errors
    /// Refused: blank evidence, another state, no assignment, a result that
    /// fails the stored `output_schema`, or someone settled it meanwhile.
    #[tracing::instrument(name = "toolrunner.operator", skip_all, fields(otel.name = "toolrunner.operator resolve", toolrunner.action = "resolve", gen_ai.tool.call.id = call_id, toolrunner.run_id = run_id))]
    pub async fn resolve(
        &self,
        run_id: &str,
        call_id: &str,
        outcome: Outcome,
        evidence: &Evidence,
    ) -> Result<Resolved> {
        let (kind, extra) = self.settlement(run_id, call_id, outcome, evidence).await?;
        let allowed = [LocalState::ReconciliationRequired, LocalState::Rejected];
        let executor_id = self.executor_id_of(run_id, call_id).await?;
        let event = Event::OperatorResolved {
            outcome: FinalReceipt { kind, extra },
            reason: format!("resolved by {}: {}", evidence.who, evidence.why),
            evidence: serde_json::to_string(evidence).unwrap_or_default(),
        };
        let receipt = match self
            .transition(
                &executor_id,
                (run_id, call_id),
                &allowed,
                event,
                "not resolved",
            )
            .await?
        {
            Some(r) => r,
            None => return Err(refused("not resolved: no receipt was written")),
        };
        let mut delivered = false;
        if let Some(client) = &self.client {
            delivered = matches!(
                deliver(client, self.store.as_ref(), &executor_id, &receipt, None).await,
                Delivery::Delivered
            );
        }
        let state = self.load(run_id, call_id).await?.state;
        Ok(Resolved {
            receipt_id: receipt.receipt_id,
            state,
            delivered,
        })
    }

    /// Checks a [`compensated`](Self::compensated) without writing
    /// anything, by the same rules.
    ///
    /// # Errors
    /// Refused as [`compensated`](Self::compensated) would refuse it now.
    pub async fn check_compensated(
        &self,
        run_id: &str,
        call_id: &str,
        evidence: &Evidence,
    ) -> Result<()> {
        evidence.check()?;
        let call = self.load(run_id, call_id).await?;
        if call.state != LocalState::Rejected {
            return Err(refused(format!(
                "call {run_id}/{call_id} is {}; only rejected calls are marked compensated",
                call.state.as_str()
            )));
        }
        Ok(())
    }

    /// Checks a [`close`](Self::close) without writing anything, by the
    /// same rules.
    ///
    /// # Errors
    /// Refused as [`close`](Self::close) would refuse it now.
    pub async fn check_close(
        &self,
        run_id: &str,
        call_id: &str,
        evidence: &Evidence,
    ) -> Result<()> {
        evidence.check()?;
        let call = self.load(run_id, call_id).await?;
        let events = self.store.events(run_id, call_id).await?;
        if events
            .iter()
            .any(|e| e.what == lifecycle::OPERATOR_CLOSED_NOTE)
        {
            return Err(refused(format!(
                "call {run_id}/{call_id} was closed already"
            )));
        }
        if !closable(call.state, &events) {
            return Err(refused(format!(
                "call {run_id}/{call_id} is {}; only orphaned calls whose outcome was unknown are closed (resolve a reconciliation_required one instead)",
                call.state.as_str()
            )));
        }
        Ok(())
    }

    /// Checks a [`resolve`](Self::resolve) without writing or sending
    /// anything, by the same rules: what a console previews before it asks
    /// to confirm.
    ///
    /// # Errors
    /// Refused as [`resolve`](Self::resolve) would refuse it now.
    pub async fn check_resolve(
        &self,
        run_id: &str,
        call_id: &str,
        outcome: Outcome,
        evidence: &Evidence,
    ) -> Result<()> {
        self.settlement(run_id, call_id, outcome, evidence)
            .await
            .map(|_| ())
    }

    /// The final receipt's kind and fields that settle the call with
    /// `outcome`; refused for blank evidence, a call in another state or
    /// without an assignment, or a result that fails the stored
    /// `output_schema`.
    async fn settlement(
        &self,
        run_id: &str,
        call_id: &str,
        outcome: Outcome,
        evidence: &Evidence,
    ) -> Result<(ReceiptKind, Value)> {
        evidence.check()?;
        let call = self.load(run_id, call_id).await?;
        let allowed = [LocalState::ReconciliationRequired, LocalState::Rejected];
        if !allowed.contains(&call.state) {
            return Err(refused(format!(
                "call {run_id}/{call_id} is {}; only reconciliation_required or rejected calls are resolved",
                call.state.as_str()
            )));
        }
        let asg = call.assignment.clone().ok_or_else(|| {
            refused("the call has no assignment in this store: settle it on the platform side")
        })?;
        Ok(match outcome {
            Outcome::Completed(result) => {
                if let Some(schema) = &asg.output_schema {
                    let schema = Schema::compile(schema).map_err(|e| {
                        refused(format!("the stored output_schema cannot be used: {e}"))
                    })?;
                    if let Some(v) = schema.violations(&result).first() {
                        return Err(refused(format!(
                            "the result does not match output_schema at '{}': {}",
                            v.path, v.masked
                        )));
                    }
                }
                (ReceiptKind::Completed, json!({"result": result}))
            }
            Outcome::Failed { code, message } => (
                ReceiptKind::Failed,
                json!({"error": {"code": code, "message": message}}),
            ),
            Outcome::Cancelled { reason } => (ReceiptKind::Cancelled, json!({"reason": reason})),
        })
    }

    /// Records that the effect of a `rejected` call (the platform had
    /// already ended the run) was compensated.
    ///
    /// # Errors
    /// Refused if the evidence is blank or the call is not `rejected`.
    #[tracing::instrument(name = "toolrunner.operator", skip_all, fields(otel.name = "toolrunner.operator compensated", toolrunner.action = "compensated", gen_ai.tool.call.id = call_id, toolrunner.run_id = run_id))]
    pub async fn compensated(
        &self,
        run_id: &str,
        call_id: &str,
        evidence: &Evidence,
    ) -> Result<()> {
        self.check_compensated(run_id, call_id, evidence).await?;
        let executor_id = self
            .executor_id_of(run_id, call_id)
            .await
            .unwrap_or_default();
        let event = Event::OperatorCompensated {
            reason: format!("compensated per {}: {}", evidence.who, evidence.why),
            evidence: serde_json::to_string(evidence).unwrap_or_default(),
        };
        self.transition(
            &executor_id,
            (run_id, call_id),
            &[LocalState::Rejected],
            event,
            "not recorded",
        )
        .await?;
        Ok(())
    }

    /// Closes an `orphaned` call whose outcome was unknown when the
    /// platform forgot it (its run expired or was deleted while the call
    /// waited for reconciliation): a local settlement with the operator's
    /// evidence in the timeline. Nothing is sent, since the platform no
    /// longer knows the call; retention may then prune it.
    ///
    /// # Errors
    /// Refused if the evidence is blank, the call is not `orphaned`, its
    /// outcome was known, or it was closed already.
    #[tracing::instrument(name = "toolrunner.operator", skip_all, fields(otel.name = "toolrunner.operator close", toolrunner.action = "close", gen_ai.tool.call.id = call_id, toolrunner.run_id = run_id))]
    pub async fn close(&self, run_id: &str, call_id: &str, evidence: &Evidence) -> Result<()> {
        self.check_close(run_id, call_id, evidence).await?;
        let executor_id = self
            .executor_id_of(run_id, call_id)
            .await
            .unwrap_or_default();
        let event = Event::OperatorClosed {
            reason: format!("closed by {}: {}", evidence.who, evidence.why),
            evidence: serde_json::to_string(evidence).unwrap_or_default(),
        };
        self.transition(
            &executor_id,
            (run_id, call_id),
            &[LocalState::Orphaned],
            event,
            "not closed",
        )
        .await?;
        Ok(())
    }

    /// An operator's transition of a call in one of `states`; refused (and
    /// nothing written) if the call is elsewhere by now. The receipt it
    /// wrote, if any.
    async fn transition(
        &self,
        executor_id: &str,
        key: (&str, &str),
        states: &[LocalState],
        event: Event,
        refusal: &str,
    ) -> Result<Option<OutboxReceipt>> {
        let moved = lifecycle::advance(self.store.as_ref(), executor_id, key, Reads::Row, |s| {
            s.call
                .as_ref()
                .filter(|c| states.contains(&c.state))
                .map(|_| event.clone())
        })
        .await
        .map_err(|e| refused(format!("{refusal}: {e}")))?;
        match moved {
            Advanced::Moved { receipt, .. } => Ok(receipt),
            Advanced::Stayed(now) => Err(refused(format!(
                "{refusal}: the call is now {}",
                now.map_or("gone", |c| c.state.as_str())
            ))),
        }
    }

    /// The outbox: counts by status and the undelivered receipts.
    ///
    /// # Errors
    /// The store failed.
    pub async fn outbox(&self) -> Result<OutboxStatus> {
        let mut by_status = std::collections::BTreeMap::new();
        for s in [
            ReceiptStatus::Pending,
            ReceiptStatus::Delivered,
            ReceiptStatus::Rejected,
            ReceiptStatus::Superseded,
            ReceiptStatus::Orphaned,
        ] {
            by_status.insert(
                s.as_str().to_owned(),
                self.store.receipts_with(s).await?.len(),
            );
        }
        let pending: Vec<ReceiptView> = self
            .store
            .receipts_with(ReceiptStatus::Pending)
            .await?
            .iter()
            .map(ReceiptView::from_row)
            .collect();
        let oldest_pending_at = pending.iter().map(|r| r.created_at).min();
        Ok(OutboxStatus {
            by_status,
            oldest_pending_at,
            pending,
        })
    }

    /// Sends undelivered receipts now (all, or one by id), oldest first.
    /// Needs [`with_platform`](Self::with_platform).
    ///
    /// # Errors
    /// Refused without a platform or for an unknown or not pending receipt.
    #[tracing::instrument(name = "toolrunner.operator", skip_all, fields(otel.name = "toolrunner.operator redeliver", toolrunner.action = "redeliver", toolrunner.receipt_id = receipt_id))]
    pub async fn redeliver(
        &self,
        receipt_id: Option<&str>,
    ) -> Result<Vec<(String, ReceiptStatus)>> {
        let client = self.client.as_ref().ok_or_else(|| refused("redeliver needs --base-url and --token (or a running executor, whose outbox delivers by itself)"))?;
        let receipts = match receipt_id {
            Some(id) => {
                let r = self
                    .store
                    .receipt(id)
                    .await?
                    .ok_or_else(|| refused(format!("no receipt {id}")))?;
                if r.status != ReceiptStatus::Pending {
                    return Err(refused(format!(
                        "receipt {id} is {}, not pending",
                        r.status.as_str()
                    )));
                }
                if r.kind == ReceiptKind::Accepted {
                    return Err(refused(format!(
                        "receipt {id} is an accepted: only the executor's accept step sends it, because only it may act on the answer; start the executor instead"
                    )));
                }
                vec![r]
            }
            // `accepted` is the accept step's alone.
            None => self
                .store
                .receipts_with(ReceiptStatus::Pending)
                .await?
                .into_iter()
                .filter(|r| r.kind != ReceiptKind::Accepted)
                .collect(),
        };
        let mut out = Vec::new();
        for r in receipts {
            let executor_id = self.executor_id_of(&r.run_id, &r.call_id).await?;
            out.push(self.send(client, &executor_id, r).await?.0);
        }
        Ok(out)
    }

    /// Sends one stored receipt (its stored bytes, through the outbox's
    /// delivery) and reads back where it stands.
    async fn send(
        &self,
        client: &Client,
        executor_id: &str,
        r: OutboxReceipt,
    ) -> Result<((String, ReceiptStatus), Delivery)> {
        let delivery = deliver(client, self.store.as_ref(), executor_id, &r, None).await;
        let status = self
            .store
            .receipt(&r.receipt_id)
            .await?
            .map_or(r.status, |x| x.status);
        Ok(((r.receipt_id, status), delivery))
    }

    /// Sends the receipts `receipt_ids` of one call now (those a preview
    /// listed: each must be the call's, waiting, and not an `accepted`,
    /// which only the executor's accept step sends), after writing the
    /// operator's evidence into the call's timeline (`operator_redelivered`).
    /// A receipt that no longer waits is not sent; the sending stops at the
    /// first the platform did not take (out of reach, or the call moved
    /// on), as the outbox does. Needs [`with_platform`](Self::with_platform).
    /// Each receipt named (once, in sequence order), with its status
    /// afterwards.
    ///
    /// # Errors
    /// Refused, with nothing written or sent: blank evidence, no platform,
    /// an unknown call, no receipt named, one that is not this call's or is
    /// an `accepted`, or none of them waits any more.
    #[tracing::instrument(name = "toolrunner.operator", skip_all, fields(otel.name = "toolrunner.operator redeliver", toolrunner.action = "redeliver", gen_ai.tool.call.id = call_id, toolrunner.run_id = run_id))]
    pub async fn redeliver_call(
        &self,
        run_id: &str,
        call_id: &str,
        receipt_ids: &[String],
        evidence: &Evidence,
    ) -> Result<Vec<(String, ReceiptStatus)>> {
        evidence.check()?;
        let client = self.client.as_ref().ok_or_else(|| {
            refused("redeliver needs the platform (--base-url and TOOLRUNNER_TOKEN), or a running executor, whose outbox delivers by itself")
        })?;
        self.load(run_id, call_id).await?;
        if receipt_ids.is_empty() {
            return Err(refused("name the receipts to send"));
        }
        let stored = self.store.receipts(run_id, call_id).await?;
        let mut named: Vec<OutboxReceipt> = Vec::new();
        for id in receipt_ids {
            if named.iter().any(|r| &r.receipt_id == id) {
                continue;
            }
            let r = stored
                .iter()
                .find(|r| &r.receipt_id == id)
                .ok_or_else(|| refused(format!("call {run_id}/{call_id} has no receipt {id}")))?;
            if r.kind == ReceiptKind::Accepted {
                return Err(refused(format!(
                    "receipt {id} is an accepted: only the executor's accept step sends it; start the executor instead"
                )));
            }
            named.push(r.clone());
        }
        // In the order the outbox sends them.
        named.sort_by_key(|r| r.sequence);
        if named.iter().all(|r| r.status != ReceiptStatus::Pending) {
            let now: Vec<String> = named
                .iter()
                .map(|r| format!("{} {}", r.receipt_id, r.status.as_str()))
                .collect();
            return Err(refused(format!(
                "none of these receipts waits any more ({}): nothing was sent",
                now.join(", ")
            )));
        }
        let executor_id = self.executor_id_of(run_id, call_id).await?;
        lifecycle::note(
            self.store.as_ref(),
            (run_id, call_id),
            lifecycle::OPERATOR_REDELIVERED_NOTE,
            Some(serde_json::to_string(evidence).unwrap_or_default()),
        )
        .await?;
        let mut out = Vec::new();
        let mut stopped = false;
        for r in named {
            if stopped || r.status != ReceiptStatus::Pending {
                out.push((r.receipt_id, r.status));
                continue;
            }
            let (sent, delivery) = self.send(client, &executor_id, r).await?;
            stopped = matches!(delivery, Delivery::Later | Delivery::Settled);
            out.push(sent);
        }
        Ok(out)
    }

    /// Every call with its timeline, as JSON.
    ///
    /// # Errors
    /// The store failed.
    pub async fn export(&self) -> Result<Value> {
        let mut calls = Vec::new();
        for c in self.store.calls(&CallFilter::default()).await? {
            calls.push(self.show(&c.run_id, &c.call_id).await?);
        }
        Ok(json!({"calls": calls}))
    }

    /// The executor id that claimed the call (from its attempts, or the
    /// body of a receipt for stores made before attempts were kept).
    async fn executor_id_of(&self, run_id: &str, call_id: &str) -> Result<String> {
        let attempts = self.store.attempts(run_id, call_id).await?;
        if let Some(id) = attempts.iter().rev().find_map(|a| a.executor_id.clone()) {
            return Ok(id);
        }
        for r in self.store.receipts(run_id, call_id).await? {
            if let Some(id) = serde_json::from_str::<Value>(&r.body)
                .ok()
                .and_then(|b| b["executor_id"].as_str().map(str::to_owned))
            {
                return Ok(id);
            }
        }
        Err(refused(
            "this store records no executor id for the call (no attempt, no receipt): settle it on the platform side",
        ))
    }
}

/// A call's approval requests as timeline entries: each request when it
/// was asked (`approval_requested`, with its reason), and its decision
/// (`approval_approved`, `approval_denied`, `approval_closed`) with who
/// and the note.
fn approval_events(rows: &[ApprovalRow]) -> Vec<TimelineEvent> {
    let mut out = Vec::new();
    for r in rows {
        out.push(TimelineEvent {
            at: r.asked_at,
            what: "approval_requested".to_owned(),
            detail: Some(format!("{} (digest {})", r.reason, r.digest)),
        });
        let Some(at) = r.decided_at else { continue };
        let what = match r.state {
            Stored::Approved => "approval_approved",
            Stored::Denied => "approval_denied",
            Stored::Waiting | Stored::Closed => "approval_closed",
        };
        let by = r.decided_by.as_deref().unwrap_or("-");
        let detail = match (&r.note, &r.closed_why) {
            (_, Some(why)) => format!("by {by}: {why}"),
            (Some(note), None) => format!("by {by}: {note}"),
            (None, None) => format!("by {by}"),
        };
        out.push(TimelineEvent {
            at,
            what: what.to_owned(),
            detail: Some(detail),
        });
    }
    out
}
