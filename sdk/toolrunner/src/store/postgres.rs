//! [`Store`] on PostgreSQL: a pool of connections, each commit one
//! transaction on one of them.
//!
//! The schema (this crate's `migrations/postgres`) is the SQLite store's,
//! constraint for constraint: the same rows are refused, and every call
//! change is the same compare-and-set on `version`. Times are stored as the
//! same RFC 3339 text.
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{Connection, PgConnection, Postgres, Row};

use super::columns::{parse_state, time};
use super::{
    Attempt, CallFilter, Change, DEFAULT_LEASE_TTL, DatabaseError, Event, LocalCall, LocalState,
    OutboxReceipt, OutboxSummary, ReceiptStatus, Store, StoreError, Timestamp, rfc3339,
};

use super::rows::{call_row, receipt_row};
mod approvals;
mod flow;
mod handlers;
mod lease;
mod writer;

pub(super) use handlers::HandlerTx;

use super::write;

use lease::Fence;
pub(crate) use lease::LapseWatch;

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

/// How long the server lets a session of the store stay idle inside one of
/// the store's own transactions before it ends the session (and so the
/// transaction, whose locks a frozen process would otherwise hold).
const IDLE_IN_TRANSACTION: Duration = Duration::from_secs(5);

/// How many times a commit that PostgreSQL aborted as a deadlock (or a
/// serialization failure) is done again: such a transaction wrote nothing.
const RETRIES: u32 = 3;

/// The first key of the advisory lock that lets one fold of the call counts
/// run at a time (`fold_counts`); the second is `call_counts`' oid. ASCII
/// `tool`.
const FOLD_LOCK_CLASS: i32 = 0x746f_6f6c;

/// The PostgreSQL store. Cheap to clone (the pool is shared).
///
/// One database serves several executor processes: each executor identity
/// has a schema of its own ([`connect_as`](Self::connect_as), which the
/// executor uses for a `postgres://` store URL), held through a lease with
/// a fencing token that every write checks, so two processes never drive
/// the same calls.
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    /// How to connect (for the stores of other identities: adoption).
    options: PgConnectOptions,
    /// The identity this store writes for, with its lease (none for a
    /// store opened without an identity).
    hold: Option<Hold>,
    /// The group-commit writer of the pool, started by the first commit
    /// (and again by the next one if its task is gone: its runtime shut
    /// down, or it panicked).
    writer: Arc<std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedSender<writer::Job>>>>,
    /// What the writer did.
    counts: Arc<writer::Counts>,
    /// Handlers' transactions: a pool of their own (never the store's).
    handlers: Arc<handlers::Handlers>,
}

/// Faults of one [`PgStore`]'s writer (every clone of the store shares
/// it), for the tests of its fault paths; inert until a test sets one, and
/// of this store alone. Features `failpoints` and `testing`.
///
/// - [`hold`](Self::hold): the writer stops right after it takes the next
///   job, before it gathers a group and writes (its caller waits);
///   [`held_behind`](Self::held_behind) says how many jobs wait behind it,
///   [`release`](Self::release) lets it go on with all of them in one
///   group.
/// - [`fail_next_group_commit`](Self::fail_next_group_commit): the
///   `COMMIT` of the next group of two or more jobs fails, carried out or
///   not.
/// - [`kill_writer`](Self::kill_writer): the writer task panics as it
///   takes its next job.
#[cfg(all(feature = "failpoints", feature = "testing"))]
#[derive(Clone)]
pub struct WriterFaults(Arc<writer::Counts>);

#[cfg(all(feature = "failpoints", feature = "testing"))]
impl std::fmt::Debug for WriterFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriterFaults")
            .field("held_behind", &self.held_behind())
            .finish_non_exhaustive()
    }
}

#[cfg(all(feature = "failpoints", feature = "testing"))]
impl WriterFaults {
    /// The writer stops right after it takes its next job, before it
    /// writes anything, until [`release`](Self::release).
    pub fn hold(&self) {
        self.0.faults.hold(true);
    }

    /// Lets a held writer go on.
    pub fn release(&self) {
        self.0.faults.hold(false);
    }

    /// While the writer is held on a job: how many more jobs wait behind
    /// it (they go into its group when it is released). `None` when it is
    /// not held on one.
    pub fn held_behind(&self) -> Option<usize> {
        self.0.faults.held()
    }

    /// The `COMMIT` of the next group of two or more jobs fails: not
    /// carried out (`happened: false`, the transaction rolls back) or
    /// carried out (`true`, as when the server's answer is lost); either
    /// way every job of the group hears that it failed and may have
    /// happened, but a job whose own change failed, which hears its own
    /// error.
    pub fn fail_next_group_commit(&self, happened: bool) {
        self.0.faults.fail_next_commit(if happened {
            writer::faults::CommitFault::Happened
        } else {
            writer::faults::CommitFault::RolledBack
        });
    }

    /// The writer task panics as it takes its next job (its caller hears
    /// that the store is closed); the next commit starts a new writer.
    pub fn kill_writer(&self) {
        self.0.faults.kill();
    }
}

