//! Executor identities shared by replicas on one database: a lease row
//! per identity (this crate's `migrations/postgres-leases`) with a fencing
//! token and a time to live.
//!
//! - A process start takes its identity's lease before it connects to the
//!   platform ([`take`]): at once when nobody holds it, when it was
//!   released, or when a replica adopted it; after the lease of an earlier
//!   process of the identity lapsed (a crashed process renews nothing); and
//!   never from a process that keeps renewing (two live processes with one
//!   id: the start fails). Taking bumps the token.
//! - A lapse is judged by the taker's own monotonic clock: the row seen
//!   unchanged (the same token, the same count of renewals) for a whole
//!   time to live. `renewed_at`, stamped by the database server's wall
//!   clock, decides nothing: a step of that clock never makes a live holder
//!   look old.
//! - Every write of the identity's store first checks that the row still
//!   has the writer's token ([`check`], `FOR KEY SHARE`): a lock that the
//!   holder's renewal (an `UPDATE` of `renewed_at` and `renewals` only)
//!   does not wait for, and that every token bump (`SELECT … FOR UPDATE`)
//!   does, so a bump waits for the writes in flight and fences every later
//!   one.
//! - The holder renews the row ([`renew`]) on a connection of its own; a
//!   replica with a takeover grace adopts an identity of the same executor
//!   binding that it saw lapsed for longer than the grace ([`LapseWatch`],
//!   then [`lock_unchanged`] with `FOR UPDATE SKIP LOCKED`, so two replicas
//!   never adopt the same one, then [`adopt`]).
//! - A holder that drained with nothing left lets the identity go
//!   ([`release`]): the token is bumped and nobody adopts it.
//! - Every take, adoption and release writes the wait still owed before any
//!   `reconcile` hook may be asked (`hook_wait_ms`, see [`Owed`]), the
//!   maximum of what the row carried and what the new holder owes its
//!   predecessor, so that no sequence of holders shortens it; and the
//!   latest holders' instance ids (`holders`), which tell a takeover on
//!   this database from a twin on another.
use std::collections::HashMap;
use std::time::{Duration, Instant};

use sqlx::postgres::PgPool;
use sqlx::{PgConnection, Row};

use crate::store::StoreError;

/// The schema of the lease table.
pub(super) const SCHEMA: &str = "toolrunner_leases";

/// The lease rows' format this version writes (a session setting of every
/// store connection; the table's trigger refuses a lease write without it:
/// a process of an older version).
pub(super) const FORMAT: &str = "2";

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres-leases");

/// An identity as one writer holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Fence {
    pub(super) executor_id: String,
    /// The executor binding it serves (replicas of one binding adopt each
    /// other).
    pub(super) binding_id: String,
    pub(super) token: i64,
    /// How long the lease lasts after each renewal.
    pub(super) ttl: Duration,
}

/// Who takes an identity, and how.
#[derive(Debug, Clone)]
pub(super) struct Claimant<'a> {
    pub(super) executor_id: &'a str,
    /// The instance id of the taking process.
    pub(super) holder: &'a str,
    pub(super) binding_id: &'a str,
    /// The schema of the identity's store.
    pub(super) store_schema: &'a str,
    pub(super) ttl: Duration,
    /// The longest commit window of the taker's tools.
    pub(super) window: Duration,
}

/// What a holder owes the identity's earlier holders before any
/// `reconcile` hook may be asked: an earlier holder may still be making an
/// effect whose commit point (or handler start) it passed while its lease
/// was live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Owed {
    /// Not before this, whatever the tool: the wait the row carried, and
    /// the predecessor's own lease plus its longest commit window.
    until: Instant,
    /// When every commit point (or handler start) of the predecessor is a
    /// whole lease old: from the moment the taker saw its lease (the last
    /// renewal was sent before), two of its leases. A tool's own commit
    /// window adds to it. `None`: the predecessor released the identity
    /// (it had nothing in flight).
    lease_done: Option<Instant>,
}

