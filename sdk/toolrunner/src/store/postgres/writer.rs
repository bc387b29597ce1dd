//! Group commit on PostgreSQL, in the shape of the SQLite writer
//! (`store/sqlite/writer.rs`): every commit that arrives while the previous
//! transaction is committing goes into the next one, with a savepoint per
//! job, so a job whose change fails (a lost compare-and-set, a refused row)
//! is rolled back alone and learns its own outcome while the others commit.
//! Nobody hears an outcome before the `COMMIT` that carries its changes
//! has returned. The identity's fencing token is checked once, first, in
//! each transaction (as every write transaction of the store checks it).
//!
//! A failure of the group before its `COMMIT` (a deadlock, a fenced lease,
//! a lost connection) wrote nothing: each job is then committed alone, so
//! each learns its own error. A failed `COMMIT` may or may not have
//! happened: every job of the group hears that, and reads back (the
//! lifecycle's `landed`).
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::{Connection, PgPool};
use tokio::sync::{mpsc, oneshot};

use super::lease::{self, Fence};
use crate::store::write;
use crate::store::{Change, DatabaseError, StoreError};

/// The most jobs one transaction carries.
const MAX_GROUP: usize = 64;

/// One caller's changes, and where its outcome goes.
pub(super) struct Job {
    pub(super) changes: Vec<Change>,
    /// The identity's fence as the caller's store held it.
    pub(super) fence: Option<Fence>,
    pub(super) reply: oneshot::Sender<Result<u64, StoreError>>,
}

/// What the writer has done: jobs taken, transactions committed.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) jobs: AtomicU64,
    pub(super) transactions: AtomicU64,
    /// A test's faults of this store's writer.
    #[cfg(all(feature = "failpoints", feature = "testing"))]
    pub(super) faults: faults::State,
}

/// Faults of one store's writer for the tests of its fault paths
/// (`WriterFaults`, features `failpoints` and `testing`): inert until a test sets one,
/// and of this store alone (the PostgreSQL suite runs its tests side by
/// side, so a process-wide fail point would reach the others' writers).
#[cfg(all(feature = "failpoints", feature = "testing"))]
pub(super) mod faults {
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;

    use tokio::sync::mpsc;

