use toolrunner::{CallContext, Reconciled, ToolError};

/// In.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct In {}

/// Out.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Out {}

/// Something else.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Other {}

async fn charge(ctx: CallContext, input: In) -> Result<Out, ToolError> {
    let _ = (input, ctx);
    Ok(Out {})
}

async fn find(ctx: CallContext) -> Reconciled<Other> {
    let _ = ctx;
    Reconciled::Unknown
}

fn main() {
    let _ = toolrunner::tool::write("payments.charge", charge).reconcile(find);
}
