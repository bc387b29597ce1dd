//! [`ApprovalBook`] in a SQLite store's own file (its `approvals` table):
//! a small pool of its own, each change one statement.
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions};

use super::super::approvals::{ApprovalBook, ApprovalRow, COLUMNS, Stored, Verdict, row_of};
use super::super::columns::free_text;
use super::super::{StoreError, Timestamp, rfc3339};

/// The approval requests of one SQLite store.
pub(crate) struct SqliteApprovals {
    pool: SqlitePool,
}

impl SqliteApprovals {
    /// Over the store whose readers are `readers` (a writable pool of one
    /// connection, opened when first used).
    pub(super) fn over(readers: &SqlitePool) -> SqliteApprovals {
        let options = (*readers.connect_options()).clone().read_only(false);
        SqliteApprovals {
            pool: SqlitePoolOptions::new()
                .max_connections(1)
                .min_connections(0)
                .connect_lazy_with(options),
        }
    }
}

#[async_trait::async_trait]
impl ApprovalBook for SqliteApprovals {
    async fn ask(&self, row: &ApprovalRow) -> Result<ApprovalRow, StoreError> {
        sqlx::query(
            "INSERT INTO approvals (run_id, call_id, digest, tool, subject, agent_id, agent_version,
                 arguments, reason, executor_id, asked_at, expires_at, state)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'waiting')
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
            "SELECT {COLUMNS} FROM approvals WHERE run_id = ? AND call_id = ? AND digest = ?"
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
            "SELECT {COLUMNS} FROM approvals WHERE run_id = ? AND call_id = ? ORDER BY asked_at DESC, digest"
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
            "UPDATE approvals SET state = ?, decided_by = ?, note = ?, decided_at = ?
             WHERE run_id = ? AND call_id = ? AND digest = ? AND state = 'waiting' AND expires_at > ?",
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
            "UPDATE approvals SET state = ?, decided_by = COALESCE(decided_by, ?), closed_why = ?,
                 decided_at = COALESCE(decided_at, ?)
             WHERE run_id = ? AND call_id = ? AND state <> 'closed'",
        )
        .bind(Stored::Closed.name())
        .bind("toolrunner")
        .bind(free_text(why))
        .bind(rfc3339(&now))
        .bind(run_id)
        .bind(call_id)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn waiting(&self, now: Timestamp) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT DISTINCT run_id, call_id FROM approvals WHERE state = 'waiting' AND expires_at > ?",
        )
        .bind(rfc3339(&now))
        .fetch_all(&self.pool)
        .await?)
    }
}
