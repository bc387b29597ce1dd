//! Shared setup for the executor integration tests: one development
//! platform per test (on `127.0.0.1:0`), an agent and a binding made through
//! the real admin API, a tempdir store per test, and bounded polling of
//! `GET /v1/runs/{id}`.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tempfile::TempDir;
use toolrunner::testing::store::SqliteStore;
use toolrunner::{Executor, ExecutorBuilder, Shutdown};
use toolrunner_devserver::DevServer;

/// Admin token (`*`).
pub const ADMIN: &str = "exec-test-admin";
/// The executor's token unless a test picks its own.
pub const EXEC: &str = "exec-test-executor";

/// Call states that will not change without an operator.
pub const SETTLED: [&str; 5] = [
    "completed",
    "failed",
    "cancelled",
    "reconciliation_required",
    "terminated",
];

/// How the platform of one test is configured.
#[derive(Debug, Clone)]
pub struct Opts {
    pub lease_ttl_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub stream: bool,
    pub exec_token: String,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            lease_ttl_ms: 15_000,
            heartbeat_interval_ms: 1_000,
            stream: true,
            exec_token: EXEC.to_owned(),
        }
    }
}

/// One test's world: a platform with an agent and a binding, a store.
pub struct Env {
    server: Option<DevServer>,
    pub base: String,
    /// The typed client, with the admin token.
    pub http: toolrunner::platform::Platform,
    pub exec_token: String,
    pub store_url: String,
    pub agent_id: String,
    pub binding_id: String,
    // Last: the store files outlive everything that may still use them.
    pub dir: TempDir,
}

impl Env {
    /// Starts a platform and creates an agent and a binding for `tools`.
    pub async fn start(opts: Opts, tools: &[&str]) -> Result<Env> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = DevServer::builder()
            .listen("127.0.0.1:0".parse()?)
            .token(ADMIN, "*")
            .token(&opts.exec_token, "executors:connect,tools:execute")
            .lease_ttl_ms(opts.lease_ttl_ms)
            .heartbeat_interval_ms(opts.heartbeat_interval_ms);
        if !opts.stream {
            builder = builder.without_stream();
        }
        let server = builder.start().await.context("starting the platform")?;
        let dir = tempfile::tempdir()?;
        let store_url = format!("sqlite://{}", dir.path().join("exec.db").display());
        let http = toolrunner::platform::Platform::new(&server.base_url(), ADMIN)?;
        let mut env = Env {
            base: server.base_url(),
            server: Some(server),
            http,
            exec_token: opts.exec_token,
            store_url,
            agent_id: String::new(),
            binding_id: String::new(),
            dir,
        };
        let agent = env
            .post("/agents", json!({"name": "executor-tests"}))
            .await?;
        env.agent_id = str_of(&agent, "agent_id")?;
        let binding = env
            .post(
                "/executor-bindings",
                json!({"agent_id": env.agent_id, "name": "main", "tool_names": tools}),
            )
            .await?;
        env.binding_id = str_of(&binding, "binding_id")?;
        Ok(env)
    }

    /// A second store URL in this test's directory (another process).
    pub fn other_store_url(&self, name: &str) -> String {
        format!("sqlite://{}", self.dir.path().join(name).display())
    }

    /// An executor builder wired to this platform, binding and store, with
    /// small intervals. Tests add tools (and maybe an authorizer).
    pub fn builder(&self, executor_id: &str) -> ExecutorBuilder {
        Executor::builder()
            .base_url(&self.base)
            .token(&self.exec_token)
            .executor_id(executor_id)
            .binding_id(&self.binding_id)
            .store_url(&self.store_url)
            .poll_interval(Duration::from_millis(50))
            .request_timeout(Duration::from_secs(3))
            .backoff(Duration::from_millis(20), Duration::from_millis(200), 4)
            .allow_all()
    }

    /// Publishes a version with these tool definitions; its `agent_version`.
    pub async fn publish(&self, tools: &[toolrunner::platform::ToolDefinition]) -> Result<String> {
        let v = self
            .post(
                &format!("/agents/{}/versions", self.agent_id),
                json!({ "tools": tools }),
            )
            .await?;
        str_of(&v, "agent_version")
    }

    /// Publishes the executor's own tool definitions.
    pub async fn publish_for(&self, executor: &Executor) -> Result<String> {
        self.publish(executor.tool_definitions()).await
    }

    /// Starts a run whose calls are `(tool_name, arguments)`; its `run_id`.
    pub async fn run(&self, agv: &str, subject: &str, calls: &[(&str, Value)]) -> Result<String> {
        let calls: Vec<Value> = calls
            .iter()
            .map(|(t, a)| json!({"tool_name": t, "arguments": a}))
            .collect();
        self.run_with(agv, subject, calls).await
    }

    /// Starts a run with raw call objects (e.g. with `unchecked: true`).
    pub async fn run_with(&self, agv: &str, subject: &str, calls: Vec<Value>) -> Result<String> {
        let run = self
            .post(
                "/runs",
                json!({"agent_version": agv, "subject": subject, "tool_calls": calls}),
            )
            .await?;
        str_of(&run, "run_id")
    }

    /// `GET /v1/runs/{id}`.
    pub async fn get_run(&self, run_id: &str) -> Result<Value> {
        self.get(&format!("/runs/{run_id}")).await
    }

    /// `POST /v1/runs/{id}/cancel`.
    pub async fn cancel(&self, run_id: &str) -> Result<Value> {
        self.post(&format!("/runs/{run_id}/cancel"), json!({}))
            .await
    }

    /// The binding's diagnostics.
    pub async fn diagnostics(&self) -> Result<Value> {
        self.get(&format!(
            "/agents/{}/executor-bindings/{}/diagnostics",
            self.agent_id, self.binding_id
        ))
        .await
    }

    /// Polls the run until `done` holds, failing after `within` with the
    /// last run seen.
    pub async fn wait_run(
        &self,
        run_id: &str,
        within: Duration,
        what: &str,
        done: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        let end = Instant::now() + within;
        loop {
            let run = self.get_run(run_id).await?;
            if done(&run) {
                return Ok(run);
            }
            if Instant::now() >= end {
                bail!(
                    "run {run_id}: not {what} within {within:?}; last seen:\n{}",
                    serde_json::to_string_pretty(&run)?
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Polls until every call of the run is in one of [`SETTLED`].
    pub async fn wait_settled(&self, run_id: &str, within: Duration) -> Result<Value> {
        self.wait_run(run_id, within, "settled", |run| {
            calls(run)
                .iter()
                .all(|c| SETTLED.contains(&state(c).as_str()))
        })
        .await
    }

    /// Opens the executor's store (read side) as another process would.
    pub async fn open_store(&self) -> Result<SqliteStore> {
        Ok(SqliteStore::open(&self.store_url).await?)
    }

    /// Stops the platform.
    pub async fn shutdown(mut self) {
        if let Some(s) = self.server.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), s.shutdown()).await;
        }
    }

    pub async fn post(&self, path: &str, body: Value) -> Result<Value> {
        let req = self
            .http
            .request(toolrunner::platform::Method::POST, path)
            .json(&body);
        answer(req, "POST", path).await
    }

    /// Sets the platform's fault injection (`PUT /v1/dev/faults`).
    pub async fn faults(&self, error_rate: f64) -> Result<Value> {
        let faults = toolrunner::platform::FaultSettings {
            error_rate,
            ..Default::default()
        };
        Ok(serde_json::to_value(self.http.set_faults(&faults).await?)?)
    }

    pub async fn get(&self, path: &str) -> Result<Value> {
        let req = self.http.request(toolrunner::platform::Method::GET, path);
        answer(req, "GET", path).await
    }
}

