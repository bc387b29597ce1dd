//! Review finding: the `accepted` step treats `401` / `403 missing_scope` as
//! a refusal of the call ("nothing may start ... else `abandoned`") instead of
//! the reaction-table row "any | 401, 403 missing_scope | keep everything,
//! stop claiming, surface a configuration error".
//!
//! Consequence: the call is marked `abandoned` locally while the platform
//! keeps it `claimed` and bound to this executor identity (heartbeats with
//! the connect scope keep the lease alive). A later start with a fixed token
//! sees it in `outstanding`, finds it known (abandoned) in the store and
//! does nothing: the call is pinned `claimed` forever.
//!
//! Steps: executor 1 (full token) claims the call and stops in the product's
//! authorizer (assignment saved, `accepted` not yet saved) and its process is
//! lost. Executor 2 (same id and store) restarts with a token that lost
//! `tools:execute`. Executor 3 restarts with the full token again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Notify;
use toolrunner::testing::store::{LocalState, SqliteStore, Store};
use toolrunner::{
    AuthorizationRequest, Authorizer, CallContext, Denied, Effect, Executor, Tool, ToolError,
    async_trait,
};
use toolrunner_devserver::DevServer;

const ADMIN: &str = "rv-admin";
const FULL: &str = "rv-full";
const CONNECT_ONLY: &str = "rv-connect-only";
const TOOL: &str = "review.charge";
const EXECUTOR_ID: &str = "exe-review-scope";

#[derive(Debug, Deserialize, JsonSchema)]
struct Input {
    #[allow(dead_code)] // only its schema matters
    amount: u64,
}

#[derive(Debug, Serialize, JsonSchema)]
struct Output {
    ok: bool,
}

struct Charge;

#[async_trait]
impl Tool for Charge {
    type Input = Input;
    type Output = Output;
    fn name(&self) -> &str {
        TOOL
    }
    fn description(&self) -> &str {
        "Charges"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, _ctx: &CallContext, _input: Input) -> Result<Output, ToolError> {
        Ok(Output { ok: true })
    }
}

/// Signals, then never answers (the process is lost inside the checks).
struct Stuck(Arc<Notify>);

#[async_trait]
impl Authorizer for Stuck {
    async fn authorize(&self, _r: &AuthorizationRequest) -> Result<(), Denied> {
        self.0.notify_one();
        std::future::pending().await
    }
}

struct World {
    base: String,
    http: toolrunner::platform::Platform,
    binding_id: String,
    store_url: String,
}

impl World {
    async fn admin(
        &self,
        method: toolrunner::platform::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Value> {
        let mut req = self.http.request(method, path);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await?;
        let v = resp.json();
        if !(200..300).contains(&resp.status) {
            bail!("{path}: {} {v}", resp.status);
        }
        Ok(v)
    }

    fn builder(&self, token: &str) -> toolrunner::ExecutorBuilder {
        Executor::builder()
            .base_url(&self.base)
            .token(token)
            .executor_id(EXECUTOR_ID)
            .binding_id(&self.binding_id)
            .store_url(&self.store_url)
            .poll_interval(Duration::from_millis(50))
            .request_timeout(Duration::from_secs(3))
            .backoff(Duration::from_millis(20), Duration::from_millis(200), 4)
            .tool(Charge)
    }

    async fn call_state(&self, run_id: &str) -> Result<String> {
        let run = self
            .admin(
                toolrunner::platform::Method::GET,
                &format!("/runs/{run_id}"),
                None,
            )
            .await?;
        Ok(run["tool_calls"][0]["state"]
            .as_str()
            .unwrap_or("?")
            .to_owned())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_scope_on_accepted_keeps_the_call() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .token(ADMIN, "*")
        .token(FULL, "executors:connect,tools:execute")
        .token(CONNECT_ONLY, "executors:connect")
        .lease_ttl_ms(5_000)
        .heartbeat_interval_ms(200)
        .start()
        .await?;
    let dir = tempfile::tempdir()?;
    let mut w = World {
        base: server.base_url(),
        http: toolrunner::platform::Platform::new(&server.base_url(), ADMIN)?,
        binding_id: String::new(),
        store_url: format!("sqlite://{}", dir.path().join("exec.db").display()),
    };
    let agent = w
        .admin(
            toolrunner::platform::Method::POST,
            "/agents",
            Some(json!({"name": "review"})),
        )
        .await?;
    let agent_id = agent["agent_id"].as_str().context("agent_id")?.to_owned();
    let binding = w
        .admin(
            toolrunner::platform::Method::POST,
            "/executor-bindings",
            Some(json!({"agent_id": agent_id, "name": "main", "tool_names": [TOOL]})),
        )
        .await?;
    w.binding_id = binding["binding_id"]
        .as_str()
        .context("binding_id")?
        .to_owned();

    // Executor 1: claims, saves the assignment, is lost inside the checks.
    let asked = Arc::new(Notify::new());
    let exec1 = w.builder(FULL).authorizer(Stuck(asked.clone())).build()?;
    let version = w
        .admin(
            toolrunner::platform::Method::POST,
            &format!("/agents/{agent_id}/versions"),
            Some(json!({"tools": exec1.tool_definitions()})),
        )
        .await?;
    let agv = version["agent_version"].as_str().context("agv")?.to_owned();
    let run = w
        .admin(
            toolrunner::platform::Method::POST,
            "/runs",
            Some(json!({"agent_version": agv, "subject": "u1",
                        "tool_calls": [{"tool_name": TOOL, "arguments": {"amount": 3}}]})),
        )
        .await?;
    let run_id = run["run_id"].as_str().context("run_id")?.to_owned();
    let call_id = run["tool_calls"][0]["call_id"]
        .as_str()
        .context("call_id")?
        .to_owned();
    let running1 = exec1.start().await?;
    tokio::time::timeout(Duration::from_secs(5), asked.notified())
        .await
        .context("executor 1 never reached the authorizer")?;
    drop(running1);
    assert_eq!(w.call_state(&run_id).await?, "claimed");

    // Executor 2: the token lost tools:execute.
    let running2 = w.builder(CONNECT_ONLY).allow_all().build()?.start().await?;
    let surfaced = tokio::time::timeout(Duration::from_secs(3), running2.wait()).await;
    let store = SqliteStore::open(&w.store_url).await?;
    let local2 = store.call(&run_id, &call_id).await?.context("known")?;
    drop(running2);

    // Executor 3: the token is fixed.
    let running3 = w.builder(FULL).allow_all().build()?.start().await?;
    let end = Instant::now() + Duration::from_secs(5);
    let mut platform = w.call_state(&run_id).await?;
    while platform != "completed" && Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(100)).await;
        platform = w.call_state(&run_id).await?;
    }
    let local3 = store.call(&run_id, &call_id).await?.context("known")?;
    drop(running3);
    let _ = server.shutdown().await;

    eprintln!(
        "executor 2: wait() -> {:?}; local state {:?} ({:?}); after the token was fixed: \
         platform {platform}, local {:?}",
        surfaced
            .as_ref()
            .map(|r| r.as_ref().map_err(|e| e.to_string())),
        local2.state,
        local2.reason,
        local3.state
    );
    assert_ne!(
        local2.state,
        LocalState::Abandoned,
        "403 missing_scope on `accepted` must keep everything, not abandon the call"
    );
    assert_eq!(
        platform, "completed",
        "after the token was fixed the call stayed {platform} on the platform \
         (local {:?}): nothing resumes it",
        local3.state
    );
    Ok(())
}
