use std::io::Write;

use serde::{Deserialize, Serialize};
use toolrunner::{CallContext, Executor, Reconciled, ToolError};

/// An entry for the ledger.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Entry { amount: u64, memo: String }

/// The entry made, by its operation key.
#[toolrunner::schema]
#[derive(Serialize)]
struct Posted { key: String }

/// Appends an entry to the ledger, once.
#[toolrunner::tool(name = "ledger.post", effect = write, reconcile = find)]
async fn post(ctx: CallContext, e: Entry) -> Result<Posted, ToolError> {
    ctx.commit_point().await?; // nothing irreversible before this line
    let mut ledger = std::fs::OpenOptions::new().create(true).append(true).open("ledger.txt")?;
    writeln!(ledger, "{} {} {}", ctx.operation_key(), e.amount, e.memo)?;
    Ok(Posted { key: ctx.operation_key().into() })
}

/// After a crash or a lost answer: did the entry happen? Look it up by key.
async fn find(ctx: CallContext) -> Reconciled<Posted> {
    let ledger = std::fs::read_to_string("ledger.txt").unwrap_or_default();
    let line = ledger.lines().find(|l| l.starts_with(ctx.operation_key()));
    Reconciled::found(line.map(|_| Posted { key: ctx.operation_key().into() }))
}

#[tokio::main]
async fn main() -> toolrunner::Result<()> {
    Executor::from_env().allow_all().tool(post).build()?.serve(toolrunner::shutdown_signal()).await
}
