//! The crash table of protocol §6, row by row: a fail point stops the call at
//! one durable step, the executor is dropped (a lost process), and a second
//! executor with the same store and executor id must do what the table's
//! "on restart" column says.
//!
//! The fail-point registry is global, so every test holds a
//! `fail::FailScenario` for its whole length (that serializes them) and runs
//! its own Tokio runtime inside it.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use toolrunner::testing::store::{
    CallFilter, LocalCall, LocalState, OutboxReceipt, ReceiptStatus, SqliteStore, Store,
};
use toolrunner::{
    ApprovalState, Approvals, AuthorizationRequest, Authorizer, CallContext, Denied, Effect,
    Executor, Limits, Reconciled, RunningExecutor, Tool, ToolError, async_trait,
};
use toolrunner_devserver::DevServer;

const ADMIN: &str = "dev-admin";
const EXEC_TOKEN: &str = "dev-executor";
const EXECUTOR_ID: &str = "crash-exec-01";

/// The executor id of the store at `store_url`: on PostgreSQL, where leases
/// of executor identities are shared by the whole database, one of its own
/// per store (`crash-exec-` and the schema's suffix), so that no test's
/// executor follows another's as the same identity.
fn executor_id_of(store_url: &str) -> String {
    match store_url.rsplit_once("search_path%3Dcrash_") {
        Some((_, suffix)) => format!("crash-exec-{suffix}"),
        None => EXECUTOR_ID.to_owned(),
    }
}

/// On PostgreSQL, an executor identity's lease (a crashed executor's lapses
/// this long after its last renewal, and its restart waits that long).
const PG_LEASE: Duration = Duration::from_millis(500);

/// The tools' commit window (after a restart on PostgreSQL, a `reconcile`
/// hook waits two leases and this).
const COMMIT_WINDOW: Duration = Duration::from_millis(1_000);
const WRITE_TOOL: &str = "crash.write";
const READ_TOOL: &str = "crash.read";
/// Long enough for a task to go from the observed durable step to its fail
/// point (no I/O lies in between).
const GRACE: Duration = Duration::from_millis(250);
const LIMIT: Duration = Duration::from_secs(15);

// ------------------------------------------------------------------ tools

/// `crash.*` arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct Input {
    /// Any amount.
    amount: u64,
}

/// `crash.*` result.
#[derive(Debug, Serialize, schemars::JsonSchema)]
struct Output {
    /// How many times a handler of this log has run so far.
    invocation: usize,
}

/// One handler invocation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Invocation {
    tool: String,
    call_id: String,
    operation_key: String,
    amount: u64,
}

/// Every handler invocation of the executors sharing it.
#[derive(Debug, Clone, Default)]
struct Log(Arc<Mutex<Vec<Invocation>>>, Arc<Mutex<Vec<String>>>);

impl Log {
    /// The operation keys the `reconcile` hook was asked about.
    fn checks(&self) -> Vec<String> {
        self.1.lock().expect("not poisoned").clone()
    }

    fn all(&self) -> Vec<Invocation> {
        self.0.lock().expect("not poisoned").clone()
    }

    fn len(&self) -> usize {
        self.0.lock().expect("not poisoned").len()
    }
}

struct Recorder {
    name: &'static str,
    effect: Effect,
    log: Log,
    /// With a delay, `reconcile` looks the key up in the log (after that
    /// delay); without, it cannot tell.
    hook: Option<Duration>,
}

#[async_trait]
impl Tool for Recorder {
    type Input = Input;
    type Output = Output;

    fn name(&self) -> &str {
        self.name
    }

    fn description(&self) -> &str {
        "Records every invocation (the side effect under test)"
    }

    fn effect(&self) -> Effect {
        self.effect
    }

    fn commit_window(&self) -> Duration {
        COMMIT_WINDOW
    }

    async fn call(&self, ctx: &CallContext, input: Input) -> Result<Output, ToolError> {
        let mut log = self.log.0.lock().expect("not poisoned");
        log.push(Invocation {
            tool: self.name.to_owned(),
            call_id: ctx.call_id().to_owned(),
            operation_key: ctx.operation_key().to_owned(),
            amount: input.amount,
        });
        Ok(Output {
            invocation: log.len(),
        })
    }

    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Output> {
        let Some(delay) = self.hook else {
            return Reconciled::Unknown;
        };
        self.log
            .1
            .lock()
            .expect("not poisoned")
            .push(ctx.operation_key().to_owned());
        tokio::time::sleep(delay).await;
        let found = self
            .log
            .all()
            .iter()
            .position(|i| i.operation_key == ctx.operation_key());
        match found {
            Some(n) => Reconciled::Happened(Output { invocation: n + 1 }),
            None => Reconciled::DidNotHappen,
        }
    }
}

// --------------------------------------------------------------- harness

/// With `--features postgres`, every store of these tests is a schema of
/// its own in the PostgreSQL database at this URL instead of a SQLite file
/// (`TOOLRUNNER_CRASH_PG_URL=postgres://… cargo test --features postgres
/// --test crash`).
const PG_URL_VAR: &str = "TOOLRUNNER_CRASH_PG_URL";

fn pg_url() -> Option<String> {
    std::env::var(PG_URL_VAR).ok().filter(|u| !u.is_empty())
}

/// The schemas this test created, dropped when it ends.
static SCHEMAS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A new, empty store: a file in `dir`, or a schema of its own.
async fn fresh_store(dir: &std::path::Path) -> String {
    match pg_url() {
        Some(pg) => pg_schema(&pg).await,
        None => format!("sqlite://{}", dir.join("exec.db").display()),
    }
}

#[cfg(feature = "postgres")]
async fn pg_schema(pg: &str) -> String {
    let schema = format!("crash_{:08x}", rand::random::<u32>());
    toolrunner::testing::store::PgStore::connect_in_schema(pg, &schema)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {PG_URL_VAR} answers: {e}"));
    SCHEMAS.lock().expect("lock").push(schema.clone());
    let sep = if pg.contains('?') { '&' } else { '?' };
    format!("{pg}{sep}options=-c%20search_path%3D{schema}")
}

#[cfg(not(feature = "postgres"))]
async fn pg_schema(pg: &str) -> String {
    panic!("{PG_URL_VAR} is set ({pg}) but the `postgres` feature is off: add --features postgres")
}

/// Opens a store by its URL, beside the executor.
async fn open_store(url: &str) -> Arc<dyn Store> {
    #[cfg(feature = "postgres")]
    if url.starts_with("postgres") {
        return Arc::new(
            toolrunner::testing::store::PgStore::connect(url)
                .await
                .expect("the store opens for inspection"),
        );
    }
    Arc::new(
        SqliteStore::open(url)
            .await
            .expect("the store opens for inspection"),
    )
}

