//! Telemetry as its readers see it: a tracing backend (the span tree and
//! its attributes, through `tracing-opentelemetry` into OpenTelemetry's
//! in-memory exporter), a Prometheus scrape (every metric of the table in
//! `docs/operations.md` with its labels, and no other), and an
//! orchestrator's probes (`/readyz` through the `admin` router).
//!
//! The Prometheus recorder is process-wide: it is installed once for this
//! test binary. The span tests install their subscriber for their own
//! thread only, on a current-thread runtime, so every task of their
//! executor reports to it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use opentelemetry::trace::{Status, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use toolrunner::testing::{ProcessFaults, SettledBy, Step, TestKit};
use toolrunner::{CallContext, Evidence, Outcome, ToolError};
use tracing_subscriber::layer::SubscriberExt;

/// What to do.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Job {
    /// Free text, echoed back.
    note: String,
}

/// What was done.
#[toolrunner::schema]
#[derive(Serialize)]
struct Done {
    /// The note, echoed.
    note: String,
}

/// Completes.
#[toolrunner::tool(name = "t.ok", effect = write)]
async fn ok(_ctx: CallContext, input: Job) -> Result<Done, ToolError> {
    Ok(Done { note: input.note })
}

/// Fails, confirmed.
#[toolrunner::tool(name = "t.fail", effect = write)]
async fn fail(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::failed("declined", "the downstream declined"))
}

/// Its outcome is unknown (no reconcile hook: it waits for a person).
#[toolrunner::tool(name = "t.unknown", effect = write)]
async fn unknown(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::unknown("the downstream timed out"))
}

/// Completes (the metrics test's own tools: the tests of this binary run
/// side by side on one recorder, each executor named `testkit-executor`).
#[toolrunner::tool(name = "m.ok", effect = write)]
async fn m_ok(_ctx: CallContext, input: Job) -> Result<Done, ToolError> {
    Ok(Done { note: input.note })
}

/// Fails, confirmed.
#[toolrunner::tool(name = "m.fail", effect = write)]
async fn m_fail(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::failed("declined", "the downstream declined"))
}

/// Its outcome is unknown.
#[toolrunner::tool(name = "m.unknown", effect = write)]
async fn m_unknown(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::unknown("the downstream timed out"))
}

/// Its outcome is unknown, and its hook finds it happened.
#[toolrunner::tool(name = "t.hooked", effect = write, reconcile = found)]
async fn hooked(_ctx: CallContext, _input: Job) -> Result<Done, ToolError> {
    Err(ToolError::unknown("the downstream timed out"))
}

async fn found(_ctx: CallContext) -> toolrunner::Reconciled<Done> {
    toolrunner::Reconciled::Happened(Done {
        note: "found".into(),
    })
}

/// Takes a while (a drain waits for it).
#[toolrunner::tool(name = "t.slow", effect = read)]
async fn slow(_ctx: CallContext, input: Job) -> Result<Done, ToolError> {
    tokio::time::sleep(Duration::from_millis(1500)).await;
    Ok(Done { note: input.note })
}

fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.as_str().into_owned())
}

