//! [`ApprovalBook`] shared by every replica and identity of a PostgreSQL
//! database (`toolrunner_leases.approvals`, this crate's
//! `migrations/postgres-leases`): a small pool of its own, each change one
//! statement.
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

use super::super::approvals::{
    ACTED, ApprovalBook, ApprovalRow, COLUMNS, PRUNABLE, Stored, Verdict, row_of,
};
use super::super::columns::free_text;
use super::super::{StoreError, Timestamp, rfc3339};

/// The database's clock now, as the store writes times (RFC 3339, UTC,
/// milliseconds).
const DB_NOW: &str =
    "to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')";

/// The database's clock a minute ago, written as [`DB_NOW`].
const DB_MINUTE_AGO: &str = "to_char((clock_timestamp() - interval '1 minute') AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.MS\"Z\"')";

/// The approval requests of every replica of one database.
pub(crate) struct PgApprovals {
    pool: PgPool,
}

impl PgApprovals {
    /// A small pool of its own on the database-wide schema (already
    /// migrated by the identity's lease, or by the operator's tool), opened
    /// when first used.
    pub(super) fn connect(options: PgConnectOptions) -> PgApprovals {
        PgApprovals {
            // One connection at most, closed when idle: every executor
            // process has one of these beside its store's pools, and the
            // server admits only so many clients.
            pool: PgPoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .idle_timeout(Duration::from_secs(10))
                .connect_lazy_with(options.options([("search_path", super::lease::SCHEMA)])),
        }
    }
}