impl Owed {
    /// What a row read at `read_at` owes: its carried `hook_wait_ms`, and,
    /// unless it was released, its holder's two leases from `seen` (when
    /// the taker first saw the holder's last renewal) plus the holder's
    /// longest commit window.
    fn of(row: &Seen, seen: Instant, read_at: Instant) -> Owed {
        let carried = read_at + ms(row.hook_wait_ms);
        if row.released {
            return Owed {
                until: carried,
                lease_done: None,
            };
        }
        let lease_done = seen + 2 * ms(row.ttl_ms);
        Owed {
            until: carried.max(add(lease_done, ms(row.commit_window_ms))),
            lease_done: Some(lease_done),
        }
    }

    /// Not before this may a `reconcile` hook be asked about a call of a
    /// tool with this commit window.
    pub(crate) fn hooks_after(&self, window: Duration) -> Instant {
        match self.lease_done {
            Some(done) => self.until.max(add(done, window)),
            None => self.until,
        }
    }

    /// The wait still owed at `now` for tools whose commit windows are at
    /// most `window`, in whole milliseconds (rounded up), as a row carries
    /// it.
    pub(crate) fn left_ms(&self, window: Duration, now: Instant) -> i64 {
        let left = self.hooks_after(window).saturating_duration_since(now);
        i64::try_from(left.as_millis() + u128::from(!left.subsec_nanos().is_multiple_of(1_000_000)))
            .unwrap_or(i64::MAX)
    }
}

/// `at + by`, or a year on when that does not fit.
fn add(at: Instant, by: Duration) -> Instant {
    at.checked_add(by)
        .unwrap_or_else(|| at + Duration::from_secs(365 * 24 * 3600))
}

fn ms(v: i64) -> Duration {
    Duration::from_millis(u64::try_from(v).unwrap_or(0))
}

/// An identity taken: its new token, and what it owes its predecessor.
#[derive(Debug, Clone, Copy)]
pub(super) struct Taken {
    pub(super) token: i64,
    /// When the taking statement was sent (the lease runs from a moment
    /// after it).
    pub(super) at: Instant,
    /// `None`: nobody held it, and the row owed nothing.
    pub(super) owed: Option<Owed>,
}

/// Migrates the lease table (in [`SCHEMA`], created if missing) on a pool
/// whose `search_path` is that schema. A table that processes of an older
/// version still renew is not migrated: they could not keep what this
/// version's rows owe.
///
/// # Errors
/// [`StoreError::Refused`] when a process of an older version holds a
/// live lease on the database; a migration failed.
pub(super) async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    session_carries_the_format(pool).await?;
    refuse_older_holders(pool).await?;
    super::migrate(pool, &MIGRATOR).await
}

/// The sessions of this store carry this version's lease format (a
/// startup option): a connection pooler that drops startup options would
/// make every lease write of this version look like an older version's.
async fn session_carries_the_format(pool: &PgPool) -> Result<(), StoreError> {
    let format: Option<String> =
        sqlx::query_scalar("SELECT current_setting('toolrunner.lease_format', true)")
            .fetch_one(pool)
            .await?;
    if format.as_deref() == Some(FORMAT) {
        return Ok(());
    }
    Err(StoreError::Refused(
        "the database session lacks the setting toolrunner.lease_format, which toolrunner passes when it connects (the startup option `-c toolrunner.lease_format=2`): something between this process and PostgreSQL drops startup options (a connection pooler: PgBouncer with `ignore_startup_parameters = options` drops them); connect to PostgreSQL directly, or through a pooler that passes `options` on".into(),
    ))
}

/// Before the lease table is brought to this version's format: no live
/// lease of an older version's process on it (renewed within its time to
/// live by the database's clock: a rough look, since such a process can
/// renew nothing once the table is migrated).
async fn refuse_older_holders(pool: &PgPool) -> Result<(), StoreError> {
    let formatted: Option<bool> = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                         WHERE table_schema = 'toolrunner_leases' AND table_name = 'executor_leases'
                           AND column_name = 'format')
           FROM information_schema.tables
          WHERE table_schema = 'toolrunner_leases' AND table_name = 'executor_leases'",
    )
    .fetch_optional(pool)
    .await?;
    // No table yet, or one of this version's format.
    if formatted != Some(false) {
        return Ok(());
    }
    let live: Vec<(String, String)> = sqlx::query_as(
        "SELECT executor_id, holder FROM toolrunner_leases.executor_leases
          WHERE NOT released
            AND renewed_at > clock_timestamp() - make_interval(secs => ttl_ms::double precision / 1000)
          ORDER BY executor_id LIMIT 5",
    )
    .fetch_all(pool)
    .await?;
    if live.is_empty() {
        return Ok(());
    }
    let held: Vec<String> = live
        .iter()
        .map(|(id, holder)| format!("executor {id} (instance {holder})"))
        .collect();
    Err(StoreError::Refused(format!(
        "processes of an older toolrunner version hold leases on this database ({}): stop every process of the older version, then start this one (docs/operations.md, \"Upgrading\"); the two versions cannot share the lease table",
        held.join(", ")
    )))
}

