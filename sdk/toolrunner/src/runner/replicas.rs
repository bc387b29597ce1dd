//! Replicas on one PostgreSQL database: this process's hold on its
//! executor identity, and the adoption of identities whose lease lapsed.
//!
//! - **The lease.** The holder renews it four times per time to live, on
//!   a connection of its own. A process that has not renewed within the
//!   time to live takes no work (no claim, no `accepted`, no handler
//!   start, no `commit_point()`) until a renewal succeeds again, and
//!   connects to the platform only right after a renewal: a fenced
//!   process never connects. A renewal that finds the token moved on stops
//!   the process at once (nothing more is written).
//! - **Adoption.** With a takeover grace, a replica adopts the identities
//!   of its binding whose lease lapsed longer ago than the grace: an
//!   executor of this process connects as that identity, takes no new
//!   calls, recovers its calls by the crash table, delivers its outbox,
//!   runs its reconciliation, and lets the identity go once nothing is
//!   left (or when it stops by itself).
//! - **After a takeover** (an adoption, or a start that took the identity
//!   from an adopter, from an earlier process whose lease lapsed, or
//!   released with a wait still owed), no `reconcile` hook is asked before
//!   two of the old holder's leases have passed since the taker first saw
//!   its last renewal, plus the longer of the tool's commit window and the
//!   old holder's longest, and never before the wait the lease row carried
//!   (`docs/protocol.md`, choice 71): a holder that was only slow has
//!   finished its effect by then, and the hook sees it.
use std::collections::HashMap;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use super::lease::Lease;
use super::{Core, Phase, RunningExecutor, Shutdown};
use crate::error::{Error, Kind};
use crate::gate::{self, Gate, Reach};
use crate::store::{PgStore, StoreError};

/// How this process starts an executor as an identity it adopted: its own
/// settings and tools under that id. The template implements it (this
/// module names no template: the template starts replicas, not the
/// reverse).
pub(crate) trait Adopter: Send + Sync {
    /// The longest commit window of the tools it serves.
    fn longest_commit_window(&self) -> Duration;
    /// Starts an executor as `executor_id` on its adopted (fenced) store.
    fn start_as(
        &self,
        executor_id: &str,
        store: PgStore,
    ) -> std::pin::Pin<
        Box<dyn std::future::Future<Output = crate::error::Result<RunningExecutor>> + Send>,
    >;
}

/// How long an identity whose store would not open is left alone before
/// an adoption tries it again.
const SKIP_FOR: Duration = Duration::from_secs(30);

/// This executor's identity on a shared database.
pub(crate) struct Replica {
    /// The identity's store (it holds the lease and its fencing token).
    pub(crate) store: PgStore,
    /// Adopt identities whose lease lapsed longer than this (none: never).
    pub(crate) grace: Option<Duration>,
    /// How to start an executor as an adopted identity (this one's
    /// settings and tools under another id).
    pub(crate) template: Option<Box<dyn Adopter>>,
    /// The executors of the identities this process adopted.
    pub(crate) adopted: StdMutex<Vec<RunningExecutor>>,
    /// When the last renewal that succeeded was sent, by the monotonic
    /// clock and by the wall clock (which also counts a suspended machine).
    renewed: StdMutex<(Instant, std::time::SystemTime)>,
    /// Whether the lease was seen lapsed (to say once that it lapsed, and
    /// once that it is held again).
    lapsed: std::sync::atomic::AtomicBool,
    /// Identities whose store would not open, and until when they are
    /// left alone (one bad identity never blocks the others).
    skip: StdMutex<HashMap<String, Instant>>,
    /// A test's faults of this process.
    gate: Option<Arc<Gate>>,
}

impl Replica {
    pub(crate) fn new(
        store: PgStore,
        grace: Option<Duration>,
        template: Option<Box<dyn Adopter>>,
        gate: Option<Arc<Gate>>,
    ) -> Replica {
        let taken = store.lease_taken_at().unwrap_or_else(Instant::now);
        // The wall clock of the same moment.
        let renewed = (
            taken,
            std::time::SystemTime::now()
                .checked_sub(taken.elapsed())
                .unwrap_or_else(std::time::SystemTime::now),
        );
        Replica {
            store,
            grace,
            template,
            adopted: StdMutex::default(),
            renewed: StdMutex::new(renewed),
            lapsed: std::sync::atomic::AtomicBool::new(false),
            skip: StdMutex::default(),
            gate,
        }
    }

