//! Drives N calls (claim, `accepted`, `completed`) from C concurrent
//! clients against the development platform and prints calls/s and
//! p50/p99 latency. Exits non-zero on any error.
//!
//! ```text
//! cargo run --release --example bench_platform -- [--calls 10000] [--clients 64] [--base-url URL]
//! ```
//! Without `--base-url` it starts the platform in-process (in memory).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use toolrunner::platform::Platform;

struct Args {
    calls: usize,
    clients: usize,
    base_url: Option<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        calls: 10_000,
        clients: 64,
        base_url: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--calls" => args.calls = value.parse()?,
            "--clients" => args.clients = value.parse()?,
            "--base-url" => args.base_url = Some(value),
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(args)
}

/// The bare protocol through the typed client's raw requests.
#[derive(Clone)]
struct Api {
    http: Platform,
}

impl Api {
    async fn send(
        &self,
        method: toolrunner::platform::Method,
        path: &str,
        token: &str,
        body: Option<Value>,
        grant: Option<&str>,
    ) -> Result<Value> {
        let mut req = self.http.request(method, path).token(Some(token));
        if let Some(b) = body {
            req = req.json(&b);
        }
        if let Some(g) = grant {
            req = req.header("Tool-Grant", g);
        }
        let resp = req.send().await?;
        let value = resp.json();
        if !(200..300).contains(&resp.status) {
            bail!("{path}: {} {value}", resp.status);
        }
        Ok(value)
    }

    async fn post(&self, path: &str, token: &str, body: Value) -> Result<Value> {
        self.send(
            toolrunner::platform::Method::POST,
            path,
            token,
            Some(body),
            None,
        )
        .await
    }
}

const ADMIN: &str = "dev-admin";
const EXEC: &str = "dev-executor";

#[tokio::main]
async fn main() -> Result<()> {
    let args = parse_args()?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = match &args.base_url {
        Some(_) => None,
        None => Some(
            toolrunner_devserver::DevServer::builder()
                .listen("127.0.0.1:0".parse()?)
                .start()
                .await?,
        ),
    };
    let base = args
        .base_url
        .clone()
        .or_else(|| server.as_ref().map(|s| s.base_url()))
        .expect("one of them");
    let api = Api {
        http: Platform::new(&base, ADMIN)?,
    };

    let agent = api.post("/agents", ADMIN, json!({"name": "bench"})).await?;
    let agent_id = agent["agent_id"].as_str().context("agent_id")?.to_owned();
    let binding = api
        .post(
            "/executor-bindings",
            ADMIN,
            json!({"agent_id": agent_id, "name": "bench", "tool_names": ["bench.echo"]}),
        )
        .await?;
    let binding_id = binding["binding_id"]
        .as_str()
        .context("binding_id")?
        .to_owned();
    let tool = json!({"name": "bench.echo", "description": "echo", "binding_id": binding_id,
        "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                         "additionalProperties": false}});
    let version = api
        .post(
            &format!("/agents/{agent_id}/versions"),
            ADMIN,
            json!({"tools": [tool]}),
        )
        .await?;
    let agent_version = version["agent_version"]
        .as_str()
        .context("agent_version")?
        .to_owned();

    let mut queue = Vec::with_capacity(args.calls);
    let per_run = 100;
    let mut made = 0;
    while made < args.calls {
        let n = per_run.min(args.calls - made);
        let calls: Vec<Value> = (0..n)
            .map(|i| json!({"tool_name": "bench.echo", "arguments": {"n": made + i}}))
            .collect();
        let run = api
            .post(
                "/runs",
                ADMIN,
                json!({"agent_version": agent_version, "subject": "bench", "tool_calls": calls}),
            )
            .await?;
        let run_id = run["run_id"].as_str().context("run_id")?.to_owned();
        for c in run["tool_calls"].as_array().context("tool_calls")? {
            queue.push((
                run_id.clone(),
                c["call_id"].as_str().context("call_id")?.to_owned(),
            ));
        }
        made += n;
    }
    let queue = Arc::new(Mutex::new(queue));

    let started = Instant::now();
    let mut workers = Vec::new();
    for w in 0..args.clients {
        let (api, queue, binding_id) = (api.clone(), queue.clone(), binding_id.clone());
        workers.push(tokio::spawn(async move {
            worker(w, api, queue, binding_id).await
        }));
    }
    let mut latencies = Vec::with_capacity(args.calls);
    let mut errors = 0usize;
    for w in workers {
        match w.await? {
            Ok(l) => latencies.extend(l),
            Err(e) => {
                errors += 1;
                eprintln!("worker failed: {e:#}");
            }
        }
    }
    let elapsed = started.elapsed();
    latencies.sort();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 - 1.0) * p).round() as usize)
            .copied()
            .unwrap_or_default()
    };
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "calls: {}  clients: {}  errors: {errors}",
        latencies.len(),
        args.clients
    );
    println!(
        "elapsed: {:.2} s  throughput: {:.0} calls/s",
        elapsed.as_secs_f64(),
        latencies.len() as f64 / elapsed.as_secs_f64()
    );
    println!(
        "per-call latency (claim + accepted + completed): p50 {:.2} ms  p99 {:.2} ms  max {:.2} ms",
        ms(pct(0.5)),
        ms(pct(0.99)),
        ms(pct(1.0))
    );
    if let Some(s) = server {
        s.shutdown().await;
    }
    if errors > 0 || latencies.len() != args.calls {
        bail!(
            "{errors} errors, {} of {} calls done",
            latencies.len(),
            args.calls
        );
    }
    Ok(())
}

async fn worker(
    w: usize,
    api: Api,
    queue: Arc<Mutex<Vec<(String, String)>>>,
    binding_id: String,
) -> Result<Vec<Duration>> {
    let executor_id = format!("bench-{w}");
    let connected = api.post("/executors/connect", EXEC, json!({"executor_id": executor_id, "binding_id": binding_id, "tools": ["bench.echo"], "capacity": 4})).await?;
    let connection_id = connected["connection_id"]
        .as_str()
        .context("connection_id")?
        .to_owned();
    let mut latencies = Vec::new();
    for n in 0.. {
        let Some((run_id, call_id)) = queue.lock().await.pop() else {
            break;
        };
        let t = Instant::now();
        let claim = api.post(&format!("/runs/{run_id}/tool-calls/{call_id}/claim"), EXEC,
            json!({"executor_id": executor_id, "connection_id": connection_id, "operation_key": format!("op-{w}-{n}")})).await?;
        let asg = &claim["assignment"];
        let grant = asg["grant"].as_str().context("grant")?;
        let base = json!({"executor_id": executor_id, "assignment_id": asg["assignment_id"]});
        let path = format!("/runs/{run_id}/tool-calls/{call_id}/receipts");
        let mut accepted = base.clone();
        accepted["receipt_id"] = json!("rcp-a");
        accepted["sequence"] = json!(0);
        accepted["kind"] = json!("accepted");
        let a = api
            .send(
                toolrunner::platform::Method::POST,
                &path,
                EXEC,
                Some(accepted),
                Some(grant),
            )
            .await?;
        if a["accepted"] != json!(true) {
            bail!("accepted was not confirmed: {a}");
        }
        let mut completed = base;
        completed["receipt_id"] = json!("rcp-c");
        completed["sequence"] = json!(1);
        completed["kind"] = json!("completed");
        completed["result"] = json!({"echo": call_id});
        api.send(
            toolrunner::platform::Method::POST,
            &path,
            EXEC,
            Some(completed),
            Some(grant),
        )
        .await?;
        latencies.push(t.elapsed());
    }
    Ok(latencies)
}
