//! A testing kit for your own tools (feature `testing`): the embedded
//! development platform, your tools published, runs started and awaited in
//! a few lines; and crashes of the executor at the step you choose, then a
//! restart on the same store, so you can prove your reconcile hook right.
//!
//! ```rust,no_run
//! # use toolrunner::{CallContext, ToolError};
//! # /// In.
//! # #[toolrunner::schema] #[derive(serde::Deserialize)] struct In {}
//! # /// Out.
//! # #[toolrunner::schema] #[derive(serde::Serialize)] struct Out {}
//! /// Greets.
//! #[toolrunner::tool(name = "hello", effect = read)]
//! async fn hello(_ctx: CallContext, _input: In) -> Result<Out, ToolError> {
//!     Ok(Out {})
//! }
//!
//! # async fn demo() -> toolrunner::Result<()> {
//! use toolrunner::testing::TestKit;
//! let kit = TestKit::start(|b| b.tool(hello)).await?;
//! let outcome = kit.call("hello", serde_json::json!({})).await?;
//! assert!(outcome.is_completed());
//! # Ok(()) }
//! ```
//!
//! A crash after the handler, and the hook settling the call:
//!
//! ```rust,no_run
//! # use toolrunner::{CallContext, Reconciled, ToolError};
//! # /// In.
//! # #[toolrunner::schema] #[derive(serde::Deserialize)] struct In {}
//! # /// Out.
//! # #[toolrunner::schema] #[derive(serde::Serialize)] struct Out {}
//! # /// Pays.
//! # #[toolrunner::tool(name = "pay", effect = write, reconcile = find)]
//! # async fn pay(_ctx: CallContext, _input: In) -> Result<Out, ToolError> { Ok(Out {}) }
//! # async fn find(_ctx: CallContext) -> Reconciled<Out> { Reconciled::Happened(Out {}) }
//! # async fn demo() -> toolrunner::Result<()> {
//! use toolrunner::testing::{SettledBy, Step, TestKit};
//! let mut kit = TestKit::builder().crash_at(Step::AfterHandler).start(|b| b.tool(pay)).await?;
//! let call = kit.submit("pay", serde_json::json!({})).await?;
//! kit.wait_crashed().await?;
//! kit.restart().await?; // a new process on the same store
//! let outcome = kit.wait(&call).await?;
//! assert_eq!(outcome.settled_by, SettledBy::ReconcileHook);
//! # Ok(()) }
//! ```
#[doc(hidden)]
pub mod model;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;
use toolrunner_devserver::DevServer;

use crate::error::{Error, Kind, Result};
use crate::net::platform::{CallState, NewToolCall, Platform, Run, RunCall};
use crate::store::{SqliteStore, Store};
use crate::{ExecutorBuilder, RunningExecutor, Shutdown};

const ADMIN: &str = "testkit-admin";
const EXEC: &str = "testkit-executor";
const EXECUTOR_ID: &str = "testkit-executor";

/// Where the kit stops the executor, as a lost process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Step {
    /// The operation key is saved; the claim has not gone out.
    BeforeClaim,
    /// The platform confirmed `accepted`; the handler has not started.
    AfterAccepted,
    /// In the handler, at its `ctx.commit_point()`: right before the
    /// irreversible step.
    AtCommitPoint,
    /// The handler returned; nothing of its outcome is saved.
    AfterHandler,
    /// The final receipt is saved, not yet delivered.
    BeforeDelivery,
}

impl Step {
    fn point(self) -> &'static str {
        match self {
            Step::BeforeClaim => "after_operation_key_saved",
            Step::AfterAccepted => "after_accepted_confirmed",
            Step::AtCommitPoint => "commit_point",
            Step::AfterHandler => "after_handler",
            Step::BeforeDelivery => "after_final_saved",
        }
    }
}

/// Who settled a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SettledBy {
    /// The handler's own outcome.
    Handler,
    /// The tool's reconcile hook, after an unknown outcome.
    ReconcileHook,
    /// An operator (`Reconciler::resolve`).
    Operator,
    /// Refused before anything ran (arguments, digest, authorization).
    Refusal,
    /// Not settled: the outcome is unknown (`reconciliation_required`).
    Nobody,
}

/// How a call ended, as the platform and the executor's store say.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct CallOutcome {
    /// The run.
    pub run_id: String,
    /// The platform's state of the call.
    pub state: CallState,
    /// The `completed` result.
    pub result: Option<Value>,
    /// The `failed` error code.
    pub error_code: Option<String>,
    /// Who settled it.
    pub settled_by: SettledBy,
    /// The call as the platform holds it (receipts included).
    pub call: RunCall,
}