    /// Runs one request to the database under the process's faults.
    async fn io<T>(
        &self,
        request: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        gate::before(self.gate.as_deref(), Reach::Store)
            .await
            .map_err(|why| StoreError::Database(crate::store::DatabaseError::said(why)))?;
        let answer = request.await;
        gate::thawed(self.gate.as_deref()).await;
        answer
    }

    fn ttl(&self) -> Duration {
        self.store
            .lease_ttl()
            .unwrap_or(crate::store::DEFAULT_LEASE_TTL)
    }

    /// Whether the lease is live by this process's clock: renewed (the
    /// renewal sent) less than its time to live ago. Whoever would take
    /// the identity over counts from its own first sighting of that
    /// renewal, which is later.
    fn live(&self) -> bool {
        let (at, wall) = *lock(&self.renewed);
        // A wall clock set back counts as no time at all; the monotonic
        // clock still runs.
        let wall = wall.elapsed().unwrap_or_default();
        at.elapsed() < self.ttl() && wall < self.ttl()
    }

    /// When the lease was last renewed (by this process's clock).
    fn renewed_at(&self) -> Instant {
        lock(&self.renewed).0
    }

    /// Renews the lease now, and records it.
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when the token moved on; the database failed.
    async fn renew(&self, executor_id: &str) -> Result<(), StoreError> {
        let sent = (Instant::now(), std::time::SystemTime::now());
        self.io(self.store.renew()).await?;
        {
            let mut renewed = lock(&self.renewed);
            if renewed.0 < sent.0 {
                *renewed = sent;
            }
        }
        if self.lapsed.swap(false, std::sync::atomic::Ordering::SeqCst) {
            tracing::warn!(
                executor_id,
                "the executor's lease is renewed again: taking work again"
            );
        }
        Ok(())
    }

