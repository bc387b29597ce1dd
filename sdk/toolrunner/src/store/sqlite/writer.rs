//! The store's single writer, with group commit.
//!
//! Every [`Store::commit`](super::Store::commit) is a job sent to one task
//! that owns the only write connection. The jobs that arrive while a
//! transaction is being committed (its fsync in flight) wait in the
//! channel; the next transaction takes all of them together. A job that
//! fails (a lost compare-and-set, a row the schema refuses) fails alone:
//! the others commit (see [`commit_batch`]). Nobody learns an outcome
//! before the one `COMMIT` that makes it durable has returned, so the
//! rules built on "stored before sent" and "`running` durable before the
//! effect" hold unchanged. The timeline rows of a transaction go in one
//! statement at its end.
//!
//! The writer also runs the WAL checkpoints itself (automatic checkpoints
//! are off on its connection), so it can count every fsync it causes: one
//! per commit (`synchronous=FULL` syncs the WAL) and two per checkpoint that
//! copies pages (the WAL, then the database file).
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sqlx::pool::PoolConnection;
use sqlx::{Connection, Row, Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::{mpsc, oneshot};

use crate::store::{Change, DatabaseError, StoreError};

/// One caller's changes and where to send its outcome.
pub(super) type Job = (Vec<Change>, oneshot::Sender<Result<(), StoreError>>);

/// At most this many jobs share one transaction, so one commit never holds
/// the write lock (and the readers' view) back for long.
const MAX_BATCH: usize = 512;

/// A checkpoint is tried after this many commits.
const CHECKPOINT_EVERY: u64 = 256;

/// What the writer has done since the store was opened.
#[derive(Debug, Default)]
pub(super) struct Counters {
    jobs: AtomicU64,
    transactions: AtomicU64,
    checkpoints: AtomicU64,
}

/// What a [`SqliteStore`](super::SqliteStore)'s writer has done since the
/// store was opened: how many changes were asked for, how many
/// transactions carried them, and how many fsyncs that cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct WriterStats {
    /// Commits asked for (calls to `Store::commit`), failed ones included.
    pub jobs: u64,
    /// Transactions committed; with group commit, several jobs share one.
    pub transactions: u64,
    /// Checkpoints that copied pages from the WAL into the database file.
    pub checkpoints: u64,
    /// The fsyncs those caused: one per transaction (`synchronous=FULL`
    /// syncs the WAL at every commit) and two per checkpoint.
    pub fsyncs: u64,
}

impl Counters {
    pub(super) fn stats(&self) -> WriterStats {
        let transactions = self.transactions.load(Ordering::Relaxed);
        let checkpoints = self.checkpoints.load(Ordering::Relaxed);
        WriterStats {
            jobs: self.jobs.load(Ordering::Relaxed),
            transactions,
            checkpoints,
            fsyncs: transactions + 2 * checkpoints,
        }
    }
}

/// Takes jobs until every sender is gone, committing each batch that has
/// gathered in one transaction.
pub(super) async fn write_loop(
    pool: SqlitePool,
    mut rx: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
) {
    let mut conn = match pool.acquire().await {
        Ok(conn) => conn,
        Err(e) => {
            let e = StoreError::from(e);
            tracing::error!(error = %e, "the store's writer cannot take its connection");
            while let Some((_, reply)) = rx.recv().await {
                let _ = reply.send(Err(StoreError::Closed));
            }
            return;
        }
    };
    let mut since_checkpoint = 0u64;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    while rx.recv_many(&mut batch, MAX_BATCH).await > 0 {
        counters
            .jobs
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        if commit_batch(&mut conn, &mut batch).await {
            counters.transactions.fetch_add(1, Ordering::Relaxed);
            since_checkpoint += 1;
        }
        if since_checkpoint >= CHECKPOINT_EVERY || rx.is_empty() && since_checkpoint >= 16 {
            since_checkpoint = 0;
            if checkpoint(&mut conn).await {
                counters.checkpoints.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    drop(conn);
    pool.close().await;
}

/// Copies the WAL's pages into the database file without waiting on
/// readers; true if it copied any (and so synced twice).
async fn checkpoint(conn: &mut PoolConnection<Sqlite>) -> bool {
    match sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(&mut **conn)
        .await
    {
        Ok(row) => row.try_get::<i64, _>(2).is_ok_and(|copied| copied > 0),
        Err(e) => {
            tracing::warn!(error = %e, "a WAL checkpoint failed; the next one will try again");
            false
        }
    }
}

/// Commits `batch` (emptied) in one transaction; each job learns its own
/// outcome. True if a transaction committed.
///
/// No savepoints: a job refused at its first change (a lost
/// compare-and-set, a row the schema refuses) has written nothing, so it
/// fails alone and the others go on. A job that fails after it wrote
/// something fails too, and the transaction is rolled back and done again
/// without it: the others' outcomes are those of the transaction that
/// commits.
async fn commit_batch(conn: &mut SqliteConnection, batch: &mut Vec<Job>) -> bool {
    let mut failed: Vec<Option<StoreError>> = batch.iter().map(|_| None).collect();
    let committed = loop {
        let mut tx = match conn.begin_with("BEGIN IMMEDIATE").await {
            Ok(tx) => tx,
            Err(e) => break Err(StoreError::from(e)),
        };
        let mut notes = Vec::new();
        let mut again = false;
        for (i, (changes, _)) in batch.iter().enumerate() {
            if failed[i].is_some() {
                continue;
            }
            let mark = notes.len();
            for (k, change) in changes.iter().enumerate() {
                if let Err(e) = super::apply(&mut tx, change, &mut notes).await {
                    let wrote_nothing =
                        k == 0 && matches!(e, StoreError::Conflict(..) | StoreError::Refused(_));
                    failed[i] = Some(e);
                    notes.truncate(mark);
                    again = !wrote_nothing;
                    break;
                }
            }
            if again {
                break;
            }
        }
        if again {
            // Rolled back when dropped; done again without the failed job.
            drop(tx);
            continue;
        }
        if failed.iter().all(Option::is_some) {
            // Nothing to write: no commit, no fsync.
            break Ok(false);
        }
        let end = async {
            super::write_notes(&mut tx, &notes).await?;
            tx.commit().await.map_err(StoreError::from)
        };
        break end.await.map(|()| true);
    };
    match committed {
        Ok(wrote) => {
            for ((_, reply), outcome) in batch.drain(..).zip(failed) {
                let _ = reply.send(outcome.map_or(Ok(()), Err));
            }
            wrote
        }
        Err(e) => {
            fail_all(batch, failed, e);
            false
        }
    }
}

/// The transaction did not commit: a job that had failed on its own keeps
/// its own error; every other fails with the transaction's (a batch of one
/// job gets that error as it was).
fn fail_all(batch: &mut Vec<Job>, failed: Vec<Option<StoreError>>, cause: StoreError) {
    if batch.len() == 1 {
        if let Some((_, reply)) = batch.pop() {
            let _ = reply.send(Err(failed.into_iter().flatten().next().unwrap_or(cause)));
        }
        return;
    }
    for ((_, reply), own) in batch.drain(..).zip(failed) {
        let outcome = own.unwrap_or_else(|| {
            let message = format!("the transaction did not commit: {cause}");
            StoreError::Database(DatabaseError(message.into()))
        });
        let _ = reply.send(Err(outcome));
    }
}
