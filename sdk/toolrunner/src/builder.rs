//! `Executor::builder()`: settings, tools, and the checks made at `build()`.
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use toolrunner_protocol::tooldef::{self, ToolDefinition, check_version};

use crate::api::authorizer::{AllowAll, Authorizer};
use crate::api::function::{IntoTool, Registered, States};
use crate::api::handler::ErasedTool;
use crate::api::policy::{ApprovalPolicy, WithPolicies};
use crate::error::{Error, Kind, Result};
use crate::gate::Gate;
use crate::net::client::{Backoff, Client};
use crate::runner::template::Template;
use crate::runner::{Config, CrashPlan, RunningExecutor, Timing};
use crate::store::DEFAULT_LEASE_TTL;

/// How long a handler's transaction may stay open on a SQLite store by
/// default ([`ExecutorBuilder::sqlite_transaction_timeout`]).
const DEFAULT_SQLITE_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(1);

/// The longest bound of a handler's transaction on a SQLite store: the
/// store's writer waits for one such transaction at most, and gives up on
/// the write lock after 10 s; half of that is left for the settlement and
/// the writer's own transaction (`docs/protocol.md`, choice 70).
const MAX_SQLITE_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(5);

/// Refuses a bound of handlers' transactions that would starve the SQLite
/// store's writer, or that is set for another store.
fn check_sqlite_transaction_timeout(bound: Duration, store_url: &str) -> Result<()> {
    if crate::store::is_postgres(store_url) {
        return Err(Error::new(
            Kind::Builder,
            "sqlite_transaction_timeout needs a sqlite:// store: a PostgreSQL store's handler transactions hold no lock of the store's writer (leave it unset)",
        ));
    }
    if bound > MAX_SQLITE_TRANSACTION_TIMEOUT {
        return Err(Error::new(
            Kind::Builder,
            format!(
                "sqlite_transaction_timeout of {bound:?} can starve the store's writer, which gives up on the SQLite write lock after 10 s: set .sqlite_transaction_timeout(..) to at most 5 s (the default is 1 s), or use a postgres:// store for handlers that need longer transactions"
            ),
        ));
    }
    if bound < Duration::from_millis(10) {
        return Err(Error::new(
            Kind::Builder,
            "sqlite_transaction_timeout must be at least 10 ms: set .sqlite_transaction_timeout(..) between 10 ms and 5 s (the default is 1 s)",
        ));
    }
    Ok(())
}

/// Builds an [`Executor`]. Settings are checked at [`build`](Self::build).
#[must_use]
pub struct ExecutorBuilder {
    base_url: Option<String>,
    token: Option<String>,
    executor_id: Option<String>,
    binding_id: Option<String>,
    store_url: String,
    capacity: u32,
    poll_interval: Duration,
    request_timeout: Duration,
    handler_timeout: Duration,
    sqlite_transaction_timeout: Option<Duration>,
    retry_attempts: u32,
    backoff: Backoff,
    use_stream: bool,
    auto_reconcile: bool,
    reconcile_interval: Duration,
    retention: Option<Duration>,
    authorizer: Option<Arc<dyn Authorizer>>,
    tools: Vec<Registered>,
    /// Limits set by configuration, by tool name (over the tools' own).
    limits: BTreeMap<String, crate::Limits>,
    /// Each tool's own approval policy, by tool name.
    policies: HashMap<String, Arc<dyn ApprovalPolicy>>,
    states: States,
    allow_insecure_http: bool,
    crash_plan: Option<CrashPlan>,
    takeover_grace: Option<Duration>,
    lease_ttl: Option<Duration>,
    gate: Option<Arc<Gate>>,
    definitions_only: bool,
}

impl std::fmt::Debug for ExecutorBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecutorBuilder")
            .field("base_url", &self.base_url)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("executor_id", &self.executor_id)
            .field("binding_id", &self.binding_id)
            .field("store_url", &self.store_url)
            .field("capacity", &self.capacity)
            .finish_non_exhaustive()
    }
}

