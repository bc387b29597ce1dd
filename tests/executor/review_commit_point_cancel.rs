//! Review finding: `CallContext::commit_point()` sends a heartbeat whose
//! answer may carry `cancel_requested` for this very call (a call "not yet
//! announced in any heartbeat", choice 18) and throws that answer away: it
//! returns `Ok(())` although the platform has just told it the run was
//! cancelled, and the platform now counts the notice as announced.
//!
//! Setup: a platform without a stream (polling-only platforms are allowed,
//! §4 "polling pending alone must also work") and an advised heartbeat of
//! 30 s, so the only heartbeat between the cancel and the commit point is the
//! one `commit_point()` sends itself.

use crate::fixture;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::Notify;
use toolrunner::{CallContext, Effect, Tool, ToolError, async_trait};

use fixture::*;

const TOOL: &str = "review.pay";

#[derive(Debug, Deserialize, JsonSchema)]
struct Input {
    #[allow(dead_code)] // only its schema matters
    amount: u64,
}

#[derive(Debug, Serialize, JsonSchema)]
struct Output {
    ok: bool,
}

#[derive(Default)]
struct Shared {
    started: Notify,
    go: Notify,
    answer: Mutex<Option<String>>,
    effects: Mutex<u32>,
}

struct Pay(Arc<Shared>);

#[async_trait]
impl Tool for Pay {
    type Input = Input;
    type Output = Output;
    fn name(&self) -> &str {
        TOOL
    }
    fn description(&self) -> &str {
        "Pays (irreversible step behind commit_point)"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, ctx: &CallContext, _input: Input) -> Result<Output, ToolError> {
        self.0.started.notify_one();
        self.0.go.notified().await;
        let r = ctx.commit_point().await;
        *self.0.answer.lock().unwrap() = Some(format!("{r:?}"));
        r?;
        *self.0.effects.lock().unwrap() += 1; // the irreversible step
        Ok(Output { ok: true })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_point_honours_a_cancel_announced_in_its_own_heartbeat() -> Result<()> {
    let opts = Opts {
        heartbeat_interval_ms: 30_000,
        lease_ttl_ms: 60_000,
        stream: false,
        ..Opts::default()
    };
    let env = Env::start(opts, &[TOOL]).await?;
    let shared = Arc::new(Shared::default());
    let exec = env
        .builder("exe-review-cp")
        .tool(Pay(shared.clone()))
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(&agv, "user_1", &[(TOOL, json!({"amount": 1}))])
        .await?;
    let running = exec.start().await?;
    bounded(
        Duration::from_secs(5),
        "handler start",
        shared.started.notified(),
    )
    .await;

    // The run is cancelled while the handler works, before its commit point.
    env.cancel(&run_id).await?;
    shared.go.notify_one();
    assert!(
        eventually(Duration::from_secs(5), || shared
            .answer
            .lock()
            .unwrap()
            .is_some())
        .await,
        "commit_point never answered"
    );
    let answer = shared.answer.lock().unwrap().clone().unwrap();
    let effects = *shared.effects.lock().unwrap();
    drop(running);
    env.shutdown().await;
    assert_eq!(
        answer, "Err(Cancelled)",
        "the heartbeat sent by commit_point() was answered with cancel_requested for \
         this call, yet commit_point() said {answer} and the handler took {effects} \
         irreversible step(s) after the run was cancelled"
    );
    Ok(())
}
