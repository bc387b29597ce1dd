//! The store's single writer, with group commit.
//!
//! Every [`Store::commit`](super::Store::commit) is a job sent to one
//! thread that owns the only write connection, a synchronous one: a whole
//! transaction, however many statements, costs one wake-up of that thread. The jobs that arrive while a
//! transaction is being committed (its fsync in flight) wait in the
//! channel; the next transaction takes all of them together. A job that
//! fails (a lost compare-and-set, a row the schema refuses) fails alone:
//! the others commit (see `commit_batch`). Nobody learns an outcome
//! before the one `COMMIT` that makes it durable has returned, so the
//! rules built on "stored before sent" and "`running` durable before the
//! effect" hold unchanged. The timeline rows of a transaction go in one
//! statement at its end.
//!
//! The writer also runs the WAL checkpoints itself (automatic checkpoints
//! are off on its connection), so it can count every fsync it causes: one
//! per commit (`synchronous=FULL` syncs the WAL) and two per checkpoint that
//! copies pages (the WAL, then the database file).
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rusqlite::{Connection, OpenFlags};
use tokio::sync::{mpsc, oneshot};

use super::changes::{Writer, db, now};
use crate::store::write;
use crate::store::{Change, DatabaseError, StoreError};

/// One caller's changes and where to send its outcome.
pub(super) type Job = (Vec<Change>, oneshot::Sender<Result<(), StoreError>>);

/// At most this many jobs share one transaction, so one commit never holds
/// the write lock (and the readers' view) back for long.
const MAX_BATCH: usize = 512;

/// A checkpoint is run after this many commits, or after this many when
/// no job is waiting.
const CHECKPOINT_EVERY: u64 = 1000;
const CHECKPOINT_IDLE: u64 = 200;

/// How long a transaction waits for company when the previous one had
/// several jobs (as PostgreSQL's `commit_delay`). Alone, it never waits.
const COMMIT_WINDOW: Duration = Duration::from_micros(2000);

/// What the writer has done since the store was opened.
#[derive(Debug, Default)]
pub(super) struct Counters {
    jobs: AtomicU64,
    transactions: AtomicU64,
    checkpoints: AtomicU64,
    /// The writer waits for the write lock: a handler's transaction does
    /// not begin meanwhile (the writer goes first, see
    /// `SqliteStore::begin`), so it waits for one at most.
    pub(super) wants_lock: AtomicBool,
}

/// What a [`SqliteStore`](super::SqliteStore)'s writer has done since the
/// store was opened: how many changes were asked for, how many
/// transactions carried them, and how many fsyncs that cost. A running
/// executor's health probe (one write a second, `Change::Probe`) is left
/// out of the jobs and transactions (its fsyncs too), not of the
/// checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
#[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by the testing seam (the bench)
pub struct WriterStats {
    /// Commits asked for (calls to `Store::commit`), failed ones included,
    /// the health probe's aside.
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
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by the testing seam (the bench)
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

/// Opens the writer's connection to the (migrated) store file at `path`
/// and starts the writer on a thread of its own.
pub(super) fn spawn(
    path: &Path,
    rx: mpsc::Receiver<Job>,
    counters: Arc<Counters>,
) -> Result<(), StoreError> {
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX
            | OpenFlags::SQLITE_OPEN_URI,
    )
    .map_err(db)?;
    conn.busy_timeout(Duration::from_secs(10)).map_err(db)?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(db)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(db)?;
    conn.pragma_update(None, "foreign_keys", "ON").map_err(db)?;
    // The writer runs the checkpoints itself, so it can count them.
    conn.pragma_update(None, "wal_autocheckpoint", "0")
        .map_err(db)?;
    conn.set_prepared_statement_cache_capacity(32);
    std::thread::Builder::new()
        .name("toolrunner-store-writer".into())
        .spawn(move || write_loop(conn, rx, counters))
        .map_err(|e| StoreError::Database(DatabaseError(Box::new(e))))?;
    Ok(())
}