/// Drops the schemas the test created.
async fn drop_schemas() {
    let schemas = std::mem::take(&mut *SCHEMAS.lock().expect("lock"));
    #[cfg(feature = "postgres")]
    if let Some(pg) = pg_url() {
        use sqlx::Connection;
        let mut conn = sqlx::PgConnection::connect(&pg).await.expect("PostgreSQL");
        for schema in schemas {
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS {schema} CASCADE"
            )))
            .execute(&mut conn)
            .await
            .expect("schema dropped");
            // And the lease of the identity that used it (this test's own).
            let id = executor_id_of(&format!("search_path%3D{schema}"));
            let _ =
                sqlx::query("DELETE FROM toolrunner_leases.executor_leases WHERE executor_id = $1")
                    .bind(id)
                    .execute(&mut conn)
                    .await;
        }
    }
    #[cfg(not(feature = "postgres"))]
    drop(schemas);
}

/// Runs `body` on a fresh multi-threaded runtime while holding the
/// fail-point scenario (which also clears every fail point before and after).
fn with_failpoints<F: Future<Output = ()>>(body: F) {
    let scenario = fail::FailScenario::setup();
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(async {
            body.await;
            drop_schemas().await;
        });
    scenario.teardown();
}

/// Polls `probe` every 25 ms until it yields a value.
async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let started = Instant::now();
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

struct Platform {
    server: DevServer,
    http: toolrunner::platform::Platform,
}

impl Platform {
    /// A platform on a file database in `dir` (the in-memory one loses its
    /// tables when a request is abandoned mid-write, as dropping an
    /// executor does).
    async fn start(dir: &std::path::Path, lease: Option<(u64, u64)>) -> Platform {
        let mut builder = DevServer::builder()
            .listen("127.0.0.1:0".parse().expect("addr"))
            .db_path(dir.join("platform.db"));
        if let Some((ttl, heartbeat)) = lease {
            builder = builder.lease_ttl_ms(ttl).heartbeat_interval_ms(heartbeat);
        }
        let server = builder.start().await.expect("devserver starts");
        let http = toolrunner::platform::Platform::new(&server.base_url(), ADMIN)
            .expect("platform client");
        Platform { server, http }
    }

    async fn send(&self, req: toolrunner::platform::RawRequest) -> Value {
        let resp = req.send().await.expect("platform answers");
        let body = resp.json();
        assert!(
            (200..300).contains(&resp.status),
            "platform answered {}: {body}",
            resp.status
        );
        body
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        self.send(
            self.http
                .request(toolrunner::platform::Method::POST, path)
                .json(&body),
        )
        .await
    }

    async fn get(&self, path: &str) -> Value {
        self.send(self.http.request(toolrunner::platform::Method::GET, path))
            .await
    }
}

/// One platform, one agent version with both tools, one run of one call.
struct Row {
    platform: Platform,
    binding_id: String,
    run_id: String,
    call_id: String,
    store_url: String,
    _dir: tempfile::TempDir,
    /// The handler invocations of every executor started with [`Row::start`].
    log: Log,
    local: Option<Arc<dyn Store>>,
}

struct Options {
    store_url: String,
    log: Log,
    poll: Duration,
    stream: bool,
    /// Another way to the platform (a proxy).
    base_url: Option<String>,
    /// The `reconcile` hook's delay; `None`: the hook cannot tell.
    hook: Option<Duration>,
    /// Every call needs a person's approval ([`NeedsAPerson`]).
    approval: bool,
}

impl Options {
    fn new(store_url: &str, log: &Log) -> Options {
        Options {
            store_url: store_url.to_owned(),
            log: log.clone(),
            poll: Duration::from_millis(100),
            stream: true,
            base_url: None,
            hook: None,
            approval: false,
        }
    }
}

/// Every call needs a person's yes, for a minute.
struct NeedsAPerson;

#[async_trait]
impl Authorizer for NeedsAPerson {
    async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
        Err(Denied::needs_approval(
            "a person checks every call",
            Duration::from_secs(60),
        ))
    }
}

fn build_executor(executor_id: &str, binding_id: &str, base_url: &str, o: &Options) -> Executor {
    let mut builder = Executor::builder();
    if o.store_url.starts_with("postgres") {
        builder = builder.lease_ttl(PG_LEASE);
    }
    builder = builder
        .base_url(o.base_url.as_deref().unwrap_or(base_url))
        .token(EXEC_TOKEN)
        .executor_id(executor_id)
        .binding_id(binding_id)
        .store_url(o.store_url.clone())
        .capacity(4)
        .poll_interval(o.poll)
        .stream(o.stream)
        .request_timeout(Duration::from_secs(5))
        .backoff(Duration::from_millis(50), Duration::from_millis(500), 6)
        .reconcile_interval(Duration::from_millis(200));
    builder = if o.approval {
        builder.authorizer(NeedsAPerson)
    } else {
        builder.allow_all()
    };
    builder
        // Every row runs with limits on: a crash must give back no slot or
        // token twice and keep none, and the calls recovery resumes take
        // theirs whatever the count.
        .limit(WRITE_TOOL, Limits::none().concurrency(1).rate(20))
        .limit(READ_TOOL, Limits::none().concurrency(2).rate(20))
        .tool(Recorder {
            name: WRITE_TOOL,
            effect: Effect::Write,
            log: o.log.clone(),
            hook: o.hook,
        })
        .tool(Recorder {
            name: READ_TOOL,
            effect: Effect::Read,
            log: o.log.clone(),
            hook: o.hook,
        })
        .build()
        .expect("executor builds")
}

impl Row {
    async fn new(tool: &str, lease: Option<(u64, u64)>) -> Row {
        let dir = tempfile::tempdir().expect("tempdir");
        let platform = Platform::start(dir.path(), lease).await;
        let agent = platform
            .post("/agents", json!({"name": "crash-table"}))
            .await;
        let agent_id = agent["agent_id"].as_str().expect("agent_id").to_owned();
        let binding = platform
            .post(
                "/executor-bindings",
                json!({"agent_id": agent_id, "name": "crash",
                       "tool_names": [WRITE_TOOL, READ_TOOL]}),
            )
            .await;
        let binding_id = binding["binding_id"]
            .as_str()
            .expect("binding_id")
            .to_owned();
        let store_url = fresh_store(dir.path()).await;
        let definitions = build_executor(
            &executor_id_of(&store_url),
            &binding_id,
            &platform.server.base_url(),
            &Options::new(&store_url, &Log::default()),
        )
        .tool_definitions()
        .to_vec();
        let version = platform
            .post(
                &format!("/agents/{agent_id}/versions"),
                json!({"tools": definitions}),
            )
            .await;
        let run = platform
            .post(
                "/runs",
                json!({"agent_version": version["agent_version"], "subject": "user_42",
                       "tool_calls": [{"tool_name": tool, "arguments": {"amount": 1200}}]}),
            )
            .await;
        let run_id = run["run_id"].as_str().expect("run_id").to_owned();
        let call_id = run["tool_calls"][0]["call_id"]
            .as_str()
            .expect("call_id")
            .to_owned();
        Row {
            platform,
            binding_id,
            run_id,
            call_id,
            store_url,
            _dir: dir,
            log: Log::default(),
            local: None,
        }
    }

    /// Starts an executor on the row's store, recording into the row's log.
    async fn start(&mut self) -> RunningExecutor {
        let o = Options::new(&self.store_url, &self.log);
        self.start_custom(&o).await
    }

