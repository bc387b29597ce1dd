//! Executor identities shared by replicas on one database: a lease row
//! per identity with a fencing token (`migrations/postgres-leases`).
//!
//! - A process takes its identity's lease before it connects to the
//!   platform ([`take`]): the token is bumped (fencing out any earlier
//!   process of the identity), unless a replica adopted the identity, in
//!   which case the process refuses to start and writes nothing.
//! - Every write of the identity's store first checks, under a shared row
//!   lock, that the row still has the writer's token ([`check`]); an
//!   adoption's update waits for those writes and fences every later one.
//! - The holder renews the row ([`renew`]); a replica with a takeover grace
//!   adopts an identity of the same executor binding whose renewal lapsed
//!   longer ago than the grace ([`lapsed`], `SELECT … FOR UPDATE SKIP
//!   LOCKED`, so two replicas never adopt the same one, then [`adopt`]).
use sqlx::PgConnection;
use sqlx::postgres::PgPool;

use crate::store::StoreError;

/// The schema of the lease table.
pub(super) const SCHEMA: &str = "toolrunner_leases";

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations/postgres-leases");

/// An identity as one writer holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Fence {
    pub(super) executor_id: String,
    /// The executor binding it serves (replicas of one binding adopt each
    /// other).
    pub(super) binding_id: String,
    pub(super) token: i64,
}

/// Migrates the lease table (in [`SCHEMA`], created if missing) on a pool
/// whose `search_path` is that schema.
pub(super) async fn migrate(pool: &PgPool) -> Result<(), StoreError> {
    MIGRATOR.run(pool).await?;
    Ok(())
}

fn fenced(executor_id: &str, why: &str) -> StoreError {
    StoreError::Fenced(format!(
        "executor {executor_id} {why}: this process must stop and write nothing more (another replica holds the identity)"
    ))
}

/// Takes the identity's lease for the process `holder`: the new token.
///
/// # Errors
/// [`StoreError::Fenced`] when a replica adopted the identity.
pub(super) async fn take(
    pool: &PgPool,
    executor_id: &str,
    holder: &str,
    binding_id: &str,
    store_schema: &str,
) -> Result<i64, StoreError> {
    let mut tx = pool.begin().await?;
    let row: Option<(i64, Option<String>)> = sqlx::query_as(
        "SELECT token, adopted_by FROM toolrunner_leases.executor_leases WHERE executor_id = $1 FOR UPDATE",
    )
    .bind(executor_id)
    .fetch_optional(&mut *tx)
    .await?;
    if let Some((_, Some(by))) = &row {
        return Err(adopted(executor_id, by));
    }
    let token: i64 = sqlx::query_scalar(
        "INSERT INTO toolrunner_leases.executor_leases (executor_id, token, holder, renewed_at, binding_id, store_schema)
         VALUES ($1, 1, $2, now(), $3, $4)
         ON CONFLICT (executor_id) DO UPDATE SET token = executor_leases.token + 1, holder = $2, renewed_at = now(),
           binding_id = $3, store_schema = $4
         RETURNING token",
    )
    .bind(executor_id)
    .bind(holder)
    .bind(binding_id)
    .bind(store_schema)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(token)
}

/// Renews the lease `fence` holds.
///
/// # Errors
/// [`StoreError::Fenced`] when the identity's token moved on.
pub(super) async fn renew(pool: &PgPool, fence: &Fence) -> Result<(), StoreError> {
    let renewed = sqlx::query(
        "UPDATE toolrunner_leases.executor_leases SET renewed_at = now() WHERE executor_id = $1 AND token = $2",
    )
    .bind(&fence.executor_id)
    .bind(fence.token)
    .execute(pool)
    .await?
    .rows_affected();
    if renewed == 0 {
        return Err(fenced(
            &fence.executor_id,
            "lost its lease (its fencing token moved on)",
        ));
    }
    Ok(())
}

/// In a write transaction, before its first write: the identity still has
/// the writer's token. The shared row lock lasts until the transaction
/// ends, so an adoption waits for this write and fences the next.
///
/// # Errors
/// [`StoreError::Fenced`] when the token moved on.
pub(super) async fn check(conn: &mut PgConnection, fence: &Fence) -> Result<(), StoreError> {
    let token: Option<i64> = sqlx::query_scalar(
        "SELECT token FROM toolrunner_leases.executor_leases WHERE executor_id = $1 FOR SHARE",
    )
    .bind(&fence.executor_id)
    .fetch_optional(conn)
    .await?;
    if token != Some(fence.token) {
        return Err(fenced(
            &fence.executor_id,
            "lost its lease (its fencing token moved on)",
        ));
    }
    Ok(())
}

/// For the replica `me` serving `binding_id`, in `tx`: one identity of
/// the same binding whose lease was last renewed more than `grace_ms` ago,
/// locked (`FOR UPDATE SKIP LOCKED`: another replica looking at the same
/// moment skips it), with its store's schema (empty: the identity's own).
///
/// # Errors
/// The database failed.
pub(super) async fn lapsed(
    tx: &mut PgConnection,
    me: &str,
    binding_id: &str,
    grace_ms: u64,
) -> Result<Option<(String, String)>, StoreError> {
    Ok(sqlx::query_as(
        "SELECT executor_id, store_schema FROM toolrunner_leases.executor_leases
         WHERE binding_id = $3 AND binding_id <> '' AND executor_id <> $1
           AND renewed_at < now() - make_interval(secs => $2::double precision / 1000)
         ORDER BY renewed_at LIMIT 1 FOR UPDATE SKIP LOCKED",
    )
    .bind(me)
    .bind(i64::try_from(grace_ms).unwrap_or(i64::MAX) as f64)
    .bind(binding_id)
    .fetch_optional(tx)
    .await?)
}

/// In `tx`, after [`lapsed`] locked it: adopts `executor_id` for the
/// replica `me` (process `holder`), bumping its token.
///
/// # Errors
/// The database failed.
pub(super) async fn adopt(
    tx: &mut PgConnection,
    executor_id: &str,
    binding_id: &str,
    me: &str,
    holder: &str,
) -> Result<Fence, StoreError> {
    let token: i64 = sqlx::query_scalar(
        "UPDATE toolrunner_leases.executor_leases SET token = token + 1, holder = $2, adopted_by = $3, renewed_at = now()
         WHERE executor_id = $1 RETURNING token",
    )
    .bind(executor_id)
    .bind(holder)
    .bind(me)
    .fetch_one(tx)
    .await?;
    Ok(Fence {
        executor_id: executor_id.to_owned(),
        binding_id: binding_id.to_owned(),
        token,
    })
}

/// Whether a replica adopted `executor_id` (a process of it must not run).
///
/// # Errors
/// [`StoreError::Fenced`] when one did.
pub(super) async fn refuse_if_adopted(pool: &PgPool, executor_id: &str) -> Result<(), StoreError> {
    let by: Option<Option<String>> = sqlx::query_scalar(
        "SELECT adopted_by FROM toolrunner_leases.executor_leases WHERE executor_id = $1",
    )
    .bind(executor_id)
    .fetch_optional(pool)
    .await?;
    match by.flatten() {
        Some(by) => Err(adopted(executor_id, &by)),
        None => Ok(()),
    }
}

fn adopted(executor_id: &str, by: &str) -> StoreError {
    fenced(
        executor_id,
        &format!(
            "was adopted by replica {by}, which finished its calls; start this process with a new executor id"
        ),
    )
}