    /// How the next group's `COMMIT` fails.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(crate) enum CommitFault {
        /// It is not carried out (the transaction rolls back), and is
        /// reported failed.
        RolledBack,
        /// It is carried out, and reported failed (the answer lost).
        Happened,
    }

    /// The switches, as the writer reads them.
    #[derive(Debug, Default)]
    pub(crate) struct State {
        hold: AtomicBool,
        /// `1 +` the jobs waiting behind the one the writer holds; 0 when
        /// it holds none.
        held: AtomicUsize,
        commit: Mutex<Option<CommitFault>>,
        die: AtomicBool,
    }

    impl State {
        pub(crate) fn hold(&self, hold: bool) {
            self.hold.store(hold, Ordering::SeqCst);
        }

        pub(crate) fn held(&self) -> Option<usize> {
            self.held.load(Ordering::SeqCst).checked_sub(1)
        }

        pub(crate) fn fail_next_commit(&self, how: CommitFault) {
            *self
                .commit
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(how);
        }

        pub(crate) fn kill(&self) {
            self.die.store(true, Ordering::SeqCst);
        }

        /// The fault the next group's `COMMIT` is to have, taken.
        pub(super) fn take_commit(&self) -> Option<CommitFault> {
            self.commit
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take()
        }

        /// Right after the writer took a group's first job: the task dies
        /// (its channel closed first, so the next commit starts a new
        /// writer), or it waits while held.
        pub(super) async fn before_group<T>(&self, jobs: &mut mpsc::UnboundedReceiver<T>) {
            if self.die.swap(false, Ordering::SeqCst) {
                jobs.close();
                panic!("the PostgreSQL store's writer task dies (a fault a test set)");
            }
            while self.hold.load(Ordering::SeqCst) {
                self.held.store(1 + jobs.len(), Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            self.held.store(0, Ordering::SeqCst);
        }
    }
}

/// Starts the writer of `pool`: it lives until every sender is gone.
pub(super) fn spawn(pool: PgPool, counts: Arc<Counts>) -> mpsc::UnboundedSender<Job> {
    let (sender, mut jobs) = mpsc::unbounded_channel::<Job>();
    tokio::spawn(async move {
        while let Some(first) = jobs.recv().await {
            #[cfg(all(feature = "failpoints", feature = "testing"))]
            counts.faults.before_group(&mut jobs).await;
            let mut group = vec![first];
            while group.len() < MAX_GROUP
                && let Ok(next) = jobs.try_recv()
            {
                group.push(next);
            }
            // A caller that is gone (its executor stopped, or its task was
            // dropped) waits for nothing: its changes are not written, as
            // its own transaction would have rolled back.
            group.retain(|job| !job.reply.is_closed());
            if !group.is_empty() {
                // The health probe's own jobs are not the store's work.
                let jobs = group.iter().filter(|j| !is_probe(j)).count();
                counts.jobs.fetch_add(jobs as u64, Ordering::Relaxed);
                commit_group(&pool, group, &counts).await;
            }
        }
    });
    sender
}

/// How a group's transaction failed.
enum GroupError {
    /// Before its `COMMIT`: nothing of it is stored.
    Before(StoreError),
    /// At its `COMMIT`: stored or not, only a read tells; with each job's
    /// own error, for the jobs whose change failed (rolled back to their
    /// savepoint before the `COMMIT`).
    Commit(StoreError, Vec<Option<StoreError>>),
}

/// Whether a job is the health probe alone (not counted as the store's
/// work).
fn is_probe(job: &Job) -> bool {
    matches!(job.changes.as_slice(), [Change::Probe { .. }])
}

async fn commit_group(pool: &PgPool, group: Vec<Job>, counts: &Counts) {
    let same_fence = group
        .windows(2)
        .all(|w| fence_key(&w[0]) == fence_key(&w[1]));
    if group.len() == 1 || !same_fence {
        for job in group {
            let outcome = alone(pool, &job, counts).await;
            let _ = job.reply.send(outcome);
        }
        return;
    }
    match in_one(pool, &group, counts).await {
        Ok(outcomes) => {
            counts.transactions.fetch_add(1, Ordering::Relaxed);
            let calls = group.iter().filter(|j| !is_probe(j)).count();
            if calls > 0 {
                crate::store::committed_together(calls);
            }
            for (job, outcome) in group.into_iter().zip(outcomes) {
                let _ = job.reply.send(outcome);
            }
        }
        Err(GroupError::Before(e)) => {
            tracing::debug!(error = %e, jobs = group.len(), "a group commit failed before its COMMIT; committing each job alone");
            for job in group {
                let outcome = alone(pool, &job, counts).await;
                let _ = job.reply.send(outcome);
            }
        }
        Err(GroupError::Commit(e, own)) => {
            // A job whose own change failed wrote nothing whatever the
            // COMMIT did: it hears its own error. The others may or may
            // not be stored.
            let message = e.to_string();
            for (job, own) in group.into_iter().zip(own) {
                let _ = job
                    .reply
                    .send(Err(own.unwrap_or_else(|| commit_failed(&message))));
            }
        }
    }
}

/// The fence a job's transaction checks, as a comparable key.
fn fence_key(job: &Job) -> Option<(&str, i64)> {
    job.fence
        .as_ref()
        .map(|f| (f.executor_id.as_str(), f.token))
}

/// The error each job of a group hears when the group's `COMMIT` failed.
fn commit_failed(message: &str) -> StoreError {
    StoreError::Database(DatabaseError(Box::new(std::io::Error::other(format!(
        "the COMMIT of a group of commits failed (it may have happened): {message}"
    )))))
}

/// The group in one transaction, a savepoint per job.
async fn in_one(
    pool: &PgPool,
    group: &[Job],
    #[cfg_attr(
        not(all(feature = "failpoints", feature = "testing")),
        allow(unused_variables)
    )]
    counts: &Counts,
) -> Result<Vec<Result<u64, StoreError>>, GroupError> {
    let before = |e: sqlx::Error| GroupError::Before(e.into());
    let mut tx = pool.begin().await.map_err(before)?;
    if let Some(fence) = &group[0].fence {
        lease::check(&mut tx, fence)
            .await
            .map_err(GroupError::Before)?;
    }
    let mut notes = Vec::new();
    let mut outcomes = Vec::with_capacity(group.len());
    for job in group {
        let mut savepoint = tx.begin().await.map_err(before)?;
        let mark = notes.len();
        let mut conn = crate::store::sqlx_conn::Pg(&mut savepoint);
        let mut outcome = Ok(0);
        for change in &job.changes {
            match write::apply(&mut conn, change, &mut notes).await {
                Ok(n) => outcome = outcome.map(|m| m + n),
                // A deadlock or a serialization failure: the group is done
                // again, each job alone (and tried again there).
                Err(e) if super::retryable(&e) => return Err(GroupError::Before(e)),
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
        }
        match outcome {
            Ok(n) => {
                savepoint.commit().await.map_err(before)?;
                outcomes.push(Ok(n));
            }
            Err(e) => {
                notes.truncate(mark);
                savepoint.rollback().await.map_err(before)?;
                outcomes.push(Err(e));
            }
        }
    }
    write::write_notes(&mut crate::store::sqlx_conn::Pg(&mut tx), notes)
        .await
        .map_err(GroupError::Before)?;
    #[cfg(all(feature = "failpoints", feature = "testing"))]
    if let Some(how) = counts.faults.take_commit() {
        let done = match how {
            faults::CommitFault::RolledBack => tx.rollback().await,
            faults::CommitFault::Happened => tx.commit().await,
        };
        let said = format!("a fault a test set ({how:?}; the transaction's own end: {done:?})");
        let own = outcomes.into_iter().map(Result::err).collect();
        return Err(GroupError::Commit(
            StoreError::Database(DatabaseError::said(said)),
            own,
        ));
    }
    if let Err(e) = tx.commit().await {
        let own = outcomes.into_iter().map(Result::err).collect();
        return Err(GroupError::Commit(e.into(), own));
    }
    Ok(outcomes)
}

/// One job in a transaction of its own; a deadlock or a serialization
/// failure (which wrote nothing) is tried again.
async fn alone(pool: &PgPool, job: &Job, counts: &Counts) -> Result<u64, StoreError> {
    let mut tries = 0;
    loop {
        match once(pool, job).await {
            Err(e) if tries < super::RETRIES && super::retryable(&e) => tries += 1,
            outcome => {
                if outcome.is_ok() && !is_probe(job) {
                    counts.transactions.fetch_add(1, Ordering::Relaxed);
                    crate::store::committed_together(1);
                }
                return outcome;
            }
        }
    }
}

async fn once(pool: &PgPool, job: &Job) -> Result<u64, StoreError> {
    let mut tx = pool.begin().await?;
    if let Some(fence) = &job.fence {
        lease::check(&mut tx, fence).await?;
    }
    let mut notes = Vec::new();
    let mut pruned = 0;
    let mut conn = crate::store::sqlx_conn::Pg(&mut tx);
    for change in &job.changes {
        pruned += write::apply(&mut conn, change, &mut notes).await?;
    }
    write::write_notes(&mut conn, notes).await?;
    tx.commit().await?;
    Ok(pruned)
}