impl CallOutcome {
    /// Whether the call `completed`.
    pub fn is_completed(&self) -> bool {
        self.state == CallState::Completed
    }
}

/// A call submitted with [`TestKit::submit`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CallHandle {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
}

type Configure = Arc<dyn Fn(ExecutorBuilder) -> ExecutorBuilder + Send + Sync>;

/// Settings of a [`TestKit`].
#[derive(Debug, Default)]
#[must_use]
pub struct TestKitBuilder {
    crash_at: Option<Step>,
}

impl TestKitBuilder {
    /// Stops the first executor at `step` (of the first call that reaches
    /// it); [`TestKit::restart`] then starts a new one on the same store.
    pub fn crash_at(mut self, step: Step) -> Self {
        self.crash_at = Some(step);
        self
    }

    /// Starts the platform, publishes the tools `configure` registers, and
    /// starts an executor with them.
    ///
    /// # Errors
    /// The platform or the executor cannot start, or the tools fail the
    /// protocol's checks.
    pub async fn start(
        self,
        configure: impl Fn(ExecutorBuilder) -> ExecutorBuilder + Send + Sync + 'static,
    ) -> Result<TestKit> {
        let setup = |e: &dyn std::fmt::Display| Error::new(Kind::Builder, format!("test kit: {e}"));
        let server = DevServer::builder()
            .listen(([127, 0, 0, 1], 0).into())
            .token(ADMIN, "*")
            .token(EXEC, "executors:connect,tools:execute")
            .lease_ttl_ms(3_000)
            .heartbeat_interval_ms(500)
            .start()
            .await
            .map_err(|e| setup(&e))?;
        let platform = Platform::new(&server.base_url(), ADMIN)?;
        let dir = tempfile::tempdir().map_err(|e| setup(&e))?;
        let configure: Configure = Arc::new(configure);
        // The tools' names, for the binding.
        let probe = configure(ExecutorBuilder::default().allow_all())
            .base_url(server.base_url())
            .token(EXEC)
            .executor_id(EXECUTOR_ID)
            .binding_id("bnd_probe")
            .build()?;
        let names: Vec<String> = probe
            .tool_definitions()
            .iter()
            .map(|d| d.name.clone())
            .collect();
        let agent = platform.create_agent("testkit").await?;
        let name_refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let binding = platform
            .create_binding(&agent.agent_id, "testkit", &name_refs)
            .await?;
        let mut kit = TestKit {
            server: Some(server),
            platform,
            agent_version: String::new(),
            binding_id: binding.binding_id,
            store_url: format!("sqlite://{}", dir.path().join("executor.db").display()),
            store_path: dir.path().join("executor.db"),
            configure,
            running: None,
            health: crate::Health::default(),
            crashed: Arc::new(AtomicBool::new(false)),
            _dir: dir,
        };
        let executor = kit.executor(self.crash_at)?;
        kit.agent_version = kit
            .platform
            .publish(&agent.agent_id, executor.tool_definitions())
            .await?
            .agent_version;
        kit.health = executor.health();
        kit.running = Some(executor.start().await?);
        Ok(kit)
    }
}

/// The embedded platform with your tools published and an executor
/// serving them.
pub struct TestKit {
    server: Option<DevServer>,
    platform: Platform,
    agent_version: String,
    binding_id: String,
    store_url: String,
    store_path: std::path::PathBuf,
    configure: Configure,
    running: Option<RunningExecutor>,
    health: crate::Health,
    crashed: Arc<AtomicBool>,
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for TestKit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKit")
            .field("agent_version", &self.agent_version)
            .finish_non_exhaustive()
    }
}

impl TestKit {
    /// Settings: where to crash.
    pub fn builder() -> TestKitBuilder {
        TestKitBuilder::default()
    }

    /// [`TestKit::builder`]`().start(configure)`.
    ///
    /// # Errors
    /// As [`TestKitBuilder::start`].
    pub async fn start(
        configure: impl Fn(ExecutorBuilder) -> ExecutorBuilder + Send + Sync + 'static,
    ) -> Result<TestKit> {
        TestKit::builder().start(configure).await
    }

