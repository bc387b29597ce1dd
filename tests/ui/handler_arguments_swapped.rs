use toolrunner::{CallContext, ToolError};

/// In.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct In {}

/// Out.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Out {}

async fn charge(input: In, ctx: CallContext) -> Result<Out, ToolError> {
    let _ = (input, ctx);
    Ok(Out {})
}

fn main() {
    let _ = toolrunner::tool::write("payments.charge", charge);
}
