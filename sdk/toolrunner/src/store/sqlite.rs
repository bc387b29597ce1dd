//! [`Store`] on SQLite: WAL, `synchronous=FULL`, one writer connection
//! using `BEGIN IMMEDIATE` behind a task, and a pool of readers.
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{Row, Sqlite};
use tokio::sync::{mpsc, oneshot};

use super::columns::{corrupt, time};
use super::{
    Attempt, CallFilter, Change, Event, LocalCall, LocalState, OutboxReceipt, OutboxSummary,
    ReceiptStatus, Store, StoreError, Timestamp, rfc3339,
};

use super::rows::{call_row, receipt_row};
mod approvals;
mod changes;
mod writer;

pub(crate) use approvals::SqliteApprovals;

pub use writer::WriterStats;
use writer::{Counters, Job};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/sqlite");

/// How long a handler's `ctx.transaction` waits for its turn (the other
/// handlers' transactions before it) before it gives up (a transactional
/// tool's handler is then asked to retry: nothing happened).
const HANDLER_TURN_WITHIN: Duration = Duration::from_secs(10);

/// The SQLite store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    readers: SqlitePool,
    /// Connections for handlers' transactions (opened when first used,
    /// closed once a handler used them).
    business: SqlitePool,
    /// One handler's transaction at a time holds (or waits for) the write
    /// lock; the others wait here, in turn.
    turns: Arc<tokio::sync::Semaphore>,
    writer: mpsc::Sender<Job>,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by the testing seam (the bench)
    counters: Arc<Counters>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore").finish_non_exhaustive()
    }
}

impl SqliteStore {
    /// Opens (creating and migrating) the store at a `sqlite://PATH` URL.
    ///
    /// # Errors
    /// The URL does not parse, the file cannot be opened, or a migration fails.
    pub async fn open(url: &str) -> Result<SqliteStore, StoreError> {
        Self::open_with(SqliteConnectOptions::from_str(url)?).await
    }

    /// Opens (creating and migrating) the store in the file at `path`,
    /// taken literally (no URL decoding).
    ///
    /// # Errors
    /// The file cannot be opened, or a migration fails.
    pub async fn open_path(path: &std::path::Path) -> Result<SqliteStore, StoreError> {
        Self::open_with(SqliteConnectOptions::new().filename(path)).await
    }

    async fn open_with(options: SqliteConnectOptions) -> Result<SqliteStore, StoreError> {
        let options = options
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        let path = options.get_filename().to_owned();
        let name = path.to_string_lossy();
        if name.is_empty() || name == ":memory:" || name.contains("mode=memory") {
            let why = "the executor's store must be a file (sqlite://PATH): an in-memory store loses every saved receipt with the process";
            return Err(StoreError::Database(super::DatabaseError(why.into())));
        }
        // Creates and migrates the file; the writer then has a connection
        // of its own.
        let migrator = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await?;
        MIGRATOR.run(&migrator).await?;
        migrator.close().await;
        let business = SqlitePoolOptions::new()
            .max_connections(4)
            .min_connections(0)
            // Never handed to another handler: closed, and whatever the
            // handler set on its connection (a PRAGMA) goes with it.
            .after_release(|_, _| Box::pin(async { Ok(false) }))
            .connect_lazy_with(options.clone());
        let readers = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options.read_only(true))
            .await?;
        let (tx, rx) = mpsc::channel::<Job>(1024);
        let counters = Arc::new(Counters::default());
        writer::spawn(&path, rx, counters.clone())?;
        Ok(SqliteStore {
            readers,
            business,
            turns: Arc::new(tokio::sync::Semaphore::new(1)),
            writer: tx,
            counters,
        })
    }

    /// The approval requests this store's file keeps (a connection of
    /// their own, opened when first used).
    pub(crate) fn approvals(&self) -> SqliteApprovals {
        SqliteApprovals::over(&self.readers)
    }

    /// What this store's writer has done since it was opened: commits
    /// asked for, transactions that carried them (group commit puts the
    /// changes of concurrent calls in one), and the fsyncs they cost.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // read by the testing seam (the bench)
    pub fn writer_stats(&self) -> WriterStats {
        self.counters.stats()
    }
}