    fn executor(&self, crash_at: Option<Step>) -> Result<crate::Executor> {
        let server = self
            .server
            .as_ref()
            .expect("the platform runs while the kit lives");
        let mut builder = (self.configure)(
            ExecutorBuilder::default()
                .allow_all()
                .poll_interval(Duration::from_millis(25))
                .reconcile_interval(Duration::from_millis(100))
                .backoff(Duration::from_millis(10), Duration::from_millis(100), 4),
        )
        .base_url(server.base_url())
        .token(EXEC)
        .executor_id(EXECUTOR_ID)
        .binding_id(&self.binding_id)
        .store_url(&self.store_url);
        if let Some(step) = crash_at {
            let crashed = self.crashed.clone();
            let point = step.point();
            builder =
                builder.crash_plan(move |at| at == point && !crashed.swap(true, Ordering::SeqCst));
        }
        builder.build()
    }

    /// The platform's client (admin token): runs, diagnostics, faults.
    pub fn platform(&self) -> &Platform {
        &self.platform
    }

    /// The embedded platform's base URL, for an operator's tool that
    /// delivers receipts itself ([`crate::Reconciler::with_platform`]).
    pub fn base_url(&self) -> String {
        self.server
            .as_ref()
            .map(DevServer::base_url)
            .unwrap_or_default()
    }

    /// The executor's token on the embedded platform (scopes
    /// `executors:connect,tools:execute`), for an operator's tool that
    /// delivers receipts itself, with [`base_url`](Self::base_url).
    pub fn executor_token(&self) -> &str {
        EXEC
    }

    /// The published agent version.
    pub fn agent_version(&self) -> &str {
        &self.agent_version
    }

    /// Starts a run with one call of `tool`, without waiting.
    ///
    /// # Errors
    /// The platform refused the run (arguments that fail the schema, …).
    pub async fn submit(&self, tool: &str, arguments: Value) -> Result<CallHandle> {
        let run = self
            .platform
            .create_run(
                &self.agent_version,
                "testkit-user",
                vec![NewToolCall::new(tool, arguments)],
            )
            .await?;
        let call_id = run
            .tool_calls
            .first()
            .map(|c| c.call_id.clone())
            .ok_or_else(|| Error::new(Kind::Platform, "the run has no call"))?;
        Ok(CallHandle {
            run_id: run.run_id,
            call_id,
        })
    }

    /// Runs one call of `tool` and waits (up to 30 s) until it is settled.
    ///
    /// # Errors
    /// The run was refused, or did not settle in time.
    pub async fn call(&self, tool: &str, arguments: Value) -> Result<CallOutcome> {
        let handle = self.submit(tool, arguments).await?;
        self.wait(&handle).await
    }