    /// Starts an executor on the row's store with settings of its own.
    async fn start_custom(&mut self, o: &Options) -> RunningExecutor {
        let running = self.start_with(o).await;
        if self.local.is_none() {
            self.local = Some(open_store(&self.store_url).await);
        }
        running
    }

    async fn start_with(&self, o: &Options) -> RunningExecutor {
        // The row's identity, whichever store it starts on.
        let id = executor_id_of(&self.store_url);
        build_executor(&id, &self.binding_id, &self.platform.server.base_url(), o)
            .start()
            .await
            .expect("executor starts")
    }

    fn store(&self) -> &dyn Store {
        self.local.as_deref().expect("an executor was started")
    }

    async fn local_call(&self) -> Option<LocalCall> {
        self.store()
            .call(&self.run_id, &self.call_id)
            .await
            .expect("store readable")
    }

    async fn local_receipts(&self) -> Vec<OutboxReceipt> {
        self.store()
            .receipts(&self.run_id, &self.call_id)
            .await
            .expect("store readable")
    }

    /// Waits until the local call is in `state`.
    async fn wait_local(&self, state: LocalState) -> LocalCall {
        eventually(
            &format!("local state {}", state.as_str()),
            LIMIT,
            || async { self.local_call().await.filter(|c| c.state == state) },
        )
        .await
    }

    /// The run's one call as the platform shows it.
    async fn platform_call(&self) -> Value {
        let run = self.platform.get(&format!("/runs/{}", self.run_id)).await;
        run["tool_calls"][0].clone()
    }

    async fn wait_platform(&self, state: &str) -> Value {
        eventually(&format!("platform state {state}"), LIMIT, || async {
            let c = self.platform_call().await;
            (c["state"] == state).then_some(c)
        })
        .await
    }
}

fn receipts_of_kind<'a>(call: &'a Value, kind: &str) -> Vec<&'a Value> {
    call["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .filter(|r| r["kind"] == kind)
        .collect()
}

fn receipt_kinds(call: &Value) -> Vec<String> {
    call["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .map(|r| r["kind"].as_str().unwrap_or("?").to_owned())
        .collect()
}

fn local_of_kind<'a>(receipts: &'a [OutboxReceipt], kind: &str) -> Vec<&'a OutboxReceipt> {
    receipts
        .iter()
        .filter(|r| r.kind.as_str() == kind)
        .collect()
}

/// The common end of every row that completes: the platform holds exactly
/// one `accepted` and one `completed` receipt, each the very receipt (id and
/// body) of the local outbox, all of one assignment; the local call is
/// `delivered`; the platform never stored a late receipt.
async fn assert_completed_once(row: &Row) -> Value {
    let call = row.wait_platform("completed").await;
    let local = row.wait_local(LocalState::Delivered).await;
    assert_eq!(
        receipt_kinds(&call),
        ["accepted", "completed"],
        "platform receipts: {call}"
    );
    assert_eq!(call["late_receipts"], json!([]), "{call}");
    let asg = local
        .assignment
        .as_ref()
        .expect("assignment")
        .assignment_id
        .clone();
    assert_eq!(call["assignment_id"], asg.as_str());
    let outbox = row.local_receipts().await;
    for stored in call["receipts"].as_array().expect("receipts") {
        assert_eq!(stored["body"]["assignment_id"], asg.as_str(), "{stored}");
        let id = stored["receipt_id"].as_str().expect("receipt_id");
        let mine = outbox
            .iter()
            .find(|r| r.receipt_id == id)
            .unwrap_or_else(|| panic!("platform receipt {id} is not in the local outbox"));
        assert_eq!(mine.status, ReceiptStatus::Delivered, "{mine:?}");
        let body: Value = serde_json::from_str(&mine.body).expect("outbox body is JSON");
        assert_eq!(
            stored["body"], body,
            "stored body differs from the outbox body"
        );
    }
    call
}

// ---------------------------------------------------------------- proxy

#[path = "../examples/support/proxy.rs"]
mod proxy;

/// A proxy in front of the platform that holds the answer to every
/// `calls/report` for `delay` *after* the platform has processed it: a
/// report whose answer is slow to come back (as after a retried, dropped
/// answer). Everything else passes straight through. No WebSocket:
/// executors behind it run with the stream off.
async fn slow_report_proxy(upstream: String, delay: Duration) -> String {
    proxy::start(&upstream, move |_, path, _| {
        if path.ends_with("/calls/report") {
            proxy::Verdict::ForwardThenWait(delay)
        } else {
            proxy::Verdict::Forward
        }
    })
    .await
}

// ------------------------------------------------------------------- rows

/// Row "operation key saved, claim not answered" (here: not even sent) →
/// claim again with the same key; the call completes; the handler ran once,
/// with the key stored before the crash.
#[test]
fn after_operation_key_saved_claims_again_with_the_same_key() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_operation_key_saved", "return").unwrap();
        let first = row.start().await;
        let saved = row.wait_local(LocalState::Claiming).await;
        tokio::time::sleep(GRACE).await;
        assert_eq!(
            row.platform_call().await["state"],
            "pending",
            "the claim must not have been sent"
        );
        drop(first);
        fail::remove("after_operation_key_saved");

        let second = row.start().await;
        assert_completed_once(&row).await;
        let local = row.local_call().await.expect("known");
        assert_eq!(local.operation_key, saved.operation_key);
        let log = row.log.all();
        assert_eq!(log.len(), 1, "handler invocations: {log:?}");
        assert_eq!(log[0].operation_key, saved.operation_key);
        assert_eq!(log[0].call_id, row.call_id);
        assert_eq!(log[0].amount, 1200);
        drop(second);
    });
}

/// Row "operation key saved, claim answered, assignment not saved" → the
/// same key gets `replayed: true`: the platform keeps the one assignment of
/// the first claim; completes; the handler ran once.
#[test]
fn after_claim_answer_replays_the_claim() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_claim_answer", "return").unwrap();
        let first = row.start().await;
        let claimed = row.wait_platform("claimed").await;
        let first_asg = claimed["assignment_id"]
            .as_str()
            .expect("assignment_id")
            .to_owned();
        tokio::time::sleep(GRACE).await;
        let saved = row.local_call().await.expect("operation key saved");
        assert_eq!(saved.state, LocalState::Claiming);
        assert!(
            saved.assignment.is_none(),
            "the fail point sits before the assignment is saved"
        );
        drop(first);
        fail::remove("after_claim_answer");

        let second = row.start().await;
        let call = assert_completed_once(&row).await;
        assert_eq!(
            call["assignment_id"], first_asg,
            "a replayed claim returns the first assignment; a new one means the key changed"
        );
        let local = row.local_call().await.expect("known");
        assert_eq!(local.operation_key, saved.operation_key);
        let log = row.log.all();
        assert_eq!(log.len(), 1, "handler invocations: {log:?}");
        assert_eq!(log[0].operation_key, saved.operation_key);
        drop(second);
    });
}

