//! Function tools end to end: `#[toolrunner::tool]` and `tool::write` with
//! shared `State<T>`, a reconcile hook, and the checks made at `build()`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::{CallContext, Reconciled, State, ToolError};

use crate::fixture::*;

/// The business ledger the tools write to.
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<Vec<(String, u64)>>>);

impl Ledger {
    fn entries(&self) -> Vec<(String, u64)> {
        self.0.lock().expect("not poisoned").clone()
    }
}

/// What to post.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Post {
    /// Amount in minor units.
    amount: u64,
}

/// The entry made.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
struct Posted {
    /// Its line number.
    entry: usize,
}

/// Posts an amount to the ledger (the model reads this).
#[toolrunner::tool(name = "ledger.post", effect = write, reconcile = find_post)]
async fn post(
    State(ledger): State<Ledger>,
    ctx: CallContext,
    input: Post,
) -> Result<Posted, ToolError> {
    let mut lines = ledger.0.lock().expect("not poisoned");
    lines.push((ctx.operation_key().to_owned(), input.amount));
    if input.amount == 13 {
        return Err(ToolError::unknown("the ledger timed out after writing"));
    }
    Ok(Posted { entry: lines.len() })
}

async fn find_post(State(ledger): State<Ledger>, ctx: CallContext) -> Reconciled<Posted> {
    let lines = ledger.entries();
    match lines.iter().position(|(k, _)| k == ctx.operation_key()) {
        Some(i) => Reconciled::Happened(Posted { entry: i + 1 }),
        None => Reconciled::DidNotHappen,
    }
}

/// The macro's tool and `tool::read` serve calls; the description is the
/// doc comment; a handler's unknown outcome is settled once by its hook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_tools_serve_calls_and_their_hook_settles_the_unknown() -> Result<()> {
    let env = Env::start(Opts::default(), &["ledger.post", "ledger.total"]).await?;
    let ledger = Ledger::default();
    async fn total(
        State(ledger): State<Ledger>,
        _ctx: CallContext,
        _input: Empty,
    ) -> Result<Total, ToolError> {
        Ok(Total {
            total: ledger.entries().iter().map(|(_, a)| a).sum(),
        })
    }
    let exec = env
        .builder("exe-functions")
        .state(ledger.clone())
        .tool(post)
        .tool(toolrunner::tool::read("ledger.total", total).describe("The ledger's total"))
        .build()?;
    let post_def = exec
        .tool_definitions()
        .iter()
        .find(|d| d.name == "ledger.post")
        .expect("ledger.post");
    assert_eq!(
        post_def.description,
        "Posts an amount to the ledger (the model reads this)."
    );
    assert_eq!(
        post_def.input_schema["properties"]["amount"]["description"],
        "Amount in minor units."
    );
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_1",
            &[
                ("ledger.post", json!({"amount": 5})),
                ("ledger.post", json!({"amount": 13})),
            ],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(10)).await?;
    let states: Vec<String> = calls(&run).iter().map(state).collect();
    assert_eq!(states, ["completed", "completed"], "{run:#}");
    assert_eq!(ledger.entries().len(), 2, "each posted once");
    let total_run = env
        .run(&agv, "user_1", &[("ledger.total", json!({}))])
        .await?;
    let run = env
        .wait_settled(&total_run, Duration::from_secs(10))
        .await?;
    assert_eq!(
        receipt_body(&call_of(&run, "ledger.total"), "completed")["result"],
        json!({"total": 18})
    );
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    env.shutdown().await;
    Ok(())
}

/// No arguments.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct Empty {}

/// A total.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
struct Total {
    /// The sum of every amount.
    total: u64,
}

/// A tool that takes a state nobody gave is refused at `build()`, naming
/// the tool and the state's type.
#[tokio::test]
async fn a_missing_state_is_refused_at_build() -> Result<()> {
    let err = toolrunner::Executor::builder()
        .base_url("http://127.0.0.1:1")
        .token("t")
        .executor_id("exe")
        .binding_id("bnd_1")
        .allow_all()
        .tool(post)
        .build()
        .expect_err("no State<Ledger>");
    let msg = err.to_string();
    assert!(
        msg.contains("ledger.post") && msg.contains("Ledger") && msg.contains(".state("),
        "{msg}"
    );
    Ok(())
}

/// An executor built only to tell its definitions needs no platform
/// settings: its definitions name the placeholder binding, and it never
/// starts (`--print-definitions` gives such a builder from the
/// environment).
#[tokio::test]
async fn definitions_need_no_platform() -> Result<()> {
    let exec = toolrunner::Executor::builder()
        .state(Ledger::default())
        .tool(post)
        .definitions_only()
        .build()?;
    let defs = exec.tool_definitions();
    assert_eq!(defs.len(), 1, "{defs:?}");
    assert_eq!(defs[0].name, "ledger.post");
    assert_eq!(defs[0].binding_id, toolrunner::UNBOUND);
    let refused = exec.start().await.expect_err("it does not start");
    assert!(
        refused.is_builder() && refused.to_string().contains("--print-definitions"),
        "{refused}"
    );
    // A binding id given is kept.
    let exec = toolrunner::Executor::builder()
        .binding_id("bnd_7")
        .state(Ledger::default())
        .tool(post)
        .definitions_only()
        .build()?;
    assert_eq!(exec.tool_definitions()[0].binding_id, "bnd_7");
    Ok(())
}
