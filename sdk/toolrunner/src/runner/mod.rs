//! The running executor: connection, claimer, per-call pipeline, outbox.
//!
//! Every step that the crash table names is committed to the store before
//! the matching request goes out; see `docs/protocol.md` §14.

mod answers;
pub(crate) mod approval;
pub(crate) mod call;
mod checks;
mod connection;
mod dispatch;
pub(crate) mod fenced;
pub(crate) mod flow;
mod gauges;
mod host;
pub(crate) mod lease;
pub(crate) mod life;
mod loops;
pub(crate) mod machine;
pub(crate) mod outbox;
mod progress;
#[cfg(feature = "postgres")]
pub(crate) mod replicas;
pub(crate) mod telemetry;
pub(crate) mod template;
pub(crate) mod unwind;

use std::collections::HashMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use tokio::sync::{Notify, RwLock, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::api::authorizer::Authorizer;
use crate::api::handler::Tools;
use crate::error::{Error, Kind};
use crate::lifecycle::{self, Advanced, Event, Reads, Snapshot};
use crate::net::client::Client;
use crate::store::{LocalCall, Store, StoreError};

/// Settings the runner works with.
#[derive(Debug, Clone)]
pub(crate) struct Config {
    pub(crate) executor_id: String,
    pub(crate) binding_id: String,
    pub(crate) capacity: u32,
    pub(crate) instance_id: String,
    /// How often and how long the executor does things.
    pub(crate) timing: Timing,
    pub(crate) use_stream: bool,
    pub(crate) auto_reconcile: bool,
    /// An identity this process adopted: it takes no new calls, finishes
    /// what was left, then lets the identity go.
    pub(crate) adopted: bool,
    /// How long the identity's lease lasts after each renewal (a
    /// PostgreSQL store).
    pub(crate) lease_ttl: Duration,
}

/// How often and how long the executor does things (a part of
/// [`Config`]).
#[derive(Debug, Clone)]
pub(crate) struct Timing {
    /// Between two listings of pending calls.
    pub(crate) poll_interval: Duration,
    /// How long a handler attempt may run.
    pub(crate) handler_timeout: Duration,
    /// How long a handler's transaction may stay open on a SQLite store.
    pub(crate) sqlite_transaction_timeout: Duration,
    /// How many attempts a handler gets (a `Retry`, a read's failure).
    pub(crate) retry_attempts: u32,
    /// Between two automatic checks of a call whose outcome is unknown.
    pub(crate) reconcile_interval: Duration,
    /// How long calls settled for good are kept (`None`: for ever).
    pub(crate) retention: Option<Duration>,
}

pub(crate) use crate::api::context::CallKey;
pub(crate) use life::Phase;
pub(crate) use machine::Pause;

/// The live connection.
#[derive(Debug, Clone)]
pub(crate) struct Conn {
    pub(crate) connection_id: String,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) lease_ttl_ms: u64,
    pub(crate) stream_path: String,
}

/// A fail point of one executor instance: asked with the step's name after
/// each durable step; `true` stops the instance there as a lost process
/// would. Compiled in with the `failpoints` feature only.
pub(crate) type CrashPlan = std::sync::Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// Everything the runner's tasks share.
pub(crate) struct Core {
    pub(crate) cfg: Config,
    pub(crate) client: Client,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) tools: Tools,
    pub(crate) authorizer: Arc<dyn Authorizer>,
    /// The connection to the platform.
    pub(crate) link: Link,
    /// The calls this process drives.
    pub(crate) calls: Calls,
    /// The facts a [`crate::Health`] handle reads.
    pub(crate) health: Arc<crate::health::HealthState>,
    /// Where the executor is in its life.
    pub(crate) life: life::Life,
    /// Per-instance fail points (tests and the simulation).
    pub(crate) crash_plan: Option<CrashPlan>,
    /// Whether its gauges are still published (until it stops).
    pub(crate) gauges: gauges::Published,
    /// This process's hold on its executor identity (its own store, or a
    /// lease on a database shared by replicas).
    pub(crate) lease: Arc<dyn lease::Lease>,
}

/// The connection to the platform (a part of [`Core`]): only
/// `runner/connection.rs` makes, keeps and ends it.
#[derive(Default)]
pub(crate) struct Link {
    /// The live connection, if there is one.
    pub(crate) conn: RwLock<Option<Conn>>,
    /// Held while one task connects again (the others wait for it).
    pub(crate) reconnecting: tokio::sync::Mutex<()>,
    /// What each connect learnt, until recovery takes it.
    pub(crate) learnt: connection::Learnt,
}

