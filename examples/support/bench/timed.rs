//! A store that times its commits (the executor's store, wrapped).

use super::*;

/// The executor's store, timing each call from its first durable write
/// (the operation key, before the claim) to the platform's answer to its
/// final receipt (when the delivered mark is asked for).
pub(crate) struct Timed {
    pub(crate) inner: Arc<dyn Store>,
    /// Calls begun (when), and the times of those delivered.
    pub(crate) calls: Mutex<(HashMap<CallId, Instant>, Vec<Duration>)>,
    /// When the first call was inserted (its operation key saved).
    pub(crate) first: Mutex<Option<Instant>>,
    pub(crate) expected: usize,
    pub(crate) all_delivered: Notify,
    /// Reads by kind: call, calls, receipts, receipt, other.
    pub(crate) reads: [AtomicU64; 5],
    /// How long each commit took, as its caller waited.
    pub(crate) commits: Mutex<Vec<Duration>>,
}

impl Timed {
    pub(crate) fn new(inner: Arc<dyn Store>, expected: usize) -> Timed {
        Timed {
            inner,
            calls: Mutex::new((
                HashMap::with_capacity(expected),
                Vec::with_capacity(expected),
            )),
            expected,
            all_delivered: Notify::new(),
            first: Mutex::new(None),
            reads: Default::default(),
            commits: Mutex::new(Vec::with_capacity(expected * 6)),
        }
    }

    pub(crate) fn read(&self, kind: usize) {
        self.reads[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// Reads so far by kind: call, calls, receipts, receipt, other.
    pub(crate) fn reads(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.reads[i].load(Ordering::Relaxed))
    }

    pub(crate) fn first_claim(&self) -> Option<Instant> {
        *self.first.lock().expect("lock")
    }

    pub(crate) fn latencies(&self) -> Vec<Duration> {
        self.calls.lock().expect("lock").1.clone()
    }

    /// The calls a commit starts (their first row) and ends (delivered).
    pub(crate) fn marks(changes: &[Change]) -> Vec<(bool, CallId)> {
        changes
            .iter()
            .filter_map(|change| match change {
                Change::InsertCall(c) => Some((true, (c.run_id.clone(), c.call_id.clone()))),
                Change::UpdateCall { call, .. } if call.state == LocalState::Delivered => {
                    Some((false, (call.run_id.clone(), call.call_id.clone())))
                }
                _ => None,
            })
            .collect()
    }

    pub(crate) fn observe(&self, marks: Vec<(bool, CallId)>, started: Instant) {
        let mut guard = self.calls.lock().expect("lock");
        let (begun, done) = &mut *guard;
        for (first, key) in marks {
            if first {
                self.first.lock().expect("lock").get_or_insert(started);
                begun.insert(key, started);
            } else if let Some(t) = begun.remove(&key) {
                // Until the platform's answer to the final receipt: the
                // delivered mark is asked for right after it.
                done.push(started.duration_since(t));
                if done.len() == self.expected {
                    self.all_delivered.notify_one();
                }
            }
        }
    }
}

#[toolrunner::async_trait]
impl Store for Timed {
    async fn commit(&self, changes: Vec<Change>) -> Result<(), StoreError> {
        let started = Instant::now();
        let marks = Self::marks(&changes);
        self.inner.commit(changes).await?;
        self.commits.lock().expect("lock").push(started.elapsed());
        self.observe(marks, started);
        Ok(())
    }
    async fn call(&self, run_id: &str, call_id: &str) -> Result<Option<LocalCall>, StoreError> {
        self.read(0);
        self.inner.call(run_id, call_id).await
    }
    async fn calls(&self, filter: &CallFilter) -> Result<Vec<LocalCall>, StoreError> {
        self.read(1);
        self.inner.calls(filter).await
    }
    async fn count_by_state(
        &self,
    ) -> Result<std::collections::BTreeMap<LocalState, u64>, StoreError> {
        self.read(4);
        self.inner.count_by_state().await
    }
    async fn receipts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.read(2);
        self.inner.receipts(run_id, call_id).await
    }
    async fn receipt(&self, receipt_id: &str) -> Result<Option<OutboxReceipt>, StoreError> {
        self.read(3);
        self.inner.receipt(receipt_id).await
    }
    async fn receipts_with(&self, status: ReceiptStatus) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.read(4);
        self.inner.receipts_with(status).await
    }
    async fn events(&self, run_id: &str, call_id: &str) -> Result<Vec<Event>, StoreError> {
        self.read(4);
        self.inner.events(run_id, call_id).await
    }
    async fn attempts(&self, run_id: &str, call_id: &str) -> Result<Vec<Attempt>, StoreError> {
        self.read(4);
        self.inner.attempts(run_id, call_id).await
    }
    async fn prune(&self, settled_before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        self.inner.prune(settled_before, limit).await
    }
    async fn outbox_summary(&self) -> Result<OutboxSummary, StoreError> {
        self.read(4);
        self.inner.outbox_summary().await
    }
}
