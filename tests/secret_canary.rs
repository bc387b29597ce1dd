//! The secret canary: unique strings planted in the executor's token, the
//! arguments and the results (and the grants the platform issues, read
//! back from the store) go through every path a call can take — completed,
//! failed, an unknown outcome left for a person, one settled by the
//! `reconcile` hook, a result that fails its schema, an operator's resolve
//! and redelivery — and none of them shows up in any log line at `trace`
//! (span fields and span events included), any span attribute or event as
//! OpenTelemetry exports it, any metric label, or the `Debug` of a public
//! type. (The operator CLI's output is checked by the CLI's own tests,
//! `sdk/cli/tests/cli/canary.rs`, which run its binary.)
//!
//! The subscriber and the recorder are process-wide; this binary holds
//! only this test.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[path = "support/leaks.rs"]
mod leaks;

use anyhow::{Context, Result, ensure};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::platform::{CallState, NewToolCall, Platform};
use toolrunner::{
    CallContext, CallFilter, Evidence, Executor, LocalState, Outcome, Reconciled, ToolError,
};
use toolrunner_devserver::DevServer;
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

const TOKEN: &str = "tok-CANARY-token-5f1e0a";
/// The operator console's own token.
const CONSOLE_TOKEN: &str = "console-CANARY-token-77aa01";
const ARGUMENT: &str = "CANARY-argument-9b2c4d";
const RESULT: &str = "CANARY-result-7e3f81";
const ADMIN: &str = "canary-admin";

/// What to do.
#[toolrunner::schema]
#[derive(Deserialize)]
#[allow(dead_code)] // only its schema matters
struct Job {
    /// Free text.
    note: String,
}

/// What was done.
#[toolrunner::schema]
#[derive(Serialize)]
struct Done {
    /// A reference (at most 12 characters).
    #[schemars(length(max = 12))]
    reference: String,
}

fn done() -> Done {
    Done {
        reference: RESULT[..12].to_owned(),
    }
}

/// Completes, with the result canary.
#[toolrunner::tool(name = "c.ok", effect = write)]
async fn ok(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Ok(done())
}

/// Fails, saying the result canary to the model.
#[toolrunner::tool(name = "c.fail", effect = write)]
async fn fail(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::failed("declined", format!("declined: {RESULT}")))
}

/// Unknown outcome; a person settles it.
#[toolrunner::tool(name = "c.unknown", effect = write)]
async fn unknown(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::unknown("the downstream timed out"))
}

/// Unknown outcome; its hook finds it happened.
#[toolrunner::tool(name = "c.hooked", effect = write, reconcile = found)]
async fn hooked(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::unknown("the downstream timed out"))
}

async fn found(_ctx: CallContext) -> Reconciled<Done> {
    Reconciled::Happened(done())
}

/// Returns a result its own schema refuses (too long), holding the canary.
#[toolrunner::tool(name = "c.bad", effect = write)]
async fn bad(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Ok(Done {
        reference: RESULT.to_owned(),
    })
}

/// Allows every call, keeping the `Debug` of what it was asked (as a
/// product's authorizer might log it).
#[derive(Clone, Default)]
struct Keeping(Arc<Mutex<Vec<String>>>);

#[toolrunner::async_trait]
impl toolrunner::Authorizer for Keeping {
    async fn authorize(
        &self,
        request: &toolrunner::AuthorizationRequest,
    ) -> Result<(), toolrunner::Denied> {
        self.0
            .lock()
            .expect("not poisoned")
            .push(format!("{request:?}"));
        Ok(())
    }
}