/// The calls this process drives (a part of [`Core`]).
pub(crate) struct Calls {
    /// Calls this process is driving, with their cancellation tokens.
    pub(crate) active: StdMutex<HashMap<CallKey, CancellationToken>>,
    /// Calls whose run the platform asked to cancel (heartbeat or stream),
    /// or that a connect no longer listed, remembered while this process
    /// lives, whether or not they were being driven when the notice came.
    pub(crate) cancelled: StdMutex<std::collections::HashSet<CallKey>>,
    /// The executor's capacity: a permit per call a handler may run.
    pub(crate) slots: Arc<Semaphore>,
    /// Each limited tool's slots in this process.
    pub(crate) flow: Arc<flow::Flow>,
    /// The one dispatch queue of calls to drive.
    pub(crate) dispatch: dispatch::Queue,
    /// Wakes the claimer (a stream notice, a slot given back).
    pub(crate) wake: Notify,
    /// A task paused a call (it waits in the store for the claim loop).
    pub(crate) paused: AtomicBool,
    /// The one flush of reports running, shared by those who ask meanwhile.
    pub(crate) reports: outbox::ReportFlush,
    /// The approval requests of the store, and the calls that wait for one.
    pub(crate) approvals: approval::Waits,
}

impl Core {
    /// What a call of `tool` this identity picks up again holds of its
    /// tool's limits (see [`flow::Flow::take_for_resume`]).
    pub(crate) async fn resume_hold(
        &self,
        key: &CallKey,
        tool: &str,
        claimed: bool,
    ) -> Option<flow::ToolHold> {
        let holder = self.flow_holder();
        self.calls
            .flow
            .take_for_resume(holder.as_ref(), key, tool, claimed)
            .await
    }

    /// This identity as a taker of shared flow holds (on a store shared
    /// by replicas: its executor id and fencing token).
    pub(crate) fn flow_holder(&self) -> Option<flow::Holder> {
        let token = self.lease.fencing_token()?;
        Some(flow::Holder {
            executor_id: self.cfg.executor_id.clone(),
            lease_token: i64::try_from(token).unwrap_or(i64::MAX),
        })
    }

    /// Asks the lifecycle for a transition of one call (see
    /// [`lifecycle::advance`]).
    pub(crate) async fn advance(
        &self,
        key: &CallKey,
        reads: Reads,
        decide: impl FnMut(&Snapshot) -> Option<Event>,
    ) -> Result<Advanced, StoreError> {
        self.advance_from(key, None, reads, decide).await
    }

    /// [`advance`](Self::advance) from the row as this task last saw it
    /// (see [`lifecycle::advance_from`]).
    pub(crate) async fn advance_from(
        &self,
        key: &CallKey,
        known: Option<Option<LocalCall>>,
        reads: Reads,
        decide: impl FnMut(&Snapshot) -> Option<Event>,
    ) -> Result<Advanced, StoreError> {
        self.advance_then(key, known, reads, None, decide).await
    }

    /// [`advance_from`](Self::advance_from), with `then` in the same commit
    /// (see [`lifecycle::advance_then`]).
    pub(crate) async fn advance_then(
        &self,
        key: &CallKey,
        known: Option<Option<LocalCall>>,
        reads: Reads,
        then: Option<Event>,
        decide: impl FnMut(&Snapshot) -> Option<Event>,
    ) -> Result<Advanced, StoreError> {
        lifecycle::advance_then(
            self.store.as_ref(),
            &self.cfg.executor_id,
            (&key.run_id, &key.call_id),
            known,
            reads,
            decide,
            then,
        )
        .await
    }