#[async_trait::async_trait]
impl ApprovalBook for PgApprovals {
    async fn ask(&self, row: &ApprovalRow) -> Result<ApprovalRow, StoreError> {
        sqlx::query(
            "INSERT INTO approvals (run_id, call_id, digest, tool, subject, agent_id, agent_version,
                 arguments, reason, executor_id, asked_at, expires_at, state)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, 'waiting')
             ON CONFLICT (run_id, call_id, digest) DO NOTHING",
        )
        .bind(&row.run_id)
        .bind(&row.call_id)
        .bind(&row.digest)
        .bind(&row.tool)
        .bind(free_text(&row.subject))
        .bind(free_text(&row.agent_id))
        .bind(free_text(&row.agent_version))
        .bind(&row.arguments)
        .bind(free_text(&row.reason))
        .bind(&row.executor_id)
        .bind(rfc3339(&row.asked_at))
        .bind(rfc3339(&row.expires_at))
        .execute(&self.pool)
        .await?;
        let sql = format!(
            "SELECT {COLUMNS} FROM approvals WHERE run_id = $1 AND call_id = $2 AND digest = $3"
        );
        let stored = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(&row.run_id)
            .bind(&row.call_id)
            .bind(&row.digest)
            .fetch_one(&self.pool)
            .await?;
        row_of(&stored)
    }

    async fn of_call(&self, run_id: &str, call_id: &str) -> Result<Vec<ApprovalRow>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM approvals WHERE run_id = $1 AND call_id = $2 ORDER BY asked_at DESC, digest"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(run_id)
            .bind(call_id)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(row_of)
            .collect()
    }

    async fn list(&self) -> Result<Vec<ApprovalRow>, StoreError> {
        let sql = format!(
            "SELECT {COLUMNS} FROM approvals ORDER BY asked_at DESC, run_id, call_id, digest"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(row_of)
            .collect()
    }

    async fn decide(
        &self,
        (run_id, call_id, digest): (&str, &str, &str),
        verdict: Verdict,
        who: &str,
        note: Option<&str>,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let now = rfc3339(&now);
        let done = sqlx::query(
            "UPDATE approvals SET state = $1, decided_by = $2, note = $3, decided_at = $4
             WHERE run_id = $5 AND call_id = $6 AND digest = $7 AND state = 'waiting' AND expires_at > $8",
        )
        .bind(verdict.stored().name())
        .bind(free_text(who))
        .bind(note.map(free_text))
        .bind(&now)
        .bind(run_id)
        .bind(call_id)
        .bind(digest)
        .bind(&now)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn close(
        &self,
        run_id: &str,
        call_id: &str,
        why: &str,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE approvals SET state = $1, decided_by = COALESCE(decided_by, $2), closed_why = $3,
                 decided_at = COALESCE(decided_at, $4)
             WHERE run_id = $5 AND call_id = $6 AND state = 'waiting'",
        )
        .bind(Stored::Closed.name())
        .bind("toolrunner")
        .bind(free_text(why))
        .bind(rfc3339(&now))
        .bind(run_id)
        .bind(call_id)
        .execute(&self.pool)
        .await?;
        // The call ended: a decision of its is needed no more (retention
        // may take it).
        sqlx::query(
            "UPDATE approvals SET acted_at = COALESCE(acted_at, $1)
             WHERE run_id = $2 AND call_id = $3 AND state <> 'waiting'",
        )
        .bind(rfc3339(&now))
        .bind(run_id)
        .bind(call_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn expire(
        &self,
        (run_id, call_id, digest): (&str, &str, &str),
        why: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let now = rfc3339(&now);
        let done = sqlx::query(
            "UPDATE approvals SET state = 'closed', decided_by = 'toolrunner', closed_why = $1,
                 decided_at = $2
             WHERE run_id = $3 AND call_id = $4 AND digest = $5 AND state = 'waiting'
                 AND expires_at <= $6",
        )
        .bind(free_text(why))
        .bind(&now)
        .bind(run_id)
        .bind(call_id)
        .bind(digest)
        .bind(&now)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn told(
        &self,
        (run_id, call_id, digest): (&str, &str, &str),
        now: Timestamp,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE approvals SET notified_at = $1
             WHERE run_id = $2 AND call_id = $3 AND digest = $4 AND notified_at IS NULL",
        )
        .bind(rfc3339(&now))
        .bind(run_id)
        .bind(call_id)
        .bind(digest)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn untold(
        &self,
        executor_id: &str,
        now: Timestamp,
    ) -> Result<Vec<ApprovalRow>, StoreError> {
        let own = format!(
            "SELECT {COLUMNS} FROM approvals
             WHERE executor_id = $1 AND state = 'waiting' AND expires_at > $2 AND notified_at IS NULL
             ORDER BY asked_at"
        );
        let mut rows = sqlx::query(sqlx::AssertSqlSafe(own))
            .bind(executor_id)
            .bind(rfc3339(&now))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(row_of)
            .collect::<Result<Vec<_>, _>>()?;
        // Those of askers of the same binding (the same product and tools)
        // that stopped: an identity whose lease nobody renewed for three
        // of its periods (by the database's clock, which wrote
        // `renewed_at`), that let it go, or that another replica adopted
        // (an adopted identity claims nothing, so it tells nothing). Taken
        // by a compare-and-set on `retold_at`, so that one replica tells
        // each, once a minute at most until its telling is recorded. An
        // asker only paused may tell too when it thaws: told twice, as
        // after a crash.
        // `retold_at` by the database's clock (the one every replica
        // shares), as text in the store's one format.
        let stopped = format!(
            "UPDATE approvals a SET retold_at = {DB_NOW}
             WHERE state = 'waiting' AND expires_at > $2 AND notified_at IS NULL
               AND executor_id <> $1
               AND (retold_at IS NULL OR retold_at < {DB_MINUTE_AGO})
               AND EXISTS (
                   SELECT 1 FROM executor_leases l JOIN executor_leases me
                       ON me.executor_id = $1 AND me.binding_id = l.binding_id
                    WHERE l.executor_id = a.executor_id AND l.binding_id <> ''
                      AND (l.released OR l.adopted_by IS NOT NULL
                           OR l.renewed_at < clock_timestamp() - 3 * l.ttl_ms * interval '1 millisecond'))
             RETURNING {COLUMNS}"
        );
        let taken = sqlx::query(sqlx::AssertSqlSafe(stopped))
            .bind(executor_id)
            .bind(rfc3339(&now))
            .fetch_all(&self.pool)
            .await?;
        for row in &taken {
            rows.push(row_of(row)?);
        }
        Ok(rows)
    }

    async fn waiting(&self, now: Timestamp) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT DISTINCT run_id, call_id FROM approvals WHERE state = 'waiting' AND expires_at > $1",
        )
        .bind(rfc3339(&now))
        .fetch_all(&self.pool)
        .await?)
    }

    async fn acted(
        &self,
        (run_id, call_id, digest): (&str, &str, &str),
        now: Timestamp,
    ) -> Result<(), StoreError> {
        sqlx::query(ACTED)
            .bind(rfc3339(&now))
            .bind(run_id)
            .bind(call_id)
            .bind(digest)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    async fn prune(&self, before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        let sql = format!(
            "DELETE FROM approvals WHERE ctid IN (SELECT ctid FROM approvals WHERE {PRUNABLE} LIMIT $2)"
        );
        let done = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(rfc3339(&before))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}
