//! The running executor: connection, claimer, per-call pipeline, outbox.
//!
//! Every step that the crash table names is committed to the store before
//! the matching request goes out; see `docs/protocol.md` §14.

pub(crate) mod call;
mod checks;
mod claimer;
mod connection;
mod gauges;
pub(crate) mod outbox;
mod reconcile;
mod recovery;
mod stream;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::{Notify, RwLock, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::authorizer::Authorizer;
use crate::client::Client;
use crate::error::{Error, Kind};
use crate::handler::Tools;
use crate::store::{Change, LocalCall, Store, StoreError};

pub(crate) use call::progress;
pub(crate) use connection::lease_check;

/// Settings the runner works with.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) executor_id: String,
    pub(crate) binding_id: String,
    pub(crate) capacity: u32,
    pub(crate) instance_id: String,
    pub(crate) poll_interval: Duration,
    pub(crate) handler_timeout: Duration,
    pub(crate) retry_attempts: u32,
    pub(crate) use_stream: bool,
    pub(crate) auto_reconcile: bool,
    pub(crate) reconcile_interval: Duration,
}

/// A run and call id pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct CallKey {
    pub(crate) run_id: String,
    pub(crate) call_id: String,
}

impl CallKey {
    pub(crate) fn of(c: &LocalCall) -> CallKey {
        CallKey {
            run_id: c.run_id.clone(),
            call_id: c.call_id.clone(),
        }
    }
}

/// The live connection.
#[derive(Debug, Clone)]
pub(crate) struct Conn {
    pub(crate) connection_id: String,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) lease_ttl_ms: u64,
    pub(crate) stream_path: String,
}

/// Everything the runner's tasks share.
pub(crate) struct Core {
    pub(crate) cfg: Config,
    pub(crate) client: Client,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) tools: Tools,
    pub(crate) authorizer: Arc<dyn Authorizer>,
    pub(crate) conn: RwLock<Option<Conn>>,
    pub(crate) reconnecting: tokio::sync::Mutex<()>,
    /// Serializes the read-modify-write of `next_sequence` by progress
    /// receipts and the final receipt.
    pub(crate) progress_lock: tokio::sync::Mutex<()>,
    /// Calls this process is driving, with their cancellation tokens.
    pub(crate) active: StdMutex<HashMap<CallKey, CancellationToken>>,
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) wake: Notify,
    pub(crate) claiming: AtomicBool,
    pub(crate) fatal: StdMutex<Option<Error>>,
    /// Stop taking new work.
    pub(crate) stop: CancellationToken,
    /// Everything ended.
    pub(crate) done: CancellationToken,
}

impl Core {
    /// Commits, and after an error re-reads: a commit whose answer was
    /// lost may have happened. `expect` is the call as it should now be.
    pub(crate) async fn commit(
        &self,
        changes: Vec<Change>,
        expect: Option<&LocalCall>,
    ) -> Result<(), StoreError> {
        let started = std::time::Instant::now();
        for c in &changes {
            if let Change::PutCall(call) = c {
                metrics::counter!("toolrunner_call_transitions_total", "state" => call.state.as_str()).increment(1);
            }
        }
        let result = self.store.commit(changes).await;
        metrics::histogram!("toolrunner_store_commit_seconds")
            .record(started.elapsed().as_secs_f64());
        match result {
            Ok(()) => Ok(()),
            Err(e) => {
                if matches!(e, StoreError::Conflict(..)) {
                    return Err(e);
                }
                if let Some(want) = expect
                    && let Ok(Some(have)) = self.store.call(&want.run_id, &want.call_id).await
                    && have.state == want.state
                    && have.next_sequence == want.next_sequence
                    && have.assignment == want.assignment
                {
                    tracing::warn!(error = %e, "a commit reported an error but its changes are stored");
                    return Ok(());
                }
                Err(e)
            }
        }
    }

    /// Records a condition that stops the executor from claiming.
    pub(crate) fn fail(&self, e: Error) {
        tracing::error!(error = %e, "executor stops claiming");
        self.claiming.store(false, Ordering::SeqCst);
        let mut fatal = self.fatal.lock().expect("not poisoned");
        if fatal.is_none() {
            *fatal = Some(e);
        }
        self.stop.cancel();
    }

    pub(crate) fn is_active(&self, key: &CallKey) -> bool {
        self.active.lock().expect("not poisoned").contains_key(key)
    }