/// The finished spans, once a span for `call_id` named `name` is among
/// them (a call's span ends after its first delivery, a moment after the
/// platform says the call settled).
async fn spans_with(
    exporter: &InMemorySpanExporter,
    name: &str,
    call_id: &str,
) -> Result<Vec<SpanData>> {
    for _ in 0..200 {
        let spans = exporter.get_finished_spans()?;
        if spans
            .iter()
            .any(|s| s.name == name && attr(s, "gen_ai.tool.call.id").as_deref() == Some(call_id))
        {
            return Ok(spans);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let names: Vec<_> = exporter
        .get_finished_spans()?
        .iter()
        .map(|s| s.name.to_string())
        .collect();
    bail!("no span {name} for call {call_id}; spans: {names:?}")
}

/// The call's span and the names of its descendants.
fn tree<'a>(
    spans: &'a [SpanData],
    name: &str,
    call_id: &str,
) -> Result<(&'a SpanData, BTreeSet<String>)> {
    let root = spans
        .iter()
        .find(|s| s.name == name && attr(s, "gen_ai.tool.call.id").as_deref() == Some(call_id))
        .with_context(|| format!("no span {name}"))?;
    let mut below = BTreeSet::new();
    let mut parents = vec![root.span_context.span_id()];
    while let Some(parent) = parents.pop() {
        for s in spans.iter().filter(|s| s.parent_span_id == parent) {
            below.insert(s.name.to_string());
            parents.push(s.span_context.span_id());
        }
    }
    Ok((root, below))
}

/// The attributes every call span carries, as the GenAI conventions name
/// them.
fn check_call_span(span: &SpanData, tool: &str, run_id: &str, outcome: &str) -> Result<()> {
    let want = [
        ("gen_ai.operation.name", "execute_tool"),
        ("gen_ai.tool.name", tool),
        ("gen_ai.tool.type", "function"),
        ("toolrunner.run_id", run_id),
        ("toolrunner.executor_id", "testkit-executor"),
        ("toolrunner.effect", "write"),
        ("toolrunner.outcome", outcome),
    ];
    for (key, value) in want {
        ensure!(
            attr(span, key).as_deref() == Some(value),
            "{}: {key} is {:?}, not {value:?} ({:?})",
            span.name,
            attr(span, key),
            span.attributes
        );
    }
    Ok(())
}

/// A global default subscriber for the whole test binary (a bare
/// registry, which records nothing anyone reads), installed before any
/// test runs code. tracing caches each callsite's interest process-wide;
/// with at most one dispatcher registered it recomputes that interest
/// against whatever the recomputing thread has as its default, so a
/// sibling test's thread without a subscriber could mark a span this test
/// awaits as never enabled (the operator's span once went missing in CI
/// that way). With a global registry, every callsite stays enabled and
/// each test's own `set_default` subscriber sees its spans.
fn callsites_stay_live() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = tracing::subscriber::set_global_default(tracing_subscriber::registry());
    });
}

