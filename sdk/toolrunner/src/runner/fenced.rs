//! The store as the runner sees it: once the process is fenced (a crash, a
//! detach), nothing more is written, as after a real process loss; and,
//! under a test's faults of the process, frozen or cut off.
use std::collections::BTreeMap;
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::gate::{Gate, Reach};
use crate::health::HealthState;
use crate::store::{
    Attempt, CallFilter, Change, Event, LocalCall, LocalState, OutboxReceipt, OutboxSummary,
    ReceiptStatus, Store, StoreError, StoreTransaction, Timestamp,
};

pub(crate) struct FencedStore {
    pub(crate) inner: Arc<dyn Store>,
    pub(crate) fence: CancellationToken,
    /// A test's faults of this process.
    pub(crate) gate: Option<Arc<Gate>>,
    /// Where each commit's outcome goes (the store's health).
    pub(crate) health: Arc<HealthState>,
}

impl FencedStore {
    /// Runs one store request under the process's faults: it waits while
    /// the process is frozen, before it goes out and before its answer is
    /// taken in, and fails while the store is cut off.
    async fn io<T>(
        &self,
        request: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        if let Some(gate) = &self.gate {
            gate.before(Reach::Store).await.map_err(cut)?;
            let answer = request.await;
            gate.thawed().await;
            return answer;
        }
        request.await
    }
}

fn cut(why: String) -> StoreError {
    StoreError::Database(crate::store::DatabaseError::said(why))
}

#[async_trait::async_trait]
impl Store for FencedStore {
    async fn commit(&self, changes: Vec<Change>) -> Result<(), StoreError> {
        if self.fence.is_cancelled() {
            return Err(StoreError::Closed);
        }
        let committed = self.io(self.inner.commit(changes)).await;
        match &committed {
            Ok(()) | Err(StoreError::Conflict(..) | StoreError::Refused(_)) => {
                self.health.store(Ok(()))
            }
            // Closed: the writer is gone (or the process stopped, which the
            // health says first).
            Err(e @ (StoreError::Database(_) | StoreError::Fenced(_) | StoreError::Closed)) => {
                self.health.store(Err(e.to_string()))
            }
            Err(_) => {}
        }
        committed
    }

    async fn begin(&self) -> Result<StoreTransaction, StoreError> {
        if self.fence.is_cancelled() {
            return Err(StoreError::Closed);
        }
        self.io(self.inner.begin()).await
    }

    async fn call(&self, run_id: &str, call_id: &str) -> Result<Option<LocalCall>, StoreError> {
        self.io(self.inner.call(run_id, call_id)).await
    }

    async fn calls(&self, filter: &CallFilter) -> Result<Vec<LocalCall>, StoreError> {
        self.io(self.inner.calls(filter)).await
    }

    async fn count_by_state(&self) -> Result<BTreeMap<LocalState, u64>, StoreError> {
        self.io(self.inner.count_by_state()).await
    }

    async fn receipts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.io(self.inner.receipts(run_id, call_id)).await
    }

    async fn receipt(&self, receipt_id: &str) -> Result<Option<OutboxReceipt>, StoreError> {
        self.io(self.inner.receipt(receipt_id)).await
    }

    async fn receipts_with(&self, status: ReceiptStatus) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.io(self.inner.receipts_with(status)).await
    }

    async fn events(&self, run_id: &str, call_id: &str) -> Result<Vec<Event>, StoreError> {
        self.io(self.inner.events(run_id, call_id)).await
    }

    async fn attempts(&self, run_id: &str, call_id: &str) -> Result<Vec<Attempt>, StoreError> {
        self.io(self.inner.attempts(run_id, call_id)).await
    }

    async fn prune(&self, settled_before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        if self.fence.is_cancelled() {
            return Err(StoreError::Closed);
        }
        self.io(self.inner.prune(settled_before, limit)).await
    }

    async fn outbox_summary(&self) -> Result<OutboxSummary, StoreError> {
        self.io(self.inner.outbox_summary()).await
    }

    async fn outcomes(
        &self,
        calls: &[crate::store::CallKey],
    ) -> Result<
        std::collections::HashMap<crate::store::CallKey, toolrunner_protocol::wire::ReceiptKind>,
        StoreError,
    > {
        self.io(self.inner.outcomes(calls)).await
    }

    async fn executor_ids(&self) -> Result<Vec<String>, StoreError> {
        self.io(self.inner.executor_ids()).await
    }
}
