//! A long-running tool: progress receipts as it goes, the run's
//! cancellation honoured between steps, and `commit_point()` right before
//! the irreversible step.
//!
//! ```text
//! cargo run --example long_running                       # the embedded platform
//! cargo run --example long_running -- --base-url URL     # a real one (TOOLRUNNER_* variables)
//! cargo run --example long_running -- --print-definitions # {"tools": [...]} for `toolrunner tools publish`
//! ```
//!
//! On the embedded platform it runs two exports: one finishes (a progress
//! receipt per batch, then the publication), and one whose run is
//! cancelled while it works: the handler stops between batches and nothing
//! is published.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Parser;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::TestKit;
use toolrunner::{CallContext, Executor, Progress, State, ToolError};

#[path = "support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
#[command(about = "Serve reports.export with toolrunner")]
struct Args {
    /// A real platform (with TOOLRUNNER_TOKEN, _EXECUTOR_ID, _BINDING_ID):
    /// serve until SIGTERM instead of the demo.
    #[arg(long)]
    base_url: Option<String>,
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
}

/// What to export.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Export {
    /// How many batches of rows.
    batches: u32,
}

/// The published export.
#[toolrunner::schema]
#[derive(Serialize)]
struct Exported {
    /// Where it was published.
    url: String,
}

/// Exports published so far (the irreversible step).
#[derive(Clone, Default)]
struct Published(Arc<Mutex<Vec<String>>>);

/// Exports the report in batches and publishes it.
#[toolrunner::tool(name = "reports.export", effect = write)]
async fn export(
    State(published): State<Published>,
    ctx: CallContext,
    e: Export,
) -> Result<Exported, ToolError> {
    for batch in 1..=e.batches {
        tokio::select! {
            () = ctx.cancelled() => return Err(ToolError::cancelled("the run was cancelled; nothing was published")),
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
        let fraction = f64::from(batch) / f64::from(e.batches);
        let progress = Progress::new(format!("batch {batch} of {}", e.batches));
        ctx.progress(progress.fraction(fraction).data(json!({"batch": batch})))
            .await?;
    }
    ctx.commit_point().await?; // not cancelled, still ours: publish
    let url = format!("https://reports.example/{}", ctx.operation_key());
    published.0.lock().expect("not poisoned").push(url.clone());
    Ok(Exported { url })
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    support::quiet_logs();
    let args = Args::parse();
    let published = Published::default();
    if args.print_definitions {
        return support::print_definitions(|b| b.state(published).tool(export));
    }
    if let Some(url) = args.base_url {
        let executor = Executor::from_env()
            .base_url(url)
            .state(published)
            .allow_all()
            .tool(export)
            .build()?;
        executor.serve(toolrunner::shutdown_signal()).await?;
        return Ok(());
    }
    let state = published.clone();
    let kit = TestKit::start(move |b| b.state(state.clone()).tool(export)).await?;
    let mut lines = Vec::new();
    let asked = json!({"batches": 3});
    let outcome = kit.call("reports.export", asked.clone()).await?;
    lines.push(support::Line {
        tool: "reports.export".into(),
        asked: asked.to_string(),
        outcome,
    });
    // A second export whose run is cancelled while it works.
    let asked = json!({"batches": 50});
    let call = kit.submit("reports.export", asked.clone()).await?;
    kit.platform()
        .wait_for(&call.run_id, Duration::from_secs(10), "under way", |run| {
            run.tool_calls
                .iter()
                .any(|c| c.receipts.iter().any(|r| r.kind.as_str() == "progress"))
        })
        .await?;
    kit.platform().cancel_run(&call.run_id).await?;
    let outcome = kit.wait(&call).await?;
    lines.push(support::Line {
        tool: "reports.export (cancelled)".into(),
        asked: asked.to_string(),
        outcome,
    });
    kit.shutdown().await?;
    support::print(&lines);
    println!(
        "published: {} export(s)",
        published.0.lock().expect("not poisoned").len()
    );
    Ok(())
}
