//! Regression tests for the findings of the lifecycle review (issue 7,
//! items 3a–3g): paths that broke "a write never runs twice, a receipt is
//! never lost, unknown is never guessed". Each test failed on the main of
//! before the lifecycle module (see the closing note of issue 7).
//!
//! Some tests stop an executor at a fail point; the fail-point registry is
//! global, so every test holds a `fail::FailScenario` for its whole length
//! (that serializes them) and runs its own Tokio runtime inside it.

#![allow(missing_docs)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Notify;
use toolrunner::testing::store::{
    LocalCall, LocalState, OutboxReceipt, ReceiptStatus, SqliteStore, Store,
};
use toolrunner::{
    AuthorizationRequest, Authorizer, CallContext, Denied, Effect, Evidence, Executor,
    ExecutorBuilder, Outcome, Reconciled, Reconciler, RunningExecutor, Shutdown, Tool, ToolError,
    async_trait,
};
use toolrunner_devserver::DevServer;

const ADMIN: &str = "dev-admin";
const EXEC_TOKEN: &str = "dev-executor";
const TOOL: &str = "pay.write";
const LIMIT: Duration = Duration::from_secs(15);

// ------------------------------------------------------------ the product

/// `pay.write` arguments.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct Input {
    /// Any amount.
    #[allow(dead_code)]
    amount: u64,
}

/// `pay.write` result.
#[derive(Debug, Serialize, schemars::JsonSchema)]
struct Output {
    /// Small numbers only (a larger one breaks the output schema).
    #[schemars(range(max = 10))]
    n: u64,
}

/// What the handler does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// The effect, then `Ok`.
    Ok,
    /// An ordinary error before any effect: the outcome is unknown.
    UnknownBefore,
    /// The effect, then an ordinary error.
    UnknownAfter,
    /// Waits for its cancellation token, then answers a business
    /// cancellation (a handler that honours its token).
    HonourCancel,
    /// The effect, then an output that breaks the output schema.
    BadOutput,
}

/// What the `reconcile` hook does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hook {
    /// Cannot tell.
    Unknown,
    /// Looks the operation key up in the business ledger.
    Truthful,
    /// Sends a progress receipt, then looks the key up.
    ProgressThenTruthful,
    /// Panics.
    Panic,
    /// Never answers, and ignores its token (it says when it starts and
    /// when its future is dropped).
    Hangs,
}

/// The business system every executor of a test shares (it survives
/// crashes): effects by call, handler starts, and the knobs.
#[derive(Default)]
struct Business {
    /// `(call_id, operation_key)` of every effect.
    effects: Vec<(String, String)>,
    /// `(call_id, operation_key)` of every handler start.
    starts: Vec<(String, String)>,
    mode: HashMap<String, Mode>,
    default_mode: Option<Mode>,
    hook: HashMap<String, Hook>,
    default_hook: Option<Hook>,
    rerun: bool,
}

#[derive(Clone, Default)]
struct Shared {
    business: Arc<Mutex<Business>>,
    started: Arc<Notify>,
    /// A hanging hook started ([`Hook::Hangs`]).
    hook_entered: Arc<std::sync::atomic::AtomicBool>,
    /// A hanging hook's future was dropped.
    hook_dropped: Arc<std::sync::atomic::AtomicBool>,
}

/// Sets its flag when dropped.
struct SaysDropped(Arc<std::sync::atomic::AtomicBool>);

impl Drop for SaysDropped {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Shared {
    fn with<T>(&self, f: impl FnOnce(&mut Business) -> T) -> T {
        f(&mut self.business.lock().expect("not poisoned"))
    }

    fn effects_of(&self, call_id: &str) -> usize {
        self.with(|b| b.effects.iter().filter(|(c, _)| c == call_id).count())
    }

    fn starts_of(&self, call_id: &str) -> usize {
        self.with(|b| b.starts.iter().filter(|(c, _)| c == call_id).count())
    }
}

struct Pay(Shared);

#[async_trait]
impl Tool for Pay {
    type Input = Input;
    type Output = Output;

    fn name(&self) -> &str {
        TOOL
    }

    fn description(&self) -> &str {
        "Charges an amount (the side effect under test)"
    }

    fn effect(&self) -> Effect {
        Effect::Write
    }

    async fn call(&self, ctx: &CallContext, _input: Input) -> Result<Output, ToolError> {
        let call = ctx.call_id().to_owned();
        let key = ctx.operation_key().to_owned();
        let mode = self.0.with(|b| {
            b.starts.push((call.clone(), key.clone()));
            b.mode
                .get(&call)
                .copied()
                .or(b.default_mode)
                .unwrap_or(Mode::Ok)
        });
        self.0.started.notify_waiters();
        let effect = |s: &Shared| s.with(|b| b.effects.push((call.clone(), key.clone())));
        match mode {
            Mode::Ok => {
                effect(&self.0);
                Ok(Output { n: 1 })
            }
            Mode::UnknownBefore => Err(ToolError::unknown("the bank timed out before charging")),
            Mode::UnknownAfter => {
                effect(&self.0);
                Err(ToolError::unknown("the bank timed out after charging"))
            }
            Mode::HonourCancel => {
                ctx.cancelled().await;
                Err(ToolError::cancelled("the customer cancelled"))
            }
            Mode::BadOutput => {
                effect(&self.0);
                Ok(Output { n: 99 })
            }
        }
    }

    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Output> {
        let hook = self.0.with(|b| {
            b.hook
                .get(ctx.call_id())
                .copied()
                .or(b.default_hook)
                .unwrap_or(Hook::Unknown)
        });
        match hook {
            Hook::Unknown => return Reconciled::Unknown,
            Hook::Panic => panic!("the reconcile hook of this product panics"),
            Hook::Hangs => {
                let _dropped = SaysDropped(self.0.hook_dropped.clone());
                self.0
                    .hook_entered
                    .store(true, std::sync::atomic::Ordering::SeqCst);
                std::future::pending::<()>().await;
            }
            Hook::ProgressThenTruthful => {
                if ctx.progress("looking the charge up").await.is_err() {
                    return Reconciled::Unknown;
                }
            }
            Hook::Truthful => {}
        }
        let key = ctx.operation_key().to_owned();
        if self.0.with(|b| b.effects.iter().any(|(_, k)| *k == key)) {
            Reconciled::Happened(Output { n: 1 })
        } else {
            Reconciled::DidNotHappen
        }
    }

