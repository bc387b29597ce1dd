use toolrunner::CallContext;

/// In.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct In {}

/// Out.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Out {}

async fn charge(ctx: CallContext, input: In) -> Result<Out, String> {
    let _ = (input, ctx);
    Ok(Out {})
}

fn main() {
    let _ = toolrunner::tool::write("payments.charge", charge);
}