/// Holds a store file for one executor process; released when dropped (and
/// by the operating system when the process dies, `kill -9` included).
///
/// Two executor processes on one store file would both resend the same
/// `accepted` and both run the handler, so an executor takes this lock
/// before it opens its store, and a second one fails at once. Operators'
/// tools (the `Reconciler`, the CLI) read and write beside a running
/// executor without it: their writes are compare-and-set transitions.
#[derive(Debug)]
pub struct StoreLock {
    _file: std::fs::File,
}

impl SqliteStore {
    /// Takes the process lock of the store at a `sqlite://PATH` URL: the
    /// file `PATH-lock` beside it, locked exclusively. `None` for an
    /// in-memory store.
    ///
    /// # Errors
    /// [`StoreError::Locked`] if another process (or another executor in
    /// this one) holds it; the URL does not parse; the lock file cannot be
    /// created.
    pub fn lock(url: &str) -> Result<Option<StoreLock>, StoreError> {
        let options = SqliteConnectOptions::from_str(url)?;
        let path = options.get_filename();
        let name = path.to_string_lossy();
        if name.is_empty() || name == ":memory:" || url.contains("mode=memory") {
            return Ok(None);
        }
        Self::lock_path(path).map(Some)
    }

    /// [`lock`](Self::lock) for the store file at `path`, taken literally.
    ///
    /// # Errors
    /// As [`lock`](Self::lock).
    pub fn lock_path(path: &std::path::Path) -> Result<StoreLock, StoreError> {
        // One lock per file, whatever the path that names it (links,
        // `..`, relative paths).
        let resolved = std::fs::canonicalize(path).or_else(|_| {
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => std::path::Path::new("."),
            };
            std::fs::canonicalize(parent).map(|dir| dir.join(path.file_name().unwrap_or_default()))
        });
        let path = resolved.as_deref().unwrap_or(path);
        let mut lock_name = path.as_os_str().to_owned();
        lock_name.push("-lock");
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_name)
            .map_err(|e| StoreError::Lock(unusable_directory(path, &e)))?;
        match file.try_lock() {
            Ok(()) => Ok(StoreLock { _file: file }),
            Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Locked {
                path: path.display().to_string(),
            }),
            Err(std::fs::TryLockError::Error(e)) => Err(StoreError::Lock(format!(
                "cannot lock {}: {e}",
                std::path::Path::new(&lock_name).display()
            ))),
        }
    }
}

