//! What an orchestrator asks of a running executor: is it connected, can
//! it write its store, is its lease fresh, how full is it, is it draining;
//! and one verdict, ready or not, with the reason.
//!
//! The runner writes the facts as they change ([`HealthState`]); a
//! [`Health`] handle, taken before the executor starts, reads them from
//! anywhere (an admin endpoint, a probe, a test).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

/// The facts the runner keeps up to date, shared with every [`Health`].
#[derive(Debug, Default)]
pub(crate) struct HealthState {
    executor_id: OnceLock<String>,
    started: AtomicBool,
    stopped: AtomicBool,
    /// Why the executor stopped taking work by itself (refused
    /// credentials, superseded), if it did.
    failed: Mutex<Option<String>>,
    draining: AtomicBool,
    /// `None` while connected; why not otherwise.
    platform: Mutex<Option<String>>,
    /// `None` while the store takes writes; the last write's error
    /// otherwise.
    store: Mutex<Option<String>>,
    /// The last lease renewal, on a store shared by replicas; and whether
    /// the lease is live by this process's clock.
    lease: Mutex<Option<Lease>>,
    slots: OnceLock<(u32, Arc<Semaphore>)>,
    receipts_waiting: AtomicU64,
    oldest_receipt: Mutex<Option<Instant>>,
    reconciliation_required: AtomicU64,
}

#[derive(Debug, Clone, Copy)]
struct Lease {
    renewed: Instant,
    live: bool,
    ttl: Duration,
}

impl Lease {
    /// Live when last seen, and not older than its time to live now (a
    /// process whose renewals stopped turns not ready without waiting for
    /// the loop that would say so).
    fn live(&self) -> bool {
        self.live && self.renewed.elapsed() < self.ttl
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl HealthState {
    /// The executor starts with this id, `capacity` slots taken from
    /// `slots`.
    pub(crate) fn starting(&self, executor_id: &str, capacity: u32, slots: Arc<Semaphore>) {
        let _ = self.executor_id.set(executor_id.to_owned());
        let _ = self.slots.set((capacity, slots));
        *lock(&self.platform) = Some("not connected yet".into());
    }

    /// The first connect succeeded: the executor runs.
    pub(crate) fn started(&self) {
        self.started.store(true, Ordering::SeqCst);
    }

    /// A shutdown began: not ready from now on.
    pub(crate) fn draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// The executor stopped (shut down, halted, or stopped by itself).
    pub(crate) fn stopped(&self) {
        self.stopped.store(true, Ordering::SeqCst);
    }

    /// The executor stopped taking work by itself, for `why`.
    pub(crate) fn failed(&self, why: String) {
        lock(&self.failed).get_or_insert(why);
    }

    /// The platform answered (`Ok`), or could not be reached (`Err` with
    /// why).
    pub(crate) fn platform(&self, reached: Result<(), String>) {
        *lock(&self.platform) = reached.err();
    }

    /// A store write committed (`Ok`) or failed (`Err` with why).
    pub(crate) fn store(&self, wrote: Result<(), String>) {
        *lock(&self.store) = wrote.err();
    }

    /// The lease was last renewed at `renewed`, is `live` by the
    /// process's clocks, and lasts `ttl` after each renewal.
    pub(crate) fn lease(&self, renewed: Instant, live: bool, ttl: Duration) {
        *lock(&self.lease) = Some(Lease { renewed, live, ttl });
    }

    /// The outbox now: receipts waiting, and since when the oldest.
    pub(crate) fn outbox(&self, waiting: u64, oldest_age: Option<Duration>) {
        self.receipts_waiting.store(waiting, Ordering::Relaxed);
        *lock(&self.oldest_receipt) = oldest_age.and_then(|a| Instant::now().checked_sub(a));
    }

    /// Calls in `reconciliation_required` now.
    pub(crate) fn reconciliation_required(&self, n: u64) {
        self.reconciliation_required.store(n, Ordering::Relaxed);
    }

    fn report(&self) -> HealthReport {
        let (capacity, in_use) = self.slots.get().map_or((0, 0), |(n, s)| {
            let free = u32::try_from(s.available_permits()).unwrap_or(u32::MAX);
            (*n, n.saturating_sub(free))
        });
        let lease = *lock(&self.lease);
        let platform = lock(&self.platform).clone();
        let store = lock(&self.store).clone();
        let draining = self.draining.load(Ordering::SeqCst);
        let stopped = self.stopped.load(Ordering::SeqCst);
        let started = self.started.load(Ordering::SeqCst);
        let failed = lock(&self.failed).clone();
        let reason = if let Some(why) = failed {
            Some(format!("stopped: {why}"))
        } else if stopped {
            Some("stopped: the executor is not running".to_owned())
        } else if draining {
            Some("draining: the executor is shutting down and takes no new calls".to_owned())
        } else if !started {
            Some("starting: the executor has not connected yet".to_owned())
        } else if let Some(why) = &platform {
            Some(format!("platform unreachable: {why}"))
        } else if let Some(why) = &store {
            Some(format!("store not writable: {why}"))
        } else if lease.is_some_and(|l| !l.live()) {
            Some(
                "lease not live: it could not be renewed in time, so the executor takes no work"
                    .to_owned(),
            )
        } else {
            None
        };
        HealthReport {
            executor_id: self.executor_id.get().cloned().unwrap_or_default(),
            ready: reason.is_none(),
            reason,
            connected: started && !stopped && platform.is_none(),
            store_writable: store.is_none(),
            store_error: store,
            lease_age: lease.map(|l| l.renewed.elapsed()),
            capacity,
            in_use,
            receipts_waiting: self.receipts_waiting.load(Ordering::Relaxed),
            oldest_receipt_age: lock(&self.oldest_receipt).map(|t| t.elapsed()),
            reconciliation_required: self.reconciliation_required.load(Ordering::Relaxed),
            draining,
        }
    }
}

/// A handle on a running executor's health, for an orchestrator's probes.
///
/// Take it before [`start`](crate::Executor::start) or
/// [`serve`](crate::Executor::serve) (which consumes the executor) with
/// [`Executor::health`](crate::Executor::health); clone it freely. Before
/// the start it reports not ready (`starting`); from the shutdown's first
/// step until the process ends it reports not ready (`draining`, then
/// `stopped`).
///
/// ```no_run
/// # async fn demo(executor: toolrunner::Executor) -> toolrunner::Result<()> {
/// let health = executor.health();
/// tokio::spawn(async move {
///     loop {
///         let report = health.report();
///         if !report.ready() {
///             tracing::warn!(reason = report.reason(), "not ready");
///         }
///         tokio::time::sleep(std::time::Duration::from_secs(5)).await;
///     }
/// });
/// executor.serve(toolrunner::shutdown_signal()).await
/// # }
/// ```
#[derive(Clone, Default)]
pub struct Health {
    pub(crate) state: Arc<HealthState>,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("report", &self.report())
            .finish()
    }
}

impl Health {
    /// The executor's health now.
    #[must_use]
    pub fn report(&self) -> HealthReport {
        self.state.report()
    }
}

/// A running executor's health at one moment ([`Health::report`]). It
/// serializes to the JSON an admin endpoint answers with (durations in
/// seconds).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct HealthReport {
    executor_id: String,
    ready: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    connected: bool,
    store_writable: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    store_error: Option<String>,
    #[serde(serialize_with = "seconds", skip_serializing_if = "Option::is_none")]
    lease_age: Option<Duration>,
    capacity: u32,
    in_use: u32,
    receipts_waiting: u64,
    #[serde(serialize_with = "seconds", skip_serializing_if = "Option::is_none")]
    oldest_receipt_age: Option<Duration>,
    reconciliation_required: u64,
    draining: bool,
}

