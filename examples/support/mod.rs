//! What the examples share: quiet logs on stderr, the table of outcomes
//! they print, and `--print-definitions`.
#![allow(dead_code)]

use std::io::Write as _;

use comfy_table::presets::UTF8_FULL_CONDENSED;
use comfy_table::{ContentArrangement, Table};
use toolrunner::testing::{CallOutcome, SettledBy};
use toolrunner::{Executor, ExecutorBuilder};

/// `--print-definitions`: the tool definitions of the tools `register`
/// adds, as `{"tools": [...]}` (pretty JSON) on stdout, for `toolrunner
/// tools check` and `toolrunner tools publish`. Nothing is started: the
/// executor is built [`definitions_only`](ExecutorBuilder::definitions_only)
/// (no platform, no store); the binding is `TOOLRUNNER_BINDING_ID`'s, or
/// [`toolrunner::UNBOUND`], which `toolrunner dev up` replaces.
pub(crate) fn print_definitions(
    register: impl FnOnce(ExecutorBuilder) -> ExecutorBuilder,
) -> anyhow::Result<()> {
    let mut builder = Executor::builder().definitions_only();
    if let Ok(binding) = std::env::var("TOOLRUNNER_BINDING_ID") {
        builder = builder.binding_id(binding);
    }
    let executor = register(builder).build()?;
    let definitions = serde_json::json!({ "tools": executor.tool_definitions() });
    // Written, not printed: a closed pipe (`| head`) is an error, not a panic.
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string_pretty(&definitions)?)?;
    Ok(())
}

/// Logs go to stderr, quiet unless `RUST_LOG` says otherwise, so they
/// never break the table on stdout.
pub(crate) fn quiet_logs() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .init();
}

/// How a call was settled, in words.
pub(crate) fn settled_by(outcome: &CallOutcome) -> &'static str {
    match outcome.settled_by {
        SettledBy::Handler => "handler",
        SettledBy::ReconcileHook => "reconcile hook",
        SettledBy::Operator => "operator",
        SettledBy::Refusal => "refused before start",
        SettledBy::Nobody => "nobody yet (waits for a human)",
        _ => "other",
    }
}

/// One line of the table: what was asked, and how it ended.
pub(crate) struct Line {
    pub(crate) tool: String,
    pub(crate) asked: String,
    pub(crate) outcome: CallOutcome,
}

/// The receipts the platform holds, e.g. `accepted, progress×2, completed`.
fn receipts(outcome: &CallOutcome) -> String {
    let mut parts: Vec<(String, usize)> = Vec::new();
    for r in &outcome.call.receipts {
        let kind = r.kind.as_str().to_owned();
        match parts.last_mut() {
            Some((k, n)) if *k == kind => *n += 1,
            _ => parts.push((kind, 1)),
        }
    }
    parts
        .into_iter()
        .map(|(k, n)| if n == 1 { k } else { format!("{k}×{n}") })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Prints the outcomes as an aligned table.
pub(crate) fn print(lines: &[Line]) {
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(["tool", "asked", "state", "settled by", "receipts", "result"]);
    for l in lines {
        let result = match (&l.outcome.result, &l.outcome.error_code) {
            (Some(r), _) => r.to_string(),
            (None, Some(code)) => format!("error {code}"),
            (None, None) => String::new(),
        };
        table.add_row([
            l.tool.clone(),
            l.asked.clone(),
            l.outcome.state.as_str().to_owned(),
            settled_by(&l.outcome).to_owned(),
            receipts(&l.outcome),
            result,
        ]);
    }
    println!("{table}");
}

/// The limits a `--concurrency N` and a `--rate N` flag set (none when
/// neither is given).
pub(crate) fn limits(concurrency: Option<u32>, rate: Option<u32>) -> toolrunner::Limits {
    let mut limits = toolrunner::Limits::none();
    if let Some(n) = concurrency {
        limits = limits.concurrency(n);
    }
    if let Some(n) = rate {
        limits = limits.rate(n);
    }
    limits
}