/// Row "assignment saved, `accepted` not confirmed" (crash right after the
/// first assignment is saved) → a first assignment is checked before it is
/// saved and saved with its `accepted`, in one commit: the crash finds
/// both, nothing sent. On restart that `accepted` is sent; exactly one
/// `accepted` on the platform, the local one; the handler ran once.
#[test]
fn after_assignment_saved_accepts_on_restart() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_assignment_saved", "return").unwrap();
        let first = row.start().await;
        let saved = row.wait_local(LocalState::Assigned).await;
        tokio::time::sleep(GRACE).await;
        let with_it = row.local_receipts().await;
        let kinds: Vec<_> = with_it
            .iter()
            .map(|r| (r.kind.as_str(), r.status))
            .collect();
        assert_eq!(
            kinds,
            vec![("accepted", ReceiptStatus::Pending)],
            "the assignment and its accepted are saved together"
        );
        let before = row.platform_call().await;
        assert_eq!(before["state"], "claimed");
        assert_eq!(receipt_kinds(&before), Vec::<String>::new());
        drop(first);
        fail::remove("after_assignment_saved");

        let second = row.start().await;
        let call = assert_completed_once(&row).await;
        let asg = saved.assignment.expect("assignment saved").assignment_id;
        assert_eq!(call["assignment_id"], asg.as_str());
        let accepted = receipts_of_kind(&call, "accepted");
        let local = row.local_receipts().await;
        let local_accepted = local_of_kind(&local, "accepted");
        assert_eq!(local_accepted.len(), 1, "{local:?}");
        assert_eq!(
            accepted[0]["receipt_id"],
            local_accepted[0].receipt_id.as_str()
        );
        assert_eq!(row.log.len(), 1, "{:?}", row.log.all());
        assert_eq!(row.log.all()[0].operation_key, saved.operation_key);
        drop(second);
    });
}

/// Row "assignment saved, `accepted` not confirmed" (crash right after the
/// `accepted` receipt is saved, before it is sent) → the saved receipt is
/// sent with the same `receipt_id` and body; the handler ran once.
#[test]
fn after_accepted_saved_resends_the_saved_accepted() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_accepted_saved", "return").unwrap();
        let first = row.start().await;
        let saved = eventually("a saved accepted receipt", LIMIT, || async {
            local_of_kind(&row.local_receipts().await, "accepted")
                .first()
                .map(|r| (*r).clone())
        })
        .await;
        tokio::time::sleep(GRACE).await;
        assert_eq!(saved.status, ReceiptStatus::Pending);
        assert_eq!(
            row.local_call().await.expect("known").state,
            LocalState::Assigned
        );
        let before = row.platform_call().await;
        assert_eq!(
            before["state"], "claimed",
            "accepted must not have been sent"
        );
        drop(first);
        fail::remove("after_accepted_saved");

        let second = row.start().await;
        let call = assert_completed_once(&row).await;
        let accepted = receipts_of_kind(&call, "accepted");
        assert_eq!(accepted[0]["receipt_id"], saved.receipt_id.as_str());
        let body: Value = serde_json::from_str(&saved.body).expect("JSON");
        assert_eq!(accepted[0]["body"], body);
        assert_eq!(
            local_of_kind(&row.local_receipts().await, "accepted").len(),
            1,
            "no second accepted receipt may be made"
        );
        assert_eq!(row.log.len(), 1, "{:?}", row.log.all());
        drop(second);
    });
}

/// Row "`accepted` confirmed" with the handler not started yet (local state
/// still `assigned`) → the saved `accepted` is replayed, answered
/// `accepted: true` again, and the handler runs once.
#[test]
fn after_accepted_confirmed_replays_accepted_and_runs_once() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_accepted_confirmed", "return").unwrap();
        let first = row.start().await;
        let running = row.wait_platform("running").await;
        tokio::time::sleep(GRACE).await;
        assert_eq!(row.log.len(), 0, "the handler must not have started");
        let local = row.local_call().await.expect("known");
        assert_eq!(local.state, LocalState::Assigned);
        let saved = row.local_receipts().await;
        let saved_accepted = local_of_kind(&saved, "accepted")[0].clone();
        assert_eq!(
            receipts_of_kind(&running, "accepted")[0]["receipt_id"],
            saved_accepted.receipt_id.as_str()
        );
        drop(first);
        fail::remove("after_accepted_confirmed");

        let second = row.start().await;
        let call = assert_completed_once(&row).await;
        assert_eq!(
            receipts_of_kind(&call, "accepted")[0]["receipt_id"],
            saved_accepted.receipt_id.as_str()
        );
        assert_eq!(row.log.len(), 1, "{:?}", row.log.all());
        assert_eq!(row.log.all()[0].operation_key, local.operation_key);
        drop(second);
    });
}

/// Row "`accepted` confirmed, no final receipt saved", write tool: the side
/// effect happened and its outcome is unknown → not run again; the call is
/// `reconciliation_required` locally and on the platform.
#[test]
fn after_handler_write_tool_goes_to_reconciliation() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_handler", "return").unwrap();
        let first = row.start().await;
        eventually("the handler ran", LIMIT, || async {
            (row.log.len() == 1).then_some(())
        })
        .await;
        tokio::time::sleep(GRACE).await;
        assert_eq!(
            row.local_call().await.expect("known").state,
            LocalState::Running
        );
        assert!(
            row.local_receipts()
                .await
                .iter()
                .all(|r| !r.kind.is_final()),
            "no final receipt may be saved"
        );
        drop(first);
        fail::remove("after_handler");

        let second = row.start().await;
        let call = row.wait_platform("reconciliation_required").await;
        // The platform holds it; the store records the report's answer
        // just after (the platform's state may be read in between).
        eventually("the report recorded as answered", LIMIT, || async {
            row.local_call()
                .await
                .filter(|c| c.state == LocalState::ReconciliationRequired && c.report.is_none())
        })
        .await;
        // Give a wrong re-run every chance to show up.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            row.log.len(),
            1,
            "a write handler ran again: {:?}",
            row.log.all()
        );
        let after = row.platform_call().await;
        assert_eq!(after["state"], "reconciliation_required");
        assert_eq!(receipt_kinds(&after), ["accepted"], "{after}");
        assert_eq!(after["receipts"], call["receipts"]);
        assert_eq!(
            row.local_call().await.expect("known").state,
            LocalState::ReconciliationRequired
        );
        drop(second);
    });
}

/// Row "`accepted` confirmed, no final receipt saved", read tool → run
/// again (same assignment and key); the call completes.
#[test]
fn after_handler_read_tool_runs_again() {
    with_failpoints(async {
        let mut row = Row::new(READ_TOOL, None).await;
        fail::cfg("after_handler", "return").unwrap();
        let first = row.start().await;
        eventually("the handler ran", LIMIT, || async {
            (row.log.len() == 1).then_some(())
        })
        .await;
        tokio::time::sleep(GRACE).await;
        let before = row.local_call().await.expect("known");
        assert_eq!(before.state, LocalState::Running);
        drop(first);
        fail::remove("after_handler");

        let second = row.start().await;
        let call = assert_completed_once(&row).await;
        let log = row.log.all();
        assert_eq!(log.len(), 2, "the read tool runs again once: {log:?}");
        assert!(
            log.iter()
                .all(|i| i.tool == READ_TOOL && i.operation_key == before.operation_key)
        );
        assert_eq!(
            call["assignment_id"],
            before
                .assignment
                .expect("assignment")
                .assignment_id
                .as_str()
        );
        drop(second);
    });
}

