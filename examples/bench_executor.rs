//! Drives N calls through the toolrunner executor (claim, checks,
//! `accepted`, a no-op write handler, `completed`, delivery) against the
//! in-process development platform, and prints calls/s. The executor's
//! store is a real SQLite file (WAL, `synchronous=FULL`), so the figure is
//! bounded by durable commits: every call commits about five times.
//!
//! ```text
//! cargo run --release --example bench_executor -- [--calls 2000] [--capacity 32]
//! ```

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::platform::{NewToolCall, Platform, RunStatus};
use toolrunner::{CallContext, Effect, Executor, Shutdown, Tool, ToolError, async_trait};

#[derive(Deserialize, JsonSchema)]
struct In {
    n: u64,
}

#[derive(Serialize, JsonSchema)]
struct Out {
    n: u64,
}

struct Noop;

#[async_trait]
impl Tool for Noop {
    type Input = In;
    type Output = Out;
    fn name(&self) -> &str {
        "bench.noop"
    }
    fn description(&self) -> &str {
        "does nothing, durably"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, _ctx: &CallContext, input: In) -> Result<Out, ToolError> {
        Ok(Out { n: input.n })
    }
}

fn arg(name: &str, default: usize) -> Result<usize> {
    let args: Vec<String> = std::env::args().collect();
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args.get(i + 1).context("missing value")?.parse()?),
        None => Ok(default),
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let calls = arg("--calls", 2000)?;
    let capacity = arg("--capacity", 32)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = toolrunner_devserver::DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let base = server.base_url();
    let admin = Platform::new(&base, "dev-admin")?;
    let dir = tempfile::tempdir()?;

    let agent = admin.create_agent("bench").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "b", &["bench.noop"])
        .await?;
    let executor = Executor::builder()
        .base_url(&base)
        .token("dev-executor")
        .executor_id("bench-exec")
        .binding_id(&binding.binding_id)
        .store_url(format!("sqlite://{}", dir.path().join("exec.db").display()))
        .capacity(u32::try_from(capacity)?)
        .poll_interval(Duration::from_millis(20))
        .allow_all()
        .tool(Noop)
        .build()?;
    let version = admin
        .publish(&agent.agent_id, executor.tool_definitions())
        .await?;
    let mut runs = Vec::new();
    for chunk in (0..calls).collect::<Vec<_>>().chunks(100) {
        let list: Vec<NewToolCall> = chunk
            .iter()
            .map(|n| NewToolCall::new("bench.noop", json!({"n": n})))
            .collect();
        let run = admin
            .create_run(&version.agent_version, "bench", list)
            .await?;
        runs.push(run.run_id);
    }

    let started = Instant::now();
    let running = executor.start().await?;
    for run_id in &runs {
        loop {
            let run = admin.run(run_id).await?;
            if run.status == RunStatus::Completed {
                break;
            }
            if started.elapsed() > Duration::from_secs(600) {
                bail!("run {run_id} did not complete: {:?}", run.status);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let elapsed = started.elapsed();
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    server.shutdown().await;
    println!("calls: {calls}  capacity: {capacity}  errors: 0");
    println!(
        "elapsed: {:.2} s  throughput: {:.0} calls/s",
        elapsed.as_secs_f64(),
        calls as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}