/// Takes jobs until every sender is gone, committing each batch that has
/// gathered in one transaction.
fn write_loop(conn: Connection, mut rx: mpsc::Receiver<Job>, counters: Arc<Counters>) {
    let mut since_checkpoint = 0u64;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut company = false;
    while let Some(job) = rx.blocking_recv() {
        batch.push(job);
        take_waiting(&mut rx, &mut batch);
        if company && batch.len() < MAX_BATCH {
            // Others were committing a moment ago: give their next changes
            // a moment to join this transaction (one fsync for all).
            std::thread::sleep(COMMIT_WINDOW);
            take_waiting(&mut rx, &mut batch);
        }
        // A job whose caller is gone (its executor stopped or was lost, or
        // it stopped waiting) is not written, as its own transaction would
        // not have been: nothing lands after the process that asked for
        // it is gone (the PostgreSQL writer does the same).
        batch.retain(|(_, reply)| !reply.is_closed());
        if batch.is_empty() {
            continue;
        }
        company = batch.len() > 1;
        // The health probe's own transactions are not the store's work:
        // the counters (and the bench's figures) leave them out.
        let probes = batch.iter().filter(|(c, _)| is_probe(c)).count();
        counters
            .jobs
            .fetch_add((batch.len() - probes) as u64, Ordering::Relaxed);
        let only_probes = probes == batch.len();
        if commit_batch(&conn, &mut batch, &counters.wants_lock) {
            if !only_probes {
                counters.transactions.fetch_add(1, Ordering::Relaxed);
            }
            since_checkpoint += 1;
        }
        if since_checkpoint >= CHECKPOINT_EVERY
            || rx.is_empty() && since_checkpoint >= CHECKPOINT_IDLE
        {
            since_checkpoint = 0;
            if checkpoint(&conn) {
                counters.checkpoints.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    if let Err((_, e)) = conn.close() {
        tracing::warn!(error = %e, "the store's writer did not close cleanly");
    }
}

/// Whether a job is the health probe alone.
fn is_probe(changes: &[Change]) -> bool {
    matches!(changes, [Change::Probe { .. }])
}

/// Adds the jobs already waiting, up to [`MAX_BATCH`].
fn take_waiting(rx: &mut mpsc::Receiver<Job>, batch: &mut Vec<Job>) {
    while batch.len() < MAX_BATCH {
        match rx.try_recv() {
            Ok(job) => batch.push(job),
            Err(_) => break,
        }
    }
}

/// Copies the WAL's pages into the database file without waiting on
/// readers; true if it copied any (and so synced twice).
fn checkpoint(conn: &Connection) -> bool {
    match conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |row| {
        row.get::<_, i64>(2)
    }) {
        Ok(copied) => copied > 0,
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
fn commit_batch(conn: &Connection, batch: &mut Vec<Job>, wants_lock: &AtomicBool) -> bool {
    let mut failed: Vec<Option<StoreError>> = batch.iter().map(|_| None).collect();
    let committed = loop {
        wants_lock.store(true, Ordering::SeqCst);
        let begun = conn.execute_batch("BEGIN IMMEDIATE");
        wants_lock.store(false, Ordering::SeqCst);
        if let Err(e) = begun {
            break Err(db(e));
        }
        let mut notes = Vec::new();
        let mut again = false;
        for (i, (changes, _)) in batch.iter().enumerate() {
            if failed[i].is_some() {
                continue;
            }
            let mark = notes.len();
            for (k, change) in changes.iter().enumerate() {
                if let Err(e) = now(write::apply(&mut Writer(conn), change, &mut notes)) {
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
        if again || failed.iter().all(Option::is_some) {
            // Nothing of it counts: done again without the failed job, or
            // nothing to write (no commit, no fsync).
            rollback(conn);
            if again {
                continue;
            }
            break Ok(false);
        }
        let end = now(write::write_notes(
            &mut Writer(conn),
            std::mem::take(&mut notes),
        ))
        .and_then(|()| conn.execute_batch("COMMIT").map_err(db));
        if end.is_err() {
            rollback(conn);
        }
        break end.map(|()| true);
    };
    match committed {
        Ok(wrote) => {
            let calls = batch
                .iter()
                .zip(&failed)
                .filter(|((changes, _), f)| f.is_none() && !is_probe(changes))
                .count();
            if wrote && calls > 0 {
                super::super::committed_together(calls);
            }
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

/// Ends a transaction that must not count (nothing if none is open).
fn rollback(conn: &Connection) {
    if !conn.is_autocommit()
        && let Err(e) = conn.execute_batch("ROLLBACK")
    {
        tracing::warn!(error = %e, "a rollback failed");
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
