//! Review finding: `flush_reports` sends every flagged call in batches of 100
//! and, on any error answer, gives up on the whole batch and retries the
//! same batch next time. A batch naming one call the platform does not know
//! is refused as a whole (`400 unknown_call`, §4 Report: "A run or call that
//! does not exist at all makes the whole request 400 ... and changes
//! nothing"), forever: no other `reconciliation_required`, `released` or
//! `pending_delivery` report ever reaches the platform again.
//!
//! The contract expects the platform may lose its state (§1: "the platform
//! may have lost its state"; "never reuses an identifier, not even after
//! losing its state"). Here that is simulated by a store holding one call
//! flagged `reconciliation_required` whose run the platform does not know
//! (as it would hold after such a loss). Then a real write call ends with an
//! unknown outcome: its `reconciliation_required` report never arrives, and
//! the platform keeps the call `running`.

use crate::fixture;

use std::time::Duration;

use anyhow::Result;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::store::{Change, LocalCall, LocalState, PendingReport, Store};
use toolrunner::{CallContext, Effect, Tool, ToolError, async_trait};

use fixture::*;

const TOOL: &str = "review.unknown";

#[derive(Debug, Deserialize, JsonSchema)]
struct Input {
    #[allow(dead_code)] // only its schema matters
    amount: u64,
}

#[derive(Debug, Serialize, JsonSchema)]
struct Output {
    ok: bool,
}

struct Unknown;

#[async_trait]
impl Tool for Unknown {
    type Input = Input;
    type Output = Output;
    fn name(&self) -> &str {
        TOOL
    }
    fn description(&self) -> &str {
        "Always ends with an unknown outcome"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, _ctx: &CallContext, _input: Input) -> Result<Output, ToolError> {
        Err(ToolError::unknown("the provider timed out"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_unknown_call_does_not_block_every_report() -> Result<()> {
    let env = Env::start(Opts::default(), &[TOOL]).await?;
    // A call flagged for reporting whose run the platform no longer knows.
    let store = env.open_store().await?;
    let now: toolrunner::testing::store::Timestamp = "2024-01-01T00:00:00.000Z".parse()?;
    store
        .commit(vec![Change::InsertCall(LocalCall {
            run_id: "run_0190aaaaaaaaaaaaaaaaaaaaaaaaaaaa".into(),
            call_id: "call_0190aaaaaaaaaaaaaaaaaaaaaaaaaaaa".into(),
            tool_name: TOOL.into(),
            operation_key: "op_lost".into(),
            state: LocalState::ReconciliationRequired,
            assignment: None,
            next_sequence: 1,
            reason: Some("handler error".into()),
            report: Some(PendingReport::ReconciliationRequired),
            created_at: now,
            updated_at: now,
            version: 0,
        })])
        .await?;

    let exec = env
        .builder("exe-review-report")
        .auto_reconcile(false)
        .tool(Unknown)
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env.run(&agv, "u1", &[(TOOL, json!({"amount": 1}))]).await?;
    let running = exec.start().await?;
    let result = env
        .wait_run(
            &run_id,
            Duration::from_secs(6),
            "reported reconciliation_required",
            |run| state(&calls(run)[0]) == "reconciliation_required",
        )
        .await;
    let call_id = env.get_run(&run_id).await?["tool_calls"][0]["call_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let local = store.call(&run_id, &call_id).await?;
    drop(running);
    env.shutdown().await;
    eprintln!("local call: {:?}", local.map(|c| (c.state, c.report)));
    result.map(|_| ())
}
