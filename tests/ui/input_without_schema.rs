use toolrunner::{CallContext, ToolError};

/// What to refund: `#[toolrunner::schema]` is missing.
#[derive(serde::Deserialize)]
struct Refund {
    amount: u64,
}

/// The refund made.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Refunded {
    /// Its amount.
    amount: u64,
}

/// Refunds an amount.
#[toolrunner::tool(name = "refunds.create", effect = write)]
async fn refund(_ctx: CallContext, input: Refund) -> Result<Refunded, ToolError> {
    Ok(Refunded { amount: input.amount })
}

fn main() {
    let _ = toolrunner::Executor::builder().tool(refund);
}