/// A completed, a failed and an unknown-outcome call, then an operator's
/// resolve: the span tree and attributes a tracing backend receives.
#[tokio::test]
async fn spans_follow_the_genai_conventions_for_completed_failed_and_unknown_calls() -> Result<()> {
    callsites_stay_live();
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("telemetry-test")));
    let _only_here = tracing::subscriber::set_default(subscriber);

    let kit = TestKit::start(|b| b.tool(ok).tool(fail).tool(unknown).tool(hooked)).await?;

    // Completed: claim (with its checks), accepted, handler, delivery.
    let call = kit.submit("t.ok", json!({"note": "hello"})).await?;
    assert!(kit.wait(&call).await?.is_completed());
    let spans = spans_with(&exporter, "execute_tool t.ok", &call.call_id).await?;
    let (root, below) = tree(&spans, "execute_tool t.ok", &call.call_id)?;
    check_call_span(root, "t.ok", &call.run_id, "completed")?;
    ensure!(
        attr(root, "error.type").is_none(),
        "a completed call has no error.type"
    );
    ensure!(root.status != Status::error(""), "{:?}", root.status);
    for child in [
        "toolrunner.claim",
        "toolrunner.checks",
        "toolrunner.accepted",
        "toolrunner.handler",
        "toolrunner.deliver",
    ] {
        ensure!(
            below.contains(child),
            "no {child} under the call: {below:?}"
        );
    }
    // The checks are the claim's.
    let claim = spans
        .iter()
        .find(|s| s.name == "toolrunner.claim" && s.parent_span_id == root.span_context.span_id())
        .context("the claim span")?;
    ensure!(
        spans
            .iter()
            .any(|s| s.name == "toolrunner.checks"
                && s.parent_span_id == claim.span_context.span_id()),
        "the checks span is a child of the claim"
    );

    // Failed: the failure's code is the error type, the status an error.
    let call = kit.submit("t.fail", json!({"note": "x"})).await?;
    assert_eq!(
        kit.wait(&call).await?.error_code.as_deref(),
        Some("declined")
    );
    let spans = spans_with(&exporter, "execute_tool t.fail", &call.call_id).await?;
    let (root, below) = tree(&spans, "execute_tool t.fail", &call.call_id)?;
    check_call_span(root, "t.fail", &call.run_id, "failed")?;
    ensure!(attr(root, "error.type").as_deref() == Some("declined"));
    ensure!(
        matches!(root.status, Status::Error { .. }),
        "{:?}",
        root.status
    );
    ensure!(below.contains("toolrunner.handler") && below.contains("toolrunner.deliver"));

    // Unknown: reconciliation required, and the automatic check's span
    // carries the call id.
    let call = kit.submit("t.unknown", json!({"note": "x"})).await?;
    let outcome = kit.wait(&call).await?;
    assert_eq!(outcome.settled_by, SettledBy::Nobody, "{outcome:?}");
    let spans = spans_with(&exporter, "execute_tool t.unknown", &call.call_id).await?;
    let (root, below) = tree(&spans, "execute_tool t.unknown", &call.call_id)?;
    check_call_span(root, "t.unknown", &call.run_id, "reconciliation_required")?;
    ensure!(attr(root, "error.type").as_deref() == Some("reconciliation_required"));
    ensure!(matches!(root.status, Status::Error { .. }));
    ensure!(below.contains("toolrunner.handler"), "{below:?}");
    ensure!(
        spans.iter().any(|s| s.name == "toolrunner.reconcile"
            && attr(s, "gen_ai.tool.call.id").as_deref() == Some(call.call_id.as_str())),
        "a reconcile check span for the call"
    );

    // Refused before start (arguments that fail the schema, sent
    // unchecked): failed, with the refusal's code.
    let run = kit
        .platform()
        .create_run(
            kit.agent_version(),
            "user_42",
            vec![toolrunner::platform::NewToolCall {
                unchecked: true,
                ..toolrunner::platform::NewToolCall::new("t.ok", json!({"note": 5}))
            }],
        )
        .await?;
    let refused = &kit
        .platform()
        .wait_settled(&run.run_id, Duration::from_secs(10))
        .await?
        .tool_calls[0];
    let spans = spans_with(&exporter, "execute_tool t.ok", &refused.call_id).await?;
    let (root, _) = tree(&spans, "execute_tool t.ok", &refused.call_id)?;
    check_call_span(root, "t.ok", &run.run_id, "failed")?;
    ensure!(
        attr(root, "error.type").as_deref() == Some("invalid_arguments"),
        "{:?}",
        root.attributes
    );

    // Unknown, then found by the hook in the same pass: completed.
    let found = kit.submit("t.hooked", json!({"note": "x"})).await?;
    assert!(kit.wait(&found).await?.is_completed());
    let spans = spans_with(&exporter, "execute_tool t.hooked", &found.call_id).await?;
    let (root, below) = tree(&spans, "execute_tool t.hooked", &found.call_id)?;
    check_call_span(root, "t.hooked", &found.run_id, "completed")?;
    ensure!(attr(root, "error.type").is_none(), "{:?}", root.attributes);
    ensure!(below.contains("toolrunner.reconcile"), "{below:?}");

    // An operator settles it: a span of its own, with the call id.
    let reconciler = kit.reconciler().await?;
    reconciler
        .resolve(
            &call.run_id,
            &call.call_id,
            Outcome::Failed {
                code: "not_done".into(),
                message: "checked downstream: nothing was done".into(),
            },
            &Evidence::new("ops@example", "looked it up downstream"),
        )
        .await?;
    // The span ends when its last reference is dropped, which a task the
    // resolve started (a connection, a resolver) may do a moment after the
    // resolve returned: wait for it as for the calls' spans.
    let operator = spans_with(&exporter, "toolrunner.operator resolve", &call.call_id)
        .await?
        .into_iter()
        .find(|s| s.name == "toolrunner.operator resolve")
        .context("the operator's span")?;
    ensure!(
        attr(&operator, "gen_ai.tool.call.id").as_deref() == Some(call.call_id.as_str())
            && attr(&operator, "toolrunner.action").as_deref() == Some("resolve"),
        "{:?}",
        operator.attributes
    );
    kit.shutdown().await?;
    Ok(())
}

/// The recorder of this test binary, installed once.
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .set_buckets(&[0.001, 0.01, 0.1, 1.0, 10.0])
            .expect("buckets")
            .install_recorder()
            .expect("the only recorder of this test binary")
    })
}

/// One row of the metrics table in `docs/operations.md`.
#[derive(Debug)]
struct Row {
    kind: String,
    labels: BTreeSet<String>,
    postgres_only: bool,
}

/// The metrics table of `docs/operations.md`, by name.
fn table() -> Result<BTreeMap<String, Row>> {
    let doc = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/operations.md"),
    )?;
    let start = doc
        .find("<!-- metrics:start")
        .context("the metrics table's start marker")?;
    let end = doc
        .find("<!-- metrics:end -->")
        .context("the metrics table's end marker")?;
    let mut rows = BTreeMap::new();
    for line in doc[start..end].lines().filter(|l| l.starts_with("| `")) {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let name = cells[1].trim_matches('`').to_owned();
        let labels = cells[4]
            .split(',')
            .map(|l| l.trim().trim_matches('`').to_owned())
            .filter(|l| !l.is_empty() && l != "—")
            .collect();
        rows.insert(
            name,
            Row {
                kind: cells[2].to_owned(),
                labels,
                postgres_only: cells[5] == "PostgreSQL",
            },
        );
    }
    ensure!(rows.len() >= 10, "the table has {} rows", rows.len());
    Ok(rows)
}

