use toolrunner::{CallContext, ToolError};

/// In.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct In {}

/// Out.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Out {}

/// Charges.
#[toolrunner::tool(name = "payments.charge")]
async fn charge(ctx: CallContext, input: In) -> Result<Out, ToolError> {
    let _ = (input, ctx);
    Ok(Out {})
}

fn main() {}