    fn rerun_when_not_performed(&self) -> bool {
        self.0.with(|b| b.rerun)
    }
}

/// The product's authorizer: allows, waits at a gate, or panics.
#[derive(Clone, Default)]
struct Gatekeeper {
    gate: Option<Arc<Notify>>,
    entered: Arc<Notify>,
    /// Panics for this many calls first.
    panics: Arc<Mutex<usize>>,
}

#[async_trait]
impl Authorizer for Gatekeeper {
    async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
        self.entered.notify_waiters();
        let panics = {
            let mut left = self.panics.lock().expect("not poisoned");
            let panics = *left > 0;
            *left = left.saturating_sub(1);
            panics
        };
        if panics {
            panic!("the authorizer of this product panics");
        }
        if let Some(gate) = &self.gate {
            gate.notified().await;
        }
        Ok(())
    }
}

// -------------------------------------------------------------- harness

fn with_failpoints<F: Future<Output = ()>>(body: F) {
    let scenario = fail::FailScenario::setup();
    let _ = rustls::crypto::ring::default_provider().install_default();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(body);
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

/// Waits until `flag` is set.
async fn raised(what: &str, limit: Duration, flag: &std::sync::atomic::AtomicBool) {
    eventually(what, limit, || async {
        flag.load(std::sync::atomic::Ordering::SeqCst).then_some(())
    })
    .await
}

/// One platform (a file database), one agent version with `pay.write`.
struct World {
    server: DevServer,
    http: toolrunner::platform::Platform,
    binding_id: String,
    agent_id: String,
    agent_version: String,
    dir: tempfile::TempDir,
    shared: Shared,
}

impl World {
    async fn new(lease_ttl_ms: u64, heartbeat_ms: u64, stream: bool) -> World {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut builder = DevServer::builder()
            .listen("127.0.0.1:0".parse().expect("addr"))
            .db_path(dir.path().join("platform.db"))
            .lease_ttl_ms(lease_ttl_ms)
            .heartbeat_interval_ms(heartbeat_ms);
        if !stream {
            builder = builder.without_stream();
        }
        let server = builder.start().await.expect("devserver starts");
        let http = toolrunner::platform::Platform::new(&server.base_url(), ADMIN)
            .expect("platform client");
        let mut world = World {
            server,
            http,
            binding_id: String::new(),
            agent_id: String::new(),
            agent_version: String::new(),
            dir,
            shared: Shared::default(),
        };
        let agent = world.post("/agents", json!({"name": "findings"})).await;
        let agent_id = agent["agent_id"].as_str().expect("agent_id").to_owned();
        world.agent_id = agent_id.clone();
        let binding = world
            .post(
                "/executor-bindings",
                json!({"agent_id": agent_id, "name": "pay", "tool_names": [TOOL]}),
            )
            .await;
        world.binding_id = binding["binding_id"].as_str().expect("binding").to_owned();
        let definitions = world
            .builder("exe-definitions", "unused.db")
            .build()
            .expect("builds")
            .tool_definitions()
            .to_vec();
        let version = world
            .post(
                &format!("/agents/{agent_id}/versions"),
                json!({"tools": definitions}),
            )
            .await;
        world.agent_version = version["agent_version"]
            .as_str()
            .expect("agent_version")
            .to_owned();
        world
    }

    fn base(&self) -> String {
        self.server.base_url()
    }

    fn store_url(&self, name: &str) -> String {
        format!("sqlite://{}", self.dir.path().join(name).display())
    }

    /// An executor with `pay.write` on the store `store` in this world's
    /// directory; allows every call unless the test sets an authorizer.
    fn builder(&self, executor_id: &str, store: &str) -> ExecutorBuilder {
        Executor::builder()
            .base_url(self.base())
            .token(EXEC_TOKEN)
            .executor_id(executor_id)
            .binding_id(&self.binding_id)
            .store_url(self.store_url(store))
            .capacity(4)
            .poll_interval(Duration::from_millis(50))
            .request_timeout(Duration::from_secs(3))
            .backoff(Duration::from_millis(20), Duration::from_millis(200), 3)
            .reconcile_interval(Duration::from_millis(100))
            .allow_all()
            .tool(Pay(self.shared.clone()))
    }

    /// An executor as [`World::start`] builds it, on `with` (a store of
    /// the test's over the file `store`).
    async fn start_on(&self, executor_id: &str, store: &str, with: Hooked) -> RunningExecutor {
        self.builder(executor_id, store)
            .build()
            .expect("builds")
            .start_with_store(Arc::new(with))
            .await
            .expect("starts")
    }

    async fn start(&self, executor_id: &str, store: &str) -> RunningExecutor {
        self.builder(executor_id, store)
            .build()
            .expect("builds")
            .start()
            .await
            .expect("starts")
    }

    /// A request with `token` to `path` (under `/v1`).
    fn request(
        &self,
        method: toolrunner::platform::Method,
        path: &str,
        token: &str,
    ) -> toolrunner::platform::RawRequest {
        self.http.request(method, path).token(Some(token))
    }

    async fn send(&self, req: toolrunner::platform::RawRequest) -> (u16, Value) {
        let resp = req.send().await.expect("platform answers");
        (resp.status, resp.json())
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let req = self
            .request(toolrunner::platform::Method::POST, path, ADMIN)
            .json(&body);
        let (status, v) = self.send(req).await;
        assert_eq!(status, 200, "POST {path}: {v}");
        v
    }

    async fn faults(&self, error_rate: f64) {
        let req = self
            .request(toolrunner::platform::Method::PUT, "/dev/faults", ADMIN)
            .json(&json!({"error_rate": error_rate}));
        let (status, v) = self.send(req).await;
        assert_eq!(status, 200, "faults: {v}");
    }

    /// A run of `n` calls of `pay.write`; `(run_id, call_ids)`.
    async fn run(&self, n: usize) -> (String, Vec<String>) {
        let calls: Vec<Value> = (0..n)
            .map(|i| json!({"tool_name": TOOL, "arguments": {"amount": 100 + i}}))
            .collect();
        let run = self
            .post(
                "/runs",
                json!({"agent_version": self.agent_version, "subject": "user_7",
                       "tool_calls": calls}),
            )
            .await;
        let ids = run["tool_calls"]
            .as_array()
            .expect("calls")
            .iter()
            .map(|c| c["call_id"].as_str().expect("call_id").to_owned())
            .collect();
        (run["run_id"].as_str().expect("run_id").to_owned(), ids)
    }

    async fn platform_call(&self, run_id: &str, call_id: &str) -> Value {
        let req = self.request(
            toolrunner::platform::Method::GET,
            &format!("/runs/{run_id}"),
            ADMIN,
        );
        let (_, run) = self.send(req).await;
        run["tool_calls"]
            .as_array()
            .expect("calls")
            .iter()
            .find(|c| c["call_id"] == call_id)
            .cloned()
            .expect("the call")
    }

    async fn wait_platform(&self, run_id: &str, call_id: &str, state: &str) -> Value {
        eventually(&format!("platform state {state}"), LIMIT, || async {
            let c = self.platform_call(run_id, call_id).await;
            (c["state"] == state).then_some(c)
        })
        .await
    }

    async fn store(&self, name: &str) -> SqliteStore {
        SqliteStore::open(&self.store_url(name))
            .await
            .expect("store opens")
    }
}

async fn local(store: &SqliteStore, run_id: &str, call_id: &str) -> Option<LocalCall> {
    store.call(run_id, call_id).await.expect("store readable")
}

async fn wait_local(
    store: &SqliteStore,
    run_id: &str,
    call_id: &str,
    states: &[LocalState],
) -> LocalCall {
    eventually(&format!("local state in {states:?}"), LIMIT, || async {
        local(store, run_id, call_id)
            .await
            .filter(|c| states.contains(&c.state))
    })
    .await
}

async fn receipts(store: &SqliteStore, run_id: &str, call_id: &str) -> Vec<OutboxReceipt> {
    store
        .receipts(run_id, call_id)
        .await
        .expect("store readable")
}

fn kinds(call: &Value) -> Vec<(String, u64)> {
    call["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .map(|r| {
            (
                r["kind"].as_str().unwrap_or("?").to_owned(),
                r["sequence"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect()
}

fn evidence() -> Evidence {
    Evidence::new("on-call", "checked the bank").with_reference("INC-1")
}

/// Executor `exe-a` saves `accepted` and then cannot send it (the platform
/// answers 503 to everything), and its process is lost. The lease lapses,
/// the claim is released, and executor `exe-b` (its own store) claims the
/// call again and completes it: one effect, by `exe-b`.
async fn accepted_left_behind(world: &World) -> (String, String) {
    let gatekeeper = Gatekeeper {
        gate: Some(Arc::new(Notify::new())),
        ..Gatekeeper::default()
    };
    let a = world
        .builder("exe-a", "a.db")
        .authorizer(gatekeeper.clone())
        .build()
        .expect("builds")
        .start()
        .await
        .expect("starts");
    let entered = gatekeeper.entered.notified();
    let (run_id, calls) = world.run(1).await;
    let call_id = calls[0].clone();
    entered.await;
    world.faults(1.0).await;
    gatekeeper.gate.as_ref().expect("gate").notify_one();
    let store_a = world.store("a.db").await;
    eventually("accepted saved", LIMIT, || async {
        let rs = receipts(&store_a, &run_id, &call_id).await;
        rs.iter()
            .any(|r| r.kind.as_str() == "accepted" && r.status == ReceiptStatus::Pending)
            .then_some(())
    })
    .await;
    // Its sending fails (503, retried with a short backoff).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let accepted = receipts(&store_a, &run_id, &call_id).await;
    assert!(
        accepted.iter().all(|r| r.status == ReceiptStatus::Pending),
        "{accepted:?}"
    );
    drop(a); // the process is lost
    world.faults(0.0).await;
    world.wait_platform(&run_id, &call_id, "pending").await;
    let b = world.start("exe-b", "b.db").await;
    world.wait_platform(&run_id, &call_id, "completed").await;
    b.shutdown(Shutdown::Drain {
        deadline: Duration::from_secs(5),
    })
    .await
    .expect("b drains");
    assert_eq!(world.shared.effects_of(&call_id), 1);
    (run_id, call_id)
}

type BeforeCommit = Box<
    dyn Fn(
            &[toolrunner::testing::store::Change],
        ) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>
        + Send
        + Sync,
>;

/// The executor's SQLite store with two hooks of a test: one awaited before
/// every commit, one applied to every call row read.
struct Hooked {
    inner: SqliteStore,
    before_commit: BeforeCommit,
    on_read: Box<dyn Fn(LocalCall) -> LocalCall + Send + Sync>,
}

impl Hooked {
    fn new(inner: SqliteStore) -> Hooked {
        Hooked {
            inner,
            before_commit: Box::new(|_| Box::pin(async {})),
            on_read: Box::new(|c| c),
        }
    }
}

#[async_trait]
impl Store for Hooked {
    async fn commit(
        &self,
        changes: Vec<toolrunner::testing::store::Change>,
    ) -> Result<(), toolrunner::testing::store::StoreError> {
        (self.before_commit)(&changes).await;
        self.inner.commit(changes).await
    }
    async fn call(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Option<LocalCall>, toolrunner::testing::store::StoreError> {
        Ok(self.inner.call(run_id, call_id).await?.map(&self.on_read))
    }
    async fn calls(
        &self,
        filter: &toolrunner::testing::store::CallFilter,
    ) -> Result<Vec<LocalCall>, toolrunner::testing::store::StoreError> {
        Ok(self
            .inner
            .calls(filter)
            .await?
            .into_iter()
            .map(&self.on_read)
            .collect())
    }
    async fn count_by_state(
        &self,
    ) -> Result<std::collections::BTreeMap<LocalState, u64>, toolrunner::testing::store::StoreError>
    {
        self.inner.count_by_state().await
    }
    async fn receipts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<OutboxReceipt>, toolrunner::testing::store::StoreError> {
        self.inner.receipts(run_id, call_id).await
    }
    async fn receipt(
        &self,
        receipt_id: &str,
    ) -> Result<Option<OutboxReceipt>, toolrunner::testing::store::StoreError> {
        self.inner.receipt(receipt_id).await
    }
    async fn receipts_with(
        &self,
        status: ReceiptStatus,
    ) -> Result<Vec<OutboxReceipt>, toolrunner::testing::store::StoreError> {
        self.inner.receipts_with(status).await
    }
    async fn events(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<toolrunner::testing::store::Event>, toolrunner::testing::store::StoreError>
    {
        self.inner.events(run_id, call_id).await
    }
    async fn attempts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<toolrunner::testing::store::Attempt>, toolrunner::testing::store::StoreError>
    {
        self.inner.attempts(run_id, call_id).await
    }
}

// ---------------------------------------------------------------- tests

/// 3a: an `accepted` saved before a crash must not stay `pending` for ever
/// once the claim is lost (here: the lease lapsed and another executor did
/// the work). On restart the call is settled as "nothing ran" and the old
/// `accepted` is marked superseded: the outbox holds nothing undelivered.
#[test]
fn finding_a_an_accepted_left_by_a_lapsed_claim_is_superseded() {
    with_failpoints(async {
        let world = World::new(600, 100, true).await;
        let (run_id, call_id) = accepted_left_behind(&world).await;
        let a = world.start("exe-a", "a.db").await;
        let store_a = world.store("a.db").await;
        let settled = wait_local(
            &store_a,
            &run_id,
            &call_id,
            &[LocalState::Abandoned, LocalState::Released],
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let outbox = Reconciler::open(&world.store_url("a.db"))
            .await
            .expect("opens")
            .outbox()
            .await
            .expect("outbox");
        assert!(
            outbox.pending().is_empty(),
            "the store of exe-a still holds undelivered receipts: {:?} (call {:?})",
            outbox.pending(),
            settled
        );
        let accepted: Vec<_> = receipts(&store_a, &run_id, &call_id)
            .await
            .into_iter()
            .filter(|r| r.kind.as_str() == "accepted")
            .collect();
        assert_eq!(accepted.len(), 1);
        assert_eq!(
            accepted[0].status,
            ReceiptStatus::Superseded,
            "{accepted:?}"
        );
        assert_eq!(
            world.shared.starts_of(&call_id),
            1,
            "only exe-b ran the handler"
        );
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3a: an operator's `outbox redeliver` never sends an `accepted` (only the
/// accept step does, and acts on its answer), so it cannot turn the
/// call into `reconciliation_required`; and a hook answering
/// `DidNotHappen` with re-run allowed never runs the write a second time
/// under a released assignment.
#[test]
fn finding_a_redeliver_sends_no_accepted_and_the_write_never_runs_twice() {
    with_failpoints(async {
        let world = World::new(600, 100, true).await;
        let (run_id, call_id) = accepted_left_behind(&world).await;
        world.shared.with(|b| {
            b.rerun = true;
            b.default_hook = Some(Hook::Truthful);
        });
        let reconciler = Reconciler::open(&world.store_url("a.db"))
            .await
            .expect("opens")
            .with_platform(&world.base(), EXEC_TOKEN)
            .expect("client");
        let sent = reconciler.redeliver(None).await;
        let store_a = world.store("a.db").await;
        let after = local(&store_a, &run_id, &call_id).await.expect("known");
        assert_ne!(
            after.state,
            LocalState::ReconciliationRequired,
            "redeliver made the call ambiguous: {sent:?}"
        );
        let a = world.start("exe-a", "a.db").await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            world.shared.effects_of(&call_id),
            1,
            "the write ran twice: {:?}",
            local(&store_a, &run_id, &call_id).await
        );
        assert_eq!(world.shared.starts_of(&call_id), 1);
        let c = world.platform_call(&run_id, &call_id).await;
        assert_eq!(c["state"], "completed");
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// A write call whose tool may run again after `DidNotHappen`, in
/// `reconciliation_required` on exe-a (its handler failed before its
/// effect, its hook cannot tell yet): the executor, the run, the call and
/// the store.
async fn awaiting_reconciliation(world: &World) -> (RunningExecutor, String, String, SqliteStore) {
    world.shared.with(|b| {
        b.rerun = true;
        b.default_mode = Some(Mode::UnknownBefore);
        b.default_hook = Some(Hook::Unknown);
    });
    let a = world.start("exe-a", "a.db").await;
    let (run_id, calls) = world.run(1).await;
    let call_id = calls[0].clone();
    let store = world.store("a.db").await;
    wait_local(
        &store,
        &run_id,
        &call_id,
        &[LocalState::ReconciliationRequired],
    )
    .await;
    // The report too: until the platform has it, a test that ends or
    // forgets the run races the report's delivery (a report the platform
    // answers `400 unknown_call` leaves the outcome unknown, rightly).
    eventually(
        "the platform heard reconciliation_required",
        LIMIT,
        || async {
            let c = world.platform_call(&run_id, &call_id).await;
            (c["state"] == "reconciliation_required").then_some(())
        },
    )
    .await;
    (a, run_id, call_id, store)
}

/// Heartbeats exe-a's connection `connection_id` by hand, as the process
/// whose answer is lost would: the platform hands out the call's cancel
/// notice, once.
async fn take_the_cancel_notice(world: &World, connection_id: &Value, call_id: &str) {
    let beat = world
        .request(
            toolrunner::platform::Method::POST,
            "/executors/exe-a/heartbeat",
            EXEC_TOKEN,
        )
        .json(&json!({"connection_id": connection_id, "in_flight": []}));
    let (status, beat) = world.send(beat).await;
    assert_eq!(status, 200, "heartbeat: {beat}");
    assert!(
        beat["cancel_requested"].to_string().contains(call_id),
        "the heartbeat did not carry the cancel: {beat}"
    );
}

/// The call's run ended while it awaited reconciliation: once its hook
/// says it did not happen, it ends `abandoned`, its handler not run again.
async fn not_run_again(world: &World, store: &SqliteStore, run_id: &str, call_id: &str) {
    let row = wait_local(
        store,
        run_id,
        call_id,
        &[LocalState::Abandoned, LocalState::Running],
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        world.shared.starts_of(call_id),
        1,
        "the handler ran again after the run was cancelled: {row:?}"
    );
    assert_eq!(row.state, LocalState::Abandoned, "{row:?}");
}

/// 3b: the heartbeat that confirms the lease before a re-run carries a
/// cancel for the run: the handler must not start again.
#[test]
fn finding_b_no_rerun_when_the_lease_check_carries_a_cancel() {
    with_failpoints(async {
        // Long heartbeats and no stream: the cancel reaches the executor
        // only in the heartbeat of the automatic check.
        let world = World::new(30_000, 10_000, false).await;
        let (a, run_id, call_id, store) = awaiting_reconciliation(&world).await;
        world
            .post(&format!("/runs/{run_id}/cancel"), json!({}))
            .await;
        world.shared.with(|b| b.default_hook = Some(Hook::Truthful));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            world.shared.starts_of(&call_id),
            1,
            "the handler ran again after the run was cancelled"
        );
        let c = local(&store, &run_id, &call_id).await.expect("known");
        assert_ne!(c.state, LocalState::Running, "{c:?}");
        drop(a);
    });
}

/// 3b again, with the run cancelled while the executor was down, and the
/// cancel notice taken by a process lost before it acted: the next process
/// hears no cancel (only the platform's `outstanding` no longer lists the
/// call), so it must not take the hook's `DidNotHappen` as leave to run the
/// handler again; the call ends `abandoned` (it did not happen, and the run
/// ended). Found by the simulation (seed 1429).
#[test]
fn finding_b_no_rerun_after_a_cancel_while_down() {
    with_failpoints(async {
        let world = World::new(30_000, 10_000, false).await;
        let (a, run_id, call_id, store) = awaiting_reconciliation(&world).await;
        // Lost, as a crashed process.
        drop(a);
        tokio::time::sleep(Duration::from_millis(100)).await;
        world
            .post(&format!("/runs/{run_id}/cancel"), json!({}))
            .await;
        // A process that heard the cancel in its first heartbeat, and was
        // lost before it acted on it (or whose heartbeat's answer was
        // lost): the next one hears nothing.
        let connect = world
            .request(
                toolrunner::platform::Method::POST,
                "/executors/connect",
                EXEC_TOKEN,
            )
            .json(
                &json!({"executor_id": "exe-a", "binding_id": world.binding_id,
                          "tools": [TOOL], "capacity": 1}),
            );
        let (status, conn) = world.send(connect).await;
        assert_eq!(status, 200, "connect: {conn}");
        take_the_cancel_notice(&world, &conn["connection_id"], &call_id).await;
        world.shared.with(|b| b.default_hook = Some(Hook::Truthful));
        let c = world.start("exe-a", "a.db").await;
        not_run_again(&world, &store, &run_id, &call_id).await;
        drop(c);
    });
}

/// 3b once more, in a process that lives through the cancel: the
/// heartbeat answer that carried the cancel notice was lost (here: taken
/// by hand on the executor's own connection), so the process never hears
/// of it, and no reconnect tells it either. Before a re-run the executor
/// asks the platform whether the call is still its own; the run ended, so
/// the handler does not start again and the call ends `abandoned`.
#[test]
fn finding_b_no_rerun_when_the_cancel_notice_was_lost() {
    with_failpoints(async {
        let world = World::new(30_000, 10_000, false).await;
        let (a, run_id, call_id, store) = awaiting_reconciliation(&world).await;
        world
            .post(&format!("/runs/{run_id}/cancel"), json!({}))
            .await;
        // The notice goes out in the next heartbeat answer of exe-a's
        // connection: this one, whose answer the executor never sees.
        let agent_id = world.agent_id.clone();
        let diagnostics = world.request(
            toolrunner::platform::Method::GET,
            &format!(
                "/agents/{agent_id}/executor-bindings/{}/diagnostics",
                world.binding_id
            ),
            ADMIN,
        );
        let (status, diagnostics) = world.send(diagnostics).await;
        assert_eq!(status, 200, "diagnostics: {diagnostics}");
        let connection_id = diagnostics["executors"]
            .as_array()
            .expect("executors")
            .iter()
            .find(|e| e["executor_id"] == "exe-a")
            .map(|e| e["connection_id"].clone())
            .expect("exe-a's connection");
        take_the_cancel_notice(&world, &connection_id, &call_id).await;
        world.shared.with(|b| b.default_hook = Some(Hook::Truthful));
        not_run_again(&world, &store, &run_id, &call_id).await;
        drop(a);
    });
}

/// 3b and choice 54: before a re-run after `DidNotHappen` the executor
/// asks the platform with a report of `reconciliation_required`; a
/// platform that no longer knows the run (its own retention deleted it)
/// answers `400 unknown_call`. The call is then `orphaned`, as after a
/// `404` on a final receipt (the platform no longer knows the run), not
/// `abandoned`: the handler does not start again, and since the hook found
/// the operation not performed, its outcome is known and it waits for no
/// person (no `orphaned_outcome_unknown` in its timeline).
#[test]
fn no_rerun_for_a_call_the_platform_forgot_and_it_is_orphaned() {
    with_failpoints(async {
        let world = World::new(30_000, 10_000, false).await;
        let (a, run_id, call_id, store) = awaiting_reconciliation(&world).await;
        world
            .server
            .forget_run(&run_id)
            .await
            .expect("forgets the run");
        world.shared.with(|b| b.default_hook = Some(Hook::Truthful));
        let row = wait_local(
            &store,
            &run_id,
            &call_id,
            &[
                LocalState::Abandoned,
                LocalState::Orphaned,
                LocalState::Running,
            ],
        )
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(
            world.shared.starts_of(&call_id),
            1,
            "the handler ran again for a run the platform forgot: {row:?}"
        );
        assert_eq!(row.state, LocalState::Orphaned, "{row:?}");
        let timeline = store.events(&run_id, &call_id).await.expect("readable");
        assert!(
            !timeline
                .iter()
                .any(|e| e.what() == "orphaned_outcome_unknown"),
            "the hook knew the outcome, yet the call waits for a person: {timeline:?}"
        );
        drop(a);
    });
}

/// Loses the claim's answer at the fail point `after_claim_answer`, then,
/// as the same executor id from outside, replays the claim and sends
/// `accepted` itself: the platform holds the call `running` under an
/// assignment whose `accepted` the executor's store never saw confirmed.
/// Returns the run, the call and the restarted executor.
async fn running_behind_the_stores_back(
    world: &World,
    auto_reconcile: bool,
) -> (String, String, RunningExecutor) {
    fail::cfg("after_claim_answer", "return").unwrap();
    let a = world.start("exe-a", "a.db").await;
    let (run_id, calls) = world.run(1).await;
    let call_id = calls[0].clone();
    let store = world.store("a.db").await;
    let claiming = wait_local(&store, &run_id, &call_id, &[LocalState::Claiming]).await;
    eventually("the claim was answered", LIMIT, || async {
        let c = world.platform_call(&run_id, &call_id).await;
        (c["state"] == "claimed").then_some(())
    })
    .await;
    drop(a);
    fail::remove("after_claim_answer");
    // From outside: connect as exe-a, replay the claim, send `accepted`.
    let post = |path: String, body: Value| {
        world
            .request(toolrunner::platform::Method::POST, &path, EXEC_TOKEN)
            .json(&body)
    };
    let (status, conn) = world
        .send(post(
            "/executors/connect".into(),
            json!({"executor_id": "exe-a", "binding_id": world.binding_id,
                   "tools": [TOOL], "capacity": 1}),
        ))
        .await;
    assert_eq!(status, 200, "{conn}");
    let (status, claim) = world
        .send(post(
            format!("/runs/{run_id}/tool-calls/{call_id}/claim"),
            json!({"executor_id": "exe-a", "connection_id": conn["connection_id"],
                   "operation_key": claiming.operation_key}),
        ))
        .await;
    assert_eq!(status, 200, "{claim}");
    assert_eq!(claim["replayed"], true);
    let asg = &claim["assignment"];
    let (status, accepted) = world
        .send(
            post(
                format!("/runs/{run_id}/tool-calls/{call_id}/receipts"),
                json!({"receipt_id": "rcp_from_outside", "executor_id": "exe-a",
                       "assignment_id": asg["assignment_id"], "sequence": 0,
                       "kind": "accepted"}),
            )
            .header("Tool-Grant", asg["grant"].as_str().expect("grant")),
        )
        .await;
    assert_eq!(status, 200, "{accepted}");
    assert_eq!(accepted["accepted"], true);
    let a = world
        .builder("exe-a", "a.db")
        .auto_reconcile(auto_reconcile)
        .build()
        .expect("builds")
        .start()
        .await
        .expect("starts");
    wait_local(
        &store,
        &run_id,
        &call_id,
        &[
            LocalState::ReconciliationRequired,
            LocalState::Settled,
            LocalState::Delivered,
        ],
    )
    .await;
    (run_id, call_id, a)
}

/// 3b: re-running after `DidNotHappen` needs this assignment's `accepted`
/// confirmed by this store; here the platform says `running` but the store
/// never saw `accepted` confirmed, so the handler must not start.
#[test]
fn finding_b_no_rerun_without_a_confirmed_accepted() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        world.shared.with(|b| {
            b.rerun = true;
            b.default_hook = Some(Hook::Truthful);
        });
        let (run_id, call_id, a) = running_behind_the_stores_back(&world, true).await;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(
            world.shared.starts_of(&call_id),
            0,
            "the handler ran under an assignment whose accepted this store never saw confirmed"
        );
        let c = world.platform_call(&run_id, &call_id).await;
        assert_ne!(c["state"], "completed", "{c}");
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3g (confirmed): a claim replay answered `running` must move the next
/// sequence past the platform's `accepted` (sequence 0): an operator's
/// `failed` is then stored, not refused with `sequence_conflict`.
#[test]
fn finding_g_claim_replay_in_running_moves_the_sequence_past_accepted() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        let (run_id, call_id, a) = running_behind_the_stores_back(&world, false).await;
        let store = world.store("a.db").await;
        let c = local(&store, &run_id, &call_id).await.expect("known");
        assert!(
            c.next_sequence >= 1,
            "the platform holds accepted at sequence 0, yet the next receipt would take {}",
            c.next_sequence
        );
        let reconciler = Reconciler::open(&world.store_url("a.db"))
            .await
            .expect("opens")
            .with_platform(&world.base(), EXEC_TOKEN)
            .expect("client");
        let resolved = reconciler
            .resolve(
                &run_id,
                &call_id,
                Outcome::Failed {
                    code: "declined".into(),
                    message: "the bank declined".into(),
                },
                &evidence(),
            )
            .await
            .expect("resolved");
        assert!(resolved.delivered(), "{resolved:?}");
        let c = world.wait_platform(&run_id, &call_id, "failed").await;
        assert_eq!(
            kinds(&c),
            [("accepted".to_owned(), 0), ("failed".to_owned(), 1)]
        );
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3c: a reconcile hook that sends progress, then finds the effect: the
/// final receipt takes the sequence after the progress receipt's.
#[test]
fn finding_c_progress_from_a_hook_does_not_reuse_its_sequence() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        world.shared.with(|b| {
            b.default_mode = Some(Mode::UnknownAfter);
            b.default_hook = Some(Hook::ProgressThenTruthful);
        });
        let a = world.start("exe-a", "a.db").await;
        let (run_id, calls) = world.run(1).await;
        let c = world.wait_platform(&run_id, &calls[0], "completed").await;
        assert_eq!(
            kinds(&c),
            [
                ("accepted".to_owned(), 0),
                ("progress".to_owned(), 1),
                ("completed".to_owned(), 2)
            ]
        );
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3d: `Shutdown::Detach` leaves the call `running` and bound: the handler
/// is stopped without a receipt (no business `cancelled`), and the next
/// start follows the crash table (a write tool goes to reconciliation).
#[test]
fn finding_d_detach_stops_the_handler_without_a_receipt() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        world
            .shared
            .with(|b| b.default_mode = Some(Mode::HonourCancel));
        let a = world.start("exe-a", "a.db").await;
        let started = world.shared.started.notified();
        let (run_id, calls) = world.run(1).await;
        let call_id = calls[0].clone();
        started.await;
        a.shutdown(Shutdown::Detach).await.expect("detaches");
        tokio::time::sleep(Duration::from_millis(300)).await;
        let c = world.platform_call(&run_id, &call_id).await;
        assert_eq!(c["state"], "running", "{c}");
        assert_eq!(kinds(&c), [("accepted".to_owned(), 0)]);
        let store = world.store("a.db").await;
        let l = local(&store, &run_id, &call_id).await.expect("known");
        assert_eq!(l.state, LocalState::Running, "{l:?}");
        let finals: Vec<_> = receipts(&store, &run_id, &call_id)
            .await
            .into_iter()
            .filter(|r| r.kind.is_final())
            .collect();
        assert!(finals.is_empty(), "{finals:?}");
        // The next start follows the crash table.
        world.shared.with(|b| b.default_mode = Some(Mode::Ok));
        let a = world.start("exe-a", "a.db").await;
        wait_local(
            &store,
            &run_id,
            &call_id,
            &[LocalState::ReconciliationRequired],
        )
        .await;
        world
            .wait_platform(&run_id, &call_id, "reconciliation_required")
            .await;
        assert_eq!(world.shared.starts_of(&call_id), 1);
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3e: an authorizer that panics must not strand the call (nothing ran:
/// it is refused as `forbidden`) nor its capacity slot.
#[test]
fn finding_e_a_panicking_authorizer_settles_the_call() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        let gatekeeper = Gatekeeper {
            panics: Arc::new(Mutex::new(1)),
            ..Gatekeeper::default()
        };
        let a = world
            .builder("exe-a", "a.db")
            .capacity(1)
            .authorizer(gatekeeper)
            .build()
            .expect("builds")
            .start()
            .await
            .expect("starts");
        let (run_id, calls) = world.run(2).await;
        let mut states = Vec::new();
        for call_id in &calls {
            let c = eventually("the call settles", LIMIT, || async {
                let c = world.platform_call(&run_id, call_id).await;
                ["completed", "failed"]
                    .contains(&c["state"].as_str().unwrap_or(""))
                    .then_some(c)
            })
            .await;
            states.push(c["state"].as_str().unwrap_or("?").to_owned());
        }
        states.sort();
        assert_eq!(states, ["completed", "failed"]);
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3e: a reconcile hook that panics for one call must not stop automatic
/// reconciliation of the others.
#[test]
fn finding_e_a_panicking_hook_does_not_stop_reconciliation() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        world
            .shared
            .with(|b| b.default_mode = Some(Mode::UnknownAfter));
        let store = world.store("a.db").await;
        let a = world
            .builder("exe-a", "a.db")
            .auto_reconcile(false)
            .build()
            .expect("builds")
            .start()
            .await
            .expect("starts");
        let (run_1, first) = world.run(1).await;
        wait_local(
            &store,
            &run_1,
            &first[0],
            &[LocalState::ReconciliationRequired],
        )
        .await;
        let (run_2, second) = world.run(1).await;
        wait_local(
            &store,
            &run_2,
            &second[0],
            &[LocalState::ReconciliationRequired],
        )
        .await;
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
        world.shared.with(|b| {
            b.hook.insert(first[0].clone(), Hook::Panic);
            b.default_hook = Some(Hook::Truthful);
        });
        let a = world.start("exe-a", "a.db").await;
        world.wait_platform(&run_2, &second[0], "completed").await;
        let c = local(&store, &run_1, &first[0]).await.expect("known");
        assert_eq!(c.state, LocalState::ReconciliationRequired);
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3f: a progress receipt saved while an operator resolves the call must
/// not undo the resolve (no state written back from an old snapshot), and
/// no second final receipt appears.
#[test]
fn finding_f_progress_cannot_undo_an_operator_resolve() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        world.shared.with(|b| {
            b.default_mode = Some(Mode::UnknownAfter);
            b.default_hook = Some(Hook::ProgressThenTruthful);
        });
        let held = Arc::new(Notify::new());
        let release = Arc::new(Notify::new());
        // Every commit carrying a progress receipt waits for the test.
        let mut store = Hooked::new(world.store("a.db").await);
        let (h, r) = (held.clone(), release.clone());
        store.before_commit = Box::new(move |changes| {
            let progress = changes.iter().any(|c| {
                matches!(c, toolrunner::testing::store::Change::AddReceipt(r) if r.kind.as_str() == "progress")
            });
            let (h, r) = (h.clone(), r.clone());
            Box::pin(async move {
                if progress {
                    h.notify_one();
                    r.notified().await;
                }
            })
        });
        let a = world.start_on("exe-a", "a.db", store).await;
        let waiting = held.notified();
        let (run_id, calls) = world.run(1).await;
        let call_id = calls[0].clone();
        waiting.await;
        let reconciler = Reconciler::open(&world.store_url("a.db"))
            .await
            .expect("opens")
            .with_platform(&world.base(), EXEC_TOKEN)
            .expect("client");
        let resolved = reconciler
            .resolve(
                &run_id,
                &call_id,
                Outcome::Completed(json!({"n": 1})),
                &evidence(),
            )
            .await
            .expect("resolved");
        assert!(resolved.delivered());
        release.notify_one();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let reader = world.store("a.db").await;
        let c = local(&reader, &run_id, &call_id).await.expect("known");
        assert_eq!(
            c.state,
            LocalState::Delivered,
            "the resolve was undone: {c:?}"
        );
        let finals: Vec<_> = receipts(&reader, &run_id, &call_id)
            .await
            .into_iter()
            .filter(|r| r.kind.is_final())
            .collect();
        assert_eq!(finals.len(), 1, "{finals:#?}");
        assert_eq!(finals[0].receipt_id, resolved.receipt_id());
        drop(a);
    });
}

/// 3g (confirmed): two processes must not drive one store file. The second
/// start fails fast with an error that names the file.
#[test]
fn finding_g_a_second_process_on_one_store_fails_fast() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        let a = world.start("exe-a", "a.db").await;
        let started = Instant::now();
        let second = world
            .builder("exe-a2", "a.db")
            .build()
            .expect("builds")
            .start()
            .await;
        let err = second.expect_err("a second executor on the same store file must not start");
        assert!(started.elapsed() < Duration::from_secs(3));
        let path = world.dir.path().join("a.db").display().to_string();
        assert!(err.to_string().contains(&path), "{err}");
        a.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await
        .expect("drains");
    });
}

/// 3g (confirmed): `403 invalid_grant` on `accepted` while the platform
/// still holds the claim (no release) must not loop for ever. The process
/// stops right after saving its assignment; it restarts on a store whose
/// saved grant has gone bad, so the platform refuses the `accepted` while
/// the claim stays live. The claim is given back, and a new claim (a new
/// assignment) completes the call once.
#[test]
fn finding_g_invalid_grant_without_a_release_does_not_loop() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        fail::cfg("after_assignment_saved", "return").unwrap();
        let a = world.start("exe-a", "a.db").await;
        let (run_id, calls) = world.run(1).await;
        let store = world.store("a.db").await;
        wait_local(&store, &run_id, &calls[0], &[LocalState::Assigned]).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        drop(a);
        fail::remove("after_assignment_saved");
        // Reads return a forged grant for the first assignment they see.
        let mut forging = Hooked::new(world.store("a.db").await);
        let first = Mutex::new(None::<String>);
        forging.on_read = Box::new(move |mut c| {
            if let Some(asg) = c.assignment.as_mut() {
                let mut first = first.lock().expect("not poisoned");
                if *first.get_or_insert_with(|| asg.assignment_id.clone()) == asg.assignment_id {
                    asg.grant = serde_json::from_value(json!("grt_forged")).expect("a grant");
                }
            }
            c
        });
        let a = world.start_on("exe-a", "a.db", forging).await;
        let c = world.wait_platform(&run_id, &calls[0], "completed").await;
        assert_eq!(world.shared.starts_of(&calls[0]), 1);
        assert_eq!(
            kinds(&c),
            [("accepted".to_owned(), 0), ("completed".to_owned(), 1)]
        );
        let timeline = Reconciler::open(&world.store_url("a.db"))
            .await
            .expect("opens")
            .show(&run_id, &calls[0])
            .await
            .expect("timeline");
        let attempts = timeline.attempts();
        let assignments: Vec<_> = attempts.iter().filter_map(|a| a.assignment_id()).collect();
        assert_eq!(
            assignments.len(),
            2,
            "the refused assignment and the new one: {attempts:?}"
        );
        drop(a);
    });
}

/// 3g (confirmed): an output that fails its schema is an unknown outcome,
/// and the output itself is kept in the timeline as evidence.
#[test]
fn finding_g_output_failing_its_schema_is_kept_as_evidence() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        world
            .shared
            .with(|b| b.default_mode = Some(Mode::BadOutput));
        let a = world.start("exe-a", "a.db").await;
        let (run_id, calls) = world.run(1).await;
        let store = world.store("a.db").await;
        wait_local(
            &store,
            &run_id,
            &calls[0],
            &[LocalState::ReconciliationRequired],
        )
        .await;
        let timeline = Reconciler::open(&world.store_url("a.db"))
            .await
            .expect("opens")
            .show(&run_id, &calls[0])
            .await
            .expect("timeline");
        let kept = timeline
            .events()
            .iter()
            .any(|e| e.detail().is_some_and(|d| d.contains(r#"{"n":99}"#)));
        assert!(
            kept,
            "the refused output is not in the timeline: {:#?}",
            timeline.events()
        );
        drop(a);
    });
}

/// From the review of the lifecycle change: only the task that moved a call
/// to `running` itself may start its handler. Here another writer (a
/// process that died with its commit in flight, say) writes `running` just
/// before the executor's own `accepted: true` is recorded; the executor
/// loses the race and finds the call `running`. It must resume it as after
/// a crash (a write tool goes to `reconciliation_required`), never run it.
#[test]
fn review_a_running_row_another_writer_wrote_is_resumed_not_run() {
    with_failpoints(async {
        let world = World::new(15_000, 1_000, true).await;
        let inner = world.store("a.db").await;
        let mut store = Hooked::new(inner.clone());
        let raced = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = raced.clone();
        store.before_commit = Box::new(move |changes| {
            use toolrunner::testing::store::Change;
            let confirming = changes.iter().find_map(|c| match c {
                Change::UpdateCall {
                    expect_version,
                    call,
                } if call.state == LocalState::Running => Some((*expect_version, call.clone())),
                _ => None,
            });
            let (inner, flag) = (inner.clone(), flag.clone());
            Box::pin(async move {
                let Some((version, call)) = confirming else {
                    return;
                };
                if flag.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                // The other writer's `running` lands first.
                inner
                    .commit(vec![Change::UpdateCall {
                        expect_version: version,
                        call,
                    }])
                    .await
                    .expect("the other writer's commit");
            })
        });
        let a = world
            .builder("exe-a", "a.db")
            .auto_reconcile(false)
            .build()
            .expect("builds")
            .start_with_store(Arc::new(store))
            .await
            .expect("starts");
        let (run_id, calls) = world.run(1).await;
        world
            .wait_platform(&run_id, &calls[0], "reconciliation_required")
            .await;
        assert!(raced.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(
            world.shared.starts_of(&calls[0]),
            0,
            "the handler started on a `running` another writer recorded"
        );
        drop(a);
    });
}

/// A dropped executor stops as a lost process would: a `reconcile` hook
/// under way (one that ignores its token) is dropped with it, not left
/// running after the process is gone. (Review of issue 31: the checks the
/// dispatch queue started outlived the drop.)
#[test]
fn a_dropped_executor_drops_a_hook_under_way() {
    with_failpoints(async {
        let world = World::new(30_000, 1_000, false).await;
        let (a, _run_id, _call_id, _store) = awaiting_reconciliation(&world).await;
        world.shared.with(|b| b.default_hook = Some(Hook::Hangs));
        raised("the hook to hang", LIMIT, &world.shared.hook_entered).await;
        drop(a);
        raised(
            "the hook under way to be dropped with the executor",
            Duration::from_secs(1),
            &world.shared.hook_dropped,
        )
        .await;
    });
}

/// A recovery that panics (here in a product's store, at its first read of
/// a row) is counted as done: the start goes on, and the claimer, which
/// waits for recovery before it claims, still claims and runs new calls.
/// (Review of issue 31: recovery left the connecting task and every later
/// connect waits for it.)
#[test]
fn a_recovery_that_panics_does_not_stop_the_executor() {
    with_failpoints(async {
        let world = World::new(30_000, 1_000, false).await;
        let (a, _run_id, _call_id, _store) = awaiting_reconciliation(&world).await;
        drop(a);
        world.shared.with(|b| b.default_mode = Some(Mode::Ok));
        let panicked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut store = Hooked::new(world.store("a.db").await);
        let first = panicked.clone();
        store.on_read = Box::new(move |c| {
            if !first.swap(true, std::sync::atomic::Ordering::SeqCst) {
                panic!("this product's store panics at its first read of a row");
            }
            c
        });
        let b = world.start_on("exe-a", "a.db", store).await;
        assert!(
            panicked.load(std::sync::atomic::Ordering::SeqCst),
            "the store was not read during the start's recovery"
        );
        let (run_id, calls) = world.run(1).await;
        world.wait_platform(&run_id, &calls[0], "completed").await;
        drop(b);
    });
}