impl Default for ExecutorBuilder {
    fn default() -> Self {
        ExecutorBuilder {
            base_url: None,
            token: std::env::var("TOOLRUNNER_TOKEN").ok(),
            executor_id: None,
            binding_id: None,
            store_url: "sqlite://toolrunner.db".to_owned(),
            capacity: 8,
            poll_interval: Duration::from_secs(1),
            request_timeout: Duration::from_secs(10),
            handler_timeout: Duration::from_secs(300),
            sqlite_transaction_timeout: None,
            retry_attempts: 3,
            backoff: Backoff {
                initial: Duration::from_millis(100),
                max: Duration::from_secs(5),
                attempts: 6,
            },
            use_stream: true,
            auto_reconcile: true,
            reconcile_interval: Duration::from_secs(30),
            retention: Some(Duration::from_secs(7 * 24 * 3600)),
            authorizer: None,
            tools: Vec::new(),
            limits: BTreeMap::new(),
            policies: HashMap::new(),
            states: States::default(),
            allow_insecure_http: false,
            crash_plan: None,
            takeover_grace: None,
            lease_ttl: None,
            gate: None,
            definitions_only: false,
        }
    }
}

/// The environment variables [`Executor::from_env`] reads.
pub const ENV_VARS: [(&str, &str); 5] = [
    (
        "TOOLRUNNER_BASE_URL",
        "the platform, e.g. https://platform.example",
    ),
    (
        "TOOLRUNNER_TOKEN",
        "the bearer token (scopes executors:connect, tools:execute)",
    ),
    (
        "TOOLRUNNER_EXECUTOR_ID",
        "this deployment slot's executor id",
    ),
    ("TOOLRUNNER_BINDING_ID", "the executor binding it serves"),
    (
        "TOOLRUNNER_STORE_URL",
        "the store, sqlite://PATH or postgres://… (default sqlite://toolrunner.db, in the working directory)",
    ),
];

/// The command-line argument that makes an executor built
/// [`from_env`](ExecutorBuilder::from_env) print its tool definitions
/// instead of serving.
pub const PRINT_DEFINITIONS: &str = "--print-definitions";

/// The binding id in the definitions of an executor built
/// [`definitions_only`](ExecutorBuilder::definitions_only) with no binding
/// id set: `toolrunner dev up` puts the binding it creates in its place.
pub const UNBOUND: &str = "bnd_unbound";