/// A scrape, by metric family: its type and the label names its samples
/// carry (the histogram's `le` aside).
fn families(scrape: &str) -> BTreeMap<String, (String, BTreeSet<String>)> {
    let mut families: BTreeMap<String, (String, BTreeSet<String>)> = BTreeMap::new();
    for line in scrape.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (parts.next(), parts.next()) {
                families.entry(name.to_owned()).or_default().0 = kind.to_owned();
            }
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let (name, labels) = match line.split_once('{') {
            Some((name, rest)) => (name, rest.split_once('}').map_or("", |(l, _)| l)),
            None => (line.split_whitespace().next().unwrap_or(""), ""),
        };
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                name.strip_suffix(suffix)
                    .filter(|base| families.contains_key(*base))
            })
            .unwrap_or(name);
        let keys = labels
            .split("\",")
            .filter_map(|kv| kv.split_once('=').map(|(k, _)| k.trim().to_owned()))
            .filter(|k| k != "le" && k != "quantile");
        families
            .entry(family.to_owned())
            .or_default()
            .1
            .extend(keys);
    }
    families
}

/// After a run with every kind of call (completed, failed, unknown, a
/// claim refused because the run ended first, an operator's resolve), the
/// scrape holds every metric of the table with its labels and type, and
/// no `toolrunner_` metric the table lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scrape_holds_every_metric_of_the_table_and_no_other() -> Result<()> {
    callsites_stay_live();
    let prometheus = prometheus();
    let mut kit = TestKit::builder()
        .crash_at(Step::BeforeClaim)
        // One tool with a concurrency limit, so that the flow gauges are
        // published (only limited tools have them).
        .start(|b| {
            b.tool(m_ok).tool(m_fail).tool(m_unknown).limit(
                "m.ok",
                toolrunner::Limits::none().concurrency(8).rate(1_000),
            )
        })
        .await?;
    // The first call's key is saved and the process dies before its claim;
    // the run is cancelled meanwhile, so the next start's claim is refused.
    let refused = kit.submit("m.ok", json!({"note": "late"})).await?;
    kit.wait_crashed().await?;
    kit.platform().cancel_run(&refused.run_id).await?;
    kit.restart().await?;
    kit.platform()
        .wait_settled(&refused.run_id, Duration::from_secs(10))
        .await?;
    for (tool, want) in [
        ("m.ok", "completed"),
        ("m.fail", "failed"),
        ("m.unknown", "reconciliation_required"),
    ] {
        let call = kit.submit(tool, json!({"note": "n"})).await?;
        let outcome = kit.wait(&call).await?;
        ensure!(
            format!("{:?}", outcome.state).to_lowercase() == want.replace('_', ""),
            "{tool}: {outcome:?}"
        );
    }
    // The gauges are published once a second.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Scraped as Prometheus does: GET /metrics of the admin router.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let router = toolrunner::admin::router_with_metrics(kit.health(), move || prometheus.render());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let _ = rustls::crypto::ring::default_provider().install_default();
    let answer = reqwest::get(format!("{base}/metrics")).await?;
    ensure!(answer.status() == 200, "GET /metrics: {}", answer.status());
    let scrape = answer.text().await?;
    let seen = families(&scrape);
    let table = table()?;
    let mut problems = Vec::new();
    for (name, row) in &table {
        match seen.get(name) {
            None if row.postgres_only => {}
            None => problems.push(format!("{name}: in the table, not in the scrape")),
            Some(_) if row.postgres_only => problems.push(format!(
                "{name}: marked PostgreSQL only, but a SQLite executor published it"
            )),
            Some((kind, labels)) => {
                if kind != &row.kind {
                    problems.push(format!("{name}: type {kind}, the table says {}", row.kind));
                }
                if labels != &row.labels {
                    problems.push(format!(
                        "{name}: labels {labels:?}, the table says {:?}",
                        row.labels
                    ));
                }
            }
        }
    }
    for name in seen.keys().filter(|n| n.starts_with("toolrunner_")) {
        if !table.contains_key(name) {
            problems.push(format!("{name}: in the scrape, not in the table"));
        }
    }
    ensure!(
        problems.is_empty(),
        "{}\n\nscrape:\n{scrape}",
        problems.join("\n")
    );
    // The refusal is counted by its reason, and each outcome by its tool.
    ensure!(
        scrape.contains("toolrunner_claims_refused_total{executor_id=\"testkit-executor\",reason="),
        "{scrape}"
    );
    for (tool, outcome) in [
        ("m.ok", "completed"),
        ("m.fail", "failed"),
        ("m.unknown", "reconciliation_required"),
    ] {
        let line = format!(
            "toolrunner_tool_calls_total{{executor_id=\"testkit-executor\",tool=\"{tool}\",outcome=\"{outcome}\"}} 1"
        );
        ensure!(scrape.contains(&line), "no {line} in\n{scrape}");
    }
    ensure!(
        scrape.contains(
            "toolrunner_reconciliation_required{executor_id=\"testkit-executor\",tool=\"m.unknown\"} 1"
        ),
        "{scrape}"
    );
    kit.shutdown().await?;
    Ok(())
}