/// Row "final receipt saved, not delivered" → delivered on restart with
/// the same `receipt_id` and body; the handler ran once.
#[test]
fn after_final_saved_delivers_the_saved_receipt() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_final_saved", "return").unwrap();
        let first = row.start().await;
        row.wait_local(LocalState::Settled).await;
        tokio::time::sleep(GRACE).await;
        let outbox = row.local_receipts().await;
        let saved = local_of_kind(&outbox, "completed")[0].clone();
        assert_eq!(saved.status, ReceiptStatus::Pending);
        let before = row.platform_call().await;
        assert_eq!(before["state"], "running");
        assert_eq!(receipt_kinds(&before), ["accepted"]);
        drop(first);
        fail::remove("after_final_saved");

        let second = row.start().await;
        let call = assert_completed_once(&row).await;
        let completed = receipts_of_kind(&call, "completed")[0];
        assert_eq!(completed["receipt_id"], saved.receipt_id.as_str());
        let body: Value = serde_json::from_str(&saved.body).expect("JSON");
        assert_eq!(completed["body"], body);
        assert_eq!(row.log.len(), 1, "{:?}", row.log.all());
        drop(second);
    });
}

/// Row "final receipt delivered" → nothing: no request changes the
/// platform's call, the handler is not called again.
#[test]
fn delivered_call_is_left_alone() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        let first = row.start().await;
        let done = assert_completed_once(&row).await;
        drop(first);
        let outbox = row.local_receipts().await;

        let second = row.start().await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            row.platform_call().await,
            done,
            "the platform's call changed"
        );
        assert_eq!(row.log.len(), 1, "{:?}", row.log.all());
        assert_eq!(
            row.local_call().await.expect("known").state,
            LocalState::Delivered
        );
        assert_eq!(row.local_receipts().await, outbox, "the outbox changed");
        drop(second);
    });
}

/// A claim that expired while the process was down: the platform released
/// the assignment (the call is `pending` again, the old grant is refused).
/// On restart the executor claims again with the same key and gets a new
/// assignment; nothing of the old assignment reaches the platform.
#[test]
fn expired_claim_is_claimed_again_with_a_new_assignment() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, Some((300, 100))).await;
        fail::cfg("after_assignment_saved", "return").unwrap();
        let first = row.start().await;
        let saved = row.wait_local(LocalState::Assigned).await;
        tokio::time::sleep(GRACE).await;
        drop(first);
        fail::remove("after_assignment_saved");
        let old = saved.assignment.clone().expect("assignment");

        // The lease expires; the claimed call returns to pending.
        let pending = row.wait_platform("pending").await;
        assert_eq!(pending["assignment_id"], Value::Null);
        assert_eq!(receipt_kinds(&pending), Vec::<String>::new());
        // The old grant no longer works (probe with a receipt of our own
        // that would be valid for a live assignment).
        let probe = row
            .platform
            .http
            .with_token(EXEC_TOKEN)
            .request(
                toolrunner::platform::Method::POST,
                &format!("/runs/{}/tool-calls/{}/receipts", row.run_id, row.call_id),
            )
            .header("Tool-Grant", old.grant.expose())
            .json(
                &json!({"receipt_id": "rcp_probe_old_grant", "executor_id": executor_id_of(&row.store_url),
                          "assignment_id": old.assignment_id, "sequence": 0,
                          "kind": "accepted"}),
            )
            .send()
            .await
            .expect("answer");
        assert_eq!(probe.status, 403, "the released grant must be refused");

        let second = row.start().await;
        let call = assert_completed_once(&row).await;
        let new_asg = call["assignment_id"]
            .as_str()
            .expect("assignment")
            .to_owned();
        assert_ne!(
            new_asg, old.assignment_id,
            "a released assignment is never returned"
        );
        for r in call["receipts"].as_array().expect("receipts") {
            assert_eq!(r["body"]["assignment_id"], new_asg.as_str(), "{r}");
        }
        let local = row.local_call().await.expect("known");
        assert_eq!(
            local.operation_key, saved.operation_key,
            "the claim is made again with the saved key"
        );
        let outbox = row.local_receipts().await;
        let old_receipts: Vec<&OutboxReceipt> = outbox
            .iter()
            .filter(|r| r.assignment_id == old.assignment_id)
            .collect();
        for r in &old_receipts {
            assert_eq!(r.status, ReceiptStatus::Superseded, "{r:?}");
            assert_eq!(r.kind.as_str(), "accepted", "{r:?}");
        }
        println!(
            "old assignment's receipts in the outbox: {:?}",
            old_receipts
                .iter()
                .map(|r| (
                    r.kind.as_str(),
                    r.status.as_str(),
                    r.attempts,
                    r.last_error.clone()
                ))
                .collect::<Vec<_>>()
        );
        let log = row.log.all();
        assert_eq!(log.len(), 1, "{log:?}");
        assert_eq!(log[0].operation_key, saved.operation_key);
        drop(second);
    });
}

/// `outstanding` lists a `claimed` call the (new, empty) store does not
/// know → never executed, reported `released`: the call is `pending` again.
/// (The second executor polls only once an hour and has no stream, so any
/// handler run could only come from recovery.) A later normal executor then
/// claims it afresh: new key, new assignment, the old one never used.
#[test]
fn outstanding_claim_unknown_to_the_store_is_released() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_assignment_saved", "return").unwrap();
        let a = row.start().await;
        let saved = row.wait_local(LocalState::Assigned).await;
        tokio::time::sleep(GRACE).await;
        drop(a);
        fail::remove("after_assignment_saved");
        let old = saved.assignment.expect("assignment").assignment_id;
        assert_eq!(row.platform_call().await["state"], "claimed");

        let dir_b = tempfile::tempdir().expect("tempdir");
        let store_b = fresh_store(dir_b.path()).await;
        let log_b = Log::default();
        let b = row
            .start_with(&Options {
                poll: Duration::from_secs(3600),
                stream: false,
                ..Options::new(&store_b, &log_b)
            })
            .await;
        let pending = row.wait_platform("pending").await;
        assert_eq!(pending["assignment_id"], Value::Null);
        let inspect_b = open_store(&store_b).await;
        let known = eventually("B records the call released", LIMIT, || async {
            inspect_b
                .call(&row.run_id, &row.call_id)
                .await
                .expect("readable")
                .filter(|c| c.state == LocalState::Released && c.report.is_none())
        })
        .await;
        assert!(known.assignment.is_none(), "{known:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            log_b.len(),
            0,
            "B executed a call it did not know: {:?}",
            log_b.all()
        );
        assert_eq!(row.log.len(), 0, "A never got to the handler");
        assert_eq!(row.platform_call().await["state"], "pending");
        drop(b);

        // A normal executor on store B claims the pending call afresh.
        let b2 = row.start_with(&Options::new(&store_b, &log_b)).await;
        let call = row.wait_platform("completed").await;
        assert_ne!(call["assignment_id"], old.as_str());
        for r in call["receipts"].as_array().expect("receipts") {
            assert_ne!(r["body"]["assignment_id"], old.as_str(), "{r}");
        }
        let log = log_b.all();
        assert_eq!(log.len(), 1, "{log:?}");
        assert_ne!(log[0].operation_key, saved.operation_key);
        assert_eq!(row.log.len(), 0);
        drop(b2);
    });
}

