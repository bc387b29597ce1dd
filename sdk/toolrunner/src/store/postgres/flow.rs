//! Flow control shared by the replicas of one database
//! (`toolrunner_leases.flow_tools` and `flow_holds`, this crate's
//! `migrations/postgres-leases`): [`PgFlow`] implements [`SharedFlow`].
//!
//! - A taker locks its tool's row (`FOR UPDATE`), reads every hold of the
//!   tool with its identity's lease row, counts those that still count,
//!   deletes the others, and takes only below the limits: two replicas
//!   never both take the last slot, and a call's hold has one row (its
//!   key), so replicas racing for one candidate reserve it once.
//! - A hold counts while its identity's lease row has the hold's token, is
//!   not released, and was not seen unchanged for its whole time to live
//!   by this process's monotonic clock (as adoptions judge a lapse): a
//!   killed replica's slots come back within a lease; a restarted or
//!   adopted identity's old holds (an older token) count no more.
//! - A token counts while it is being sent by a live holder, and for a
//!   second after `at` (the database's clock: the one clock every replica
//!   shares) otherwise.
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{PgConnection, Row};

use super::super::StoreError;
use super::super::flow::{Caps, Counted, HoldAt, SharedFlow, Take, ToolRow};

/// The slots and tokens of every replica of one database.
pub(crate) struct PgFlow {
    pool: PgPool,
    /// Each identity's lease as this process last saw it change: its
    /// token, its renewals, and when (this process's monotonic clock).
    seen: Mutex<HashMap<String, (i64, i64, Instant)>>,
}

/// A hold's row as a taker reads it.
struct HoldRow {
    kind: String,
    stage: String,
    run_id: String,
    call_id: String,
    assignment_id: String,
    executor_id: String,
    lease_token: i64,
    recent: bool,
    lease: Option<(i64, i64, i64, bool)>,
}

fn limit(n: Option<i32>) -> Option<u32> {
    n.and_then(|n| u32::try_from(n).ok())
}

fn sql_limit(n: Option<u32>) -> Option<i32> {
    n.map(|n| i32::try_from(n).unwrap_or(i32::MAX))
}

fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl PgFlow {
    /// A small pool of its own on the database-wide schema (already
    /// migrated by the identity's lease).
    pub(super) async fn connect(options: PgConnectOptions) -> Result<PgFlow, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(4)
            .idle_timeout(Duration::from_secs(30))
            .connect_with(options.options([("search_path", super::lease::SCHEMA)]))
            .await?;
        Ok(PgFlow {
            pool,
            seen: Mutex::default(),
        })
    }

    /// Whether the identity holding `row` still holds it, by this
    /// process's clock at `now`.
    fn live(&self, row: &HoldRow, now: Instant) -> bool {
        let Some((token, renewals, ttl_ms, released)) = row.lease else {
            return false;
        };
        if released || token != row.lease_token {
            return false;
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        let entry = seen
            .entry(row.executor_id.clone())
            .or_insert((token, renewals, now));
        if (entry.0, entry.1) != (token, renewals) {
            *entry = (token, renewals, now);
        }
        let ttl = Duration::from_millis(u64::try_from(ttl_ms).unwrap_or(0));
        now.saturating_duration_since(entry.2) < ttl
    }

    /// The tool's row locked (made if missing): its stored limits.
    async fn lock_tool(tx: &mut PgConnection, tool: &str) -> Result<Caps, StoreError> {
        let select = "SELECT concurrency, rate FROM flow_tools WHERE tool = $1 FOR UPDATE";
        let mut row = sqlx::query(select)
            .bind(tool)
            .fetch_optional(&mut *tx)
            .await?;
        // A key's row is deleted when its last hold goes (see `release`):
        // made again, as often as a release races it.
        for _ in 0..3 {
            if row.is_some() {
                break;
            }
            sqlx::query("INSERT INTO flow_tools (tool) VALUES ($1) ON CONFLICT DO NOTHING")
                .bind(tool)
                .execute(&mut *tx)
                .await?;
            row = sqlx::query(select)
                .bind(tool)
                .fetch_optional(&mut *tx)
                .await?;
        }
        let Some(row) = row else {
            return Err(StoreError::Refused(format!(
                "the flow row of tool {tool} vanished as it was made"
            )));
        };
        Ok(Caps::of(
            limit(row.try_get("concurrency")?),
            limit(row.try_get("rate")?),
        ))
    }

    async fn holds(tx: &mut PgConnection, tool: &str) -> Result<Vec<HoldRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT h.kind, h.stage, h.run_id, h.call_id, h.assignment_id, h.executor_id,
                    h.lease_token, h.at > clock_timestamp() - interval '1 second' AS recent,
                    l.token, l.renewals, l.ttl_ms, l.released
               FROM flow_holds h LEFT JOIN executor_leases l ON l.executor_id = h.executor_id
              WHERE h.tool = $1",
        )
        .bind(tool)
        .fetch_all(&mut *tx)
        .await?;
        rows.iter()
            .map(|r| {
                let token: Option<i64> = r.try_get("token")?;
                Ok(HoldRow {
                    kind: r.try_get("kind")?,
                    stage: r.try_get("stage")?,
                    run_id: r.try_get("run_id")?,
                    call_id: r.try_get("call_id")?,
                    assignment_id: r.try_get("assignment_id")?,
                    executor_id: r.try_get("executor_id")?,
                    lease_token: r.try_get("lease_token")?,
                    recent: r.try_get("recent")?,
                    lease: match token {
                        Some(token) => Some((
                            token,
                            r.try_get("renewals")?,
                            r.try_get("ttl_ms")?,
                            r.try_get("released")?,
                        )),
                        None => None,
                    },
                })
            })
            .collect()
    }

    /// Counts the tool's holds that still count (slots, tokens) and
    /// deletes the others; and whether `at`'s call holds a slot already.
    /// The taker's own identity (`at`'s executor id and token) is live:
    /// it takes only while its lease is.
    async fn count(
        &self,
        tx: &mut PgConnection,
        at: &HoldAt,
    ) -> Result<(u32, u32, bool), StoreError> {
        let tool = at.tool.as_str();
        let rows = Self::holds(tx, tool).await?;
        let now = Instant::now();
        let (mut slots, mut tokens, mut has_slot) = (0, 0, false);
        let mut stale: [Vec<&str>; 4] = Default::default();
        for row in &rows {
            let live = |row: &HoldRow| {
                (row.executor_id == at.executor_id && row.lease_token == at.lease_token)
                    || self.live(row, now)
            };
            let counts = if row.kind == "slot" {
                live(row)
            } else {
                row.recent || (row.stage == "sending" && live(row))
            };
            if counts && row.kind == "slot" && row.run_id == at.run_id && row.call_id == at.call_id
            {
                has_slot = true;
            }
            match (counts, row.kind.as_str()) {
                (true, "slot") => slots += 1,
                (true, _) => tokens += 1,
                (false, kind) => {
                    stale[0].push(kind);
                    stale[1].push(&row.run_id);
                    stale[2].push(&row.call_id);
                    stale[3].push(&row.assignment_id);
                }
            }
        }
        if !stale[0].is_empty() {
            let lost = stale[0].iter().filter(|k| **k == "slot").count();
            if lost > 0 {
                tracing::warn!(
                    tool,
                    slots = lost,
                    "slots of a tool's concurrency limit came back from identities whose leases lapsed (a killed or paused replica): a paused one may still be finishing its calls, and exceed the limit when it thaws"
                );
            }
            sqlx::query(
                "DELETE FROM flow_holds WHERE tool = $1
                   AND (kind, run_id, call_id, assignment_id) IN
                       (SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[]))",
            )
            .bind(tool)
            .bind(&stale[0])
            .bind(&stale[1])
            .bind(&stale[2])
            .bind(&stale[3])
            .execute(&mut *tx)
            .await?;
        }
        Ok((slots, tokens, has_slot))
    }

    /// Inserts a hold of `kind` in `stage`: only where no live row holds
    /// that key (`only_new`: a count just deleted the rows that no longer
    /// count, so one still there is another hold's, this process's or
    /// another's), or taking any row of the key over (a call this identity
    /// owns). `false`: not inserted.
    async fn insert(
        tx: &mut PgConnection,
        at: &HoldAt,
        kind: &str,
        stage: &str,
        assignment_id: &str,
        only_new: bool,
    ) -> Result<bool, StoreError> {
        let sql = if only_new {
            "INSERT INTO flow_holds (tool, kind, run_id, call_id, assignment_id, executor_id, lease_token, stage, hold_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (tool, kind, run_id, call_id, assignment_id) DO NOTHING"
        } else {
            "INSERT INTO flow_holds (tool, kind, run_id, call_id, assignment_id, executor_id, lease_token, stage, hold_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (tool, kind, run_id, call_id, assignment_id) DO UPDATE
                SET executor_id = EXCLUDED.executor_id, lease_token = EXCLUDED.lease_token,
                    stage = EXCLUDED.stage, hold_id = EXCLUDED.hold_id, at = clock_timestamp()"
        };
        let done = sqlx::query(sql)
            .bind(&at.tool)
            .bind(kind)
            .bind(&at.run_id)
            .bind(&at.call_id)
            .bind(assignment_id)
            .bind(&at.executor_id)
            .bind(at.lease_token)
            .bind(stage)
            .bind(at.hold_id)
            .execute(&mut *tx)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// Commits what a take that took nothing deleted (holds that no longer
/// count).
async fn commit(
    tx: sqlx::Transaction<'_, sqlx::Postgres>,
    counted: Counted,
) -> Result<Counted, StoreError> {
    tx.commit().await?;
    Ok(counted)
}

#[async_trait::async_trait]
impl SharedFlow for PgFlow {
    async fn stored_limits(&self) -> Result<BTreeMap<String, Caps>, StoreError> {
        let rows = sqlx::query(
            "SELECT tool, concurrency, rate FROM flow_tools
              WHERE concurrency IS NOT NULL OR rate IS NOT NULL",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("tool")?,
                    Caps::of(limit(r.try_get("concurrency")?), limit(r.try_get("rate")?)),
                ))
            })
            .collect()
    }

    async fn take(
        &self,
        at: &HoldAt,
        limits: Caps,
        take: Take,
        assignment_id: &str,
    ) -> Result<Counted, StoreError> {
        let mut tx = self.pool.begin().await?;
        let limits = limits.overridden_by(Self::lock_tool(&mut tx, &at.tool).await?);
        let (slots, tokens, has_slot) = self.count(&mut tx, at).await?;
        let below = |n: u32, max: Option<u32>| max.is_none_or(|max| n < max);
        let mut counted = Counted {
            taken: false,
            slots,
            tokens,
            limits,
        };
        match take {
            Take::New => {
                if !below(slots, limits.concurrency) || !below(tokens, limits.rate) {
                    return commit(tx, counted).await;
                }
                if limits.concurrency.is_some() {
                    if !Self::insert(&mut tx, at, "slot", "held", "", true).await? {
                        // Another identity reserved this very call.
                        return Ok(counted);
                    }
                    counted.slots += 1;
                }
                if limits.rate.is_some() {
                    if !Self::insert(&mut tx, at, "token", "reserved", "", true).await? {
                        return Ok(counted);
                    }
                    counted.tokens += 1;
                }
            }
            Take::Owed => {
                if limits.concurrency.is_some() {
                    Self::insert(&mut tx, at, "slot", "held", "", false).await?;
                    counted.slots += u32::from(!has_slot);
                    if counted.slots > limits.concurrency.unwrap_or(u32::MAX) {
                        tracing::warn!(
                            tool = %at.tool,
                            run_id = %at.run_id,
                            call_id = %at.call_id,
                            held = counted.slots,
                            "a call this identity resumes took its tool's slot above the concurrency limit (its own work is never refused)"
                        );
                    }
                }
            }
            Take::SendNow => {
                let mine = sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM flow_holds WHERE tool = $1 AND kind = 'token'
                        AND run_id = $2 AND call_id = $3 AND assignment_id = $4
                        AND hold_id = $5",
                )
                .bind(&at.tool)
                .bind(&at.run_id)
                .bind(&at.call_id)
                .bind(assignment_id)
                .bind(at.hold_id)
                .fetch_one(&mut *tx)
                .await?;
                if mine == 0 {
                    if !below(tokens, limits.rate) {
                        return commit(tx, counted).await;
                    }
                    if !Self::insert(&mut tx, at, "token", "sending", assignment_id, true).await? {
                        return Ok(counted);
                    }
                    counted.tokens += 1;
                }
            }
        }
        tx.commit().await?;
        counted.taken = true;
        Ok(counted)
    }

    async fn start_send(&self, at: &HoldAt, assignment_id: &str) -> Result<bool, StoreError> {
        // Under the tool's lock (shared: sends do not wait for each other),
        // so that no taker counting at the same moment misses the token
        // as it turns from a reservation into a send.
        let mut tx = self.pool.begin().await?;
        sqlx::query("SELECT 1 FROM flow_tools WHERE tool = $1 FOR SHARE")
            .bind(&at.tool)
            .execute(&mut *tx)
            .await?;
        let done = sqlx::query(
            "UPDATE flow_holds SET stage = 'sending', assignment_id = $4, at = clock_timestamp()
              WHERE tool = $1 AND kind = 'token' AND run_id = $2 AND call_id = $3
                AND assignment_id = '' AND stage = 'reserved' AND hold_id = $5
                AND at > clock_timestamp() - interval '1 second'",
        )
        .bind(&at.tool)
        .bind(&at.run_id)
        .bind(&at.call_id)
        .bind(assignment_id)
        .bind(at.hold_id)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected() == 1)
    }

    async fn answered(&self, at: &HoldAt, assignment_id: &str) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE flow_holds SET stage = 'sent', at = clock_timestamp()
              WHERE tool = $1 AND kind = 'token' AND run_id = $2 AND call_id = $3
                AND assignment_id = $4 AND stage = 'sending' AND hold_id = $5",
        )
        .bind(&at.tool)
        .bind(&at.run_id)
        .bind(&at.call_id)
        .bind(assignment_id)
        .bind(at.hold_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn release(&self, at: &HoldAt, slot: bool) -> Result<bool, StoreError> {
        let slots: i64 = sqlx::query_scalar(
            "WITH gone AS (
                 DELETE FROM flow_holds
                  WHERE tool = $1 AND run_id = $2 AND call_id = $3 AND hold_id = $4
                    AND (kind = 'slot' OR stage = 'reserved')
              RETURNING kind),
             sent AS (
                 UPDATE flow_holds SET stage = 'sent', at = clock_timestamp()
                  WHERE tool = $1 AND kind = 'token' AND run_id = $2 AND call_id = $3
                    AND hold_id = $4 AND stage = 'sending'
              RETURNING 1)
             -- (A data-modifying WITH runs whether the query reads it.)
             SELECT count(*) FROM gone WHERE kind = 'slot'",
        )
        .bind(&at.tool)
        .bind(&at.run_id)
        .bind(&at.call_id)
        .bind(at.hold_id)
        .fetch_one(&self.pool)
        .await?;
        // A concurrency key's row goes with its last hold, so that keys
        // (one a merchant, a tenant) do not pile up: refused by the
        // foreign key while another hold of the key is there, which is
        // fine.
        if at.tool.contains('\u{1f}') {
            let _ = sqlx::query("DELETE FROM flow_tools WHERE tool = $1")
                .bind(&at.tool)
                .execute(&self.pool)
                .await;
        }
        Ok(!slot || slots > 0)
    }

    async fn set_limits(&self, tool: &str, limits: Caps, clear: bool) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO flow_tools (tool, concurrency, rate, set_at)
             VALUES ($1, $2, $3, clock_timestamp())
             ON CONFLICT (tool) DO UPDATE SET
                concurrency = CASE WHEN $4 THEN EXCLUDED.concurrency
                                   ELSE coalesce(EXCLUDED.concurrency, flow_tools.concurrency) END,
                rate = CASE WHEN $4 THEN EXCLUDED.rate
                            ELSE coalesce(EXCLUDED.rate, flow_tools.rate) END,
                set_at = clock_timestamp()",
        )
        .bind(tool)
        .bind(sql_limit(limits.concurrency))
        .bind(sql_limit(limits.rate))
        .bind(clear)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ToolRow>, StoreError> {
        let rows = sqlx::query(
            "SELECT t.tool, t.concurrency, t.rate,
                    (SELECT count(*) FROM flow_holds h JOIN executor_leases l
                         ON l.executor_id = h.executor_id AND l.token = h.lease_token AND NOT l.released
                      WHERE h.tool = t.tool AND h.kind = 'slot') AS slots,
                    (SELECT count(*) FROM flow_holds h
                      WHERE h.tool = t.tool AND h.kind = 'token'
                        AND (h.stage = 'sending' OR h.at > clock_timestamp() - interval '1 second')) AS tokens
               FROM flow_tools t
              -- A tool's concurrency keys are held as the tool, U+001F, the key: not tools.
              WHERE strpos(t.tool, chr(31)) = 0
              ORDER BY t.tool",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(ToolRow {
                    tool: r.try_get("tool")?,
                    stored: Caps::of(limit(r.try_get("concurrency")?), limit(r.try_get("rate")?)),
                    slots: count(usize::try_from(r.try_get::<i64, _>("slots")?).unwrap_or(0)),
                    tokens: count(usize::try_from(r.try_get::<i64, _>("tokens")?).unwrap_or(0)),
                })
            })
            .collect()
    }
}