fn fenced(executor_id: &str) -> StoreError {
    StoreError::Fenced(format!(
        "executor {executor_id} lost its lease (its fencing token moved on: another process of the identity, or a replica that adopted it, holds it now): this process must stop and write nothing more"
    ))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A lease row as a taker looks at it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Seen {
    token: i64,
    holder: String,
    adopted_by: Option<String>,
    released: bool,
    ttl_ms: i64,
    renewals: i64,
    hook_wait_ms: i64,
    commit_window_ms: i64,
}

impl Seen {
    /// Whether a start may take the identity now, without watching it
    /// lapse: released, or held by a replica that adopted it.
    fn free(&self) -> bool {
        self.released || self.adopted_by.is_some()
    }

    /// Whether `now` is the same lease as `self`: nobody took it and its
    /// holder did not renew it.
    fn unchanged(&self, now: &Seen) -> bool {
        self.token == now.token && self.renewals == now.renewals
    }

    fn ttl(&self) -> Duration {
        ms(self.ttl_ms)
    }
}

/// The lease row as a taker looks at it (a macro, so that the locking
/// read appends `FOR UPDATE` to a literal).
macro_rules! seen_sql {
    () => {
        "SELECT token, holder, adopted_by, released, ttl_ms, renewals, hook_wait_ms, commit_window_ms
     FROM toolrunner_leases.executor_leases WHERE executor_id = $1"
    };
}

fn seen(row: &sqlx::postgres::PgRow) -> Result<Seen, StoreError> {
    Ok(Seen {
        token: row.try_get("token")?,
        holder: row.try_get("holder")?,
        adopted_by: row.try_get("adopted_by")?,
        released: row.try_get("released")?,
        ttl_ms: row.try_get("ttl_ms")?,
        renewals: row.try_get("renewals")?,
        hook_wait_ms: row.try_get("hook_wait_ms")?,
        commit_window_ms: row.try_get("commit_window_ms")?,
    })
}

/// Takes the identity's lease for `me`: at once when nobody holds it (no
/// row, released, or held by a replica that adopted it), or once this
/// process watched the lease of the process holding it stay unchanged for
/// its whole time to live (by this process's monotonic clock). A holder
/// that renews meanwhile is a live process with the same executor id: the
/// start fails and the holder serves on.
///
/// # Errors
/// [`StoreError::InUse`] when another live process holds the identity;
/// the database failed.
pub(super) async fn take(pool: &PgPool, me: &Claimant<'_>) -> Result<Taken, StoreError> {
    // The row as first seen while another process held it, and when.
    let mut first: Option<(Seen, Instant)> = None;
    loop {
        let row = sqlx::query(seen_sql!())
            .bind(me.executor_id)
            .fetch_optional(pool)
            .await?;
        let read_at = Instant::now();
        let now = row.as_ref().map(seen).transpose()?;
        if let Some(held) = now.as_ref().filter(|s| !s.free()) {
            // It renewed (or another start took it) while this one
            // waited: a live process holds the identity.
            if first.as_ref().is_some_and(|(f, _)| !f.unchanged(held)) {
                return Err(in_use(me.executor_id, &held.holder));
            }
            let (f, since) = first.get_or_insert_with(|| (held.clone(), read_at));
            let left = (*since + f.ttl()).saturating_duration_since(Instant::now());
            if !left.is_zero() {
                tracing::info!(executor_id = me.executor_id, holder = %held.holder, wait_ms = left.as_millis() as u64, "another process held this executor identity until lately: waiting for its lease to lapse");
                tokio::time::sleep(left.min(Duration::from_millis(250))).await;
                continue;
            }
        }
        if let Some(taken) = take_locked(pool, me, first.as_ref()).await? {
            return Ok(taken);
        }
    }
}

/// The locked half of [`take`]: `None` when the row changed since it was
/// seen (or is locked by a transaction of its holder) and must be looked
/// at again.
async fn take_locked(
    pool: &PgPool,
    me: &Claimant<'_>,
    first: Option<&(Seen, Instant)>,
) -> Result<Option<Taken>, StoreError> {
    let mut tx = pool.begin().await?;
    // Waits for the writes in flight of whoever holds it (their `FOR KEY
    // SHARE`), and holds off new ones until the token is bumped; but not
    // silently for ever (a process frozen inside a transaction holds it).
    sqlx::query("SET LOCAL lock_timeout = '2s'")
        .execute(&mut *tx)
        .await?;
    let row = match sqlx::query(concat!(seen_sql!(), " FOR UPDATE"))
        .bind(me.executor_id)
        .fetch_optional(&mut *tx)
        .await
    {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => {
            tracing::warn!(
                executor_id = me.executor_id,
                "a transaction of the identity's previous holder is still open (its process frozen, or its host gone without closing the connection, which the server notices within half a minute): waiting for it to end"
            );
            return Ok(None);
        }
        row => row?,
    };
    let read_at = Instant::now();
    let now = row.as_ref().map(seen).transpose()?;
    let owed = match &now {
        None => None,
        // Released or adopted: owed from this read on.
        Some(s) if s.free() => Some(Owed::of(s, read_at, read_at)),
        // Held: only the very lease this start watched lapse.
        Some(s) => match first {
            Some((f, since)) if f.unchanged(s) && since.elapsed() >= f.ttl() => {
                Some(Owed::of(s, *since, *since))
            }
            _ => return Ok(None),
        },
    };
    let at = Instant::now();
    let owed_ms = owed.map_or(0, |o| o.left_ms(me.window, at));
    // A new identity: inserted, unless another start inserted it first (it
    // then holds it, and this one looks again).
    let query = if now.is_none() {
        sqlx::query_scalar(
            "INSERT INTO toolrunner_leases.executor_leases
               (executor_id, token, holder, renewed_at, binding_id, store_schema, ttl_ms, adopted_by,
                released, hook_wait_ms, commit_window_ms, renewals, holders)
             VALUES ($1, 1, $2, clock_timestamp(), $3, $4, $5, NULL, FALSE, $6, $7, 0, ARRAY[$2])
             ON CONFLICT (executor_id) DO NOTHING
             RETURNING token",
        )
    } else {
        sqlx::query_scalar(
            "UPDATE toolrunner_leases.executor_leases SET token = token + 1, holder = $2,
               renewed_at = clock_timestamp(), binding_id = $3, store_schema = $4, ttl_ms = $5,
               adopted_by = NULL, released = FALSE, hook_wait_ms = $6, commit_window_ms = $7,
               renewals = 0, holders = (ARRAY[$2] || holders)[1:16]
             WHERE executor_id = $1
             RETURNING token",
        )
    };
    let token: Option<i64> = query
        .bind(me.executor_id)
        .bind(me.holder)
        .bind(me.binding_id)
        .bind(me.store_schema)
        .bind(millis(me.ttl))
        .bind(owed_ms)
        .bind(millis(me.window))
        .fetch_optional(&mut *tx)
        .await?;
    let Some(token) = token else {
        return Ok(None);
    };
    tx.commit().await?;
    if let Some(s) = &now {
        tracing::info!(executor_id = me.executor_id, previous_holder = %s.holder, adopted_by = ?s.adopted_by, released = s.released, hook_wait_ms = owed_ms, "took the executor identity's lease");
    }
    Ok(Some(Taken {
        token,
        at,
        owed: owed.filter(|_| owed_ms > 0 || now.as_ref().is_some_and(|s| !s.released)),
    }))
}

fn in_use(executor_id: &str, holder: &str) -> StoreError {
    StoreError::InUse(format!(
        "executor {executor_id} is held by another live process (instance {holder}), which keeps renewing its lease: two processes were started with one executor id; give every replica its own executor id (the running one serves on)"
    ))
}

/// Renews the lease `fence` holds (on the lease's own connection: a
/// renewal never waits for the store's pool, nor for the identity's own
/// writes). Each renewal counts: a taker watching the row sees it move.
///
/// # Errors
/// [`StoreError::Fenced`] when the identity's token moved on; the
/// database failed.
pub(super) async fn renew(conn: &mut PgConnection, fence: &Fence) -> Result<(), StoreError> {
    let renewed = sqlx::query(
        "UPDATE toolrunner_leases.executor_leases
            SET renewed_at = clock_timestamp(), renewals = renewals + 1
         WHERE executor_id = $1 AND token = $2 AND NOT released",
    )
    .bind(&fence.executor_id)
    .bind(fence.token)
    .execute(conn)
    .await?
    .rows_affected();
    if renewed == 0 {
        return Err(fenced(&fence.executor_id));
    }
    Ok(())
}

/// In a write transaction, before its first write: the identity still has
/// the writer's token. The row lock (`FOR KEY SHARE`) lasts until the
/// transaction ends: a token bump waits for this write and fences the
/// next, while the holder's renewals pass it.
///
/// # Errors
/// [`StoreError::Fenced`] when the token moved on.
pub(super) async fn check(conn: &mut PgConnection, fence: &Fence) -> Result<(), StoreError> {
    let token: Option<i64> = sqlx::query_scalar(
        "SELECT token FROM toolrunner_leases.executor_leases WHERE executor_id = $1 FOR KEY SHARE",
    )
    .bind(&fence.executor_id)
    .fetch_optional(conn)
    .await?;
    if token != Some(fence.token) {
        return Err(fenced(&fence.executor_id));
    }
    Ok(())
}

/// The instance ids recorded as holders of `executor_id`'s lease on this
/// database: the current holder, and the latest ones before it (newest
/// first).
///
/// # Errors
/// The database failed.
pub(super) async fn holders(
    conn: &mut PgConnection,
    executor_id: &str,
) -> Result<Vec<String>, StoreError> {
    let row: Option<(String, Vec<String>)> = sqlx::query_as(
        "SELECT holder, holders FROM toolrunner_leases.executor_leases WHERE executor_id = $1",
    )
    .bind(executor_id)
    .fetch_optional(conn)
    .await?;
    Ok(row
        .map(|(holder, mut holders)| {
            holders.insert(0, holder);
            holders.retain(|h| !h.is_empty());
            holders
        })
        .unwrap_or_default())
}

/// An identity a replica may adopt: a lease of its binding, as seen.
#[derive(Debug, Clone)]
pub(super) struct Candidate {
    pub(super) executor_id: String,
    /// Its store's schema (empty: the identity's own).
    pub(super) store_schema: String,
    row: Seen,
}

/// The leases a replica watches for adoption, each with the moment this
/// replica first saw it as it is now (its monotonic clock): one unchanged
/// for longer than its time to live plus the grace has lapsed.
#[derive(Debug, Default)]
pub(crate) struct LapseWatch {
    seen: HashMap<String, (Seen, Instant)>,
}

impl LapseWatch {
    /// Notes the leases read at `now`, forgets those no longer listed, and
    /// returns the ones unchanged for longer than their time to live plus
    /// `grace`, the longest-lapsed first.
    fn lapsed(&mut self, listed: Vec<Candidate>, now: Instant, grace: Duration) -> Vec<Candidate> {
        self.seen
            .retain(|id, _| listed.iter().any(|c| &c.executor_id == id));
        let mut due: Vec<(Instant, Candidate)> = Vec::new();
        for c in listed {
            let entry = self
                .seen
                .entry(c.executor_id.clone())
                .or_insert_with(|| (c.row.clone(), now));
            if !entry.0.unchanged(&c.row) {
                *entry = (c.row.clone(), now);
            }
            let since = entry.1;
            if now.saturating_duration_since(since) > c.row.ttl() + grace {
                due.push((since, c));
            }
        }
        due.sort_by_key(|(since, _)| *since);
        due.into_iter().map(|(_, c)| c).collect()
    }

    /// What adopting `c` owes its holder (from when this replica first saw
    /// its lease as it is).
    fn owed(&self, c: &Candidate) -> Option<Owed> {
        self.seen
            .get(&c.executor_id)
            .map(|(_, since)| Owed::of(&c.row, *since, *since))
    }
}

/// For the replica `me` serving `binding_id`: the identities of the same
/// binding, not released and not in `skip`, that `watch` saw unchanged for
/// longer than their time to live plus `grace`, the longest-lapsed first.
///
/// # Errors
/// The database failed.
pub(super) async fn lapsed(
    pool: &PgPool,
    me: &str,
    binding_id: &str,
    grace: Duration,
    skip: &[String],
    watch: &mut LapseWatch,
) -> Result<Vec<(Candidate, Owed)>, StoreError> {
    let rows = sqlx::query(
        "SELECT executor_id, store_schema, token, holder, adopted_by, released, ttl_ms, renewals,
                hook_wait_ms, commit_window_ms
         FROM toolrunner_leases.executor_leases
         WHERE binding_id = $2 AND binding_id <> '' AND executor_id <> $1 AND NOT released
           AND NOT (executor_id = ANY($3))",
    )
    .bind(me)
    .bind(binding_id)
    .bind(skip)
    .fetch_all(pool)
    .await?;
    let now = Instant::now();
    let listed = rows
        .iter()
        .map(|row| {
            Ok(Candidate {
                executor_id: row.try_get("executor_id")?,
                store_schema: row.try_get("store_schema")?,
                row: seen(row)?,
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    let due = watch.lapsed(listed, now, grace);
    Ok(due
        .into_iter()
        .filter_map(|c| watch.owed(&c).map(|o| (c, o)))
        .collect())
}

/// Locks `c`'s lease row if it is still as seen (nobody renewed, took or
/// released it) and no transaction of its holder holds it (`FOR UPDATE
/// SKIP LOCKED`: a replica adopting it at the same moment skips it, and so
/// does this one while a write of its holder is open). `false`: leave it.
///
/// # Errors
/// The database failed.
pub(super) async fn lock_unchanged(
    tx: &mut PgConnection,
    c: &Candidate,
) -> Result<bool, StoreError> {
    let row = sqlx::query(concat!(
        seen_sql!(),
        " AND token = $2 AND renewals = $3 AND NOT released FOR UPDATE SKIP LOCKED"
    ))
    .bind(&c.executor_id)
    .bind(c.row.token)
    .bind(c.row.renewals)
    .fetch_optional(tx)
    .await?;
    Ok(row.is_some())
}

/// What an adoption writes besides the bump.
#[derive(Debug, Clone, Copy)]
pub(super) struct Adoption<'a> {
    /// The binding the adopter serves.
    pub(super) binding_id: &'a str,
    /// The adopter's own executor id.
    pub(super) by: &'a str,
    /// The adopting process's instance id (its executor of the identity
    /// connects with a suffix).
    pub(super) holder: &'a str,
    pub(super) ttl: Duration,
    /// The longest commit window of the adopter's tools.
    pub(super) window: Duration,
}

/// In `tx`, after [`lock_unchanged`] locked it: adopts `executor_id`,
/// bumping its token, with `owed` written on; the lease starts now
/// (`clock_timestamp()`, not the transaction's start: opening the adopted
/// store may have taken a while).
///
/// # Errors
/// The database failed.
pub(super) async fn adopt(
    tx: &mut PgConnection,
    executor_id: &str,
    how: &Adoption<'_>,
    owed: &Owed,
) -> Result<Fence, StoreError> {
    let token: i64 = sqlx::query_scalar(
        "UPDATE toolrunner_leases.executor_leases SET token = token + 1, holder = $2, adopted_by = $3,
           renewed_at = clock_timestamp(), ttl_ms = $4, hook_wait_ms = $5, commit_window_ms = $6,
           renewals = 0, holders = (ARRAY[$2] || holders)[1:16]
         WHERE executor_id = $1 RETURNING token",
    )
    .bind(executor_id)
    .bind(how.holder)
    .bind(how.by)
    .bind(millis(how.ttl))
    .bind(owed.left_ms(how.window, Instant::now()))
    .bind(millis(how.window))
    .fetch_one(tx)
    .await?;
    Ok(Fence {
        executor_id: executor_id.to_owned(),
        binding_id: how.binding_id.to_owned(),
        token,
        ttl: how.ttl,
    })
}

/// Lets the identity go after a clean drain: the token is bumped (nothing
/// more is written under the old one) and the row marked released, so a
/// start takes it at once and no replica adopts it; `owed_ms` (what the
/// holder still owed its predecessors) is carried on. Waits for the writes
/// in flight. `false` when the token had moved on already.
///
/// # Errors
/// The database failed.
pub(super) async fn release(
    conn: &mut PgConnection,
    fence: &Fence,
    owed: impl Fn() -> i64,
) -> Result<bool, StoreError> {
    let mut tx = sqlx::Connection::begin(conn).await?;
    let token: Option<i64> = sqlx::query_scalar(
        "SELECT token FROM toolrunner_leases.executor_leases WHERE executor_id = $1 FOR UPDATE",
    )
    .bind(&fence.executor_id)
    .fetch_optional(&mut *tx)
    .await?;
    if token != Some(fence.token) {
        return Ok(false);
    }
    sqlx::query(
        "UPDATE toolrunner_leases.executor_leases SET token = token + 1, holder = '', adopted_by = NULL,
           released = TRUE, renewed_at = clock_timestamp(), hook_wait_ms = $2
         WHERE executor_id = $1",
    )
    .bind(&fence.executor_id)
    .bind(owed())
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(ttl_ms: i64, hook_wait_ms: i64, window_ms: i64, released: bool) -> Seen {
        Seen {
            token: 1,
            holder: if released {
                String::new()
            } else {
                "ins".into()
            },
            adopted_by: None,
            released,
            ttl_ms,
            renewals: 0,
            hook_wait_ms,
            commit_window_ms: window_ms,
        }
    }

    #[test]
    fn a_released_row_owes_what_it_carries_from_the_read() {
        let t = Instant::now();
        let owed = Owed::of(&row(500, 9_000, 4_000, true), t, t);
        assert_eq!(owed.hooks_after(Duration::from_secs(30)), t + ms(9_000));
        assert_eq!(owed.left_ms(Duration::ZERO, t), 9_000);
    }

    #[test]
    fn a_lapsed_row_owes_two_of_its_leases_and_the_longest_window() {
        let t = Instant::now();
        let owed = Owed::of(&row(10_000, 0, 4_000, false), t, t);
        // Its own window (4 s) or the tool's, whichever is longer.
        assert_eq!(owed.hooks_after(Duration::from_secs(1)), t + ms(24_000));
        assert_eq!(owed.hooks_after(Duration::from_secs(30)), t + ms(50_000));
        // A carried wait longer than that wins.
        let owed = Owed::of(&row(500, 60_000, 4_000, false), t, t);
        assert_eq!(owed.hooks_after(Duration::from_secs(1)), t + ms(60_000));
        assert_eq!(owed.left_ms(Duration::from_secs(1), t + ms(10_000)), 50_000);
    }

    #[test]
    fn a_lease_lapses_only_once_watched_unchanged_for_its_ttl_and_the_grace() {
        let t = Instant::now();
        let c = |renewals| Candidate {
            executor_id: "a".into(),
            store_schema: String::new(),
            row: Seen {
                renewals,
                ..row(500, 0, 0, false)
            },
        };
        let grace = Duration::from_millis(300);
        let mut watch = LapseWatch::default();
        assert!(watch.lapsed(vec![c(1)], t, grace).is_empty());
        assert!(watch.lapsed(vec![c(1)], t + ms(700), grace).is_empty());
        // Renewed: watched again from now.
        assert!(watch.lapsed(vec![c(2)], t + ms(900), grace).is_empty());
        assert!(watch.lapsed(vec![c(2)], t + ms(1_500), grace).is_empty());
        assert_eq!(watch.lapsed(vec![c(2)], t + ms(1_701), grace).len(), 1);
        assert_eq!(
            watch.owed(&c(2)).map(|o| o.hooks_after(Duration::ZERO)),
            Some(t + ms(900 + 1_000))
        );
    }
}