/// An identity this store holds.
#[derive(Clone)]
struct Hold {
    /// Its fencing token: every write checks it first.
    fence: Fence,
    /// The lease's own connection (renewals, the release): never one of the
    /// store's pool, which handler transactions hold; replaced whenever a
    /// request on it fails or hangs, so one dead socket never stalls the
    /// renewals.
    lease: Arc<tokio::sync::Mutex<Option<PgConnection>>>,
    /// When the lease was taken (sent), by this process's clock.
    taken_at: Instant,
    /// What this holder owes the identity's earlier holders before any
    /// `reconcile` hook may be asked (`None`: nothing).
    owed: Option<lease::Owed>,
    /// The longest commit window of this holder's tools (what a release
    /// carries on is owed for tools of that window).
    window: Duration,
}

/// Why an adoption failed, and of which identity (its store would not
/// open: it is skipped for a while, so it never blocks the others).
#[derive(Debug)]
pub(crate) struct AdoptError {
    pub(crate) executor_id: Option<String>,
    pub(crate) error: StoreError,
}

impl From<StoreError> for AdoptError {
    fn from(error: StoreError) -> Self {
        AdoptError {
            executor_id: None,
            error,
        }
    }
}

impl From<sqlx::Error> for AdoptError {
    fn from(error: sqlx::Error) -> Self {
        StoreError::from(error).into()
    }
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // No connection options: the URL may hold a password.
        f.debug_struct("PgStore")
            .field("executor_id", &self.identity())
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// Connects to the database at a `postgres://` URL and migrates it (in
    /// the schema its `search_path` names first, `public` by default).
    ///
    /// # Errors
    /// The URL does not parse, the server cannot be reached or refuses the
    /// login, or a migration fails.
    pub async fn connect(url: &str) -> Result<PgStore, StoreError> {
        Self::connect_with(PgConnectOptions::from_str(url)?).await
    }

    /// Connects to the database at a `postgres://` URL, creates the schema
    /// `schema` if it is missing, and migrates it; every connection of the
    /// store uses that schema (its `search_path`). `schema` is a plain
    /// lower-case name: `[a-z_][a-z0-9_]*`, at most 63 characters.
    ///
    /// # Errors
    /// The schema name is not such a name, the URL does not parse, the
    /// server cannot be reached or refuses the login, the schema cannot be
    /// created, or a migration fails.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the testing seam's
    pub async fn connect_in_schema(url: &str, schema: &str) -> Result<PgStore, StoreError> {
        Self::in_schema(PgConnectOptions::from_str(url)?, schema).await
    }