    /// Marks a call as driven by this process; `None` if it already is.
    pub(crate) fn activate(&self, key: &CallKey) -> Option<CancellationToken> {
        let mut active = self.active.lock().expect("not poisoned");
        if active.contains_key(key) {
            return None;
        }
        let token = self.done.child_token();
        active.insert(key.clone(), token.clone());
        Some(token)
    }

    pub(crate) fn deactivate(&self, key: &CallKey) {
        self.active.lock().expect("not poisoned").remove(key);
        self.wake.notify_one();
    }

    pub(crate) fn cancel_call(&self, key: &CallKey) {
        if let Some(t) = self.active.lock().expect("not poisoned").get(key) {
            tracing::info!(run_id = %key.run_id, call_id = %key.call_id, "platform asked to cancel the call");
            t.cancel();
        }
    }
}

/// How [`RunningExecutor::shutdown`] leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shutdown {
    /// Stop claiming, let in-flight calls finish (up to the deadline), flush
    /// the outbox, then disconnect with `drain`.
    Drain {
        /// How long to wait for in-flight calls.
        deadline: Duration,
    },
    /// Stop claiming, signal handlers to cancel, then disconnect with
    /// `detach`: running calls stay bound for the next start.
    Detach,
}

/// A started executor.
pub struct RunningExecutor {
    core: Arc<Core>,
    tasks: tokio::task::JoinSet<()>,
}

impl std::fmt::Debug for RunningExecutor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningExecutor")
            .field("executor_id", &self.core.cfg.executor_id)
            .finish_non_exhaustive()
    }
}

pub(crate) async fn start(core: Arc<Core>) -> Result<RunningExecutor, Error> {
    connection::connect(&core).await?;
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(connection::heartbeat_loop(core.clone()));
    tasks.spawn(claimer::claim_loop(core.clone()));
    tasks.spawn(outbox::outbox_loop(core.clone()));
    tasks.spawn(reconcile::reconcile_loop(core.clone()));
    if core.cfg.use_stream {
        tasks.spawn(stream::stream_loop(core.clone()));
    }
    Ok(RunningExecutor { core, tasks })
}

impl RunningExecutor {
    /// Waits until the executor stops by itself (a configuration error, or
    /// superseded by another instance) and returns why.
    ///
    /// # Errors
    /// The condition that stopped it.
    pub async fn wait(&self) -> Result<(), Error> {
        self.core.stop.cancelled().await;
        match self.core.fatal.lock().expect("not poisoned").take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Stops the executor.
    ///
    /// # Errors
    /// The platform could not be told (the calls stay safe in the store).
    pub async fn shutdown(mut self, how: Shutdown) -> Result<(), Error> {
        self.core.claiming.store(false, Ordering::SeqCst);
        self.core.stop.cancel();
        let deadline = match how {
            Shutdown::Drain { deadline } => deadline,
            Shutdown::Detach => {
                for t in self.core.active.lock().expect("not poisoned").values() {
                    t.cancel();
                }
                Duration::from_millis(250)
            }
        };
        let waited = tokio::time::timeout(deadline, async {
            while !self.core.active.lock().expect("not poisoned").is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        if waited.is_err() {
            tracing::warn!(
                "in-flight calls did not finish before the deadline; they stay in the store"
            );
        }
        if matches!(how, Shutdown::Drain { .. }) {
            outbox::flush(&self.core).await;
        }
        let result = connection::disconnect(&self.core, how).await;
        self.core.done.cancel();
        while self.tasks.join_next().await.is_some() {}
        result
    }
}

/// What a fail point returns to simulate the process dying at that step.
pub(crate) const CRASH: &str = "simulated crash (fail point)";

impl Drop for RunningExecutor {
    /// Dropping without [`shutdown`](RunningExecutor::shutdown) stops every
    /// task at once, like a lost process: the store keeps where each call
    /// was, and the next start resumes from there.
    fn drop(&mut self) {
        self.core.stop.cancel();
        self.core.done.cancel();
    }
}

/// The wait before retrying a step that could not reach the platform.
pub(crate) fn pause(core: &Core, attempt: u32) -> Duration {
    core.client.backoff.delay(attempt)
}

impl From<Kind> for Error {
    fn from(kind: Kind) -> Self {
        Error::new(kind, "executor stopped")
    }
}
