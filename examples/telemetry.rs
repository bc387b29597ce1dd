//! Telemetry wired as a product would: the executor's spans exported with
//! OpenTelemetry (`tracing-opentelemetry` with the stdout exporter; an
//! OTLP exporter goes in the same place), its metrics through a Prometheus
//! recorder, and `/healthz`, `/readyz`, `/metrics` served by the `admin`
//! router.
//!
//! ```text
//! cargo run --example telemetry                      # the embedded platform
//! cargo run --example telemetry -- --admin-listen 127.0.0.1:9090 --keep-serving
//! cargo run --example telemetry -- --print-definitions   # {"tools": [...]} for `toolrunner tools publish`
//! ```
//!
//! It runs three calls (completed, failed, unknown) on the embedded
//! platform, and prints, on stdout, the spans as OpenTelemetry's stdout
//! exporter writes them, then `/readyz` and some `toolrunner_` lines of
//! `/metrics`.
//! With `--keep-serving` it keeps serving the admin endpoints until
//! Ctrl-C, for `curl`.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use opentelemetry::trace::TracerProvider as _;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::TestKit;
use toolrunner::{CallContext, ToolError};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

#[path = "support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
#[command(about = "Export toolrunner's spans and metrics, and serve its health")]
struct Args {
    /// Where to serve /healthz, /readyz and /metrics.
    #[arg(long, default_value = "127.0.0.1:0")]
    admin_listen: std::net::SocketAddr,
    /// Keep serving the admin endpoints after the demo, until Ctrl-C.
    #[arg(long)]
    keep_serving: bool,
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
}

/// An amount to charge.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Charge {
    /// Minor units; 13 is declined, 99 times out after the charge.
    amount: u64,
}

/// The charge made.
#[toolrunner::schema]
#[derive(Serialize)]
struct Charged {
    /// The provider's reference.
    reference: String,
}

/// Charges a card (a stand-in for a payment provider).
#[toolrunner::tool(name = "card.charge", effect = write)]
async fn charge(ctx: CallContext, input: Charge) -> Result<Charged, ToolError> {
    match input.amount {
        13 => Err(ToolError::failed("declined", "the card was declined")),
        99 => Err(ToolError::unknown(
            "the provider timed out after the charge",
        )),
        _ => Ok(Charged {
            reference: format!("ch_{}", &ctx.operation_key()[..8]),
        }),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.print_definitions {
        return support::print_definitions(|b| b.tool(charge));
    }
    let _ = rustls::crypto::ring::default_provider().install_default();

    // Traces: tracing → OpenTelemetry → stdout (swap in an OTLP exporter).
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_simple_exporter(opentelemetry_stdout::SpanExporter::default())
        .build();
    tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("toolrunner=info"))
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("payments")))
        .init();

    // Metrics: one process-wide recorder, the product's choice.
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&[0.001, 0.01, 0.1, 1.0, 10.0])?
        .install_recorder()?;

    let kit = TestKit::start(|b| b.tool(charge)).await?;
    let render = prometheus.clone();
    let admin = toolrunner::admin::router_with_metrics(kit.health(), move || render.render());
    let listener = tokio::net::TcpListener::bind(args.admin_listen).await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, admin).await });

    for amount in [1200, 13, 99] {
        let outcome = kit.call("card.charge", json!({ "amount": amount })).await?;
        println!("charge {amount}: {:?}", outcome.state);
    }
    // The gauges are published once a second.
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let client = reqwest::Client::new();
    let ready = client.get(format!("{base}/readyz")).send().await?;
    println!(
        "GET {base}/readyz -> {} {}",
        ready.status(),
        ready.text().await?
    );
    let metrics = client
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    let ours: Vec<&str> = metrics
        .lines()
        .filter(|l| {
            l.starts_with("toolrunner_tool_calls_total")
                || l.starts_with("toolrunner_reconciliation_required{")
        })
        .collect();
    anyhow::ensure!(!ours.is_empty(), "no toolrunner_ metrics in /metrics");
    println!("GET {base}/metrics (excerpt):");
    for line in ours {
        println!("  {line}");
    }
    if args.keep_serving {
        println!("serving {base}/healthz, /readyz and /metrics until Ctrl-C");
        tokio::signal::ctrl_c().await?;
    }
    kit.shutdown().await?;
    provider.force_flush().context("flushing the spans")?;
    Ok(())
}