    /// Waits until the lease is live (at once, almost always); `Err` when
    /// the executor stopped meanwhile.
    pub(crate) async fn lease_live_or_stopped(&self) -> Result<(), Pause> {
        let mut said = false;
        while !self.lease.live() {
            if !said {
                tracing::warn!("the executor's lease is not live: the handler waits to start");
                said = true;
            }
            tokio::select! {
                _ = self.life.halted() => return Err(Pause::Halted),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        Ok(())
    }

    /// Records a condition that stops the executor from claiming.
    pub(crate) fn fail(&self, e: Error) {
        tracing::error!(error = %e, "executor stops claiming");
        self.health.failed(e.to_string());
        {
            let mut fatal = self.life.fatal.lock().expect("not poisoned");
            if fatal.is_none() {
                *fatal = Some(e);
            }
        }
        self.life.enter(Phase::Stopping);
    }

    pub(crate) fn is_active(&self, key: &CallKey) -> bool {
        self.calls
            .active
            .lock()
            .expect("not poisoned")
            .contains_key(key)
    }

    /// Marks a call as driven by this process; `None` if it already is.
    /// The mark goes when the guard is dropped, also by a panic.
    pub(crate) fn activate(self: &Arc<Self>, key: &CallKey) -> Option<Active> {
        let mut active = self.calls.active.lock().expect("not poisoned");
        if active.contains_key(key) {
            return None;
        }
        let token = self.life.call_token();
        active.insert(key.clone(), token.clone());
        Some(Active {
            core: self.clone(),
            key: key.clone(),
            token,
        })
    }

    /// Remembers that the platform ended the call's run (a cancel notice,
    /// or a call the connect no longer lists), while this process lives.
    pub(crate) fn remember_ended(&self, key: &CallKey) {
        let mut cancelled = self.calls.cancelled.lock().expect("not poisoned");
        if cancelled.len() >= 100_000 {
            cancelled.clear();
        }
        cancelled.insert(key.clone());
    }

    /// Fires the call's cancellation token, and remembers the cancel.
    pub(crate) fn cancel_call(&self, key: &CallKey) {
        self.remember_ended(key);
        if let Some(t) = self.calls.active.lock().expect("not poisoned").get(key) {
            tracing::info!(run_id = %key.run_id, call_id = %key.call_id, "platform asked to cancel the call");
            t.cancel();
        }
    }

    /// Whether the platform asked to cancel this call's run.
    pub(crate) fn was_cancelled(&self, key: &CallKey) -> bool {
        self.calls
            .cancelled
            .lock()
            .expect("not poisoned")
            .contains(key)
    }

    /// Stops the process as far as the world can tell: nothing more is
    /// written or sent, every task ends, the store file is free again.
    pub(crate) fn halt(&self) {
        self.health.stopped();
        // It holds nothing any more, whichever way it stopped: its gauges
        // say so before anyone hears it stopped, and are not published
        // again.
        gauges::clear(self);
        self.client.fence();
        self.life.enter(Phase::Halted);
        self.life.lock.lock().expect("not poisoned").take();
        // The identities this process adopted are lost with it (each
        // dropped executor halts, and clears its own gauges).
        drop(self.lease.take_adopted());
    }

    /// A fail point after a durable step: `Err` (and the process halted)
    /// when a test stops the executor here.
    pub(crate) fn crash_point(&self, name: &str) -> Result<(), Pause> {
        let global = || -> bool {
            fail::fail_point!(name, |_| true);
            false
        };
        let planned = self.crash_plan.as_ref().is_some_and(|plan| plan(name));
        if planned || global() {
            tracing::warn!(step = name, "simulated crash (fail point)");
            self.halt();
            return Err(Pause::Halted);
        }
        Ok(())
    }
}

/// A call marked as driven by this process (see [`Core::activate`]).
pub(crate) struct Active {
    core: Arc<Core>,
    pub(crate) key: CallKey,
    pub(crate) token: CancellationToken,
}

impl Drop for Active {
    fn drop(&mut self) {
        self.core
            .calls
            .active
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&self.key);
        self.core.calls.wake.notify_one();
    }
}

/// How [`RunningExecutor::shutdown`] leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Shutdown {
    /// Stop claiming, let in-flight calls finish (up to the deadline), flush
    /// the outbox, then disconnect with `drain`.
    Drain {
        /// How long to wait for in-flight calls.
        deadline: Duration,
    },
    /// Stop at once, as a lost process would: nothing more is written or
    /// sent for the calls in flight (their handlers are dropped, no
    /// receipt goes out), then disconnect with `detach`. Running calls stay
    /// `running` and bound; the next start resumes them by the crash table.
    Detach,
}

