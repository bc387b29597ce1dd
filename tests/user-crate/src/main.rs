use std::io::{ErrorKind, Write};

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
    let line = format!("{} {} {:?}\n", ctx.operation_key(), e.amount, e.memo);
    let mut ledger = std::fs::OpenOptions::new().create(true).append(true).open("ledger.txt")?;
    ctx.commit_point().await?; // nothing irreversible before this line
    ledger.write_all(line.as_bytes())?; // appended whole: calls at once never mix lines
    Ok(Posted { key: ctx.operation_key().into() })
}

/// After a crash or a lost answer: did the entry happen? Look it up by key.
async fn find(ctx: CallContext) -> Reconciled<Posted> {
    let ledger = match std::fs::read_to_string("ledger.txt") {
        Err(e) if e.kind() == ErrorKind::NotFound => String::new(), // no ledger yet: nothing was posted
        Ok(ledger) if ledger.is_empty() || ledger.ends_with('\n') => ledger,
        _ => return Reconciled::Unknown, // cannot read it, or a write was cut short: a person decides
    };
    let done = ledger.lines().any(|l| l.split(' ').next() == Some(ctx.operation_key()));
    Reconciled::found(done.then(|| Posted { key: ctx.operation_key().into() })) // None: not done, the call fails
}

#[tokio::main]
async fn main() -> toolrunner::Result<()> {
    Executor::from_env().allow_all().tool(post).build()?.serve(toolrunner::shutdown_signal()).await
}