/// Why a store file cannot be opened where it was asked for, naming the
/// directory (the lock file beside the store is the first thing created
/// there), or the lock file when it is the lock file that is refused, and
/// what to do.
fn unusable_directory(store: &std::path::Path, e: &std::io::Error) -> String {
    let dir = match store.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let mut lock = store.as_os_str().to_owned();
    lock.push("-lock");
    let lock = std::path::PathBuf::from(lock);
    let what = match std::fs::metadata(&dir) {
        Err(m) if m.kind() == std::io::ErrorKind::NotFound => {
            format!("the store's directory {} does not exist", dir.display())
        }
        Err(m) => format!(
            "the store's directory {} cannot be reached ({m})",
            dir.display()
        ),
        Ok(m) if !m.is_dir() => {
            format!("the store's directory {} is not a directory", dir.display())
        }
        Ok(_) if lock.exists() => format!(
            "the store's lock file {} cannot be opened for writing ({e}): let this process write it (or remove it while no executor runs)",
            lock.display()
        ),
        Ok(_) => format!(
            "the store's directory {} cannot be written to ({e})",
            dir.display()
        ),
    };
    format!(
        "{what}: create the directory and let this process write there, or set TOOLRUNNER_STORE_URL (or .store_url(..)) to a file in a writable directory (the store is {})",
        store.display()
    )
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    async fn commit(&self, changes: Vec<Change>) -> Result<(), StoreError> {
        let changes = match super::columns::storable_changes(&changes) {
            std::borrow::Cow::Borrowed(_) => changes,
            std::borrow::Cow::Owned(storable) => storable,
        };
        let (tx, rx) = oneshot::channel();
        self.writer
            .send((changes, tx))
            .await
            .map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
    }

    async fn begin(&self) -> Result<super::StoreTransaction, StoreError> {
        // Handlers' transactions in turn (fairly: the first to ask goes
        // first), each after the writer when the writer waits for the
        // lock, so the writer waits for one handler's transaction at most
        // (which the executor bounds: `sqlite_transaction_timeout`).
        let turn = tokio::time::timeout(HANDLER_TURN_WITHIN, self.turns.clone().acquire_owned())
            .await
            .map_err(|_| {
                StoreError::Database(super::DatabaseError::said(format!(
                    "no turn for a handler's transaction within {} s: other handlers' transactions hold the SQLite store's write lock (keep them short)",
                    HANDLER_TURN_WITHIN.as_secs()
                )))
            })?
            .map_err(|_| StoreError::Closed)?;
        let writer_first = tokio::time::Instant::now() + HANDLER_TURN_WITHIN;
        while self
            .counters
            .wants_lock
            .load(std::sync::atomic::Ordering::SeqCst)
            && tokio::time::Instant::now() < writer_first
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        // The write lock at once: a transaction that read first and wrote
        // later could find the database changed under it, and fail.
        let tx = self.business.begin_with("BEGIN IMMEDIATE").await?;
        let mut begun = super::StoreTransaction::new(super::transaction::Inner::Sqlite(tx));
        begun.turn = Some(turn);
        Ok(begun)
    }

    async fn call(&self, run_id: &str, call_id: &str) -> Result<Option<LocalCall>, StoreError> {
        let row = sqlx::query("SELECT * FROM calls WHERE run_id = ?1 AND call_id = ?2")
            .bind(run_id)
            .bind(call_id)
            .fetch_optional(&self.readers)
            .await?;
        row.as_ref().map(call_row).transpose()
    }

    async fn calls(&self, filter: &CallFilter) -> Result<Vec<LocalCall>, StoreError> {
        // Filtered in SQL (the `calls_by_state` index), so the executor's
        // periodic look-ups stay cheap however many calls the store holds.
        let mut sql = sqlx::QueryBuilder::<Sqlite>::new("SELECT * FROM calls WHERE 1 = 1");
        if !filter.states.is_empty() {
            sql.push(" AND state IN (");
            let mut list = sql.separated(", ");
            for s in &filter.states {
                list.push_bind(s.as_str());
            }
            sql.push(")");
        }
        if let Some(tool) = &filter.tool_name {
            sql.push(" AND tool_name = ").push_bind(tool.clone());
        }
        if let Some(before) = &filter.updated_before {
            sql.push(" AND updated_at < ").push_bind(rfc3339(before));
        }
        if filter.pending_report {
            sql.push(" AND report IS NOT NULL");
        }
        sql.push(" ORDER BY updated_at, run_id, call_id");
        let rows = sql.build().fetch_all(&self.readers).await?;
        rows.iter().map(call_row).collect()
    }

    async fn count_by_state(
        &self,
    ) -> Result<std::collections::BTreeMap<LocalState, u64>, StoreError> {
        // Kept by triggers (`call_counts`): no scan of the calls.
        let rows = sqlx::query("SELECT state, n FROM call_counts WHERE n > 0")
            .fetch_all(&self.readers)
            .await?;
        let mut out = std::collections::BTreeMap::new();
        for row in &rows {
            let state: String = row.try_get(0)?;
            let n: i64 = row.try_get(1)?;
            let state = LocalState::parse(&state)
                .ok_or_else(|| corrupt(format!("unknown call state {state}")))?;
            out.insert(state, u64::try_from(n).unwrap_or(0));
        }
        Ok(out)
    }

    async fn receipts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<OutboxReceipt>, StoreError> {
        let rows = sqlx::query("SELECT * FROM receipts WHERE run_id = ?1 AND call_id = ?2 ORDER BY sequence, created_at")
            .bind(run_id)
            .bind(call_id)
            .fetch_all(&self.readers)
            .await?;
        rows.iter().map(receipt_row).collect()
    }

    async fn receipt(&self, receipt_id: &str) -> Result<Option<OutboxReceipt>, StoreError> {
        let row = sqlx::query("SELECT * FROM receipts WHERE receipt_id = ?1")
            .bind(receipt_id)
            .fetch_optional(&self.readers)
            .await?;
        row.as_ref().map(receipt_row).transpose()
    }

    async fn receipts_with(&self, status: ReceiptStatus) -> Result<Vec<OutboxReceipt>, StoreError> {
        let rows =
            sqlx::query("SELECT * FROM receipts WHERE status = ?1 ORDER BY created_at, sequence")
                .bind(status.as_str())
                .fetch_all(&self.readers)
                .await?;
        rows.iter().map(receipt_row).collect()
    }

    async fn prune(&self, settled_before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        let counted = format!("SELECT COUNT(*) FROM ({})", crate::store::write::PRUNABLE);
        let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(counted))
            .bind(rfc3339(&settled_before))
            .bind(limit)
            .fetch_one(&self.readers)
            .await?;
        if n > 0 {
            self.commit(vec![Change::Prune {
                settled_before,
                limit,
            }])
            .await?;
        }
        Ok(u64::try_from(n).unwrap_or(0))
    }

    async fn outbox_summary(&self) -> Result<OutboxSummary, StoreError> {
        // From the `receipts_pending` index: no bodies are read.
        let (pending, oldest): (i64, Option<String>) = sqlx::query_as(
            "SELECT COUNT(*), MIN(created_at) FROM receipts WHERE status = 'pending'",
        )
        .fetch_one(&self.readers)
        .await?;
        let calls: Vec<(String, String)> = sqlx::query_as(
            "SELECT DISTINCT run_id, call_id FROM receipts
             WHERE status = 'pending' AND kind <> 'accepted' ORDER BY run_id, call_id",
        )
        .fetch_all(&self.readers)
        .await?;
        Ok(OutboxSummary {
            pending: u64::try_from(pending).unwrap_or(0),
            oldest: oldest.as_deref().map(time).transpose()?,
            calls,
        })
    }

    async fn outcomes(
        &self,
        calls: &[super::CallKey],
    ) -> Result<std::collections::HashMap<super::CallKey, super::ReceiptKind>, StoreError> {
        if calls.len() <= super::OUTCOMES_ONE_BY_ONE {
            let mut out = std::collections::HashMap::new();
            for (run_id, call_id) in calls {
                let kind: Option<String> = sqlx::query_scalar(super::CALL_OUTCOME)
                    .bind(run_id)
                    .bind(call_id)
                    .fetch_optional(&self.readers)
                    .await?;
                if let Some(kind) = kind {
                    out.insert((run_id.clone(), call_id.clone()), super::parse_kind(kind)?);
                }
            }
            return Ok(out);
        }
        let rows: Vec<(String, String, String)> = sqlx::query_as(super::FINAL_KINDS)
            .fetch_all(&self.readers)
            .await?;
        let rows = rows
            .into_iter()
            .map(|(r, c, k)| Ok((r, c, super::parse_kind(k)?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(super::outcomes_among(calls, rows))
    }

    async fn executor_ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(super::EXECUTOR_IDS)
            .fetch_all(&self.readers)
            .await?)
    }

    async fn attempts(&self, run_id: &str, call_id: &str) -> Result<Vec<Attempt>, StoreError> {
        let rows = sqlx::query(
            "SELECT run_id, call_id, operation_key, executor_id, assignment_id, created_at
             FROM attempts WHERE run_id = ?1 AND call_id = ?2 ORDER BY id",
        )
        .bind(run_id)
        .bind(call_id)
        .fetch_all(&self.readers)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Attempt {
                    run_id: r.try_get(0)?,
                    call_id: r.try_get(1)?,
                    operation_key: r.try_get(2)?,
                    executor_id: r.try_get(3)?,
                    assignment_id: r.try_get(4)?,
                    created_at: time(&r.try_get::<String, _>(5)?)?,
                })
            })
            .collect()
    }

    async fn events(&self, run_id: &str, call_id: &str) -> Result<Vec<Event>, StoreError> {
        let rows = sqlx::query(
            "SELECT at, what, detail FROM events WHERE run_id = ?1 AND call_id = ?2 ORDER BY id",
        )
        .bind(run_id)
        .bind(call_id)
        .fetch_all(&self.readers)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(Event {
                    at: time(&r.try_get::<String, _>(0)?)?,
                    what: r.try_get(1)?,
                    detail: r.try_get(2)?,
                })
            })
            .collect()
    }
}
