//! This process's hold on its executor identity, as the rest of the
//! runner sees it: [`Sole`] on a store of its own (nothing to hold: the
//! store file's lock is enough), or a lease on a database shared by
//! replicas (`replicas::Replica`, PostgreSQL). The runner asks through
//! [`Lease`] and names neither, so no step of a call depends on which
//! store it runs on.
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Core, RunningExecutor};
use crate::error::Error;
use crate::store::StoreError;

/// What the runner asks of its hold on the identity.
#[async_trait::async_trait]
pub(crate) trait Lease: Send + Sync {
    /// Whether this process may take work now: always, unless its lease on
    /// a shared database was not renewed within its time to live (a
    /// replica may adopt the identity).
    fn live(&self) -> bool;

    /// When the lease was last renewed, by this process's clock (`None`:
    /// no lease to renew).
    fn renewed_at(&self) -> Option<Instant>;

    /// Whether the identity is held by a lease on a database shared by
    /// replicas.
    fn is_shared(&self) -> bool {
        self.renewed_at().is_some()
    }

    /// Whether the process that superseded this one's connection (the
    /// platform's `message` names its instance) is one this process's
    /// database recorded as a holder of the identity: a takeover on this
    /// database, not a twin on another. Always `true` on a store of one
    /// process.
    ///
    /// # Errors
    /// The database could not tell (try again later).
    async fn superseded_by_a_holder(&self, message: &str) -> Result<bool, StoreError>;

    /// Where the identity's database is (host, port and name; never a
    /// password), on a store shared by replicas.
    fn database(&self) -> Option<String>;

    /// Right before a connect: the lease renewed now (nothing to do on a
    /// store of its own). A fenced process halts here.
    ///
    /// # Errors
    /// The token moved on (the executor is halted), or the lease could not
    /// be confirmed now (try again later).
    async fn confirm(&self, core: &Core) -> Result<(), Error>;

    /// Not before this may a `reconcile` hook be asked about a call of a
    /// tool with `commit_window`: the identity was taken over, and its old
    /// holder may still be finishing an effect.
    fn hooks_after(&self, commit_window: Duration) -> Option<Instant>;

    /// The identity's fencing token, on a store shared by replicas.
    fn fencing_token(&self) -> Option<u64>;

    /// Whether the identity's store holds nothing left to do
    /// (`claims_given_back`: the platform answered a drain). `false` on a
    /// store of its own: its identity is never let go.
    ///
    /// # Errors
    /// The database could not tell.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    async fn is_idle(
        &self,
        auto_reconcile: bool,
        claims_given_back: bool,
    ) -> Result<bool, StoreError>;

    /// The executors of the identities this process adopted, taken out (to
    /// stop them with this one, or drop them with it).
    fn take_adopted(&self) -> Vec<RunningExecutor>;

    /// At the end of a drain, once every task has stopped: lets the
    /// identity go when its store holds nothing left to do.
    async fn release_if_idle(&self, core: &Core, claims_given_back: bool);

    /// Starts renewing the lease, for as long as the executor runs (from
    /// before its first connect).
    fn spawn_renewals(self: Arc<Self>, core: Arc<Core>, tasks: &mut tokio::task::JoinSet<()>);

    /// Starts adopting the lapsed identities of its binding (with a
    /// takeover grace), once the executor serves.
    fn spawn_adoptions(self: Arc<Self>, core: Arc<Core>, tasks: &mut tokio::task::JoinSet<()>);
}

/// A store of one process: its identity is its own for as long as it runs.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Sole;

#[async_trait::async_trait]
impl Lease for Sole {
    fn live(&self) -> bool {
        true
    }

    fn renewed_at(&self) -> Option<Instant> {
        None
    }

    async fn superseded_by_a_holder(&self, _message: &str) -> Result<bool, StoreError> {
        Ok(true)
    }

    fn database(&self) -> Option<String> {
        None
    }

    async fn confirm(&self, _core: &Core) -> Result<(), Error> {
        Ok(())
    }

    fn hooks_after(&self, _commit_window: Duration) -> Option<Instant> {
        None
    }

    fn fencing_token(&self) -> Option<u64> {
        None
    }

    async fn is_idle(&self, _: bool, _: bool) -> Result<bool, StoreError> {
        Ok(false)
    }

    fn take_adopted(&self) -> Vec<RunningExecutor> {
        Vec::new()
    }

    async fn release_if_idle(&self, _core: &Core, _claims_given_back: bool) {}

    fn spawn_renewals(self: Arc<Self>, _: Arc<Core>, _: &mut tokio::task::JoinSet<()>) {}

    fn spawn_adoptions(self: Arc<Self>, _: Arc<Core>, _: &mut tokio::task::JoinSet<()>) {}
}