    /// Waits (up to 30 s) until the call is settled: `completed`,
    /// `failed`, `cancelled`, `terminated`, or `reconciliation_required`
    /// with nothing left for the executor to try.
    ///
    /// # Errors
    /// It did not settle in time.
    pub async fn wait(&self, call: &CallHandle) -> Result<CallOutcome> {
        let store = SqliteStore::open(&self.store_url).await?;
        let end = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let run = self.platform.run(&call.run_id).await?;
            if let Some(outcome) = self.outcome(&store, call, &run).await? {
                return Ok(outcome);
            }
            if tokio::time::Instant::now() >= end {
                return Err(Error::new(
                    Kind::Platform,
                    format!("test kit: call {} did not settle within 30 s", call.call_id),
                ));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    async fn outcome(
        &self,
        store: &SqliteStore,
        handle: &CallHandle,
        run: &Run,
    ) -> Result<Option<CallOutcome>> {
        let Some(call) = run.tool_calls.iter().find(|c| c.call_id == handle.call_id) else {
            return Ok(None);
        };
        let local = store.call(&handle.run_id, &handle.call_id).await?;
        let settled_by = match (call.state, &local) {
            (CallState::ReconciliationRequired, Some(l))
                if l.state == crate::store::LocalState::ReconciliationRequired
                    && l.report.is_none()
                    && self.running.is_some() =>
            {
                // Settled for now, unless the hook is about to answer:
                // give it a moment.
                tokio::time::sleep(Duration::from_millis(300)).await;
                let again = store.call(&handle.run_id, &handle.call_id).await?;
                if again.is_some_and(|a| a.state != l.state) {
                    return Ok(None);
                }
                SettledBy::Nobody
            }
            (s, _) if !s.is_terminal() => return Ok(None),
            (_, Some(_)) => self.settled_by(store, handle).await?,
            (_, None) => SettledBy::Handler,
        };
        let final_body: Option<Value> = call
            .receipts
            .iter()
            .rev()
            .find(|r| r.kind.is_final())
            .and_then(|r| serde_json::from_str(r.body.get()).ok());
        Ok(Some(CallOutcome {
            run_id: handle.run_id.clone(),
            state: call.state,
            result: final_body.as_ref().and_then(|b| b.get("result").cloned()),
            error_code: final_body
                .as_ref()
                .and_then(|b| b["error"]["code"].as_str().map(str::to_owned)),
            settled_by,
            call: call.clone(),
        }))
    }

    /// Who wrote the call's final receipt, from its timeline.
    async fn settled_by(&self, store: &SqliteStore, handle: &CallHandle) -> Result<SettledBy> {
        let events = store.events(&handle.run_id, &handle.call_id).await?;
        let by = events
            .iter()
            .rev()
            .find(|e| e.what == "settled" || e.what == "resolved by operator")
            .map(|e| {
                let detail = e.detail.as_deref().unwrap_or("");
                if e.what == "resolved by operator" || detail.starts_with("resolved by") {
                    SettledBy::Operator
                } else if detail.starts_with("automatic check") {
                    SettledBy::ReconcileHook
                } else if detail.starts_with("refused before start") {
                    SettledBy::Refusal
                } else {
                    SettledBy::Handler
                }
            });
        Ok(by.unwrap_or(SettledBy::Handler))
    }

    /// Waits (up to 30 s) until the executor stopped at the step given to
    /// [`TestKitBuilder::crash_at`], and drops it as a lost process.
    ///
    /// # Errors
    /// It did not reach the step in time.
    pub async fn wait_crashed(&mut self) -> Result<()> {
        let end = tokio::time::Instant::now() + Duration::from_secs(30);
        while !self.crashed.load(Ordering::SeqCst) {
            if tokio::time::Instant::now() >= end {
                return Err(Error::new(
                    Kind::Platform,
                    "test kit: the executor did not reach its crash step within 30 s",
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.running.take();
        Ok(())
    }

    /// Stops the executor as a lost process would (nothing more is written
    /// or sent), without waiting for a crash step.
    pub fn kill(&mut self) {
        self.running.take();
    }

    /// Starts a new executor (same id, same store, no crash step): it
    /// resumes every call by the crash table.
    ///
    /// # Errors
    /// The executor cannot start.
    pub async fn restart(&mut self) -> Result<()> {
        self.running.take();
        let executor = self.executor(None)?;
        self.health = executor.health();
        self.running = Some(executor.start().await?);
        Ok(())
    }

    /// The health of the executor running now ([`crate::Executor::health`]);
    /// a [`restart`](Self::restart) starts another, with a health of its
    /// own: take it again.
    pub fn health(&self) -> crate::Health {
        self.health.clone()
    }

    /// The executor's store file (for `toolrunner calls … --db`).
    pub fn store_path(&self) -> &std::path::Path {
        &self.store_path
    }

    /// The operator's API over the executor's store, to look at what it
    /// holds (timelines, the outbox) as an operator would.
    ///
    /// # Errors
    /// The store cannot be opened.
    pub async fn reconciler(&self) -> Result<crate::Reconciler> {
        crate::Reconciler::open(&self.store_url).await
    }

    /// Drains the executor and stops the platform.
    ///
    /// # Errors
    /// The executor could not tell the platform.
    pub async fn shutdown(mut self) -> Result<()> {
        let drained = match self.running.take() {
            Some(r) => {
                r.shutdown(Shutdown::Drain {
                    deadline: Duration::from_secs(5),
                })
                .await
            }
            None => Ok(()),
        };
        if let Some(server) = self.server.take() {
            server.shutdown().await;
        }
        drained
    }
}

pub use crate::gate::ProcessFaults;

/// The call lifecycle's table (`lifecycle.rs`), written out as
/// `docs/architecture.md` shows it between its markers: the workspace's
/// test `layers` checks the document against it. Part of the seam below,
/// not stable.
pub fn lifecycle_table_markdown() -> String {
    crate::lifecycle::table_markdown()
}

/// The store's rows and writes, for tests that seed or read raw rows
/// (a backfill, a corrupt row, a store that fails on purpose) and for
/// benchmarks that time the store alone.
///
/// This is a seam for tests, not an extension point: the `Store` trait,
/// [`Change`](store::Change) and the rows follow the executor's schema
/// and change in any release, without notice. A product reads its calls
/// through [`Reconciler`](crate::Reconciler) and writes them only through
/// the executor.
pub mod store {
    pub use crate::store::*;
}