impl ExecutorBuilder {
    /// A builder with the settings of the environment (see [`ENV_VARS`]);
    /// what is not set there can still be set on the builder. When the
    /// program was started with `--print-definitions` among its
    /// arguments, the builder is [`definitions_only`](Self::definitions_only):
    /// [`Executor::serve`] prints the tool definitions and returns, so
    /// `cargo run -- --print-definitions > tools.json` needs no platform.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let defaults = ExecutorBuilder::default();
        ExecutorBuilder {
            base_url: var("TOOLRUNNER_BASE_URL"),
            token: var("TOOLRUNNER_TOKEN"),
            executor_id: var("TOOLRUNNER_EXECUTOR_ID"),
            binding_id: var("TOOLRUNNER_BINDING_ID"),
            store_url: var("TOOLRUNNER_STORE_URL").unwrap_or(defaults.store_url.clone()),
            definitions_only: std::env::args_os().any(|a| a == PRINT_DEFINITIONS),
            ..defaults
        }
    }

    /// Builds an executor that only tells its tool definitions: `build()`
    /// needs no platform settings (no base URL, token, executor id; the
    /// binding id is [`UNBOUND`] unless one is set), checks the tools as
    /// always, and [`Executor::serve`] prints `{"tools": [...]}` on
    /// standard output and returns without connecting
    /// ([`Executor::tool_definitions`] reads them too).
    /// [`from_env`](Self::from_env) turns it on for `--print-definitions`.
    pub fn definitions_only(mut self) -> Self {
        self.definitions_only = true;
        self
    }

    /// Allows a plain `http://` base URL to a host other than this machine.
    /// Without it such a URL is refused at [`build`](Self::build): the token
    /// and every grant would cross the network in clear.
    pub fn allow_insecure_http(mut self) -> Self {
        self.allow_insecure_http = true;
        self
    }

    /// The platform, e.g. `http://127.0.0.1:8700` (paths go under `/v1`).
    pub fn base_url(mut self, url: impl Into<String>) -> Self {
        self.base_url = Some(url.into());
        self
    }

    /// The bearer token (default: `TOOLRUNNER_TOKEN`). Needs the scopes
    /// `executors:connect` and `tools:execute`. Never logged.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// The executor id: 1–128 of `[A-Za-z0-9_.:-]`, stable across restarts
    /// of the same deployment slot and never shared by two live processes.
    pub fn executor_id(mut self, id: impl Into<String>) -> Self {
        self.executor_id = Some(id.into());
        self
    }

    /// The executor binding this executor serves.
    pub fn binding_id(mut self, id: impl Into<String>) -> Self {
        self.binding_id = Some(id.into());
        self
    }

    /// The store, `sqlite://PATH` (default `sqlite://toolrunner.db`), or
    /// with the `postgres` feature a `postgres://` URL (the store is then
    /// `toolrunner::store::PgStore`).
    pub fn store_url(mut self, url: impl Into<String>) -> Self {
        self.store_url = url.into();
        self
    }

    /// Adopts the executor identities of this executor's binding that share
    /// its PostgreSQL database and whose lease lapsed longer than `grace`
    /// ago (a replica that is gone, or cut off from the database): an
    /// executor of this process connects as that identity, takes no new
    /// calls, recovers its calls by the crash table, delivers its outbox,
    /// runs its reconciliation, and lets the identity go once nothing is
    /// left. A process of the adopted identity that starts again takes it
    /// back at once. Default: never. Needs a `postgres://` store (the
    /// `postgres` feature); refused at [`build`](Self::build) otherwise.
    /// A lease lapses [`lease_ttl`](Self::lease_ttl) after its last
    /// renewal, and the grace counts from there; choose it above a
    /// restart's length, so that a restart is not taken for a death.
    pub fn takeover_grace(mut self, grace: Duration) -> Self {
        self.takeover_grace = Some(grace);
        self
    }

    /// How long this executor's hold on its identity lasts after each
    /// renewal, on a `postgres://` store shared by replicas (default 3 s;
    /// renewed four times within it, on a database connection of its
    /// own). A process that could not renew for that long takes no work
    /// until it renews again, and a replica may adopt its identity once
    /// the lease lapsed longer than its takeover grace. A start of an
    /// identity whose earlier process crashed waits at most this long.
    /// Refused at [`build`](Self::build) without a `postgres://` store.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = Some(ttl);
        self
    }

    /// Most calls claimed or running at once (default 8).
    pub fn capacity(mut self, n: u32) -> Self {
        self.capacity = n;
        self
    }

    /// How often to poll `pending` when the stream is quiet (default 1 s).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }

    /// Timeout of one HTTP request (default 10 s).
    pub fn request_timeout(mut self, d: Duration) -> Self {
        self.request_timeout = d;
        self
    }

    /// How long a handler may run before its outcome counts as unknown
    /// (default 300 s).
    pub fn handler_timeout(mut self, d: Duration) -> Self {
        self.handler_timeout = d;
        self
    }

    /// How long a handler's transaction
    /// ([`CallContext::transaction`](crate::CallContext::transaction)) may
    /// stay open on a SQLite store, from its first closure to the call's
    /// settlement (default 1 s, at most 5 s). It holds the store's write
    /// lock meanwhile, so every write of the executor, and of an
    /// operator's tool, waits for it: at the bound it is rolled back, and
    /// the call fails `transaction_rolled_back` (a write tool's goes to
    /// reconciliation: its other effects may have happened). The
    /// executor's writer waits for one handler's transaction at most; it
    /// gives up on the lock after 10 s, hence the 5 s ceiling. Above 2 s
    /// the health probe (a write that must come back within 2 s) may find
    /// the store not writable while such a transaction is open. Refused
    /// at [`build`](Self::build) without a SQLite store (a PostgreSQL
    /// store's handler transactions hold no lock of the store's writer).
    pub fn sqlite_transaction_timeout(mut self, d: Duration) -> Self {
        self.sqlite_transaction_timeout = Some(d);
        self
    }

    /// Handler attempts for [`ToolError::Retry`](crate::ToolError::Retry)
    /// (default 3).
    pub fn retry_attempts(mut self, n: u32) -> Self {
        self.retry_attempts = n;
        self
    }

    /// Backoff for transient failures: first wait, longest wait, attempts per
    /// request (defaults 100 ms, 5 s, 6).
    pub fn backoff(mut self, initial: Duration, max: Duration, attempts: u32) -> Self {
        self.backoff = Backoff {
            initial,
            max,
            attempts,
        };
        self
    }

    /// Whether to open the WebSocket stream (default on; polling always runs).
    pub fn stream(mut self, on: bool) -> Self {
        self.use_stream = on;
        self
    }

    /// Whether to run the tools' `reconcile` hooks for calls whose outcome
    /// is unknown (default on). Off, every ambiguity waits for a human.
    pub fn auto_reconcile(mut self, on: bool) -> Self {
        self.auto_reconcile = on;
        self
    }

    /// First wait before an automatic check is repeated (default 30 s,
    /// doubling per call up to an hour).
    pub fn reconcile_interval(mut self, d: Duration) -> Self {
        self.reconcile_interval = d;
        self
    }

    /// How long the store keeps a call settled for good (delivered,
    /// abandoned, released, rejected, orphaned, compensated) with its
    /// receipts, attempts and timeline; default 7 days. `None` keeps
    /// everything. A call waiting for reconciliation, a receipt still to
    /// send or a state still to report is never pruned. Approval requests
    /// are kept as long once acted on (decided and what that made of the
    /// call saved), closed, or expired undecided; a decision not yet acted
    /// on is never pruned. Pruning runs at the start and then every 30 s,
    /// in small batches, so it never holds the store's writer for long.
    pub fn retention(mut self, keep: Option<Duration>) -> Self {
        self.retention = keep;
        self
    }

    /// The product's authorization, asked for every call before it runs.
    pub fn authorizer(mut self, a: impl Authorizer) -> Self {
        self.authorizer = Some(Arc::new(a));
        self
    }

    /// Allows every call without asking the product (development only).
    pub fn allow_all(self) -> Self {
        self.authorizer(AllowAll)
    }

    /// Fail points of this executor alone (tests and simulations): after
    /// each durable step `plan` is asked with the step's name, and `true`
    /// stops this executor there as a lost process would (nothing more is
    /// written or sent). Steps: `after_operation_key_saved`,
    /// `after_claim_answer`, `after_assignment_saved`,
    /// `after_accepted_saved`, `after_accepted_confirmed`, `after_handler`,
    /// `after_final_saved`, and for a call that waits for a person
    /// `after_approval_stored` (its request stored, the claim not yet
    /// given back) and `after_approval_released_saved` (given back in the
    /// store, `released` not yet sent).
    #[cfg(any(feature = "failpoints", feature = "testing"))]
    pub fn crash_plan(mut self, plan: impl Fn(&str) -> bool + Send + Sync + 'static) -> Self {
        self.crash_plan = Some(Arc::new(plan));
        self
    }

    /// Faults of this executor's process, for tests and simulations
    /// ([`ProcessFaults`](crate::testing::ProcessFaults)): frozen as by
    /// SIGSTOP, its store or its platform unreachable. Replicas it adopts
    /// share them (they run in the same process).
    #[cfg(feature = "testing")]
    pub fn process_faults(mut self, faults: &crate::gate::ProcessFaults) -> Self {
        self.gate = Some(faults.gate());
        self
    }

    /// Registers a tool: a function marked `#[toolrunner::tool]`, a
    /// [`tool::write`](crate::tool::write) / [`tool::read`](crate::tool::read),
    /// or a [`Tool`](crate::Tool) implementation.
    pub fn tool(mut self, tool: impl IntoTool) -> Self {
        self.tools.push(tool.into_tool());
        self
    }

    /// Sets the flow-control limits of the tool named `tool` from
    /// configuration: each limit set here takes the place of the one the
    /// tool sets in code ([`Tool::limits`](crate::Tool::limits),
    /// `#[toolrunner::tool(concurrency = 4)]`); a limit not set here stays
    /// the tool's. Called again for the same tool, the later call wins.
    ///
    /// ```
    /// use toolrunner::{Executor, Limits};
    ///
    /// let builder = Executor::builder().limit("payments.charge", Limits::none().concurrency(4));
    /// # let _ = builder;
    /// ```
    ///
    /// A tool name that no registered tool has, or a limit of zero, is
    /// refused at [`build`](Self::build).
    pub fn limit(mut self, tool: impl Into<String>, limits: crate::Limits) -> Self {
        self.limits.insert(tool.into(), limits);
        self
    }

    /// The approval policy of the tool named `tool`: which of its calls
    /// need a person's yes (an amount over a threshold), asked after the
    /// [`authorizer`](Self::authorizer) (a call it refuses is not asked;
    /// one it sends to a person is, and a refusal of the policy refuses
    /// it). Called again for the same tool, the later call wins. See
    /// [`ApprovalPolicy`].
    ///
    /// A tool name that no registered tool has is refused at
    /// [`build`](Self::build).
    pub fn approval_policy(mut self, tool: impl Into<String>, policy: impl ApprovalPolicy) -> Self {
        self.policies.insert(tool.into(), Arc::new(policy));
        self
    }

    /// Shared state that handlers and hooks take as `State<T>` (one value
    /// per type; cloned for every call, so wrap large things in an `Arc`).
    pub fn state<T: Clone + Send + Sync + 'static>(mut self, value: T) -> Self {
        self.states.insert(value);
        self
    }

    /// Checks every setting and every tool definition.
    ///
    /// # Errors
    /// A missing base URL, token, executor id, binding id or authorizer; an
    /// invalid executor id; capacity 0; no tools; duplicate tool names; a
    /// tool whose schemas fail the protocol's tool-definition checks; a
    /// [`sqlite_transaction_timeout`](Self::sqlite_transaction_timeout)
    /// above 5 s (it could starve the store's writer) or below 10 ms, or
    /// set for a `postgres://` store; a [`limit`](Self::limit) for a tool
    /// not registered, or a limit of zero; an
    /// [`approval_policy`](Self::approval_policy) for a tool not
    /// registered. A
    /// `postgres://` store URL without the `postgres` feature is
    /// [`is_missing_feature`](Error::is_missing_feature).
    pub fn build(mut self) -> Result<Executor> {
        if self.definitions_only {
            // Placeholders where nothing will be reached: the executor
            // refuses to start (Executor::start).
            self.base_url = Some("http://127.0.0.1:9".to_owned());
            self.token.get_or_insert_with(|| "unused".to_owned());
            self.executor_id = Some("definitions-only".to_owned());
            self.binding_id.get_or_insert_with(|| UNBOUND.to_owned());
            self.authorizer.get_or_insert_with(|| Arc::new(AllowAll));
        }
        let missing = |what: &str, var: &str| {
            Error::new(
                Kind::Builder,
                format!("missing {what}: call .{what}(..) on the builder or set {var}"),
            )
        };
        let base_url = self
            .base_url
            .clone()
            .ok_or_else(|| missing("base_url", "TOOLRUNNER_BASE_URL"))?;
        check_base_url(&base_url, self.allow_insecure_http)?;
        let token = self
            .token
            .clone()
            .ok_or_else(|| missing("token", "TOOLRUNNER_TOKEN"))?;
        let executor_id = self
            .executor_id
            .clone()
            .ok_or_else(|| missing("executor_id", "TOOLRUNNER_EXECUTOR_ID"))?;
        let binding_id = self
            .binding_id
            .clone()
            .ok_or_else(|| missing("binding_id", "TOOLRUNNER_BINDING_ID"))?;
        let authorizer = self
            .authorizer
            .clone()
            .ok_or_else(|| {
                Error::new(
                    Kind::Builder,
                    "missing authorizer: call .authorizer(..) with the product's own checks (or .allow_all() in development)",
                )
            })?;
        let valid_id = (1..=128).contains(&executor_id.len())
            && executor_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
        if !valid_id {
            return Err(Error::new(
                Kind::Builder,
                "executor_id must be 1-128 characters of [A-Za-z0-9_.:-]",
            ));
        }
        if self.capacity == 0 {
            return Err(Error::new(Kind::Builder, "capacity must be at least 1"));
        }
        // Said at build(), not at start(): the build lacks what the URL asks.
        #[cfg(not(feature = "postgres"))]
        if crate::store::is_postgres(&self.store_url) {
            return Err(crate::error::missing_feature(
                "a postgres:// store",
                "postgres",
            ));
        }
        if self.takeover_grace.is_some() && !crate::store::is_postgres(&self.store_url) {
            return Err(Error::new(
                Kind::Builder,
                "takeover_grace needs a postgres:// store: replicas adopt each other's identities through their shared database",
            ));
        }
        if self.lease_ttl.is_some() && !crate::store::is_postgres(&self.store_url) {
            return Err(Error::new(
                Kind::Builder,
                "lease_ttl needs a postgres:// store: a SQLite store is held by its file lock, not by a lease",
            ));
        }
        if self
            .lease_ttl
            .is_some_and(|t| t < Duration::from_millis(100))
        {
            return Err(Error::new(
                Kind::Builder,
                "lease_ttl must be at least 100 ms (it is renewed four times within it)",
            ));
        }
        if let Some(bound) = self.sqlite_transaction_timeout {
            check_sqlite_transaction_timeout(bound, &self.store_url)?;
        }
        if self.tools.is_empty() {
            return Err(Error::new(
                Kind::Builder,
                "register at least one tool with .tool(...)",
            ));
        }
        for t in &self.tools {
            if let Some(need) = t.needs().iter().find(|n| !self.states.has(n)) {
                return Err(Error::new(
                    Kind::Builder,
                    format!(
                        "tool {} takes State<{}>: give it with .state(..) on the builder",
                        t.name(),
                        need.name
                    ),
                ));
            }
        }
        let states = Arc::new(self.states);
        let bound: Vec<Arc<dyn ErasedTool>> =
            self.tools.into_iter().map(|t| t.bind(&states)).collect();
        let mut tools = BTreeMap::new();
        for t in &bound {
            if tools.insert(t.name().to_owned(), t.clone()).is_some() {
                return Err(Error::new(
                    Kind::Builder,
                    format!("tool {} is registered twice", t.name()),
                ));
            }
        }
        let limits = tool_limits(&tools, std::mem::take(&mut self.limits))?;
        registered(&tools, self.policies.keys(), "approval policy")?;
        let authorizer: Arc<dyn Authorizer> = if self.policies.is_empty() {
            authorizer
        } else {
            Arc::new(WithPolicies {
                authorizer,
                policies: std::mem::take(&mut self.policies),
            })
        };
        let definitions = match check_version(&definitions(&bound, &binding_id), None) {
            Ok(checked) => checked.tools,
            Err(problems) => {
                let said = crate::api::handler::definition_problems(&bound, &problems);
                return Err(Error::new(Kind::Builder, said));
            }
        };
        let definitions_only = self.definitions_only;
        let client = Client::new(&base_url, &token, self.request_timeout, self.backoff)
            .map_err(|e| Error::new(Kind::Builder, format!("cannot build the HTTP client: {e}")))?
            .with_gate(self.gate.clone());
        Ok(Executor {
            template: Template {
                cfg: Config {
                    executor_id,
                    binding_id,
                    capacity: self.capacity,
                    instance_id: format!("ins_{}", uuid::Uuid::new_v4().simple()),
                    timing: Timing {
                        poll_interval: self.poll_interval,
                        handler_timeout: self.handler_timeout,
                        sqlite_transaction_timeout: self
                            .sqlite_transaction_timeout
                            .unwrap_or(DEFAULT_SQLITE_TRANSACTION_TIMEOUT),
                        retry_attempts: self.retry_attempts.max(1),
                        reconcile_interval: self.reconcile_interval,
                        retention: self.retention,
                    },
                    use_stream: self.use_stream,
                    auto_reconcile: self.auto_reconcile,
                    adopted: false,
                    lease_ttl: self.lease_ttl.unwrap_or(DEFAULT_LEASE_TTL),
                },
                client,
                store_url: self.store_url,
                tools: Arc::new(tools),
                flow: Arc::new(crate::runner::flow::Flow::new(&limits)),
                authorizer,
                definitions,
                crash_plan: self.crash_plan,
                takeover_grace: self.takeover_grace,
                gate: self.gate,
                health: Arc::default(),
            },
            definitions_only,
        })
    }
}