/// Appends everything written to a shared buffer.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("not poisoned").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_argument_or_result_reaches_logs_spans_metrics_or_debug() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let logs = Capture::default();
    let sink = logs.clone();
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    tracing_subscriber::registry()
        .with(
            tracing_subscriber::fmt::layer()
                .with_ansi(false)
                .with_span_events(FmtSpan::FULL)
                .with_writer(move || sink.clone()),
        )
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("canary")))
        .try_init()
        .context("the only subscriber of this test binary")?;
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("the only recorder of this test binary")?;
    let mut debug: Vec<String> = Vec::new();

    let dir = tempfile::tempdir()?;
    let server = DevServer::builder()
        .listen(([127, 0, 0, 1], 0).into())
        .token(ADMIN, "*")
        .token(TOKEN, "executors:connect,tools:execute")
        .heartbeat_interval_ms(200)
        .start()
        .await?;
    let platform = Platform::new(&server.base_url(), ADMIN)?;
    let agent = platform.create_agent("canary").await?;
    let tools = ["c.ok", "c.fail", "c.unknown", "c.hooked", "c.bad"];
    let binding = platform
        .create_binding(&agent.agent_id, "canary", &tools)
        .await?;
    let store_url = format!("sqlite://{}", dir.path().join("executor.db").display());
    let authorizer = Keeping::default();
    let builder = Executor::builder()
        .base_url(server.base_url())
        .allow_insecure_http()
        .token(TOKEN)
        .executor_id("canary-01")
        .binding_id(&binding.binding_id)
        .store_url(&store_url)
        .poll_interval(Duration::from_millis(25))
        .reconcile_interval(Duration::from_millis(100))
        .authorizer(authorizer.clone())
        .tool(ok)
        .tool(fail)
        .tool(unknown)
        .tool(hooked)
        .tool(bad);
    debug.push(format!("{builder:?}"));
    let executor = builder.build()?;
    debug.push(format!("{executor:?}"));
    let health = executor.health();
    let version = platform
        .publish(&agent.agent_id, executor.tool_definitions())
        .await?;
    let calls = tools
        .iter()
        .map(|t| NewToolCall::new(*t, json!({ "note": ARGUMENT })))
        .collect();
    let run = platform
        .create_run(&version.agent_version, "user_42", calls)
        .await?;
    let running = executor.start().await?;
    debug.push(format!("{running:?}"));
    // Settled, and the hooked call's `reconciliation_required` (itself a
    // settled state) past: its hook completes it on a later check.
    let settled = platform
        .wait_for(
            &run.run_id,
            Duration::from_secs(20),
            "settled, the hooked call completed",
            |run| {
                run.tool_calls.iter().all(|c| {
                    matches!(
                        c.state,
                        CallState::Completed
                            | CallState::Failed
                            | CallState::ReconciliationRequired
                    )
                }) && run
                    .tool_calls
                    .get(3)
                    .is_some_and(|c| c.state == CallState::Completed)
            },
        )
        .await?;
    debug.push(format!("{settled:?}"));
    let states: Vec<String> = settled
        .tool_calls
        .iter()
        .map(|c| format!("{:?}", c.state))
        .collect();
    ensure!(
        states
            == [
                "Completed",
                "Failed",
                "ReconciliationRequired",
                "Completed",
                "ReconciliationRequired"
            ],
        "{states:?}"
    );
    // The gauges and the health (published once a second).
    tokio::time::sleep(Duration::from_millis(1200)).await;
    debug.push(format!("{health:?} {:?}", health.report()));

    // An operator resolves the unknown one, with the platform at hand.
    let reconciler = toolrunner::Reconciler::open(&store_url)
        .await?
        .with_platform(&server.base_url(), TOKEN)?;
    debug.push(format!("{reconciler:?}"));
    let unknown_call = &settled.tool_calls[2];
    let outcome = Outcome::Completed(json!({ "reference": &RESULT[..12] }));
    debug.push(format!("{outcome:?}"));
    // A request of one's own through the platform client, with the token.
    let client = Platform::new(&server.base_url(), TOKEN)?;
    debug.push(format!(
        "{client:?} {:?}",
        client
            .request(toolrunner::platform::Method::POST, "/runs")
            .json(&json!({ "note": ARGUMENT }))
    ));
    let resolved = reconciler
        .resolve(
            &run.run_id,
            &unknown_call.call_id,
            outcome,
            &Evidence::new("ops", "the downstream shows it").with_reference("ticket-1"),
        )
        .await?;
    debug.push(format!("{resolved:?}"));
    debug.push(format!("{:?}", reconciler.redeliver(None).await?));
    let listed = reconciler.list(&CallFilter::new()).await?;
    debug.push(format!("{listed:?}"));
    for c in &listed {
        debug.push(format!(
            "{:?}",
            reconciler.show(c.run_id(), c.call_id()).await?
        ));
    }
    debug.push(format!("{:?}", reconciler.outbox().await?));
    debug.push(format!("{:?}", LocalState::ALL));
    // The operator console over the store, with the platform's token and
    // a token of its own: every page, as a signed-in operator sees it.
    let builder = toolrunner::console::Console::builder()
        .database(&store_url)
        .platform(server.base_url(), TOKEN)
        .auth_token(CONSOLE_TOKEN);
    debug.push(format!("{builder:?}"));
    let console = builder.build().await?;
    debug.push(format!("{console:?}"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let serving = tokio::spawn(axum::serve(listener, console.router()).into_future());
    let http = reqwest::Client::new();
    let mut pages = String::new();
    let mut paths: Vec<String> = ["/", "/calls", "/calls?needs=person", "/outbox", "/login"]
        .map(str::to_owned)
        .to_vec();
    paths.extend(
        listed
            .iter()
            .map(|c| format!("/calls/{}/{}", c.run_id(), c.call_id())),
    );
    for path in &paths {
        let page = http
            .get(format!("{base}{path}"))
            .bearer_auth(CONSOLE_TOKEN)
            .send()
            .await?;
        ensure!(page.status() == 200, "GET {path}: {}", page.status());
        pages.push_str(&page.text().await?);
    }
    serving.abort();
    let asked = authorizer.0.lock().expect("not poisoned").clone();
    ensure!(
        asked.len() == tools.len(),
        "the authorizer was asked for every call"
    );
    debug.extend(asked);
    running
        .shutdown(toolrunner::Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;

    // The grants the platform issued, as the store holds them.
    let store = toolrunner::testing::store::SqliteStore::open(&store_url).await?;
    let mut grants = Vec::new();
    for c in toolrunner::testing::store::Store::calls(
        &store,
        &toolrunner::testing::store::CallFilter::default(),
    )
    .await?
    {
        if let Some(a) = &c.assignment {
            grants.push(a.grant.expose().to_owned());
        }
    }
    ensure!(
        grants.len() == tools.len(),
        "one grant per call: {grants:?}"
    );
    server.shutdown().await;
    provider.force_flush()?;

    let logs = String::from_utf8_lossy(&logs.0.lock().expect("not poisoned")).into_owned();
    let spans = format!("{:#?}", exporter.get_finished_spans()?);
    let metrics = prometheus.render();
    let debug = debug.join("\n");
    // The captures hold what they should, so an empty one cannot pass.
    ensure!(
        logs.contains("execute_tool") && logs.contains(&run.run_id),
        "the logs were captured"
    );
    ensure!(
        spans.contains("gen_ai.tool.call.id"),
        "the spans were captured"
    );
    ensure!(
        metrics.contains("toolrunner_tool_calls_total"),
        "the metrics were captured"
    );
    ensure!(debug.contains("canary-01"), "the Debug output was captured");
    let planted: Vec<(&str, String)> = [
        ("the token", TOKEN.to_owned()),
        ("the arguments", ARGUMENT.to_owned()),
        ("a result", RESULT[..12].to_owned()),
    ]
    .into_iter()
    .chain(grants.into_iter().map(|g| ("a grant", g)))
    .collect();
    let planted: Vec<(&str, &str)> = planted.iter().map(|(w, s)| (*w, s.as_str())).collect();
    ensure!(
        pages.contains("id=\"operation-key\"") && pages.contains(ARGUMENT),
        "the console's pages were captured (a call's page shows its arguments, on purpose)"
    );
    let mut leaks = leaks::leaks(
        &[
            ("logs", &logs),
            ("spans", &spans),
            ("metrics", &metrics),
            ("Debug output", &debug),
        ],
        &planted,
    );
    // The console shows arguments and results to an operator on purpose;
    // never a token or a grant.
    let secrets: Vec<(&str, &str)> = planted
        .iter()
        .copied()
        .filter(|(what, _)| matches!(*what, "the token" | "a grant"))
        .chain([("the console's token", CONSOLE_TOKEN)])
        .collect();
    leaks.extend(leaks::leaks(&[("console pages", &pages)], &secrets));
    leaks.extend(leaks::leaks(
        &[("Debug output", &debug)],
        &[("the console's token", CONSOLE_TOKEN)],
    ));
    ensure!(
        leaks.is_empty(),
        "{} leak(s):\n{}",
        leaks.len(),
        leaks.join("\n---\n")
    );
    Ok(())
}