    /// Whether `message` (the platform's words on a superseded
    /// connection, which name the new instance) names an instance this
    /// database recorded as a holder of the identity, now or lately (an
    /// adopter's executors connect as its instance id and a suffix).
    ///
    /// # Errors
    /// The database could not tell.
    pub(crate) async fn holds_or_held(&self, message: &str) -> Result<bool, StoreError> {
        let holders = self.io(self.store.recorded_holders()).await?;
        Ok(super::connection::names_instance(message, &holders))
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The token moved on: stop at once, saying why (nothing more is written).
fn fenced(core: &Core, e: &StoreError) {
    core.fail(Error::new(Kind::Superseded, e.to_string()));
    core.halt();
}

/// Renews the lease for as long as the process runs (a drain included:
/// its calls still commit); a fenced identity stops the executor at once.
async fn lease_loop(replica: Arc<Replica>, core: Arc<Core>) {
    let every = replica.ttl() / 4;
    loop {
        tokio::select! {
            _ = core.life.halted() => return,
            _ = tokio::time::sleep(every) => {}
        }
        match replica.renew(&core.cfg.executor_id).await {
            Err(e @ StoreError::Fenced(_)) => return fenced(&core, &e),
            Err(e) => {
                super::telemetry::lease_renewal_failed(&core.cfg.executor_id);
                if !replica.live()
                    && !replica
                        .lapsed
                        .swap(true, std::sync::atomic::Ordering::SeqCst)
                {
                    tracing::error!(executor_id = %core.cfg.executor_id, error = %e, ttl_ms = replica.ttl().as_millis() as u64, "the executor's lease lapsed (it could not be renewed): taking no work until it is renewed; a replica may adopt the identity");
                } else {
                    tracing::warn!(error = %e, "the executor's lease could not be renewed");
                }
            }
            Ok(()) => {}
        }
        core.health
            .lease(replica.renewed_at(), replica.live(), replica.ttl());
    }
}

/// Right before a connect: a renewal that succeeds, and a lease still
/// live when it answered (a process frozen meanwhile must look again).
/// A fenced process stops here, and never connects.
///
/// # Errors
/// The token moved on (the executor is halted), or the lease could not be
/// confirmed now (try again later).
async fn confirm(replica: &Replica, core: &Core) -> Result<(), Error> {
    match replica.renew(&core.cfg.executor_id).await {
        Ok(()) if replica.live() => Ok(()),
        Ok(()) => Err(Error::new(
            Kind::Store,
            "the lease renewal answered too late to connect on it: connecting after the next renewal",
        )),
        Err(e @ StoreError::Fenced(_)) => {
            fenced(core, &e);
            Err(Error::new(Kind::Superseded, e.to_string()))
        }
        Err(e) => Err(Error::from(e).context(
            "the executor's lease could not be confirmed before connecting to the platform",
        )),
    }
}

/// At the end of a drain, once every task has stopped: lets the identity
/// go when its store holds nothing left to do, so that no replica adopts
/// it (one that left work is adopted after the grace) and its own next
/// start takes it at once. `claims_given_back`: the platform answered the
/// drain's disconnect (see [`PgStore::is_idle`](crate::store::PgStore::is_idle)).
async fn release_if_idle(replica: &Replica, core: &Core, claims_given_back: bool) {
    let id = &core.cfg.executor_id;
    match Lease::is_idle(replica, core.cfg.auto_reconcile, claims_given_back).await {
        Ok(true) => match replica.io(replica.store.release()).await {
            Ok(true) => {
                tracing::info!(executor_id = %id, "nothing left: the executor identity is released")
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(executor_id = %id, error = %e, "the executor identity could not be released; it lapses instead")
            }
        },
        Ok(false) => {
            tracing::info!(executor_id = %id, "work is left in the store: the identity's lease lapses, and a replica with a takeover grace adopts it")
        }
        Err(e) => {
            tracing::warn!(executor_id = %id, error = %e, "could not tell whether work is left; the identity's lease lapses")
        }
    }
}

/// With a takeover grace: until the executor stops taking work, adopts
/// the lapsed identities of its binding, one at a time (on a task of its
/// own, so a slow adoption never holds the renewals back), and lets go of
/// the adopted ones that finished or stopped.
async fn adoption_loop(replica: Arc<Replica>, core: Arc<Core>) {
    let replica = replica.as_ref();
    let (Some(grace), Some(template)) = (replica.grace, &replica.template) else {
        return;
    };
    let every = (grace / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    // The leases of the binding as this replica watches them lapse.
    let mut watch = crate::store::LapseWatch::default();
    loop {
        tokio::select! {
            _ = core.life.stopping() => return,
            _ = tokio::time::sleep(every) => {}
        }
        let_go(replica).await;
        if replica.live() {
            adopt(&core, replica, template.as_ref(), grace, &mut watch).await;
        }
    }
}

/// Adopts one lapsed identity, if there is one, and starts its executor.
async fn adopt(
    core: &Core,
    replica: &Replica,
    template: &dyn Adopter,
    grace: Duration,
    watch: &mut crate::store::LapseWatch,
) {
    let skip: Vec<String> = {
        let mut skip = lock(&replica.skip);
        skip.retain(|_, until| *until > Instant::now());
        skip.keys().cloned().collect()
    };
    if gate::before(replica.gate.as_deref(), Reach::Store)
        .await
        .is_err()
    {
        return;
    }
    let adopting = replica
        .store
        .adopt_lapsed(
            &core.cfg.instance_id,
            grace,
            replica.ttl(),
            template.longest_commit_window(),
            &skip,
            watch,
        )
        .await;
    gate::thawed(replica.gate.as_deref()).await;
    let adopted = match adopting {
        Ok(Some(store)) => store,
        Ok(None) => return,
        Err(e) => {
            if let Some(id) = &e.executor_id {
                tracing::error!(adopted = %id, error = %e.error, skip_s = SKIP_FOR.as_secs(), "the store of a lapsed executor identity would not open; it is left alone for a while");
                lock(&replica.skip).insert(id.clone(), Instant::now() + SKIP_FOR);
            } else {
                tracing::warn!(error = %e.error, "could not adopt a lapsed executor identity");
            }
            return;
        }
    };
    let id = adopted.identity().unwrap_or_default().to_owned();
    // This process may have stood still while it adopted (and been taken
    // over itself meanwhile): it starts the adopted executor only on a
    // lease of its own renewed now. Otherwise the adopted identity lapses
    // again, and is adopted again then.
    if core.life.is_stopping() {
        return;
    }
    if let Err(e) = replica.renew(&core.cfg.executor_id).await {
        tracing::warn!(executor_id = %core.cfg.executor_id, adopted = %id, error = %e, "this replica's own lease could not be renewed right after an adoption: the adopted identity is left to lapse again");
        return;
    }
    tracing::warn!(executor_id = %core.cfg.executor_id, adopted = %id, grace_ms = grace.as_millis() as u64, "adopting an executor identity whose lease lapsed: finishing its calls, then letting it go");
    let started = template.start_as(&id, adopted).await;
    match started {
        // Stopped with this one, unless this one stops first.
        Ok(running) if !core.life.is_stopping() => lock(&replica.adopted).push(running),
        Ok(running) => drop(running),
        // Its lease lapses again, and it is adopted again then.
        Err(e) => {
            tracing::error!(adopted = %id, error = %e, "the adopted identity's executor did not start")
        }
    }
}

/// Lets go of the adopted identities whose executor finished (nothing
/// left: the identity is released) or stopped by itself (fenced by a
/// start that took it back, superseded, refused credentials: its lease
/// lapses unless nothing is left), so none is held for ever.
async fn let_go(replica: &Replica) {
    let mut done = Vec::new();
    {
        let mut list = lock(&replica.adopted);
        let mut i = 0;
        while i < list.len() {
            let core = &list[i].core;
            let over = core.life.phase() >= Phase::Finished;
            if over {
                done.push(list.swap_remove(i));
            } else {
                i += 1;
            }
        }
    }
    for running in done {
        let id = running.core.cfg.executor_id.clone();
        tracing::info!(adopted = %id, "letting go of an adopted executor identity");
        // Boxed: a shutdown's future is large (it drains, flushes and
        // disconnects), and this loop's future lives as long as the
        // executor.
        let drained = Box::pin(running.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        }))
        .await;
        if let Err(e) = drained {
            tracing::debug!(adopted = %id, error = %e, "the adopted executor's drain did not reach the platform");
        }
    }
    // The adopted executors still at work check whether they are done.
    let list: Vec<Arc<Core>> = lock(&replica.adopted)
        .iter()
        .map(|r| r.core.clone())
        .collect();
    for core in list {
        if core.calls.active.lock().expect("not poisoned").is_empty()
            && core
                .lease
                .is_idle(core.cfg.auto_reconcile, false)
                .await
                .unwrap_or(false)
        {
            core.life.enter(Phase::Finished);
        }
    }
}

#[async_trait::async_trait]
impl Lease for Replica {
    fn live(&self) -> bool {
        Replica::live(self)
    }