    /// The schema an executor identity's store lives in when its URL names
    /// none (`toolrunner_` and the id in lower case, characters other than
    /// letters, digits and `_` as `_`, and a hash of the id when that
    /// changed it or it is long). Operators' tools reach the store with
    /// `?options=-c%20search_path%3DSCHEMA` on the URL.
    pub fn identity_schema(executor_id: &str) -> String {
        let plain: String = executor_id
            .chars()
            .map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9' | '_') => c,
                _ => '_',
            })
            .collect();
        let name = format!("toolrunner_{plain}");
        if plain == executor_id && name.len() <= 63 {
            return name;
        }
        // FNV-1a: stable across versions and platforms.
        let hash = executor_id.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let keep: String = name.chars().take(63 - 17).collect();
        format!("{keep}_{hash:016x}")
    }

    /// The store of the executor identity `executor_id` at a `postgres://`
    /// URL, serving the executor binding `binding_id` (replicas of one
    /// binding adopt each other), held for the process `holder` (its
    /// instance id): the schema the URL names (`options=-c
    /// search_path=…`), or else the identity's own
    /// ([`identity_schema`](Self::identity_schema)), so replicas with
    /// distinct ids share one database and each works only its own rows.
    /// Takes the identity's lease (`toolrunner_leases.executor_leases`,
    /// with a time to live of 3 s) with a new fencing token, which every
    /// write of this store checks: at once when nobody holds it, when it
    /// was released, or when a replica adopted it (that replica's writes
    /// are fenced from now on); after the lease lapsed when an earlier
    /// process of the identity held it (a crashed process renews nothing).
    ///
    /// # Errors
    /// As [`connect_in_schema`](Self::connect_in_schema); and
    /// [`StoreError::InUse`] when another live process holds the identity
    /// (it keeps renewing its lease: two processes with one executor id).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the testing seam's
    pub async fn connect_as(
        url: &str,
        executor_id: &str,
        binding_id: &str,
        holder: &str,
    ) -> Result<PgStore, StoreError> {
        Self::open_identity(
            url,
            executor_id,
            binding_id,
            holder,
            DEFAULT_LEASE_TTL,
            super::DEFAULT_COMMIT_WINDOW,
        )
        .await
    }

    /// [`connect_as`](Self::connect_as) with a lease of `ttl`, for tools
    /// whose longest commit window is `window`.
    pub(crate) async fn open_identity(
        url: &str,
        executor_id: &str,
        binding_id: &str,
        holder: &str,
        ttl: Duration,
        window: Duration,
    ) -> Result<PgStore, StoreError> {
        let options = PgConnectOptions::from_str(url)?;
        let leases = Self::in_schema_pool(options.clone(), lease::SCHEMA).await?;
        if let Err(e) = lease::migrate(&leases).await {
            leases.close().await;
            return Err(e);
        }
        let mut store = if url.contains("search_path") {
            Self::connect_with(options).await?
        } else {
            Self::in_schema(options, &Self::identity_schema(executor_id)).await?
        };
        store.claim_schema(executor_id).await?;
        let schema: String = sqlx::query_scalar("SELECT current_schema()")
            .fetch_one(&store.pool)
            .await?;
        let claimant = lease::Claimant {
            executor_id,
            holder,
            binding_id,
            store_schema: &schema,
            ttl,
            window,
        };
        let taken = lease::take(&leases, &claimant).await;
        leases.close().await;
        let taken = taken?;
        store.hold = Some(Hold {
            fence: Fence {
                executor_id: executor_id.to_owned(),
                binding_id: binding_id.to_owned(),
                token: taken.token,
                ttl,
            },
            lease: Arc::default(),
            taken_at: taken.at,
            owed: taken.owed,
            window,
        });
        Ok(store)
    }

    /// Adopts, for this store's identity (a replica, process `holder`), one
    /// identity that `watch` saw lapsed for longer than `grace` and that
    /// is not in `skip`, and opens its store, fenced by the adoption's
    /// token, with a lease of `ttl`, for tools whose longest commit window
    /// is `window`: `None` when no lease lapsed that long (or another
    /// replica adopted it first). Its store is opened before anything is
    /// locked, and the identity is then locked only for the bump: a slow
    /// opening holds nobody back, and a store that fails to open adopts
    /// nothing.
    ///
    /// # Errors
    /// The database failed (naming the identity whose store would not
    /// open, if that was it), or this store holds no identity.
    pub(crate) async fn adopt_lapsed(
        &self,
        holder: &str,
        grace: Duration,
        ttl: Duration,
        window: Duration,
        skip: &[String],
        watch: &mut LapseWatch,
    ) -> Result<Option<PgStore>, AdoptError> {
        let me = self.fence().ok_or_else(|| {
            StoreError::Unsupported("a store without an identity adopts none".into())
        })?;
        let due = lease::lapsed(
            &self.pool,
            &me.executor_id,
            &me.binding_id,
            grace,
            skip,
            watch,
        )
        .await?;
        for (seen, owed) in due {
            // Picked under a lock, let go at once: one whose holder's
            // transaction is still open is passed over.
            let mut pick = self.pool.begin().await?;
            let free = lease::lock_unchanged(&mut pick, &seen).await?;
            pick.rollback().await?;
            if !free {
                continue;
            }
            let id = seen.executor_id.clone();
            let named = |error: StoreError| AdoptError {
                executor_id: Some(id.clone()),
                error,
            };
            // The store its holder used (its own schema when none is
            // recorded).
            let schema = if seen.store_schema.is_empty() {
                Self::identity_schema(&id)
            } else {
                seen.store_schema.clone()
            };
            let mut adopted = Self::in_schema(self.options.clone(), &schema)
                .await
                .map_err(named)?;
            adopted.claim_schema(&id).await.map_err(named)?;
            // Still as seen, and nobody else's: locked, bumped, committed.
            let mut tx = self.pool.begin().await?;
            if !lease::lock_unchanged(&mut tx, &seen).await? {
                adopted.pool.close().await;
                return Ok(None);
            }
            let taken_at = Instant::now();
            let how = lease::Adoption {
                binding_id: &me.binding_id,
                by: &me.executor_id,
                holder,
                ttl,
                window,
            };
            let fence = lease::adopt(&mut tx, &id, &how, &owed).await?;
            tx.commit().await?;
            adopted.hold = Some(Hold {
                fence,
                lease: Arc::default(),
                taken_at,
                owed: Some(owed),
                window,
            });
            return Ok(Some(adopted));
        }
        Ok(None)
    }

    /// The instance ids this database records as holders of this store's
    /// identity: the current holder and the latest ones before it. A
    /// connection of the identity superseded by one of them is a takeover
    /// on this database; by another, a twin with the same executor id on
    /// another database.
    ///
    /// # Errors
    /// The database failed, or did not answer in time.
    pub(crate) async fn recorded_holders(&self) -> Result<Vec<String>, StoreError> {
        let Some(h) = &self.hold else {
            return Ok(Vec::new());
        };
        self.on_lease(h, h.fence.ttl.max(Duration::from_secs(1)), async |conn| {
            lease::holders(conn, &h.fence.executor_id).await
        })
        .await
    }

    /// Where this store's database is, for an operator (host, port and
    /// database name; never a password).
    pub(crate) fn database(&self) -> String {
        format!(
            "postgres://{}:{}/{}",
            self.options.get_host(),
            self.options.get_port(),
            self.options.get_database().unwrap_or("")
        )
    }

    fn fence(&self) -> Option<&Fence> {
        self.hold.as_ref().map(|h| &h.fence)
    }

    /// The executor id this store writes for, if it holds one.
    pub(crate) fn identity(&self) -> Option<&str> {
        self.fence().map(|f| f.executor_id.as_str())
    }

    /// The identity's fencing token as this store holds it.
    /// What this store's writer has done since it was opened: commits
    /// asked for and the transactions that carried them (group commit puts
    /// several in one). The server's fsyncs are its own (`pg_stat_wal`):
    /// `fsyncs` and `checkpoints` stay 0.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the testing seam's
    pub fn writer_stats(&self) -> super::WriterStats {
        super::WriterStats {
            jobs: self.counts.jobs.load(std::sync::atomic::Ordering::Relaxed),
            transactions: self
                .counts
                .transactions
                .load(std::sync::atomic::Ordering::Relaxed),
            checkpoints: 0,
            fsyncs: 0,
        }
    }

    /// Faults of this store's writer, for tests of its fault paths (see
    /// [`WriterFaults`]).
    #[cfg(all(feature = "failpoints", feature = "testing"))]
    pub fn writer_faults(&self) -> WriterFaults {
        WriterFaults(self.counts.clone())
    }

    pub(crate) fn fencing_token(&self) -> Option<u64> {
        self.fence().and_then(|f| u64::try_from(f.token).ok())
    }

    /// The lease's time to live, when this store holds an identity.
    pub(crate) fn lease_ttl(&self) -> Option<Duration> {
        self.fence().map(|f| f.ttl)
    }

    /// When the lease was taken, by this process's clock.
    pub(crate) fn lease_taken_at(&self) -> Option<Instant> {
        self.hold.as_ref().map(|h| h.taken_at)
    }

    /// Not before this may a `reconcile` hook be asked about a call of a
    /// tool with this commit window: what this holder owes the identity's
    /// earlier holders (`None`: nothing).
    pub(crate) fn hooks_after(&self, window: Duration) -> Option<Instant> {
        self.hold
            .as_ref()
            .and_then(|h| h.owed)
            .map(|o| o.hooks_after(window))
    }

    /// Runs one request on the lease's own connection (opened if there is
    /// none), within `within`: a request that fails or hangs drops the
    /// connection, and the next one opens a fresh one.
    async fn on_lease<T>(
        &self,
        h: &Hold,
        within: Duration,
        request: impl AsyncFnOnce(&mut PgConnection) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let mut slot = h.lease.lock().await;
        let answer = tokio::time::timeout(within, async {
            if slot.is_none() {
                *slot = Some(PgConnection::connect_with(&session(self.options.clone())).await?);
            }
            let conn = slot.as_mut().expect("opened above");
            request(conn).await
        })
        .await;
        match answer {
            Ok(Ok(v)) => Ok(v),
            // Closed: a broken socket is never used again.
            Ok(Err(e)) => {
                if !matches!(e, StoreError::Fenced(_)) {
                    slot.take();
                }
                Err(e)
            }
            Err(_) => {
                slot.take();
                Err(StoreError::Database(DatabaseError::said(format!(
                    "the database did not answer the lease's request within {} ms: check the connection to PostgreSQL",
                    within.as_millis()
                ))))
            }
        }
    }

    /// Renews this store's lease (a third of its time to live at most: a
    /// request that hangs is given up, its connection dropped, and the
    /// next renewal tries a fresh one).
    ///
    /// # Errors
    /// [`StoreError::Fenced`] when the identity's token moved on; the
    /// database failed or did not answer in time.
    pub(crate) async fn renew(&self) -> Result<(), StoreError> {
        let Some(h) = &self.hold else {
            return Ok(());
        };
        self.on_lease(h, h.fence.ttl / 3, async |conn| {
            lease::renew(conn, &h.fence).await
        })
        .await
    }

    /// Lets the identity go (a clean drain, nothing left): nobody adopts
    /// it, and a start takes it at once. `false` when it had moved on.
    ///
    /// # Errors
    /// The database failed.
    pub(crate) async fn release(&self) -> Result<bool, StoreError> {
        let Some(h) = &self.hold else {
            return Ok(false);
        };
        let owed = || h.owed.map_or(0, |o| o.left_ms(h.window, Instant::now()));
        self.on_lease(h, Duration::from_secs(10), async |conn| {
            lease::release(conn, &h.fence, owed).await
        })
        .await
    }

    /// Whether the identity's store holds nothing left to do: no call
    /// mid-way, no state to report, no receipt to send, and (when
    /// `reconciling`: the executor runs the tools' `reconcile` hooks) no
    /// call waiting for reconciliation. With `claims_given_back` (the
    /// platform answered a `drain` disconnect, which gives back every call
    /// claimed and not started), a call still `claiming` is not work left:
    /// nothing of it ran, and the platform holds none of it for this
    /// identity; the next start claims it again with its key (refused, and
    /// nothing runs, if another executor took it meanwhile). An approval
    /// request this identity asked that a person may still decide (waiting,
    /// not expired) is work left too.
    ///
    /// # Errors
    /// The database failed.
    pub(crate) async fn is_idle(
        &self,
        reconciling: bool,
        claims_given_back: bool,
    ) -> Result<bool, StoreError> {
        let busy: bool = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT EXISTS (SELECT 1 FROM calls WHERE state IN ('assigned', 'running', 'settled')
                              OR (state = 'claiming' AND NOT $2)
                              OR (state = 'reconciliation_required' AND $1) OR report IS NOT NULL)
                 OR EXISTS (SELECT 1 FROM receipts WHERE status = 'pending')
                 OR EXISTS (SELECT 1 FROM {schema}.approvals a JOIN store_identity i
                                ON a.executor_id = i.executor_id
                             WHERE a.state = 'waiting' AND a.expires_at > $3)",
            schema = lease::SCHEMA
        )))
        .bind(reconciling)
        .bind(claims_given_back)
        .bind(rfc3339(&super::now()))
        .fetch_one(&self.pool)
        .await?;
        Ok(!busy)
    }

    /// Records `executor_id` as the identity whose calls this store's
    /// schema holds, or checks that it is the one recorded.
    ///
    /// # Errors
    /// [`StoreError::Refused`] when the schema holds another identity's
    /// calls.
    async fn claim_schema(&self, executor_id: &str) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO store_identity (executor_id) VALUES ($1) ON CONFLICT (one) DO NOTHING",
        )
        .bind(executor_id)
        .execute(&self.pool)
        .await?;
        let owner: String = sqlx::query_scalar("SELECT executor_id FROM store_identity")
            .fetch_one(&self.pool)
            .await?;
        if owner != executor_id {
            return Err(StoreError::Refused(format!(
                "this store's schema holds the calls of executor {owner}, not {executor_id}: give every executor id a schema of its own (leave search_path out of the URL, and each id gets toolrunner_<id>)"
            )));
        }
        Ok(())
    }

    /// Connects, in `schema` (created if missing, then migrated).
    async fn in_schema(options: PgConnectOptions, schema: &str) -> Result<PgStore, StoreError> {
        create_schema(&options, schema).await?;
        let mut store =
            Self::connect_with(options.clone().options([("search_path", schema)])).await?;
        store.options = options;
        Ok(store)
    }

    /// Every executor identity that has held a lease on the database at
    /// `url`, with the schema its store lives in, by executor id: none when
    /// no executor ever ran there (no lease table yet).
    ///
    /// # Errors
    /// The URL does not parse, or the server cannot be reached.
    pub(crate) async fn identities(url: &str) -> Result<Vec<(String, String)>, StoreError> {
        let options = session(PgConnectOptions::from_str(url)?);
        let pool = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await?;
        let rows: Result<Vec<(String, String)>, sqlx::Error> = sqlx::query_as(
            "SELECT executor_id, store_schema FROM toolrunner_leases.executor_leases ORDER BY executor_id",
        )
        .fetch_all(&pool)
        .await;
        let rows = match rows {
            Ok(rows) => rows,
            // 42P01: undefined table (no executor has run on it yet).
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => {
                pool.close().await;
                return Ok(Vec::new());
            }
            Err(e) => {
                pool.close().await;
                return Err(e.into());
            }
        };
        let rows: Vec<(String, String)> = rows
            .into_iter()
            .map(|(id, schema)| {
                let schema = if schema.is_empty() {
                    Self::identity_schema(&id)
                } else {
                    schema
                };
                (id, schema)
            })
            .collect();
        // Only the identities whose store is there (a schema dropped by
        // hand leaves its lease row behind): an operator's look creates
        // nothing.
        let names: Vec<String> = rows.iter().map(|(_, s)| s.clone()).collect();
        let present: Result<Vec<String>, sqlx::Error> = sqlx::query_scalar(
            "SELECT schema_name::TEXT FROM information_schema.schemata WHERE schema_name = ANY($1)",
        )
        .bind(&names)
        .fetch_all(&pool)
        .await;
        pool.close().await;
        let present = present?;
        Ok(rows
            .into_iter()
            .filter(|(_, schema)| present.contains(schema))
            .collect())
    }

    /// The store in `schema` at `url` as it is, for an operator's look: no
    /// lease taken, nothing created, nothing migrated (the executors that
    /// own it migrate it), a small pool.
    ///
    /// # Errors
    /// The URL does not parse, or the server cannot be reached.
    pub(crate) async fn open_in_schema(url: &str, schema: &str) -> Result<PgStore, StoreError> {
        let options = PgConnectOptions::from_str(url)?;
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .idle_timeout(std::time::Duration::from_secs(30))
            .connect_with(session(options.clone()).options([("search_path", schema)]))
            .await?;
        Ok(Self::over(pool, options))
    }

    /// The flow control shared by every replica of this store's database
    /// (a small pool of its own).
    ///
    /// # Errors
    /// The server cannot be reached.
    pub(crate) async fn shared_flow(&self) -> Result<flow::PgFlow, StoreError> {
        flow::PgFlow::connect(session(self.options.clone())).await
    }

    /// The flow control shared by every replica of the database at `url`,
    /// for operators' tools (no identity): the database-wide schema is
    /// migrated first if this version never ran there.
    ///
    /// # Errors
    /// The URL does not parse, the server cannot be reached, a migration
    /// failed.
    pub(crate) async fn open_shared_flow(url: &str) -> Result<flow::PgFlow, StoreError> {
        flow::PgFlow::connect(session(Self::shared_schema_migrated(url).await?)).await
    }

    /// The options of the database at `url`, its database-wide schema
    /// migrated first if this version never ran there.
    async fn shared_schema_migrated(url: &str) -> Result<PgConnectOptions, StoreError> {
        let options = PgConnectOptions::from_str(url)?;
        let leases = Self::in_schema_pool(options.clone(), lease::SCHEMA).await?;
        let migrated = lease::migrate(&leases).await;
        leases.close().await;
        migrated?;
        Ok(options)
    }

    /// The approval requests every replica of this store's database
    /// shares (a small pool of their own, opened when first used).
    pub(crate) fn approvals(&self) -> approvals::PgApprovals {
        approvals::PgApprovals::connect(session(self.options.clone()))
    }

    /// The approval requests of the database at `url`, for operators'
    /// tools (no identity): the database-wide schema is migrated first if
    /// this version never ran there.
    ///
    /// # Errors
    /// The URL does not parse, the server cannot be reached, a migration
    /// failed.
    pub(crate) async fn open_approvals(url: &str) -> Result<approvals::PgApprovals, StoreError> {
        let options = Self::shared_schema_migrated(url).await?;
        Ok(approvals::PgApprovals::connect(session(options)))
    }

    /// A store over `pool`, holding no identity yet.
    fn over(pool: PgPool, options: PgConnectOptions) -> PgStore {
        PgStore {
            pool,
            options,
            hold: None,
            writer: Arc::default(),
            counts: Arc::default(),
            handlers: Arc::default(),
        }
    }

    /// A small pool in `schema` (created if missing), not migrated.
    async fn in_schema_pool(options: PgConnectOptions, schema: &str) -> Result<PgPool, StoreError> {
        create_schema(&options, schema).await?;
        Ok(PgPoolOptions::new()
            .max_connections(1)
            .connect_with(session(options).options([("search_path", schema)]))
            .await?)
    }

    async fn connect_with(options: PgConnectOptions) -> Result<PgStore, StoreError> {
        let options = session(options);
        let pool = PgPoolOptions::new()
            .max_connections(16)
            // Replicas share the server's connections: an idle one goes.
            .idle_timeout(std::time::Duration::from_secs(30))
            .connect_with(options.clone())
            .await?;
        migrate(&pool, &MIGRATOR).await?;
        Ok(Self::over(pool, options))
    }

    /// Applies `changes` in one transaction; the number of calls pruned.
    async fn apply_all(&self, changes: &[Change]) -> Result<u64, StoreError> {
        let mut tries = 0;
        loop {
            match self.transaction(changes).await {
                Err(e) if tries < RETRIES && retryable(&e) => tries += 1,
                outcome => return outcome,
            }
        }
    }

    async fn transaction(&self, changes: &[Change]) -> Result<u64, StoreError> {
        let mut tx = self.pool.begin().await?;
        if let Some(fence) = self.fence() {
            lease::check(&mut tx, fence).await?;
        }
        let mut notes = Vec::new();
        let mut pruned = 0;
        let mut conn = super::sqlx_conn::Pg(&mut tx);
        for change in changes {
            pruned += write::apply(&mut conn, change, &mut notes).await?;
        }
        write::write_notes(&mut conn, notes).await?;
        tx.commit().await?;
        Ok(pruned)
    }

    /// Folds the call counts' deltas into `call_counts` (see the
    /// migration), in a transaction of its own, unless another fold of the
    /// schema is under way: a count reads the deltas no fold took anyway.
    ///
    /// One fold at a time, each one's statement reading after the last one
    /// committed. Two folds at once each took a share of the deltas: one
    /// that waited for the other skipped the rows the other had committed
    /// (a call's `+1`, say) and kept the rest (its `-1`), and its `UPDATE`
    /// computed the count from the row its snapshot held, before the
    /// other's commit. PostgreSQL checks a new row's constraints before it
    /// finds the row updated since and computes it again, so that stale
    /// count, below zero, was refused by `call_counts`' check though the
    /// recomputed one was not (seed 215 of the simulation;
    /// `docs/simulation.md`). Folded alone, the deltas a fold takes are
    /// every one committed before it, and each count it writes is the
    /// number of calls in that state then.
    async fn fold_counts(&self) -> Result<(), StoreError> {
        // READ COMMITTED whatever the database's default: the statement's
        // snapshot must be taken after the lock, not at the first statement.
        let mut tx = self
            .pool
            .begin_with("BEGIN ISOLATION LEVEL READ COMMITTED")
            .await?;
        if let Some(fence) = self.fence() {
            lease::check(&mut tx, fence).await?;
        }
        // Keyed by the table's oid: one key per schema of the database.
        let alone: bool = sqlx::query_scalar(
            "SELECT pg_try_advisory_xact_lock($1, ('call_counts'::regclass)::oid::integer)",
        )
        .bind(FOLD_LOCK_CLASS)
        .fetch_one(&mut *tx)
        .await?;
        if !alone {
            tx.rollback().await?;
            return Ok(());
        }
        sqlx::query(
            "WITH moved AS (DELETE FROM call_count_deltas RETURNING state, n),
                  sums AS (SELECT state, SUM(n)::BIGINT AS n FROM moved GROUP BY state)
             UPDATE call_counts c SET n = c.n + sums.n FROM sums WHERE c.state = sums.state",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}

/// `options` with what every connection of the store sets for its session.
///
/// - The server notices within half a minute a peer that is gone without
///   closing its connection (a host lost with a transaction open holds the
///   identity's lease row until then).
/// - A process frozen (SIGSTOP, a stall) inside one of the store's own
///   transactions would hold the lock it took on the lease row (a write's
///   token check, a start's take, a release) for as long as it stands
///   still (its kernel still answers the keepalives), and no other process
///   could take the identity: the server ends such a session once it has
///   been idle in its transaction for [`IDLE_IN_TRANSACTION`] (the store's
///   transactions never wait on anything but the database; a handler's own
///   transaction is exempt, see `begin`).
fn session(options: PgConnectOptions) -> PgConnectOptions {
    let idle = IDLE_IN_TRANSACTION.as_millis().to_string();
    options.options([
        ("tcp_keepalives_idle", "10"),
        ("tcp_keepalives_interval", "5"),
        ("tcp_keepalives_count", "3"),
        ("idle_in_transaction_session_timeout", idle.as_str()),
        // This version's lease rows (the lease table's trigger refuses a
        // lease write of a session without it: an older version).
        ("toolrunner.lease_format", lease::FORMAT),
    ])
}

/// Runs `migrator` on the pool's schema, unless every one of its
/// migrations is applied there already, as it is: that look takes no lock.
/// sqlx's migrator locks the whole database (an advisory lock named after
/// it) even when nothing is left to apply, and a process frozen while it
/// held that lock would hold back every start and adoption of every
/// identity on the database.
///
/// # Errors
/// A migration failed, or an applied one differs from its file.
pub(super) async fn migrate(
    pool: &PgPool,
    migrator: &sqlx::migrate::Migrator,
) -> Result<(), StoreError> {
    // The table of the first schema on the search path (where the store's
    // tables are created), not one that a later schema holds.
    let table = &migrator.table_name;
    let applied: Result<Vec<(i64, Vec<u8>)>, sqlx::Error> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT version, checksum FROM {table}
             WHERE success AND tableoid = to_regclass(quote_ident(current_schema()) || '.{table}')
             ORDER BY version"
        )))
        .fetch_all(pool)
        .await;
    if let Ok(applied) = applied {
        let wanted = migrator
            .iter()
            .filter(|m| m.migration_type.is_up_migration())
            .map(|m| (m.version, &*m.checksum));
        if applied.iter().map(|(v, c)| (*v, c.as_slice())).eq(wanted) {
            return Ok(());
        }
    }
    migrator.run(pool).await?;
    Ok(())
}

