//! Review finding: a `running` call whose drive task ends with an error
//! after the handler returned (one failed store commit of the final receipt,
//! or one failed re-read of the call) stays `running` in the store with no
//! task driving it. The claimer resumes only `claiming` / `assigned`, the
//! outbox only pending receipts, the reconcile loop only
//! `reconciliation_required`; `running` is looked at again only by
//! `recovery::resume`, i.e. after a reconnect or restart. Until then the
//! call is stuck: the platform keeps it `running`, nothing is reported, and
//! the handler's outcome is lost (the contract wants it saved, or else
//! reported `reconciliation_required`, §6 items 3-4).
//!
//! Here the store refuses exactly one commit: the one saving the
//! `completed` receipt (a transient failure such as SQLITE_BUSY from an
//! operator's CLI holding the write lock).

use crate::fixture;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{
    CallFilter, Change, Event, LocalCall, OutboxReceipt, ReceiptStatus, SqliteStore, Store,
    StoreError,
};
use toolrunner::{CallContext, Effect, Tool, ToolError, async_trait};

use fixture::*;

const TOOL: &str = "review.write";

#[derive(Debug, Deserialize, JsonSchema)]
struct Input {
    #[allow(dead_code)] // only its schema matters
    amount: u64,
}

#[derive(Debug, Serialize, JsonSchema)]
struct Output {
    ok: bool,
}

struct Write;

#[async_trait]
impl Tool for Write {
    type Input = Input;
    type Output = Output;
    fn name(&self) -> &str {
        TOOL
    }
    fn description(&self) -> &str {
        "Writes"
    }
    fn effect(&self) -> Effect {
        Effect::Write
    }
    async fn call(&self, _ctx: &CallContext, _input: Input) -> Result<Output, ToolError> {
        Ok(Output { ok: true })
    }
}

/// SQLite, except that the first commit saving a `completed` receipt fails.
struct OnceFlaky {
    inner: SqliteStore,
    failed: AtomicBool,
}

#[async_trait]
impl Store for OnceFlaky {
    async fn commit(&self, changes: Vec<Change>) -> Result<(), StoreError> {
        let completes = changes
            .iter()
            .any(|c| matches!(c, Change::AddReceipt(r) if r.kind == ReceiptKind::Completed));
        if completes && !self.failed.swap(true, Ordering::SeqCst) {
            return Err(StoreError::Corrupt("injected: database is locked".into()));
        }
        self.inner.commit(changes).await
    }
    async fn call(&self, run_id: &str, call_id: &str) -> Result<Option<LocalCall>, StoreError> {
        self.inner.call(run_id, call_id).await
    }
    async fn calls(&self, filter: &CallFilter) -> Result<Vec<LocalCall>, StoreError> {
        self.inner.calls(filter).await
    }
    async fn count_by_state(
        &self,
    ) -> Result<std::collections::BTreeMap<toolrunner::testing::store::LocalState, u64>, StoreError>
    {
        self.inner.count_by_state().await
    }
    async fn receipts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.inner.receipts(run_id, call_id).await
    }
    async fn receipt(&self, receipt_id: &str) -> Result<Option<OutboxReceipt>, StoreError> {
        self.inner.receipt(receipt_id).await
    }
    async fn receipts_with(&self, status: ReceiptStatus) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.inner.receipts_with(status).await
    }
    async fn events(&self, run_id: &str, call_id: &str) -> Result<Vec<Event>, StoreError> {
        self.inner.events(run_id, call_id).await
    }
    async fn attempts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<toolrunner::testing::store::Attempt>, StoreError> {
        self.inner.attempts(run_id, call_id).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_call_is_not_left_without_a_driver() -> Result<()> {
    let env = Env::start(Opts::default(), &[TOOL]).await?;
    let store = Arc::new(OnceFlaky {
        inner: env.open_store().await?,
        failed: AtomicBool::new(false),
    });
    let exec = env.builder("exe-review-stuck").tool(Write).build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env.run(&agv, "u1", &[(TOOL, json!({"amount": 1}))]).await?;
    let running = exec.start_with_store(store.clone()).await?;
    let result = env
        .wait_run(&run_id, Duration::from_secs(8), "out of running", |run| {
            let s = state(&calls(run)[0]);
            s != "running" && s != "claimed" && s != "pending"
        })
        .await;
    let call_id = env.get_run(&run_id).await?["tool_calls"][0]["call_id"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let local = store.call(&run_id, &call_id).await?;
    drop(running);
    env.shutdown().await;
    eprintln!(
        "injected failure happened: {}; local call: {:?}",
        store.failed.load(Ordering::SeqCst),
        local.map(|c| (c.state, c.reason))
    );
    result.map(|_| ())
}