/// `outstanding` lists a `running` call the (new, empty) store does not
/// know → never executed, reported `reconciliation_required`.
#[test]
fn outstanding_running_call_unknown_to_the_store_is_reported_and_never_filed() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_accepted_confirmed", "return").unwrap();
        let a = row.start().await;
        row.wait_platform("running").await;
        tokio::time::sleep(GRACE).await;
        drop(a);
        fail::remove("after_accepted_confirmed");

        let dir_b = tempfile::tempdir().expect("tempdir");
        let store_b = fresh_store(dir_b.path()).await;
        let log_b = Log::default();
        let b = row.start_with(&Options::new(&store_b, &log_b)).await;
        let call = row.wait_platform("reconciliation_required").await;
        assert_eq!(receipt_kinds(&call), ["accepted"]);
        let inspect_b = open_store(&store_b).await;
        // Reported, and kept as nothing this store ran or can act on (it
        // holds no assignment of the call): never a call waiting for a
        // person here.
        let known = eventually("B records the call as not its own", LIMIT, || async {
            inspect_b
                .call(&row.run_id, &row.call_id)
                .await
                .expect("readable")
                .filter(|c| c.state == LocalState::Abandoned && c.report.is_none())
        })
        .await;
        assert_eq!(known.reason.as_deref(), Some("unknown_to_executor"));
        assert!(known.assignment.is_none());
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(log_b.len(), 0, "{:?}", log_b.all());
        assert_eq!(row.log.len(), 0);
        assert_eq!(
            inspect_b
                .calls(&CallFilter::default())
                .await
                .expect("readable")
                .len(),
            1
        );
        drop(b);
    });
}

/// Row "`accepted` confirmed" with the handler not started (local state
/// still `assigned`), while another store of the same executor id (a lost
/// store's replacement, a twin on another database) connected meanwhile and
/// reported the call it does not know `reconciliation_required`
/// (`unknown_to_executor`). The saved `accepted`, replayed on restart, is
/// answered `accepted: false` with `replayed: true` and the call
/// `reconciliation_required`: the platform confirmed it once and waits for
/// a final receipt under this assignment, which only this store can send.
/// The call is resumed as the crash table's "`accepted` confirmed" row says
/// (never settled `abandoned`, which left the platform holding it for ever:
/// simulation seed 205). Returns the platform's call once `tool`'s call
/// settled here, and the handler invocations of both stores.
async fn reported_by_another_store_then_restarted(tool: &str) -> (Row, Value, Log) {
    let mut row = Row::new(tool, None).await;
    fail::cfg("after_accepted_confirmed", "return").unwrap();
    let a = row.start().await;
    row.wait_platform("running").await;
    tokio::time::sleep(GRACE).await;
    assert_eq!(
        row.local_call().await.expect("known").state,
        LocalState::Assigned
    );
    drop(a);
    fail::remove("after_accepted_confirmed");

    // Another store of the identity reports the call it does not know.
    let dir_b = tempfile::tempdir().expect("tempdir");
    let store_b = fresh_store(dir_b.path()).await;
    let log_b = Log::default();
    let b = row.start_with(&Options::new(&store_b, &log_b)).await;
    row.wait_platform("reconciliation_required").await;
    let inspect_b = open_store(&store_b).await;
    eventually("B's report answered", LIMIT, || async {
        inspect_b
            .call(&row.run_id, &row.call_id)
            .await
            .expect("readable")
            .filter(|c| c.state == LocalState::Abandoned && c.report.is_none())
    })
    .await;
    drop(b);

    // The store that holds the call starts again; its hook can look.
    let o = Options {
        hook: Some(Duration::from_millis(10)),
        ..Options::new(&row.store_url, &row.log)
    };
    let again = row.start_custom(&o).await;
    let local = eventually("the call settled here", LIMIT, || async {
        row.local_call().await.filter(|c| {
            matches!(
                c.state,
                LocalState::Delivered | LocalState::Abandoned | LocalState::Released
            )
        })
    })
    .await;
    let timeline: Vec<String> = row
        .store()
        .events(&row.run_id, &row.call_id)
        .await
        .expect("readable")
        .into_iter()
        .map(|e| format!("{} {:?}", e.what(), e.detail()))
        .collect();
    let call = row.platform_call().await;
    assert_eq!(
        local.state,
        LocalState::Delivered,
        "reason {:?}, platform {call}, timeline {timeline:#?}",
        local.reason,
    );
    let outbox = row.local_receipts().await;
    assert!(
        outbox.iter().all(|r| r.status == ReceiptStatus::Delivered),
        "{outbox:#?}"
    );
    drop(again);
    (row, call, log_b)
}

/// A write tool's call: `reconciliation_required` here, and its hook
/// (which finds nothing done) settles it `failed` / `not_performed`; the
/// handler never runs.
#[test]
fn after_accepted_confirmed_reported_by_another_store_is_settled_here() {
    with_failpoints(async {
        let (row, call, log_b) = reported_by_another_store_then_restarted(WRITE_TOOL).await;
        assert_eq!(call["state"], "failed", "{call}");
        assert_eq!(receipt_kinds(&call), ["accepted", "failed"], "{call}");
        let failed = receipts_of_kind(&call, "failed")[0];
        assert_eq!(failed["body"]["error"]["code"], "not_performed", "{call}");
        assert_eq!(row.log.checks().len(), 1, "the hook was asked once");
        assert_eq!(row.log.len(), 0, "{:?}", row.log.all());
        assert_eq!(log_b.len(), 0, "{:?}", log_b.all());
    });
}

/// A read tool's call runs again here (under its assignment, same key) and
/// completes; its hook is never asked.
#[test]
fn after_accepted_confirmed_reported_by_another_store_read_tool_runs_here() {
    with_failpoints(async {
        let (row, call, log_b) = reported_by_another_store_then_restarted(READ_TOOL).await;
        assert_eq!(call["state"], "completed", "{call}");
        assert_eq!(receipt_kinds(&call), ["accepted", "completed"], "{call}");
        assert_eq!(row.log.checks().len(), 0, "the hook was asked");
        assert_eq!(row.log.len(), 1, "{:?}", row.log.all());
        assert_eq!(log_b.len(), 0, "{:?}", log_b.all());
    });
}