/// Creates the schema `schema` if it is missing.
async fn create_schema(options: &PgConnectOptions, schema: &str) -> Result<(), StoreError> {
    check_schema_name(schema)?;
    let mut conn = PgConnection::connect_with(options).await?;
    // The name is checked above: nothing in it needs quoting.
    let create = format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"");
    let created = sqlx::query(sqlx::AssertSqlSafe(create))
        .execute(&mut conn)
        .await;
    match created {
        // Another connection created it at the same moment.
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("23505" | "42P06")) => {
        }
        other => {
            other?;
        }
    }
    conn.close().await?;
    Ok(())
}

/// `[a-z_][a-z0-9_]*`, at most 63 characters (PostgreSQL's limit).
fn check_schema_name(schema: &str) -> Result<(), StoreError> {
    let mut chars = schema.chars();
    let ok = schema.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        Ok(())
    } else {
        let why = format!(
            "schema name {schema:?} is not a plain name ([a-z_][a-z0-9_]*, at most 63 characters)"
        );
        Err(StoreError::Database(DatabaseError(why.into())))
    }
}

/// A deadlock or a serialization failure: the transaction was rolled back
/// whole, so it can be done again.
fn retryable(e: &StoreError) -> bool {
    let StoreError::Database(DatabaseError(e)) = e else {
        return false;
    };
    match e.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(d)) => matches!(d.code().as_deref(), Some("40P01" | "40001")),
        _ => false,
    }
}