/// `/readyz` as an orchestrator polls it.
async fn readyz(client: &reqwest::Client, base: &str) -> Result<(u16, Value)> {
    let answer = client.get(format!("{base}/readyz")).send().await?;
    let status = answer.status().as_u16();
    Ok((status, answer.json().await?))
}

/// Polls `/readyz` until it answers `status` (within 10 s).
async fn until(client: &reqwest::Client, base: &str, status: u16) -> Result<Value> {
    let mut last = (0, Value::Null);
    for _ in 0..400 {
        last = readyz(client, base).await?;
        if last.0 == status {
            return Ok(last.1);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    bail!("/readyz did not answer {status} within 10 s; last: {last:?}")
}

/// `/readyz` turns 503 with a reason while the platform cannot be reached
/// and while the store cannot be written, 200 again once they are back,
/// and 503 from the start of the shutdown until it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_follows_the_platform_the_store_and_the_shutdown() -> Result<()> {
    callsites_stay_live();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let faults = ProcessFaults::new();
    let given = faults.clone();
    let kit = TestKit::start(move |b| b.process_faults(&given).tool(ok).tool(slow)).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let router = toolrunner::admin::router(kit.health());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let client = reqwest::Client::new();

    let body = until(&client, &base, 200).await?;
    ensure!(body == json!({"ready": true}), "{body}");
    let health: Value = client
        .get(format!("{base}/healthz"))
        .send()
        .await?
        .json()
        .await?;
    ensure!(
        health["connected"] == true && health["capacity"].as_u64() > Some(0),
        "{health}"
    );

    faults.cut_platform(true);
    let body = until(&client, &base, 503).await?;
    ensure!(body["ready"] == false, "{body}");
    ensure!(
        body["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("platform unreachable")),
        "{body}"
    );
    faults.cut_platform(false);
    until(&client, &base, 200).await?;

    faults.cut_store(true);
    let body = until(&client, &base, 503).await?;
    ensure!(
        body["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("store not writable")),
        "{body}"
    );
    faults.cut_store(false);
    until(&client, &base, 200).await?;

    // The store stops answering (the process's I/O frozen, as a half-open
    // connection would leave it): the probe's write does not come back.
    faults.freeze();
    let body = until(&client, &base, 503).await?;
    ensure!(
        body["reason"]
            .as_str()
            .is_some_and(|r| r.starts_with("store not writable: a write did not come back")),
        "{body}"
    );
    faults.thaw();
    until(&client, &base, 200).await?;

    // A slow call in flight: the drain waits for it, not ready throughout.
    let slow_call = kit.submit("t.slow", json!({"note": "n"})).await?;
    kit.platform()
        .wait_for(
            &slow_call.run_id,
            Duration::from_secs(10),
            "the slow call runs",
            |r: &toolrunner::platform::Run| {
                r.tool_calls[0].state == toolrunner::protocol::wire::CallState::Running
            },
        )
        .await?;
    let mut shutdown = tokio::spawn(kit.shutdown());
    let mut polls = 0;
    let ended = loop {
        tokio::select! {
            ended = &mut shutdown => break ended,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        let (status, body) = readyz(&client, &base).await?;
        ensure!(status == 503, "ready during the shutdown: {body}");
        polls += 1;
    };
    ended??;
    ensure!(
        polls >= 5,
        "the drain waited for the slow call ({polls} polls)"
    );
    let (status, body) = readyz(&client, &base).await?;
    ensure!(
        status == 503
            && body["reason"]
                .as_str()
                .is_some_and(|r| r.starts_with("stopped")),
        "{body}"
    );
    Ok(())
}

/// Takes longer than the platform's lease (a drain must keep it alive).
#[toolrunner::tool(name = "t.longer", effect = write)]
async fn longer(_ctx: CallContext, input: Job) -> Result<Done, ToolError> {
    tokio::time::sleep(Duration::from_millis(2500)).await;
    Ok(Done { note: input.note })
}

/// A drain waits for a handler that outlives the platform's lease (1 s)
/// more than twice over: the heartbeats go on until it finished, so the
/// platform keeps the call bound, takes its `completed`, and the executor
/// is not ready from the drain's start to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_keeps_the_lease_alive_until_the_last_handler_finished() -> Result<()> {
    callsites_stay_live();
    let prometheus = prometheus();
    let server = toolrunner_devserver::DevServer::builder()
        .listen(([127, 0, 0, 1], 0).into())
        .lease_ttl_ms(1000)
        .heartbeat_interval_ms(250)
        .start()
        .await?;
    let platform = toolrunner::platform::Platform::new(&server.base_url(), "dev-admin")?;
    let agent = platform.create_agent("drain").await?;
    let binding = platform
        .create_binding(&agent.agent_id, "drain", &["t.longer"])
        .await?;
    let dir = tempfile::tempdir()?;
    let executor = toolrunner::Executor::builder()
        .base_url(server.base_url())
        .allow_insecure_http()
        .token("dev-executor")
        .executor_id("drain-01")
        .binding_id(&binding.binding_id)
        .store_url(format!(
            "sqlite://{}",
            dir.path().join("executor.db").display()
        ))
        .poll_interval(Duration::from_millis(25))
        .allow_all()
        .tool(longer)
        .build()?;
    let health = executor.health();
    let version = platform
        .publish(&agent.agent_id, executor.tool_definitions())
        .await?;
    let run = platform
        .create_run(
            &version.agent_version,
            "user_42",
            vec![toolrunner::platform::NewToolCall::new(
                "t.longer",
                json!({"note": "n"}),
            )],
        )
        .await?;
    let running = executor.start().await?;
    platform
        .wait_for(
            &run.run_id,
            Duration::from_secs(10),
            "the long handler runs",
            |r: &toolrunner::platform::Run| {
                r.tool_calls[0].state == toolrunner::protocol::wire::CallState::Running
            },
        )
        .await?;
    let started = std::time::Instant::now();
    let mut draining = tokio::spawn(running.shutdown(toolrunner::Shutdown::Drain {
        deadline: Duration::from_secs(10),
    }));
    let drained = loop {
        tokio::select! {
            drained = &mut draining => break drained,
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
        let report = health.report();
        ensure!(!report.ready(), "ready during the drain: {report:?}");
    };
    drained??;
    // Stopped, it holds nothing: its gauges say so.
    let scrape = prometheus.render();
    for gauge in [
        "toolrunner_capacity_in_use{executor_id=\"drain-01\"} 0",
        "toolrunner_calls{executor_id=\"drain-01\",state=\"delivered\"} 0",
        "toolrunner_undelivered_receipts{executor_id=\"drain-01\"} 0",
    ] {
        ensure!(
            scrape.contains(gauge),
            "no {gauge} after the drain:\n{scrape}"
        );
    }
    ensure!(
        started.elapsed() > Duration::from_millis(1500),
        "the drain waited for the handler ({:?})",
        started.elapsed()
    );
    let done = platform.run(&run.run_id).await?;
    let call = &done.tool_calls[0];
    ensure!(
        call.state == toolrunner::protocol::wire::CallState::Completed,
        "the platform took the handler's completed after its lease would have lapsed twice: {:?}",
        call.state
    );
    server.shutdown().await;
    Ok(())
}

/// An executor that stops taking work by itself (another process took its
/// executor id) says so: not ready, with why, while it still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_superseded_by_another_process_is_not_ready() -> Result<()> {
    callsites_stay_live();
    let server = toolrunner_devserver::DevServer::builder()
        .listen(([127, 0, 0, 1], 0).into())
        .heartbeat_interval_ms(200)
        .start()
        .await?;
    let platform = toolrunner::platform::Platform::new(&server.base_url(), "dev-admin")?;
    let agent = platform.create_agent("twice").await?;
    let binding = platform
        .create_binding(&agent.agent_id, "twice", &["t.ok"])
        .await?;
    let dir = tempfile::tempdir()?;
    let executor = |store: &str| {
        toolrunner::Executor::builder()
            .base_url(server.base_url())
            .allow_insecure_http()
            .token("dev-executor")
            .executor_id("twice-01")
            .binding_id(&binding.binding_id)
            .store_url(format!("sqlite://{}", dir.path().join(store).display()))
            .allow_all()
            .tool(ok)
            .build()
    };
    let first = executor("first.db")?;
    let health = first.health();
    let first = first.start().await?;
    until_ready(&health, true).await?;
    // The same id from another process (its own store file): the first is
    // superseded at its next heartbeat and stops claiming.
    let second = executor("second.db")?.start().await?;
    let stopped = tokio::time::timeout(Duration::from_secs(10), first.wait()).await?;
    ensure!(stopped.is_err(), "the first stopped by itself");
    let report = health.report();
    // Why it stopped, not merely that it did.
    ensure!(
        !report.ready()
            && report.reason().is_some_and(|r| {
                r.starts_with("stopped: ") && r != "stopped: the executor is not running"
            }),
        "{report:?}"
    );
    drop(first);
    second
        .shutdown(toolrunner::Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    server.shutdown().await;
    Ok(())
}

/// Waits (up to 10 s) until the health's verdict is `ready`.
async fn until_ready(health: &toolrunner::Health, ready: bool) -> Result<()> {
    for _ in 0..500 {
        if health.report().ready() == ready {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("the verdict stayed {:?}", health.report())
}

/// A platform with an agent version serving `t.ok`, for an executor of an
/// id of its own (the recorder is the whole binary's: each test reads its
/// own `executor_id`'s series).
struct Solo {
    server: toolrunner_devserver::DevServer,
    platform: toolrunner::platform::Platform,
    binding_id: String,
    agent_version: String,
    dir: tempfile::TempDir,
}

impl Solo {
    async fn start() -> Result<Solo> {
        let server = toolrunner_devserver::DevServer::builder()
            .listen(([127, 0, 0, 1], 0).into())
            .heartbeat_interval_ms(200)
            .start()
            .await?;
        let platform = toolrunner::platform::Platform::new(&server.base_url(), "dev-admin")?;
        let agent = platform.create_agent("solo").await?;
        let binding = platform
            .create_binding(&agent.agent_id, "solo", &["t.ok", "t.fail"])
            .await?;
        let mut solo = Solo {
            server,
            platform,
            binding_id: binding.binding_id,
            agent_version: String::new(),
            dir: tempfile::tempdir()?,
        };
        let definitions = solo
            .executor("definitions")
            .build()?
            .tool_definitions()
            .to_vec();
        solo.agent_version = solo
            .platform
            .publish(&agent.agent_id, &definitions)
            .await?
            .agent_version;
        Ok(solo)
    }

    /// An executor `executor_id` with `t.ok` and `t.fail`, capacity 4.
    fn executor(&self, executor_id: &str) -> toolrunner::ExecutorBuilder {
        toolrunner::Executor::builder()
            .base_url(self.server.base_url())
            .allow_insecure_http()
            .token("dev-executor")
            .executor_id(executor_id)
            .binding_id(&self.binding_id)
            .store_url(format!(
                "sqlite://{}",
                self.dir.path().join(format!("{executor_id}.db")).display()
            ))
            .capacity(4)
            .poll_interval(Duration::from_millis(25))
            .allow_all()
            .tool(ok)
            .tool(fail)
    }
}

/// Waits (up to 10 s) until the scrape holds `line`.
async fn until_scraped(line: &str) -> Result<()> {
    for _ in 0..500 {
        if prometheus().render().contains(line) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    bail!("no {line} in\n{}", prometheus().render())
}

/// An executor that stops as a lost process would sets its gauges to zero
/// too, not only one shut down: one halted (here at a fail point; one
/// fenced by a takeover halts the same way) while its handle lives, and
/// one dropped (as a replica drops an adopted identity's executor it
/// started just as it began to stop itself, and every adopted one when it
/// halts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_halted_or_dropped_executor_sets_its_gauges_to_zero() -> Result<()> {
    callsites_stay_live();
    let _ = prometheus();
    let solo = Solo::start().await?;
    let mut kept = Vec::new();
    for how in ["halted", "dropped"] {
        let id = format!("gauges-{how}");
        let running = solo
            .executor(&id)
            .crash_plan(|step| step == "after_handler")
            .build()?
            .start()
            .await?;
        until_scraped(&format!(
            "toolrunner_capacity_available{{executor_id=\"{id}\"}} 4"
        ))
        .await?;
        if how == "halted" {
            solo.platform
                .create_run(
                    &solo.agent_version,
                    "user_42",
                    vec![toolrunner::platform::NewToolCall::new(
                        "t.ok",
                        json!({"note": "n"}),
                    )],
                )
                .await?;
            tokio::time::timeout(Duration::from_secs(10), running.wait())
                .await
                .context("the executor did not halt at its fail point")??;
        } else {
            // Dropped: its tasks are gone, nothing publishes any more.
            drop(running);
        }
        let scrape = prometheus().render();
        for gauge in [
            format!("toolrunner_capacity_available{{executor_id=\"{id}\"}} 0"),
            format!("toolrunner_capacity_in_use{{executor_id=\"{id}\"}} 0"),
            format!("toolrunner_undelivered_receipts{{executor_id=\"{id}\"}} 0"),
        ] {
            if !scrape.contains(&gauge) {
                kept.push(format!("{how}: no {gauge}"));
            }
        }
    }
    ensure!(
        kept.is_empty(),
        "the last counts stay for good: {kept:?}\n{}",
        prometheus().render()
    );
    solo.server.shutdown().await;
    Ok(())
}

/// Every metric family the table of `docs/operations.md` lists is in the
/// scrape of an executor just started, before any call: counters at zero
/// for each tool (and each outcome, reason, event, kind), histograms
/// empty, gauges at their values, so that an alert or a `rate()` has a
/// series from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_family_of_the_table_is_scraped_from_the_start() -> Result<()> {
    callsites_stay_live();
    let prometheus = prometheus();
    let solo = Solo::start().await?;
    // A tool with a concurrency limit: the flow gauges are published for
    // limited tools only.
    let executor = solo
        .executor("fresh-01")
        .limit(
            "t.ok",
            toolrunner::Limits::none().concurrency(4).rate(1_000),
        )
        .build()?;
    let health = executor.health();
    let running = executor.start().await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let router = toolrunner::admin::router_with_metrics(health, move || prometheus.render());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let _ = rustls::crypto::ring::default_provider().install_default();
    let scrape = reqwest::get(format!("{base}/metrics"))
        .await?
        .text()
        .await?;
    let mut missing = Vec::new();
    for (name, row) in table()? {
        if row.postgres_only {
            continue;
        }
        // A sample of this executor's (or, for the one family without
        // labels, any sample of it).
        let own = |line: &&str| {
            let sample = [name.clone(), format!("{name}_count")]
                .iter()
                .any(|n| line.starts_with(&format!("{n}{{")) || line.starts_with(&format!("{n} ")));
            sample
                && (!row.labels.contains("executor_id")
                    || line.contains("executor_id=\"fresh-01\""))
        };
        if !scrape.lines().any(|l| own(&l)) {
            missing.push(name);
        }
    }
    for line in [
        "toolrunner_tool_calls_total{executor_id=\"fresh-01\",tool=\"t.ok\",outcome=\"completed\"} 0",
        "toolrunner_tool_calls_total{executor_id=\"fresh-01\",tool=\"t.fail\",outcome=\"failed\"} 0",
        "toolrunner_tool_execution_duration_seconds_count{executor_id=\"fresh-01\",tool=\"t.ok\",outcome=\"completed\"} 0",
        "toolrunner_claim_duration_seconds_count{executor_id=\"fresh-01\",tool=\"t.fail\"} 0",
        "toolrunner_claims_refused_total{executor_id=\"fresh-01\",reason=\"unreachable\"} 0",
        "toolrunner_receipt_deliveries_total{executor_id=\"fresh-01\",kind=\"completed\",outcome=\"unreachable\"} 0",
        "toolrunner_call_transitions_total{executor_id=\"fresh-01\",event=\"outcome_unknown\",state=\"reconciliation_required\"} 0",
    ] {
        if !scrape.contains(line) {
            missing.push(line.to_owned());
        }
    }
    ensure!(
        missing.is_empty(),
        "a freshly started executor's scrape lacks {} of the table's families or series: {missing:?}\n\nscrape:\n{scrape}",
        missing.len()
    );
    running
        .shutdown(toolrunner::Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    solo.server.shutdown().await;
    Ok(())
}