/// Row "`accepted` confirmed, no final receipt saved", write tool whose
/// `reconcile` hook can look the operation key up → the automatic check
/// settles the call `completed` once: one hook call, one final receipt,
/// local state `delivered`. The `calls/report` of the
/// `reconciliation_required` state is answered late (a proxy holds the
/// answer 2 s; the hook takes 1.5 s), so the report's answer arrives after
/// the check settled and delivered the call, as it does when a report's
/// answer is dropped and retried.
#[test]
fn after_handler_write_tool_with_reconcile_hook_settles_once() {
    with_failpoints(async {
        let mut row = Row::new(WRITE_TOOL, None).await;
        fail::cfg("after_handler", "return").unwrap();
        let first = row.start().await;
        eventually("the handler ran", LIMIT, || async {
            (row.log.len() == 1).then_some(())
        })
        .await;
        tokio::time::sleep(GRACE).await;
        assert_eq!(
            row.local_call().await.expect("known").state,
            LocalState::Running
        );
        drop(first);
        fail::remove("after_handler");

        let proxy = slow_report_proxy(row.platform.server.base_url(), Duration::from_secs(2)).await;
        let o = Options {
            stream: false,
            base_url: Some(proxy),
            hook: Some(Duration::from_millis(1500)),
            ..Options::new(&row.store_url, &row.log)
        };
        let second = row.start_custom(&o).await;
        let call = row.wait_platform("completed").await;
        // Watch for a while: the late report answer arrives ~2 s after it
        // was sent, a second check would take another 1.5 s.
        let watch = Instant::now();
        while watch.elapsed() < Duration::from_secs(6) {
            let local = row.local_call().await.expect("known");
            if local.state == LocalState::Rejected {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let local = row.local_call().await.expect("known");
        let outbox = row.local_receipts().await;
        let summary: Vec<String> = outbox
            .iter()
            .map(|r| {
                format!(
                    "{} {} {:?}",
                    r.kind.as_str(),
                    r.status.as_str(),
                    r.last_error
                )
            })
            .collect();
        let timeline: Vec<String> = row
            .store()
            .events(&row.run_id, &row.call_id)
            .await
            .expect("readable")
            .into_iter()
            .map(|e| format!("{} {} {:?}", e.at(), e.what(), e.detail()))
            .collect();
        let context = format!(
            "local state {} (reason {:?}); outbox {summary:#?}; timeline {timeline:#?}",
            local.state.as_str(),
            local.reason
        );
        assert_eq!(row.log.len(), 1, "the write handler ran again; {context}");
        assert_eq!(
            row.log.checks().len(),
            1,
            "the hook was asked again about a call it had settled; {context}"
        );
        assert_eq!(local.state, LocalState::Delivered, "{context}");
        assert_eq!(
            local_of_kind(&outbox, "completed").len(),
            1,
            "a second final receipt was made; {context}"
        );
        assert!(
            outbox.iter().all(|r| r.status == ReceiptStatus::Delivered),
            "{context}"
        );
        let after = row.platform_call().await;
        assert_eq!(after["state"], "completed");
        assert_eq!(after["receipts"], call["receipts"]);
        assert_eq!(receipt_kinds(&after), ["accepted", "completed"]);
        drop(second);
    });
}

// ------------------------------------------------- transactional handlers

#[path = "transactional/mod.rs"]
mod transactional;

/// A transactional handler's business row and its final receipt are both
/// stored or both absent at every step the process stops at; after the
/// restart each call completed once, never in reconciliation.
#[test]
fn transactional_handler_business_row_and_receipt_are_both_or_neither_at_every_step() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let open = || async { Ok(open_store(&url).await) };
        transactional::both_or_neither_at_every_step(&url, open)
            .await
            .expect("both or neither");
    });
}

/// An error after a transactional handler's write rolls it back and fails
/// the call; its neighbours complete with their rows.
#[test]
fn transactional_handler_error_rolls_its_write_back() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::an_error_rolls_the_business_write_back(&url, store)
            .await
            .expect("rolled back");
    });
}

/// A transactional handler that reported progress first completes once.
#[test]
fn transactional_handler_with_progress_first_completes_once() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::progress_before_the_transaction_completes_once(&url, store)
            .await
            .expect("completes once");
    });
}

/// A transactional call stopped inside its handler whose run was cancelled
/// while the process was down is not run again by the restart.
#[test]
fn transactional_handler_is_not_run_again_after_its_run_was_cancelled() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let open = || async { Ok(open_store(&url).await) };
        transactional::a_run_cancelled_while_down_is_not_run_again(&url, open)
            .await
            .expect("not run again");
    });
}

/// A handler whose context outlives it harms no call.
#[test]
fn transactional_handler_kept_transaction_is_harmless() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        transactional::a_kept_transaction_is_harmless(&url)
            .await
            .expect("harmless");
    });
}

/// A transaction's closure cut off half-way is rolled back, never
/// committed with a `completed`.
#[test]
fn transactional_handler_interrupted_transaction_is_rolled_back() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        transactional::an_interrupted_transaction_is_rolled_back(&url)
            .await
            .expect("rolled back");
    });
}

/// A nested `ctx.transaction` is refused at once.
#[test]
fn transactional_handler_nested_transaction_is_refused_at_once() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        transactional::a_nested_transaction_is_refused_at_once(&url)
            .await
            .expect("refused");
    });
}

/// A closure still running in a kept task when the handler returns is cut
/// off; the call settles and the writer never stalls.
#[test]
fn transactional_handler_closure_still_running_is_cut_off() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        transactional::a_closure_still_running_when_the_handler_returns_is_cut_off(&url)
            .await
            .expect("cut off");
    });
}

/// An executor stopped while a kept task is inside a call's transaction
/// closure leaves no transaction open: the next executor on the store
/// works at once.
#[test]
fn transactional_executor_stopped_mid_transaction_holds_nothing() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        transactional::an_executor_stopped_mid_transaction_holds_nothing(&url)
            .await
            .expect("nothing held");
    });
}

/// A closure that fails leaves none of its writes, even when the handler
/// swallows its error and completes.
#[test]
fn transactional_closure_that_fails_leaves_none_of_its_writes() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_closure_that_fails_leaves_none_of_its_writes(&url, store)
            .await
            .expect("none of its writes");
    });
}

/// A closure that commits the call's transaction itself and then panics or
/// stays past the transaction's bound makes the call's outcome unknown.
#[test]
fn transactional_closure_that_ends_the_transaction_and_stops_is_an_unknown_outcome() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_closure_that_ends_the_transaction_and_stops_is_an_unknown_outcome(
            &url, store,
        )
        .await
        .expect("unknown outcome");
    });
}

/// A handler's temporary table named as a store table takes none of the
/// settlement's writes.
#[test]
fn transactional_temporary_table_takes_none_of_the_store_s_writes() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_temporary_table_takes_none_of_the_store_s_writes(&url, store)
            .await
            .expect("the store's own writes");
    });
}

/// A closure that commits or rolls back the call's transaction itself makes
/// the call's outcome unknown; nothing is settled on its connection.
#[test]
fn transactional_closure_that_ends_the_transaction_is_an_unknown_outcome() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_closure_that_ends_the_transaction_is_an_unknown_outcome(&url, store)
            .await
            .expect("unknown outcome");
    });
}

/// A transaction held open past the SQLite bound is rolled back and fails
/// its call; the store takes writes all along.
#[test]
fn transactional_transaction_held_open_is_cut_off_and_the_store_stays_writable() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_transaction_held_open_is_cut_off_and_the_store_stays_writable(&url, store)
            .await
            .expect("cut off");
    });
}

/// A paused transactional call whose run ended unseen is not run again.
#[test]
fn transactional_resumed_call_whose_run_ended_unseen_is_not_run_again() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_resumed_call_whose_run_ended_unseen_is_not_run_again(&url, store)
            .await
            .expect("not run again");
    });
}