#[async_trait::async_trait]
impl Store for PgStore {
    async fn commit(&self, changes: Vec<Change>) -> Result<(), StoreError> {
        if changes.is_empty() {
            return Ok(());
        }
        // Group commit: the writer puts this with every other commit that
        // arrives meanwhile into one transaction (`store/postgres/writer.rs`).
        let (reply, outcome) = tokio::sync::oneshot::channel();
        let job = writer::Job {
            changes: super::columns::storable_changes(&changes).into_owned(),
            fence: self.fence().cloned(),
            reply,
        };
        let writer = {
            let mut writer = self
                .writer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            match writer.as_ref() {
                Some(w) if !w.is_closed() => w.clone(),
                _ => writer
                    .insert(writer::spawn(self.pool.clone(), self.counts.clone()))
                    .clone(),
            }
        };
        writer.send(job).map_err(|_| StoreError::Closed)?;
        outcome.await.map_err(|_| StoreError::Closed)?.map(|_| ())
    }

    async fn begin(&self) -> Result<super::StoreTransaction, StoreError> {
        // On the handlers' own pool, with the store's connection options.
        let options = self.pool.connect_options();
        let tx = self.handlers.begin(&options, self.fence()).await?;
        Ok(super::StoreTransaction::new(
            super::transaction::Inner::Postgres(tx),
        ))
    }

