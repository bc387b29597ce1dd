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
//! - Every write of the identity's store first checks that the row still
//!   has the writer's token ([`check`], `FOR KEY SHARE`): a lock that the
//!   holder's renewal (an `UPDATE` of `renewed_at` only) does not wait
//!   for, and that every token bump (`SELECT … FOR UPDATE`) does, so a bump
//!   waits for the writes in flight and fences every later one.
//! - The holder renews the row ([`renew`], stamped with
//!   `clock_timestamp()`) on a connection of its own; a replica with a
//!   takeover grace adopts an identity of the same executor binding whose
//!   lease lapsed longer ago than the grace ([`lapsed`], `SELECT … FOR
//!   UPDATE SKIP LOCKED`, so two replicas never adopt the same one, then
//!   [`adopt`]).
//! - A holder that drained with nothing left lets the identity go
//!   ([`release`]): the token is bumped and nobody adopts it.
use std::time::{Duration, Instant};

use sqlx::postgres::PgPool;
use sqlx::{PgConnection, Row};

use crate::store::StoreError;

/// The schema of the lease table.
pub(super) const SCHEMA: &str = "toolrunner_leases";

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
}

/// An identity taken: its new token, and from when on every commit point
/// (or handler start) of whoever held it before is a whole lease old (its
/// last renewal plus two leases: an adopter fenced by this take may still
/// finish what it started before then). `None`: nobody held it (a new
/// identity, or one released clean).
#[derive(Debug, Clone, Copy)]
pub(super) struct Taken {
    pub(super) token: i64,
    /// When the taking statement was sent (the lease runs from a moment
    /// after it).
    pub(super) at: Instant,
    pub(super) predecessor_done: Option<Instant>,
}

/// Migrates the lease table (in [`SCHEMA`], created if missing) on a pool
/// whose `search_path` is that schema.
pub(super) async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    super::migrate(pool, &MIGRATOR).await
}

fn fenced(executor_id: &str) -> StoreError {
    StoreError::Fenced(format!(
        "executor {executor_id} lost its lease (its fencing token moved on: another process of the identity, or a replica that adopted it, holds it now): this process must stop and write nothing more"
    ))
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A lease row as a start looks at it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    token: i64,
    holder: String,
    adopted_by: Option<String>,
    released: bool,
    ttl_ms: i64,
    /// `renewed_at` in microseconds (to see whether it moved).
    renewed_us: i64,
    /// How long ago it was renewed, by the database's clock.
    age_ms: i64,
}

impl Seen {
    fn lapsed(&self) -> bool {
        self.age_ms > self.ttl_ms
    }

    /// Whether a start may take the identity now.
    fn free(&self) -> bool {
        self.released || self.adopted_by.is_some() || self.lapsed()
    }

    /// From when on every commit point of the holder is a whole lease old
    /// (its last renewal plus two leases), from `now`, the moment this row
    /// was read.
    fn done_at(&self, now: Instant) -> Instant {
        done_at(now, self.age_ms, self.ttl_ms)
    }
}

/// `now` minus `age_ms` plus two leases of `ttl_ms`.
fn done_at(now: Instant, age_ms: i64, ttl_ms: i64) -> Instant {
    let ahead = 2 * ttl_ms - age_ms;
    let by = Duration::from_millis(ahead.unsigned_abs());
    if ahead >= 0 {
        now + by
    } else {
        now.checked_sub(by).unwrap_or(now)
    }
}

/// The lease row as a start looks at it (a macro, so that the locking
/// read appends `FOR UPDATE` to a literal).
macro_rules! seen_sql {
    () => {
        "SELECT token, holder, adopted_by, released, ttl_ms,
        (EXTRACT(EPOCH FROM renewed_at) * 1000000)::BIGINT AS renewed_us,
        (EXTRACT(EPOCH FROM clock_timestamp() - renewed_at) * 1000)::BIGINT AS age_ms
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
        renewed_us: row.try_get("renewed_us")?,
        age_ms: row.try_get("age_ms")?,
    })
}