/// Refuses a setting (`what`) for a tool name in `names` that no tool
/// registered has, naming the tools that are.
fn registered<'a>(
    tools: &BTreeMap<String, Arc<dyn ErasedTool>>,
    mut names: impl Iterator<Item = &'a String>,
    what: &str,
) -> Result<()> {
    match names.find(|name| !tools.contains_key(*name)) {
        None => Ok(()),
        Some(unknown) => {
            let known: Vec<&str> = tools.keys().map(String::as_str).collect();
            Err(Error::new(
                Kind::Builder,
                format!(
                    "{what} set for tool {unknown:?}, which is not registered: name one of {}",
                    known.join(", ")
                ),
            ))
        }
    }
}

/// Each tool's limits: its own, with configuration's over them; refused
/// when configuration names a tool not registered, or a limit is zero.
fn tool_limits(
    tools: &BTreeMap<String, Arc<dyn ErasedTool>>,
    mut configured: BTreeMap<String, crate::Limits>,
) -> Result<BTreeMap<String, crate::Limits>> {
    registered(tools, configured.keys(), "limit")?;
    let mut limits = BTreeMap::new();
    for (name, tool) in tools {
        let own = tool.limits();
        let set = match configured.remove(name) {
            Some(over) => own.overridden_by(over),
            None => own,
        };
        if let Some(why) = set
            .problem()
            .map(str::to_owned)
            .or_else(|| key_problem(tool.as_ref(), set))
        {
            return Err(Error::new(Kind::Builder, format!("tool {name}: {why}")));
        }
        limits.insert(name.clone(), set);
    }
    Ok(limits)
}