/// A transactional call whose `accepted` was confirmed as its process was
/// lost, reported `reconciliation_required` by another store of the
/// executor id meanwhile, runs here once on restart and completes with one
/// order row (simulation seed 205).
#[test]
fn transactional_call_reported_by_another_store_runs_here() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let other_dir = tempfile::tempdir().expect("temp dir");
        let other = fresh_store(other_dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_call_reported_by_another_store_runs_here(&url, &other, store)
            .await
            .expect("run here once");
    });
}

/// A paused transactional call whose run the platform forgot settles
/// orphaned when it resumes, and is not run again.
#[test]
fn transactional_resumed_call_whose_run_was_forgotten_is_orphaned() {
    with_failpoints(async {
        let dir = tempfile::tempdir().expect("temp dir");
        let url = fresh_store(dir.path()).await;
        let store = open_store(&url).await;
        transactional::a_resumed_call_whose_run_was_forgotten_is_orphaned(&url, store)
            .await
            .expect("not run again");
    });
}

// ------------------------------------------------------------ approvals

/// What the person decides in an approval row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Decide {
    Approve,
    Deny,
}

/// One approval row (issue 34): the process dies at `point`, either while
/// it asks (`before`: the person decides while it is down) or while it
/// acts on the decision (the point is armed once the decision is stored);
/// a second process on the same store then ends the call: the effect once
/// when approved, never when denied (`failed`, code `forbidden`, at
/// sequence 0).
async fn approval_row(point: &'static str, before: bool, decide: Decide) {
    let mut row = Row::new(WRITE_TOOL, None).await;
    let mut o = Options::new(&row.store_url, &row.log);
    o.approval = true;
    // After a crash past the handler, the hook tells that the effect
    // happened (its key is in the log).
    o.hook = Some(Duration::from_millis(50));
    if before {
        fail::cfg(point, "return").unwrap();
    }
    let first = row.start_custom(&o).await;
    let approvals = Approvals::open(&row.store_url)
        .await
        .expect("approvals open");
    let asked = eventually("the approval request", LIMIT, || async {
        approvals.show(&row.run_id, &row.call_id).await.ok()
    })
    .await;
    assert_eq!(asked.state(), ApprovalState::Waiting, "{asked:?}");
    assert_eq!(asked.subject(), "user_42");
    let first = if before {
        tokio::time::timeout(LIMIT, first.wait())
            .await
            .unwrap_or_else(|_| panic!("the executor did not stop at {point}"))
            .expect("halted at the fail point, not failed");
        drop(first);
        fail::remove(point);
        None
    } else {
        // Given back: the platform holds the call for whoever claims it.
        row.wait_platform("pending").await;
        Some(first)
    };
    assert_eq!(row.log.len(), 0, "nothing runs before a decision");
    let decided = match decide {
        Decide::Approve => {
            approvals
                .approve(&row.run_id, &row.call_id, "alice", Some("checked"))
                .await
        }
        Decide::Deny => approvals.deny(&row.run_id, &row.call_id, "bob", None).await,
    };
    decided.expect("the decision is recorded");
    if let Some(first) = first {
        fail::cfg(point, "return").unwrap();
        tokio::time::timeout(LIMIT, first.wait())
            .await
            .unwrap_or_else(|_| panic!("the executor did not stop at {point}"))
            .expect("halted at the fail point, not failed");
        drop(first);
        fail::remove(point);
    }
    let second = row.start_custom(&o).await;
    match decide {
        Decide::Approve => {
            let call = row.wait_platform("completed").await;
            assert_eq!(
                receipts_of_kind(&call, "accepted").len(),
                1,
                "one accepted: {call}"
            );
            eventually("the handler ran", LIMIT, || async {
                (row.log.len() == 1).then_some(())
            })
            .await;
            tokio::time::sleep(GRACE).await;
            assert_eq!(row.log.len(), 1, "the effect once: {:?}", row.log.all());
            let stored = approvals
                .show(&row.run_id, &row.call_id)
                .await
                .expect("request");
            assert_eq!(stored.state(), ApprovalState::Approved);
            assert_eq!(stored.decided_by(), Some("alice"));
        }
        Decide::Deny => {
            let call = row.wait_platform("failed").await;
            assert_eq!(receipt_kinds(&call), ["failed"], "{call}");
            let failed = receipts_of_kind(&call, "failed")[0];
            assert_eq!(failed["body"]["sequence"], 0, "{failed}");
            assert_eq!(failed["body"]["error"]["code"], "forbidden", "{failed}");
            assert_eq!(
                failed["body"]["error"]["message"], "denied by an approver",
                "{failed}"
            );
            tokio::time::sleep(GRACE).await;
            assert_eq!(row.log.len(), 0, "no effect: {:?}", row.log.all());
        }
    }
    drop(second);
}

/// The request stored, the claim not yet saved as given back: the person
/// approves while the process is down; the next one runs the call once.
#[test]
fn approval_after_request_stored_approved_while_down_runs_once() {
    with_failpoints(approval_row("after_approval_stored", true, Decide::Approve));
}

/// The same crash, denied: settled `forbidden`, nothing ran.
#[test]
fn approval_after_request_stored_denied_while_down_never_runs() {
    with_failpoints(approval_row("after_approval_stored", true, Decide::Deny));
}

/// Given back in the store, `released` not sent: approved while down,
/// run once.
#[test]
fn approval_after_release_saved_approved_while_down_runs_once() {
    with_failpoints(approval_row(
        "after_approval_released_saved",
        true,
        Decide::Approve,
    ));
}

/// The same crash, denied.
#[test]
fn approval_after_release_saved_denied_while_down_never_runs() {
    with_failpoints(approval_row(
        "after_approval_released_saved",
        true,
        Decide::Deny,
    ));
}

/// Approved, the new claim's key saved (not sent): the next process
/// claims with it and runs once.
#[test]
fn approval_approved_then_key_saved_runs_once() {
    with_failpoints(approval_row(
        "after_operation_key_saved",
        false,
        Decide::Approve,
    ));
}

/// Denied, the new claim's key saved: settled `forbidden`, nothing ran.
#[test]
fn approval_denied_then_key_saved_never_runs() {
    with_failpoints(approval_row(
        "after_operation_key_saved",
        false,
        Decide::Deny,
    ));
}

/// Approved, `accepted` confirmed, the handler not started: run once.
#[test]
fn approval_approved_then_accepted_confirmed_runs_once() {
    with_failpoints(approval_row(
        "after_accepted_confirmed",
        false,
        Decide::Approve,
    ));
}

/// Approved, the effect made, its outcome not saved: not run again (the
/// hook tells that it happened).
#[test]
fn approval_approved_then_effect_made_runs_once() {
    with_failpoints(approval_row("after_handler", false, Decide::Approve));
}

/// Approved, the final receipt saved and not sent: delivered, run once.
#[test]
fn approval_approved_then_final_saved_runs_once() {
    with_failpoints(approval_row("after_final_saved", false, Decide::Approve));
}

/// Denied, the `forbidden` receipt saved and not sent: delivered, nothing
/// ran.
#[test]
fn approval_denied_then_final_saved_never_runs() {
    with_failpoints(approval_row("after_final_saved", false, Decide::Deny));
}