    fn renewed_at(&self) -> Option<Instant> {
        Some(Replica::renewed_at(self))
    }

    async fn superseded_by_a_holder(&self, message: &str) -> Result<bool, StoreError> {
        self.holds_or_held(message).await
    }

    fn database(&self) -> Option<String> {
        Some(self.store.database())
    }

    async fn confirm(&self, core: &Core) -> Result<(), Error> {
        confirm(self, core).await
    }

    fn hooks_after(&self, commit_window: Duration) -> Option<Instant> {
        self.store.hooks_after(commit_window)
    }

    fn fencing_token(&self) -> Option<u64> {
        self.store.fencing_token()
    }

    async fn is_idle(
        &self,
        auto_reconcile: bool,
        claims_given_back: bool,
    ) -> Result<bool, StoreError> {
        self.io(self.store.is_idle(auto_reconcile, claims_given_back))
            .await
    }

    fn take_adopted(&self) -> Vec<RunningExecutor> {
        std::mem::take(&mut *lock(&self.adopted))
    }

    async fn release_if_idle(&self, core: &Core, claims_given_back: bool) {
        release_if_idle(self, core, claims_given_back).await;
    }

    fn spawn_renewals(self: Arc<Self>, core: Arc<Core>, tasks: &mut tokio::task::JoinSet<()>) {
        tasks.spawn(lease_loop(self, core));
    }

    fn spawn_adoptions(self: Arc<Self>, core: Arc<Core>, tasks: &mut tokio::task::JoinSet<()>) {
        tasks.spawn(adoption_loop(self, core));
    }
}
