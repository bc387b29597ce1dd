//! [`ApprovalBook`] in a SQLite store's own file (its `approvals` table):
//! a small pool of its own, each change one statement.
use sqlx::sqlite::{SqlitePool, SqlitePoolOptions};

use super::super::approvals::{
    ACTED, ApprovalBook, ApprovalRow, COLUMNS, PRUNABLE, Stored, Verdict, row_of,
};
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
             WHERE run_id = ? AND call_id = ? AND state = 'waiting'",
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
            "UPDATE approvals SET state = 'closed', decided_by = 'toolrunner', closed_why = ?,
                 decided_at = ?
             WHERE run_id = ? AND call_id = ? AND digest = ? AND state = 'waiting'
                 AND expires_at <= ?",
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
            "UPDATE approvals SET notified_at = ?
             WHERE run_id = ? AND call_id = ? AND digest = ? AND notified_at IS NULL",
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
        let sql = format!(
            "SELECT {COLUMNS} FROM approvals
             WHERE executor_id = ? AND state = 'waiting' AND expires_at > ? AND notified_at IS NULL
             ORDER BY asked_at"
        );
        sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(executor_id)
            .bind(rfc3339(&now))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(row_of)
            .collect()
    }

    async fn waiting(&self, now: Timestamp) -> Result<Vec<(String, String)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT DISTINCT run_id, call_id FROM approvals WHERE state = 'waiting' AND expires_at > ?",
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
            "DELETE FROM approvals WHERE rowid IN (SELECT rowid FROM approvals WHERE {PRUNABLE} LIMIT $2)"
        );
        let done = sqlx::query(sqlx::AssertSqlSafe(sql))
            .bind(rfc3339(&before))
            .bind(i64::from(limit))
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SqliteStore;

    fn request(call_id: &str, expires_in_ms: i64) -> ApprovalRow {
        let asked_at = crate::store::now();
        ApprovalRow {
            run_id: "run_1".into(),
            call_id: call_id.into(),
            digest: "sha256:d".into(),
            tool: "refunds.refund".into(),
            subject: "user_1".into(),
            agent_id: "agt_1".into(),
            agent_version: "v1".into(),
            arguments: "{}".into(),
            reason: "over 1,000".into(),
            executor_id: "exe_1".into(),
            asked_at,
            expires_at: asked_at + chrono::TimeDelta::milliseconds(expires_in_ms),
            state: Stored::Waiting,
            decided_by: None,
            note: None,
            decided_at: None,
            closed_why: None,
            notified_at: None,
        }
    }

    async fn book() -> (tempfile::TempDir, SqliteApprovals) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = SqliteStore::open_path(&dir.path().join("a.db"))
            .await
            .expect("a store");
        (dir, store.approvals())
    }

    async fn state(book: &SqliteApprovals, call_id: &str) -> Stored {
        book.of_call("run_1", call_id).await.expect("read")[0].state
    }

    #[tokio::test]
    async fn a_call_that_ended_closes_only_the_requests_nobody_decided() {
        let (_dir, book) = book().await;
        book.ask(&request("c_approved", 60_000))
            .await
            .expect("asked");
        book.ask(&request("c_waiting", 60_000))
            .await
            .expect("asked");
        let now = crate::store::now();
        let at = ("run_1", "c_approved", "sha256:d");
        assert!(
            book.decide(at, Verdict::Approve, "ann", None, now)
                .await
                .expect("decided")
        );
        for call in ["c_approved", "c_waiting"] {
            book.close("run_1", call, "the run ended", now)
                .await
                .expect("closed");
        }
        assert_eq!(
            state(&book, "c_approved").await,
            Stored::Approved,
            "the decision stays"
        );
        assert_eq!(state(&book, "c_waiting").await, Stored::Closed);
        // Both are needed no more: retention takes them in time.
        let later = now + chrono::TimeDelta::days(1);
        assert_eq!(book.prune(later, 10).await.expect("pruned"), 2);
    }

    #[tokio::test]
    async fn an_expiry_closed_first_refuses_a_later_decision_and_a_decision_first_refuses_the_expiry()
     {
        let (_dir, book) = book().await;
        book.ask(&request("c_late", 1)).await.expect("asked");
        book.ask(&request("c_decided", 60_000))
            .await
            .expect("asked");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let now = crate::store::now();
        let late = ("run_1", "c_late", "sha256:d");
        assert!(
            book.expire(late, "approval expired", now)
                .await
                .expect("expired")
        );
        // An approver whose clock runs behind: refused, the call is settled.
        let behind = now - chrono::TimeDelta::seconds(60);
        assert!(
            !book
                .decide(late, Verdict::Approve, "bo", None, behind)
                .await
                .expect("asked")
        );
        assert_eq!(state(&book, "c_late").await, Stored::Closed);
        // Decided first: an expiry judged by a clock running ahead finds
        // nothing to close.
        let decided = ("run_1", "c_decided", "sha256:d");
        assert!(
            book.decide(decided, Verdict::Deny, "cy", None, now)
                .await
                .expect("decided")
        );
        let ahead = now + chrono::TimeDelta::seconds(120);
        assert!(
            !book
                .expire(decided, "approval expired", ahead)
                .await
                .expect("asked")
        );
        assert_eq!(state(&book, "c_decided").await, Stored::Denied);
    }

    /// Retention takes what nobody needs any more: a decision acted on
    /// before the cut-off, a request closed before it, one that expired
    /// undecided before it; a decision not acted on stays however old, as
    /// do a request that may still be decided and a decision acted on
    /// after the cut-off; `limit` bounds one pass.
    #[tokio::test]
    async fn retention_takes_only_requests_nobody_needs() {
        let (_dir, book) = book().await;
        for (call, expires_in_ms) in [
            ("c_acted", 60_000),
            ("c_not_acted", 60_000),
            ("c_closed", 60_000),
            ("c_expired", 1),
            ("c_waiting", 60_000),
            ("c_acted_late", 60_000),
        ] {
            book.ask(&request(call, expires_in_ms))
                .await
                .expect("asked");
        }
        let at = |call| ("run_1", call, "sha256:d");
        let now = crate::store::now();
        for (call, verdict) in [
            ("c_acted", Verdict::Deny),
            ("c_not_acted", Verdict::Deny),
            ("c_acted_late", Verdict::Approve),
        ] {
            assert!(
                book.decide(at(call), verdict, "ann", None, now)
                    .await
                    .expect("decided")
            );
        }
        book.acted(at("c_acted"), now).await.expect("acted");
        book.close("run_1", "c_closed", "the run ended", now)
            .await
            .expect("closed");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        let cut_off = crate::store::now();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        book.acted(at("c_acted_late"), crate::store::now())
            .await
            .expect("acted");
        // Acting on a waiting request records nothing (the schema refuses
        // it, and the statement asks for a decided one).
        book.acted(at("c_waiting"), crate::store::now())
            .await
            .expect("acted");
        assert_eq!(book.prune(cut_off, 2).await.expect("pruned"), 2);
        assert_eq!(book.prune(cut_off, 2).await.expect("pruned"), 1);
        assert_eq!(book.prune(cut_off, 2).await.expect("pruned"), 0);
        let mut left: Vec<String> = book
            .list()
            .await
            .expect("listed")
            .into_iter()
            .map(|r| r.call_id)
            .collect();
        left.sort();
        assert_eq!(left, ["c_acted_late", "c_not_acted", "c_waiting"]);
        // Much later, the decision never acted on is still there.
        let later = crate::store::now() + chrono::TimeDelta::days(365);
        book.prune(later, 100).await.expect("pruned");
        let left: Vec<String> = book
            .list()
            .await
            .expect("listed")
            .into_iter()
            .map(|r| r.call_id)
            .collect();
        assert_eq!(left, ["c_not_acted"]);
    }

    #[tokio::test]
    async fn a_second_ask_answers_the_stored_request() {
        let (_dir, book) = book().await;
        let first = book.ask(&request("c", 60_000)).await.expect("asked");
        let mut again = request("c", 120_000);
        again.reason = "another reason".into();
        let stored = book.ask(&again).await.expect("asked");
        assert_eq!(stored.reason, first.reason);
        assert_eq!(stored.expires_at, first.expires_at);
    }
}