async fn answer(req: toolrunner::platform::RawRequest, method: &str, path: &str) -> Result<Value> {
    let resp = req.send().await?;
    let body = resp.json();
    if !(200..300).contains(&resp.status) {
        bail!("{method} {path}: platform answered {}: {body}", resp.status);
    }
    Ok(body)
}

/// A string member, or an error naming it.
pub fn str_of(v: &Value, key: &str) -> Result<String> {
    v[key]
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("no string {key} in {v}"))
}

/// The run's calls.
pub fn calls(run: &Value) -> Vec<Value> {
    run["tool_calls"].as_array().cloned().unwrap_or_default()
}

/// The run's first call of this tool.
pub fn call_of(run: &Value, tool: &str) -> Value {
    calls(run)
        .into_iter()
        .find(|c| c["tool_name"] == tool)
        .unwrap_or_else(|| panic!("no call of {tool} in {run}"))
}

/// A call's state.
pub fn state(call: &Value) -> String {
    call["state"].as_str().unwrap_or("?").to_owned()
}

/// A call's stored receipts as `(kind, sequence)`.
pub fn kinds(call: &Value) -> Vec<(String, u64)> {
    call["receipts"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .map(|r| {
                    (
                        r["kind"].as_str().unwrap_or("?").to_owned(),
                        r["sequence"].as_u64().unwrap_or(u64::MAX),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The body of a call's receipt of this kind.
pub fn receipt_body(call: &Value, kind: &str) -> Value {
    call["receipts"]
        .as_array()
        .and_then(|rs| rs.iter().find(|r| r["kind"] == kind))
        .map(|r| r["body"].clone())
        .unwrap_or(Value::Null)
}

/// `(kind, sequence)` pairs, to compare with [`kinds`].
pub fn pairs(list: &[(&str, u64)]) -> Vec<(String, u64)> {
    list.iter().map(|(k, s)| ((*k).to_owned(), *s)).collect()
}

/// Drain with a deadline that fits the tests.
pub const DRAIN: Shutdown = Shutdown::Drain {
    deadline: Duration::from_secs(5),
};

/// Awaits `fut`, failing the test if it takes longer than `within`.
pub async fn bounded<T>(within: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(within, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not finish within {within:?}"),
    }
}

/// Polls `cond` every 20 ms; `false` if it never held within `within`.
pub async fn eventually(within: Duration, cond: impl Fn() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