    fn size_handler_transactions(&self, capacity: u32) {
        self.handlers.size_for(capacity);
    }

    async fn call(&self, run_id: &str, call_id: &str) -> Result<Option<LocalCall>, StoreError> {
        let row = sqlx::query("SELECT * FROM calls WHERE run_id = $1 AND call_id = $2")
            .bind(run_id)
            .bind(call_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(call_row).transpose()
    }

    async fn calls(&self, filter: &CallFilter) -> Result<Vec<LocalCall>, StoreError> {
        let mut sql = sqlx::QueryBuilder::<Postgres>::new("SELECT * FROM calls WHERE 1 = 1");
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
        let rows = sql.build().fetch_all(&self.pool).await?;
        rows.iter().map(call_row).collect()
    }

    async fn count_by_state(
        &self,
    ) -> Result<std::collections::BTreeMap<LocalState, u64>, StoreError> {
        // Kept by triggers (`call_counts` and its deltas): no scan of the calls.
        self.fold_counts().await?;
        let rows = sqlx::query(
            "SELECT c.state, c.n + COALESCE(d.n, 0)
             FROM call_counts c
             LEFT JOIN (SELECT state, SUM(n)::BIGINT AS n FROM call_count_deltas GROUP BY state) d
               ON d.state = c.state",
        )
        .fetch_all(&self.pool)
        .await?;
        let mut out = std::collections::BTreeMap::new();
        for row in &rows {
            let state: String = row.try_get(0)?;
            let n: i64 = row.try_get(1)?;
            if n > 0 {
                out.insert(parse_state(&state)?, u64::try_from(n).unwrap_or(0));
            }
        }
        Ok(out)
    }

    async fn receipts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<OutboxReceipt>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM receipts WHERE run_id = $1 AND call_id = $2 ORDER BY sequence, created_at",
        )
        .bind(run_id)
        .bind(call_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(receipt_row).collect()
    }