/// What is wrong with a tool's per-key limit and key function, said as
/// what to do instead.
fn key_problem(tool: &dyn ErasedTool, limits: crate::Limits) -> Option<String> {
    let reads = tool.key_reads();
    match (limits.max_per_key(), reads) {
        (None, _) => None,
        (Some(_), None) => Some(
            "a per-key limit needs a key function to compute each call's key from its arguments: give it with FnTool::concurrency_key(n, |args: &Args| …), or drop the per-key limit".to_owned(),
        ),
        (Some(_), Some(reads)) if reads != tool.type_names().0 => Some(format!(
            "the concurrency key's function reads {reads}, but the tool's arguments are {}: make it take &{}",
            tool.type_names().0,
            tool.type_names().0
        )),
        (Some(_), Some(_)) => {
            let schema = tool.input_schema();
            let properties = schema["properties"].as_object().map_or(0, |p| p.len());
            (properties == 0).then(|| {
                "the tool takes no arguments, so every call would have the same concurrency key: drop concurrency_key and set a concurrency limit instead".to_owned()
            })
        }
    }
}

/// A base URL must be `http(s)://HOST…`, and plain `http` only to this
/// machine unless explicitly allowed.
fn check_base_url(url: &str, allow_insecure_http: bool) -> Result<()> {
    let bad = |why: &str| Error::new(Kind::Builder, format!("base_url {url:?} {why}"));
    let (scheme, rest) = url
        .split_once("://")
        .ok_or_else(|| bad("is not a URL: write it as https://HOST[:PORT]"))?;
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.rsplit_once(':') {
        Some((h, port)) if !h.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => h,
        _ => authority,
    };
    if host.is_empty() {
        return Err(bad("names no host"));
    }
    crate::net::platform::check_base_url_path(url).map_err(|m| Error::new(Kind::Builder, m))?;
    match scheme {
        "https" => Ok(()),
        "http" if allow_insecure_http || crate::net::tls::is_loopback(host) => Ok(()),
        "http" => Err(bad(
            "is plain http to another machine: the token and every grant would cross the network in clear; use https, or call .allow_insecure_http() if the network is private",
        )),
        _ => Err(bad("must start with https:// (or http:// to this machine)")),
    }
}