/// Takes the identity's lease for `me`: at once when nobody holds it (no
/// row, released, or held by a replica that adopted it), or once the
/// lease of the process holding it lapsed. A holder that renews meanwhile
/// is a live process with the same executor id: the start fails and the
/// holder serves on.
///
/// # Errors
/// [`StoreError::InUse`] when another live process holds the identity;
/// the database failed.
pub(super) async fn take(pool: &PgPool, me: &Claimant<'_>) -> Result<Taken, StoreError> {
    // The row as first seen while another process held it.
    let mut first: Option<Seen> = None;
    loop {
        let row = sqlx::query(seen_sql!())
            .bind(me.executor_id)
            .fetch_optional(pool)
            .await?;
        let now = row.as_ref().map(seen).transpose()?;
        if let Some(held) = now.as_ref().filter(|s| !s.free()) {
            match &first {
                None => first = Some(held.clone()),
                // It renewed (or another start took it) while this one
                // waited: a live process holds the identity.
                Some(f) if f.renewed_us != held.renewed_us || f.token != held.token => {
                    return Err(in_use(me.executor_id, &held.holder));
                }
                Some(_) => {}
            }
            let left = Duration::from_millis(
                u64::try_from((held.ttl_ms - held.age_ms).max(1)).unwrap_or(1),
            );
            tracing::info!(executor_id = me.executor_id, holder = %held.holder, wait_ms = left.as_millis() as u64, "another process held this executor identity until lately: waiting for its lease to lapse");
            tokio::time::sleep(left.min(Duration::from_millis(250))).await;
            continue;
        }
        if let Some(taken) = take_locked(pool, me, first.as_ref()).await? {
            return Ok(taken);
        }
    }
}