    async fn receipt(&self, receipt_id: &str) -> Result<Option<OutboxReceipt>, StoreError> {
        let row = sqlx::query("SELECT * FROM receipts WHERE receipt_id = $1")
            .bind(receipt_id)
            .fetch_optional(&self.pool)
            .await?;
        row.as_ref().map(receipt_row).transpose()
    }

    async fn receipts_with(&self, status: ReceiptStatus) -> Result<Vec<OutboxReceipt>, StoreError> {
        let rows =
            sqlx::query("SELECT * FROM receipts WHERE status = $1 ORDER BY created_at, sequence")
                .bind(status.as_str())
                .fetch_all(&self.pool)
                .await?;
        rows.iter().map(receipt_row).collect()
    }

    async fn prune(&self, settled_before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        // Counted in the transaction that deletes them.
        let n = self
            .apply_all(&[Change::Prune {
                settled_before,
                limit,
            }])
            .await?;
        self.fold_counts().await?;
        Ok(n)
    }

    async fn outbox_summary(&self) -> Result<OutboxSummary, StoreError> {
        // From the `receipts_pending` index: no bodies are read.
        let (pending, oldest): (i64, Option<String>) = sqlx::query_as(
            "SELECT COUNT(*), MIN(created_at) FROM receipts WHERE status = 'pending'",
        )
        .fetch_one(&self.pool)
        .await?;
        let calls: Vec<(String, String)> = sqlx::query_as(
            "SELECT DISTINCT run_id, call_id FROM receipts
             WHERE status = 'pending' AND kind <> 'accepted' ORDER BY run_id, call_id",
        )
        .fetch_all(&self.pool)
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
                    .fetch_optional(&self.pool)
                    .await?;
                if let Some(kind) = kind {
                    out.insert((run_id.clone(), call_id.clone()), super::parse_kind(kind)?);
                }
            }
            return Ok(out);
        }
        let rows: Vec<(String, String, String)> = sqlx::query_as(super::FINAL_KINDS)
            .fetch_all(&self.pool)
            .await?;
        let rows = rows
            .into_iter()
            .map(|(r, c, k)| Ok((r, c, super::parse_kind(k)?)))
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(super::outcomes_among(calls, rows))
    }

    async fn executor_ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(super::EXECUTOR_IDS)
            .fetch_all(&self.pool)
            .await?)
    }

    async fn attempts(&self, run_id: &str, call_id: &str) -> Result<Vec<Attempt>, StoreError> {
        let rows = sqlx::query(
            "SELECT run_id, call_id, operation_key, executor_id, assignment_id, created_at
             FROM attempts WHERE run_id = $1 AND call_id = $2 ORDER BY id",
        )
        .bind(run_id)
        .bind(call_id)
        .fetch_all(&self.pool)
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
            "SELECT at, what, detail FROM events WHERE run_id = $1 AND call_id = $2 ORDER BY id",
        )
        .bind(run_id)
        .bind(call_id)
        .fetch_all(&self.pool)
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