fn seconds<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

impl HealthReport {
    /// The executor identity.
    pub fn executor_id(&self) -> &str {
        &self.executor_id
    }

    /// Whether the executor is ready to take calls: started, connected to
    /// the platform, its store writable, its lease (if any) live, and not
    /// draining.
    pub fn ready(&self) -> bool {
        self.ready
    }

    /// Why it is not ready; `None` when it is.
    pub fn reason(&self) -> Option<&str> {
        self.reason.as_deref()
    }

    /// Whether the platform answered the last heartbeat or connect.
    pub fn connected(&self) -> bool {
        self.connected
    }

    /// Whether the store's last write (or write probe) committed.
    pub fn store_writable(&self) -> bool {
        self.store_writable
    }

    /// How long ago the lease was last renewed, on a store shared by
    /// replicas (`None` on a store of its own, which needs no lease).
    pub fn lease_age(&self) -> Option<Duration> {
        self.lease_age
    }

    /// How many calls the executor runs at most at once.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// How many of those slots are taken now.
    pub fn in_use(&self) -> u32 {
        self.in_use
    }

    /// Receipts saved and not yet acknowledged by the platform.
    pub fn receipts_waiting(&self) -> u64 {
        self.receipts_waiting
    }

    /// How long the oldest of them has waited.
    pub fn oldest_receipt_age(&self) -> Option<Duration> {
        self.oldest_receipt_age
    }

    /// Calls in `reconciliation_required`, waiting for their `reconcile`
    /// hook or a person.
    pub fn reconciliation_required(&self) -> u64 {
        self.reconciliation_required
    }

    /// Whether a shutdown began.
    pub fn draining(&self) -> bool {
        self.draining
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_names_the_first_thing_wrong() {
        let state = HealthState::default();
        let health = Health {
            state: Arc::new(state),
        };
        assert_eq!(
            health.report().reason(),
            Some("starting: the executor has not connected yet")
        );
        health
            .state
            .starting("ex-1", 4, Arc::new(Semaphore::new(4)));
        health.state.platform(Ok(()));
        health.state.started();
        assert!(health.report().ready(), "{:?}", health.report());
        health.state.store(Err("disk I/O error".into()));
        assert_eq!(
            health.report().reason(),
            Some("store not writable: disk I/O error")
        );
        health.state.platform(Err("connection refused".into()));
        assert_eq!(
            health.report().reason(),
            Some("platform unreachable: connection refused")
        );
        health.state.platform(Ok(()));
        health.state.store(Ok(()));
        health
            .state
            .lease(Instant::now(), false, Duration::from_secs(3));
        assert!(
            health
                .report()
                .reason()
                .unwrap()
                .starts_with("lease not live")
        );
        health
            .state
            .lease(Instant::now(), true, Duration::from_secs(3));
        assert!(health.report().ready());
        health.state.draining();
        assert!(health.report().reason().unwrap().starts_with("draining"));
        health.state.stopped();
        assert!(health.report().reason().unwrap().starts_with("stopped"));
        health
            .state
            .failed("another process took this executor id".into());
        assert_eq!(
            health.report().reason(),
            Some("stopped: another process took this executor id")
        );
        let json = serde_json::to_value(health.report()).unwrap();
        assert_eq!(json["ready"], false);
        assert_eq!(json["capacity"], 4);
    }
}