fn definitions(tools: &[Arc<dyn ErasedTool>], binding_id: &str) -> Value {
    let list: Vec<Value> = tools
        .iter()
        .map(|t| {
            json!({
                "name": t.name(), "description": t.description(), "binding_id": binding_id,
                "input_schema": t.input_schema(), "output_schema": t.output_schema(),
                "max_result_context_bytes": tooldef::DEFAULT_RESULT_CONTEXT_BYTES,
            })
        })
        .collect();
    Value::Array(list)
}

/// An executor, built and checked, not yet connected.
///
/// # Examples
///
/// ```rust,no_run
/// use toolrunner::{CallContext, Executor, ToolError};
///
/// /// No input.
/// #[toolrunner::schema]
/// #[derive(serde::Deserialize)]
/// struct Empty {}
///
/// /// The time.
/// #[toolrunner::schema]
/// #[derive(serde::Serialize)]
/// struct Now { unix: u64 }
///
/// /// Tells the time.
/// #[toolrunner::tool(name = "clock.now", effect = read)]
/// async fn now(_ctx: CallContext, _input: Empty) -> Result<Now, ToolError> {
///     let unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
///     Ok(Now { unix })
/// }
///
/// # async fn demo() -> toolrunner::Result<()> {
/// let executor = Executor::builder()
///     .base_url("https://platform.example")
///     .token("…")
///     .executor_id("clock-01")
///     .binding_id("bnd_…")
///     .allow_all() // your own Authorizer in production
///     .tool(now)
///     .build()?;
/// executor.serve(toolrunner::shutdown_signal()).await
/// # }
/// ```
#[must_use = "an executor does nothing until it is started: call .serve(signal) or .start()"]
pub struct Executor {
    template: Template,
    definitions_only: bool,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = &self.template;
        f.debug_struct("Executor")
            .field("executor_id", &t.cfg.executor_id)
            .field("binding_id", &t.cfg.binding_id)
            .field("tools", &t.tools.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Executor {
    /// A builder.
    pub fn builder() -> ExecutorBuilder {
        ExecutorBuilder::default()
    }

    /// A builder with the settings of the environment (see [`ENV_VARS`]).
    pub fn from_env() -> ExecutorBuilder {
        ExecutorBuilder::from_env()
    }

    /// Starts, serves until `shutdown` completes (for example
    /// [`shutdown_signal`](crate::shutdown_signal)), then drains for up to
    /// 30 seconds and disconnects.
    ///
    /// # Errors
    /// The executor could not start, or stopped by itself (refused
    /// credentials, another process took its executor id): the error says
    /// which and what to do.
    pub async fn serve(self, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        if self.definitions_only {
            let text = serde_json::to_string_pretty(&json!({ "tools": self.tool_definitions() }))
                .map_err(|e| {
                Error::new(Kind::Builder, format!("cannot print the definitions: {e}"))
            })?;
            // Written, not printed: a closed pipe (`| head`) is an error.
            use std::io::Write;
            return writeln!(std::io::stdout().lock(), "{text}").map_err(|e| {
                Error::new(Kind::Builder, format!("cannot print the definitions: {e}"))
            });
        }
        let running = self.start().await?;
        tokio::select! {
            stopped = running.wait() => {
                let _ = running.shutdown(crate::Shutdown::Drain { deadline: Duration::from_secs(5) }).await;
                stopped
            }
            () = shutdown => {
                running.shutdown(crate::Shutdown::Drain { deadline: Duration::from_secs(30) }).await
            }
        }
    }

    /// The tool definitions to publish in an agent version (`tools` array):
    /// names, descriptions, the binding, schemas generated from the types.
    pub fn tool_definitions(&self) -> &[ToolDefinition] {
        &self.template.definitions
    }

    /// A handle on the executor's health (connected, store writable,
    /// lease, capacity, outbox, draining, and a ready verdict), to take
    /// before [`start`](Self::start) or [`serve`](Self::serve) consumes the
    /// executor. Clone it freely; the feature `admin` serves it over HTTP
    /// (`toolrunner::admin::router`).
    pub fn health(&self) -> crate::Health {
        crate::Health {
            state: self.template.health.clone(),
        }
    }

    /// The random id of this process start, sent with every connect.
    pub fn instance_id(&self) -> &str {
        &self.template.cfg.instance_id
    }

    /// Opens the store, connects, resumes what the store and the platform
    /// still hold, and starts claiming.
    ///
    /// # Errors
    /// The store cannot be opened, or the platform refuses the connect.
    pub async fn start(self) -> Result<RunningExecutor> {
        self.refuse_definitions_only()?;
        self.template.start().await
    }

    /// An executor built only to tell its definitions never connects.
    fn refuse_definitions_only(&self) -> Result<()> {
        if self.definitions_only {
            return Err(Error::new(
                Kind::Builder,
                "this executor was built only to print its tool definitions (--print-definitions, or .definitions_only()): it does not start; build it without that to serve",
            ));
        }
        Ok(())
    }

    /// Like [`start`](Self::start) with a store of the testing seam
    /// ([`testing::store`](crate::testing::store)). No lock is taken: never
    /// let two executor processes drive one store (for a
    /// [`SqliteStore`](crate::testing::store::SqliteStore), hold
    /// [`SqliteStore::lock`](crate::testing::store::SqliteStore::lock) for
    /// as long as the executor runs).
    ///
    /// # Errors
    /// The platform refuses the connect.
    #[cfg(feature = "testing")]
    pub async fn start_with_store(
        self,
        store: Arc<dyn crate::store::Store>,
    ) -> Result<RunningExecutor> {
        self.refuse_definitions_only()?;
        self.template.start_with_store(store).await
    }
}