/// The locked half of [`take`]: `None` when the row changed since it was
/// seen and must be looked at again.
async fn take_locked(
    pool: &PgPool,
    me: &Claimant<'_>,
    first: Option<&Seen>,
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
    let predecessor = match &now {
        None => None,
        Some(s) if s.released => None,
        Some(s) if s.free() => Some(s.done_at(read_at)),
        Some(s) => {
            if first.is_some_and(|f| f.renewed_us != s.renewed_us || f.token != s.token) {
                return Err(in_use(me.executor_id, &s.holder));
            }
            return Ok(None);
        }
    };
    let at = Instant::now();
    // A new identity: inserted, unless another start inserted it first (it
    // then holds it, and this one looks again).
    let query = if now.is_none() {
        sqlx::query_scalar(
            "INSERT INTO toolrunner_leases.executor_leases
               (executor_id, token, holder, renewed_at, binding_id, store_schema, ttl_ms, adopted_by, released)
             VALUES ($1, 1, $2, clock_timestamp(), $3, $4, $5, NULL, FALSE)
             ON CONFLICT (executor_id) DO NOTHING
             RETURNING token",
        )
    } else {
        sqlx::query_scalar(
            "UPDATE toolrunner_leases.executor_leases SET token = token + 1, holder = $2,
               renewed_at = clock_timestamp(), binding_id = $3, store_schema = $4, ttl_ms = $5,
               adopted_by = NULL, released = FALSE
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
        .fetch_optional(&mut *tx)
        .await?;
    let Some(token) = token else {
        return Ok(None);
    };
    tx.commit().await?;
    if let Some(s) = &now {
        tracing::info!(executor_id = me.executor_id, previous_holder = %s.holder, adopted_by = ?s.adopted_by, released = s.released, "took the executor identity's lease");
    }
    Ok(Some(Taken {
        token,
        at,
        predecessor_done: predecessor,
    }))
}

fn in_use(executor_id: &str, holder: &str) -> StoreError {
    StoreError::InUse(format!(
        "executor {executor_id} is held by another live process (instance {holder}), which keeps renewing its lease: two processes were started with one executor id; give every replica its own executor id (the running one serves on)"
    ))
}

/// Renews the lease `fence` holds (on the lease's own connection: a
/// renewal never waits for the store's pool, nor for the identity's own
/// writes).
///
/// # Errors
/// [`StoreError::Fenced`] when the identity's token moved on; the
/// database failed.
pub(super) async fn renew(conn: &mut PgConnection, fence: &Fence) -> Result<(), StoreError> {
    let renewed = sqlx::query(
        "UPDATE toolrunner_leases.executor_leases SET renewed_at = clock_timestamp()
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

/// The lapsed identities of a binding (see [`lapsed`]); `$5` is unused
/// unless the query names it.
macro_rules! lapsed_sql {
    () => {
        "SELECT executor_id, store_schema, ttl_ms,
            (EXTRACT(EPOCH FROM clock_timestamp() - renewed_at) * 1000)::BIGINT AS age_ms
         FROM toolrunner_leases.executor_leases
         WHERE binding_id = $3 AND binding_id <> '' AND executor_id <> $1 AND NOT released
           AND NOT (executor_id = ANY($4)) AND $5::TEXT IS NOT NULL
           AND renewed_at < clock_timestamp() - make_interval(secs => (ttl_ms + $2)::double precision / 1000)"
    };
}

/// A lapsed identity, found for adoption.
#[derive(Debug, Clone)]
pub(super) struct Lapsed {
    pub(super) executor_id: String,
    /// Its store's schema (empty: the identity's own).
    pub(super) store_schema: String,
    /// From when on every commit point of its holder is a whole lease old.
    pub(super) done: Instant,
}

/// For the replica `me` serving `binding_id`: one identity of the same
/// binding, not released and not in `skip`, whose lease lapsed more than
/// `grace` ago (its last renewal is older than its TTL plus the grace).
/// With `only`, that identity alone. Either way the row is locked (`FOR
/// UPDATE SKIP LOCKED`: a replica adopting it at the same moment skips it,
/// and so does this one while a transaction of its holder is open, so one
/// identity held by a frozen transaction never stands in front of the
/// others); with `only`, the adoption's bump follows in the same
/// transaction.
///
/// # Errors
/// The database failed.
pub(super) async fn lapsed<'c, E: sqlx::PgExecutor<'c>>(
    db: E,
    me: &str,
    binding_id: &str,
    grace: Duration,
    skip: &[String],
    only: Option<&str>,
) -> Result<Option<Lapsed>, StoreError> {
    let query = if only.is_some() {
        concat!(
            lapsed_sql!(),
            " AND executor_id = $5 LIMIT 1 FOR UPDATE SKIP LOCKED"
        )
    } else {
        concat!(
            lapsed_sql!(),
            " ORDER BY renewed_at LIMIT 1 FOR UPDATE SKIP LOCKED"
        )
    };
    let row = sqlx::query(query)
        .bind(me)
        .bind(millis(grace))
        .bind(binding_id)
        .bind(skip)
        .bind(only.unwrap_or(""))
        .fetch_optional(db)
        .await?;
    let read_at = Instant::now();
    let Some(row) = row else {
        return Ok(None);
    };
    Ok(Some(Lapsed {
        executor_id: row.try_get("executor_id")?,
        store_schema: row.try_get("store_schema")?,
        done: done_at(read_at, row.try_get("age_ms")?, row.try_get("ttl_ms")?),
    }))
}

/// In `tx`, after [`lapsed`] locked it: adopts `executor_id` for the
/// replica `me` (process `holder`), bumping its token; the lease starts
/// now (`clock_timestamp()`, not the transaction's start: opening the
/// adopted store may have taken a while).
///
/// # Errors
/// The database failed.
pub(super) async fn adopt(
    tx: &mut PgConnection,
    executor_id: &str,
    binding_id: &str,
    me: &str,
    holder: &str,
    ttl: Duration,
) -> Result<Fence, StoreError> {
    let token: i64 = sqlx::query_scalar(
        "UPDATE toolrunner_leases.executor_leases SET token = token + 1, holder = $2, adopted_by = $3,
           renewed_at = clock_timestamp(), ttl_ms = $4
         WHERE executor_id = $1 RETURNING token",
    )
    .bind(executor_id)
    .bind(holder)
    .bind(me)
    .bind(millis(ttl))
    .fetch_one(tx)
    .await?;
    Ok(Fence {
        executor_id: executor_id.to_owned(),
        binding_id: binding_id.to_owned(),
        token,
        ttl,
    })
}

/// Lets the identity go after a clean drain: the token is bumped (nothing
/// more is written under the old one) and the row marked released, so a
/// start takes it at once and no replica adopts it. Waits for the writes
/// in flight. `false` when the token had moved on already.
///
/// # Errors
/// The database failed.
pub(super) async fn release(conn: &mut PgConnection, fence: &Fence) -> Result<bool, StoreError> {
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
           released = TRUE, renewed_at = clock_timestamp()
         WHERE executor_id = $1",
    )
    .bind(&fence.executor_id)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}