/// A started executor. Dropping it stops everything at once, as a lost
/// process would; call [`shutdown`](RunningExecutor::shutdown) to leave
/// cleanly.
#[must_use = "dropping a RunningExecutor stops it at once: keep it, and call .shutdown(..) to leave"]
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
    let mut tasks = tokio::task::JoinSet::new();
    // The identity's lease is renewed from the start: connecting and
    // recovering may take longer than a peer's takeover grace.
    core.lease.clone().spawn_renewals(core.clone(), &mut tasks);
    telemetry::zero(
        &core.cfg.executor_id,
        core.tools.keys().map(String::as_str),
        core.lease.is_shared(),
    );
    if let Err(e) = connection::connect(&core, connection::Patience::Once).await {
        core.health.platform(Err(e.to_string()));
        core.health.stopped();
        return Err(e);
    }
    // The start's connect is recovered from before any loop runs.
    loops::recovery::catch_up(&core).await;
    gauges::lease_health(&core);
    core.health.started();
    // The calls recovery found wait in the queue; they run from now on.
    // (Started only now, so that a refused start leaves no task holding
    // the executor and its store.)
    tasks.spawn(dispatch::dispatch_loop(core.clone()));
    tasks.spawn(connection::heartbeat_loop(core.clone()));
    tasks.spawn(loops::recovery::recovery_loop(core.clone()));
    tasks.spawn(loops::claimer::claim_loop(core.clone()));
    tasks.spawn(loops::outbox::outbox_loop(core.clone()));
    tasks.spawn(loops::reconcile::reconcile_loop(core.clone()));
    tasks.spawn(loops::retention::retention_loop(core.clone()));
    // The gauges are in the scrape before the start returns.
    gauges::publish(&core).await;
    tasks.spawn(loops::gauges::gauges_loop(core.clone()));
    core.lease.clone().spawn_adoptions(core.clone(), &mut tasks);
    if core.cfg.use_stream {
        tasks.spawn(loops::stream::stream_loop(core.clone()));
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
        self.core.life.stopping().await;
        match self.core.life.fatal.lock().expect("not poisoned").as_ref() {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Stops the executor.
    ///
    /// `Drain` stops claiming, lets in-flight calls finish (up to the
    /// deadline), flushes the outbox and disconnects with `drain`. `Detach`
    /// stops at once, as a lost process would, and disconnects with
    /// `detach`: running calls stay `running` and bound, no receipt is sent
    /// for them, and the next start resumes them by the crash table.
    ///
    /// # Errors
    /// The platform could not be told (the calls stay safe in the store).
    pub async fn shutdown(mut self, how: Shutdown) -> Result<(), Error> {
        // Stopped already as a lost process would (fenced: another process
        // holds the identity now; crashed at a fail point): it says nothing
        // more to the platform.
        let halted = self.core.life.is_halted();
        // Not ready, before anything else: an orchestrator stops sending
        // work here while the calls in flight finish.
        self.core.health.draining();
        self.core.life.enter(Phase::Stopping);
        if let Shutdown::Drain { deadline } = how {
            let waited = tokio::time::timeout(deadline, async {
                while !self
                    .core
                    .calls
                    .active
                    .lock()
                    .expect("not poisoned")
                    .is_empty()
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            })
            .await;
            if waited.is_err() {
                tracing::warn!(
                    "in-flight calls did not finish before the deadline; they stay in the store"
                );
            }
            loops::outbox::flush(&self.core).await;
            // A connect the flush made (its redelivery found the connection
            // lost) is recovered from before the executor says goodbye, as
            // it was when recovery ran inside the connect, and what recovery
            // recorded is reported.
            let recovered =
                tokio::time::timeout(deadline, self.core.link.learnt.caught_up(&self.core)).await;
            if recovered.is_ok() {
                loops::outbox::reports(&self.core).await;
            }
        } else {
            // Nothing more is written or sent for the calls in flight: their
            // handlers are dropped where they are, without a receipt.
            self.core.client.fence();
            self.core.life.enter(Phase::Halted);
            let active: Vec<CancellationToken> = self
                .core
                .calls
                .active
                .lock()
                .expect("not poisoned")
                .values()
                .cloned()
                .collect();
            for t in active {
                t.cancel();
            }
        }
        let told = if halted {
            Ok(false)
        } else {
            connection::disconnect(&self.core, how).await
        };
        // The platform answered the drain: it holds no call of this
        // executor that did not start.
        let given_back = matches!(told, Ok(true));
        let result = told.map(|_| ());
        let drained = matches!(how, Shutdown::Drain { .. });
        // The identities this process adopted leave with it.
        let mut result = result;
        for adopted in self.core.lease.take_adopted() {
            // Boxed: a shutdown that awaits shutdowns is a recursive future.
            let stopped = Box::pin(adopted.shutdown(how)).await;
            result = result.and(stopped);
        }
        // Halted, its gauges say nothing is in flight any more (an adopted
        // identity let go while its adopter lives would otherwise show its
        // last counts for good).
        self.core.halt();
        while self.tasks.join_next().await.is_some() {}
        // Nothing more is written: a drain that left nothing lets the
        // identity go, so that no replica adopts it.
        if drained
            && !halted
            && self
                .core
                .calls
                .active
                .lock()
                .expect("not poisoned")
                .is_empty()
        {
            self.core
                .lease
                .release_if_idle(&self.core, given_back)
                .await;
        }
        result
    }
}

impl Drop for RunningExecutor {
    /// Dropping without [`shutdown`](RunningExecutor::shutdown) stops every
    /// task at once, like a lost process: the store keeps where each call
    /// was, and the next start resumes from there.
    fn drop(&mut self) {
        self.core.halt();
    }
}

/// The wait before retrying a step that could not reach the platform.
pub(crate) fn retry_delay(core: &Core, attempt: u32) -> Duration {
    core.client.backoff.delay(attempt)
}

impl From<Kind> for Error {
    fn from(kind: Kind) -> Self {
        Error::new(kind, "executor stopped")
    }
}
