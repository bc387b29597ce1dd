//! Replicas on one PostgreSQL database: this process's hold on its
//! executor identity (its lease is renewed; a process whose identity moved
//! on stops), and, with a takeover grace, the adoption of identities whose
//! lease lapsed: an executor of this process connects as the adopted
//! identity (superseding any zombie), recovers its calls by the crash
//! table, delivers its outbox and runs its reconciliation.
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use super::{Core, RunningExecutor};
use crate::error::{Error, Kind};
use crate::store::{PgStore, StoreError};

/// How often a holder renews its lease.
const RENEW_EVERY: Duration = Duration::from_millis(500);

/// This executor's identity on a shared database.
pub(crate) struct Replica {
    /// The identity's store (it holds the lease and its fencing token).
    pub(crate) store: PgStore,
    /// Adopt identities whose lease lapsed longer than this (none: never).
    pub(crate) grace: Option<Duration>,
    /// How to start an executor as an adopted identity (this one's
    /// settings and tools under another id).
    pub(crate) template: Option<crate::Executor>,
    /// The executors of the identities this process adopted.
    pub(crate) adopted: StdMutex<Vec<RunningExecutor>>,
}

impl Replica {
    pub(crate) fn new(
        store: PgStore,
        grace: Option<Duration>,
        template: Option<crate::Executor>,
    ) -> Replica {
        Replica {
            store,
            grace,
            template,
            adopted: StdMutex::default(),
        }
    }

    /// The adopted executors, taken out (to stop them with this one).
    pub(crate) fn take_adopted(&self) -> Vec<RunningExecutor> {
        std::mem::take(
            &mut *self
                .adopted
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }
}

/// Renews the lease for as long as the process runs (a drain included:
/// its calls still commit); a fenced identity stops the executor at once
/// (nothing more is written).
pub(crate) async fn lease_loop(core: Arc<Core>) {
    let Some(replica) = &core.replica else {
        return;
    };
    loop {
        tokio::select! {
            _ = core.done.cancelled() => return,
            _ = tokio::time::sleep(RENEW_EVERY) => {}
        }
        match replica.store.renew().await {
            Err(e @ StoreError::Fenced(_)) => {
                core.fail(Error::new(Kind::Superseded, e.to_string()));
                core.halt();
                return;
            }
            Err(e) => tracing::warn!(error = %e, "the executor's lease could not be renewed"),
            Ok(()) => {}
        }
    }
}

/// With a takeover grace: until the executor stops taking work, adopts
/// the lapsed identities of its binding, one at a time (on a task of its
/// own, so a slow adoption never holds the renewals back).
pub(crate) async fn adoption_loop(core: Arc<Core>) {
    let Some(replica) = &core.replica else {
        return;
    };
    let (Some(grace), Some(template)) = (replica.grace, &replica.template) else {
        return;
    };
    let every = (grace / 4).max(Duration::from_millis(250));
    loop {
        tokio::select! {
            _ = core.stop.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        adopt(&core, replica, template, grace).await;
    }
}

/// Adopts one lapsed identity, if there is one, and starts its executor.
async fn adopt(core: &Core, replica: &Replica, template: &crate::Executor, grace: Duration) {
    let adopted = match replica
        .store
        .adopt_lapsed(&core.cfg.instance_id, grace)
        .await
    {
        Ok(Some(store)) => store,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(error = %e, "could not adopt a lapsed executor identity");
            return;
        }
    };
    let id = adopted.identity().unwrap_or_default().to_owned();
    tracing::warn!(executor_id = %core.cfg.executor_id, adopted = %id, grace_ms = grace.as_millis() as u64, "adopting an executor identity whose lease lapsed");
    let started = template.adopted_as(&id).start_adopted(adopted).await;
    let mut list = replica
        .adopted
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // Those that stopped (fenced by a newer adoption) go.
    list.retain(|r| !r.core.done.is_cancelled());
    match started {
        // Stopped with this one, unless this one stops first.
        Ok(running) if !core.stop.is_cancelled() => list.push(running),
        Ok(running) => drop(running),
        // Its lease lapses again, and it is adopted again then.
        Err(e) => {
            tracing::error!(adopted = %id, error = %e, "the adopted identity's executor did not start")
        }
    }
}
