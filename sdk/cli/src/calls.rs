//! `toolrunner calls list|show`.
use std::time::Duration;

use serde_json::Value;
use toolrunner::{CallFilter, LocalState};

use crate::output::{self, DbArg};
use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum CallsCommand {
    /// List calls, oldest change first, each with its state and its
    /// outcome (the kind of its latest final receipt).
    List {
        #[command(flatten)]
        db: DbArg,
        /// Only this state (e.g. reconciliation_required, rejected, settled).
        #[arg(long, value_parser = parse_state)]
        state: Option<LocalState>,
        /// Only this tool.
        #[arg(long)]
        tool: Option<String>,
        /// Only calls unchanged for at least this long (e.g. 10m, 2h).
        #[arg(long, value_parser = humantime::parse_duration)]
        older_than: Option<Duration>,
        /// Stable JSON: `{"calls": [CallSummary, ...]}`.
        #[arg(long)]
        json: bool,
    },
    /// Show one call's whole timeline, with its arguments.
    Show {
        /// RUN_ID/CALL_ID.
        call: String,
        #[command(flatten)]
        db: DbArg,
        /// Stable JSON: Timeline.
        #[arg(long)]
        json: bool,
    },
}

pub(crate) fn parse_state(s: &str) -> Result<LocalState, String> {
    LocalState::parse(s).ok_or_else(|| {
        let names: Vec<&str> = toolrunner::LocalState::ALL
            .iter()
            .map(|s| s.as_str())
            .collect();
        format!("unknown state {s:?}; one of {}", names.join(", "))
    })
}

pub(crate) async fn run(cmd: CallsCommand) -> Outcome {
    match cmd {
        CallsCommand::List {
            db,
            state,
            tool,
            older_than,
            json,
        } => {
            let r = output::open(&db.db).await?;
            // An age beyond the calendar means "older than anything": none.
            let updated_before = older_than.map(|d| {
                chrono::Duration::from_std(d)
                    .ok()
                    .and_then(|d| chrono::Utc::now().checked_sub_signed(d))
                    .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC)
            });
            let mut filter = CallFilter::new().states(state);
            if let Some(tool) = tool {
                filter = filter.tool_name(tool);
            }
            if let Some(t) = updated_before {
                filter = filter.updated_before(t);
            }
            let calls = r.list(&filter).await?;
            if json {
                return output::json(&serde_json::json!({"calls": calls}));
            }
            let rows = calls
                .iter()
                .map(|c| {
                    vec![
                        format!("{}/{}", c.run_id(), c.call_id()),
                        c.tool_name().to_owned(),
                        c.state().as_str().to_owned(),
                        c.outcome().map_or("-", |k| k.as_str()).to_owned(),
                        stamp(&c.updated_at()),
                        c.reason().unwrap_or_default().to_owned(),
                    ]
                })
                .collect();
            println!(
                "{}",
                output::table(
                    &["call", "tool", "state", "outcome", "updated", "reason"],
                    rows
                )
            );
            println!("{} calls", calls.len());
            Ok(())
        }
        CallsCommand::Show { call, db, json } => {
            let (run_id, call_id) = output::call_ref(&call)?;
            let r = output::open(&db.db).await?;
            let t = r.show(&run_id, &call_id).await.map_err(Failure::from)?;
            if json {
                return output::json(&t);
            }
            let c = &t.call();
            println!("call          {}/{}", c.run_id(), c.call_id());
            println!("tool          {}", c.tool_name());
            println!("state         {}", c.state().as_str());
            println!("outcome       {}", c.outcome().map_or("-", |k| k.as_str()));
            println!("operation key {}", c.operation_key());
            println!("assignment    {}", c.assignment_id().unwrap_or("-"));
            println!("subject       {}", c.subject().unwrap_or("-"));
            println!("reason        {}", c.reason().unwrap_or("-"));
            // The model's arguments (product data, shown to the operator as
            // the console shows them); the grant is not among them.
            println!(
                "arguments     {}",
                t.arguments()
                    .map_or_else(|| "-".to_owned(), Value::to_string)
            );
            let receipts = t
                .receipts()
                .iter()
                .map(|r| {
                    vec![
                        r.sequence().to_string(),
                        r.kind().as_str().to_owned(),
                        r.receipt_id().to_owned(),
                        r.status().as_str().to_owned(),
                        r.attempts().to_string(),
                        r.last_error().unwrap_or_default().to_owned(),
                        r.body().to_owned(),
                    ]
                })
                .collect();
            println!(
                "\nreceipts\n{}",
                output::table(
                    &[
                        "seq",
                        "kind",
                        "receipt",
                        "status",
                        "attempts",
                        "last error",
                        "body"
                    ],
                    receipts
                )
            );
            let events = t
                .events()
                .iter()
                .map(|e| {
                    vec![
                        stamp(&e.at()),
                        e.what().to_owned(),
                        e.detail().unwrap_or_default().to_owned(),
                    ]
                })
                .collect();
            println!(
                "\ntimeline\n{}",
                output::table(&["at", "what", "detail"], events)
            );
            Ok(())
        }
    }
}

/// A time as the tables show it (RFC 3339, milliseconds).
pub(crate) fn stamp(t: &toolrunner::Timestamp) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}
