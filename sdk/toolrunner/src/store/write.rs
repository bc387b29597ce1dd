//! The SQL of each [`Change`], written once. Three connections run it: the
//! SQLite writer's (rusqlite, `store/sqlite/changes.rs`), the PostgreSQL
//! store's and both handler transactions' (sqlx, `store/transaction.rs`),
//! each through the small [`Conn`] adapter that binds parameters and says
//! which failures are a constraint the schema enforces. Parameters are
//! written `$1`…`$n` (SQLite reads them by name, PostgreSQL by position).
use std::borrow::Cow;
use std::future::Future;

use super::columns::{assignment_json, report_str, seq};
use super::{Change, LocalCall, ReceiptStatus, StoreError, Timestamp, now_rfc3339, rfc3339};

/// A value bound to a statement; text is borrowed from the change where it
/// can be (a receipt's body is not copied to be written).
#[derive(Debug, Clone)]
pub(crate) enum Param<'a> {
    /// Text, or `NULL`.
    Text(Option<Cow<'a, str>>),
    /// An integer.
    Int(i64),
}

impl<'a> From<&'a str> for Param<'a> {
    fn from(s: &'a str) -> Param<'a> {
        Param::Text(Some(Cow::Borrowed(s)))
    }
}

impl<'a> From<&'a String> for Param<'a> {
    fn from(s: &'a String) -> Param<'a> {
        Param::Text(Some(Cow::Borrowed(s)))
    }
}

impl From<String> for Param<'_> {
    fn from(s: String) -> Self {
        Param::Text(Some(Cow::Owned(s)))
    }
}

impl From<Option<String>> for Param<'_> {
    fn from(s: Option<String>) -> Self {
        Param::Text(s.map(Cow::Owned))
    }
}

impl<'a> From<&'a Option<String>> for Param<'a> {
    fn from(s: &'a Option<String>) -> Param<'a> {
        Param::Text(s.as_deref().map(Cow::Borrowed))
    }
}

impl<'a> From<Option<&'a str>> for Param<'a> {
    fn from(s: Option<&'a str>) -> Param<'a> {
        Param::Text(s.map(Cow::Borrowed))
    }
}

impl From<i64> for Param<'_> {
    fn from(n: i64) -> Self {
        Param::Int(n)
    }
}

/// How a statement failed.
#[derive(Debug)]
pub(crate) enum SqlFailure {
    /// A constraint the schema enforces (unique, check, foreign key, not
    /// null): a row that must never exist. The database's message.
    Constraint(String),
    /// Anything else.
    Other(StoreError),
}

/// A connection in a transaction that runs the store's statements.
pub(crate) trait Conn {
    /// What a select that reads rows it will change adds, to lock them
    /// until the transaction ends (PostgreSQL's `FOR UPDATE`; on SQLite
    /// the writer's transaction holds the whole database already).
    const LOCK_ROWS: &'static str;

    /// Whether [`Change::Prune`] deletes its whole batch in one statement
    /// ([`sql::PRUNE_ALL`]: PostgreSQL, where each statement is a round
    /// trip to the server) rather than key by key (the SQLite writer, in
    /// the process: its statements cost no round trip).
    const PRUNE_IN_ONE: bool;

    /// Runs a statement; the number of rows it changed.
    fn execute(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<u64, SqlFailure>> + Send;

    /// Runs a statement that returns rows of text columns.
    fn rows(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<Vec<String>>, SqlFailure>> + Send;
}

/// A failure of a statement that writes `what`.
fn failed(e: SqlFailure, what: &str) -> StoreError {
    match e {
        SqlFailure::Constraint(message) => StoreError::Refused(format!("{what}: {message}")),
        SqlFailure::Other(e) => e,
    }
}

/// A timeline row, written with the others of its transaction at its end
/// ([`write_notes`]).
#[derive(Debug)]
pub(crate) struct Note {
    run_id: String,
    call_id: String,
    at: String,
    what: String,
    detail: Option<String>,
}

fn note(notes: &mut Vec<Note>, run: &str, call: &str, what: String, detail: Option<String>) {
    notes.push(Note {
        run_id: run.to_owned(),
        call_id: call.to_owned(),
        at: now_rfc3339(),
        what,
        detail,
    });
}

/// The statements, each written once.
mod sql {
    /// The health probe's one row.
    pub(super) const PROBE: &str = "INSERT INTO store_probe (one, probed_at) VALUES (1, $1)
         ON CONFLICT (one) DO UPDATE SET probed_at = excluded.probed_at";
    /// A new call row.
    pub(super) const INSERT_CALL: &str = "INSERT INTO calls (run_id, call_id, tool_name, operation_key, state, assignment, next_sequence, reason, report, version, created_at, updated_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (run_id, call_id) DO NOTHING";
    /// A call row replaced if its version is `$13`.
    pub(super) const UPDATE_CALL: &str = "UPDATE calls SET tool_name = $3, operation_key = $4, state = $5, assignment = $6, next_sequence = $7,
           reason = $8, report = $9, version = $10, created_at = $11, updated_at = $12
         WHERE run_id = $1 AND call_id = $2 AND version = $13";
    /// A receipt.
    pub(super) const INSERT_RECEIPT: &str = "INSERT INTO receipts (receipt_id, run_id, call_id, assignment_id, kind, sequence, body, status, attempts, last_error, created_at, delivered_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)";
    /// A pending receipt's new status.
    pub(super) const RECEIPT_STATUS: &str = "UPDATE receipts SET status = $2, last_error = COALESCE($3, last_error), attempts = attempts + $4,
           delivered_at = COALESCE($5, delivered_at)
         WHERE receipt_id = $1 AND status = 'pending' RETURNING run_id, call_id, kind";
    /// A call's pending receipts settled (but an assignment's, or but a
    /// kind).
    pub(super) const SETTLE_PENDING: &str = "UPDATE receipts SET status = $3, last_error = $4
         WHERE run_id = $1 AND call_id = $2 AND status = 'pending'
           AND (CAST($5 AS TEXT) IS NULL OR assignment_id <> $5) AND (CAST($6 AS TEXT) IS NULL OR kind = $6)
         RETURNING receipt_id, kind";
    /// An attempt.
    pub(super) const INSERT_ATTEMPT: &str = "INSERT INTO attempts (run_id, call_id, operation_key, executor_id, assignment_id, created_at)
         VALUES ($1, $2, $3, $4, $5, $6)";
    /// What a pruned call leaves, in the order it goes.
    pub(super) const PRUNE: [&str; 4] = [
        "DELETE FROM events WHERE run_id = $1 AND call_id = $2",
        "DELETE FROM attempts WHERE run_id = $1 AND call_id = $2",
        "DELETE FROM receipts WHERE run_id = $1 AND call_id = $2",
        "DELETE FROM calls WHERE run_id = $1 AND call_id = $2",
    ];
    /// What a batch of pruned calls leaves, in one statement (`$1`: settled
    /// before; `$2`: at most this many calls): the calls are picked and
    /// locked once, and every sub-statement deletes the rows of those
    /// very calls (the foreign keys are checked at the statement's end,
    /// when their receipts and attempts are gone too). The number of rows
    /// it changed is the number of calls.
    pub(super) const PRUNE_ALL: &str = concat!(
        "WITH doomed AS MATERIALIZED (",
        prunable_calls!(),
        " AND updated_at < $1 LIMIT $2 FOR UPDATE),
      gone_events AS (DELETE FROM events t USING doomed d
                      WHERE t.run_id = d.run_id AND t.call_id = d.call_id),
      gone_attempts AS (DELETE FROM attempts t USING doomed d
                        WHERE t.run_id = d.run_id AND t.call_id = d.call_id),
      gone_receipts AS (DELETE FROM receipts t USING doomed d
                        WHERE t.run_id = d.run_id AND t.call_id = d.call_id)
 DELETE FROM calls t USING doomed d WHERE t.run_id = d.run_id AND t.call_id = d.call_id"
    );
    /// The first line of the timeline's insert; each row adds
    /// `($n, …, $n+4)`.
    pub(super) const INSERT_EVENTS: &str =
        "INSERT INTO events (run_id, call_id, at, what, detail) VALUES ";
}

/// The calls [`Change::Prune`] may delete (`$1`: settled before; `$2`: at
/// most this many).
pub(crate) const PRUNABLE: &str = concat!(prunable_calls!(), " AND updated_at < $1 LIMIT $2");

/// Inserts a call row (`expect_version` `None`) or replaces it if its
/// stored version is `expect_version`; a conflict otherwise.
async fn write_call<C: Conn>(
    conn: &mut C,
    c: &LocalCall,
    expect_version: Option<u64>,
) -> Result<(), StoreError> {
    let mut params: Vec<Param> = vec![
        (&c.run_id).into(),
        (&c.call_id).into(),
        (&c.tool_name).into(),
        (&c.operation_key).into(),
        c.state.as_str().into(),
        assignment_json(c)?.into(),
        seq(c.next_sequence).into(),
        (&c.reason).into(),
        report_str(c.report).into(),
        seq(c.version).into(),
        rfc3339(&c.created_at).into(),
        rfc3339(&c.updated_at).into(),
    ];
    let statement = match expect_version {
        None => sql::INSERT_CALL,
        Some(v) => {
            params.push(seq(v).into());
            sql::UPDATE_CALL
        }
    };
    let written = conn
        .execute(statement, &params)
        .await
        .map_err(|e| failed(e, "call row"))?;
    if written == 0 {
        return Err(StoreError::Conflict(
            format!("{}/{}", c.run_id, c.call_id),
            match expect_version {
                None => "the call is already stored".into(),
                Some(v) => format!("it is no longer at version {v}"),
            },
        ));
    }
    Ok(())
}

/// Applies one change; its timeline rows go to `notes`. The number of
/// calls it pruned (0 but for [`Change::Prune`]).
///
/// # Errors
/// [`StoreError::Conflict`] for a lost compare-and-set,
/// [`StoreError::Refused`] for a row the schema refuses, or the database's
/// failure.
pub(crate) async fn apply<C: Conn>(
    conn: &mut C,
    change: &Change,
    notes: &mut Vec<Note>,
) -> Result<u64, StoreError> {
    match change {
        Change::InsertCall(c) => write_call(conn, c, None).await?,
        Change::UpdateCall {
            expect_version,
            call,
        } => write_call(conn, call, Some(*expect_version)).await?,
        Change::AddReceipt(r) => {
            let params: Vec<Param> = vec![
                (&r.receipt_id).into(),
                (&r.run_id).into(),
                (&r.call_id).into(),
                (&r.assignment_id).into(),
                r.kind.as_str().into(),
                seq(r.sequence).into(),
                (&r.body).into(),
                r.status.as_str().into(),
                i64::from(r.attempts).into(),
                (&r.last_error).into(),
                rfc3339(&r.created_at).into(),
                r.delivered_at.as_ref().map(rfc3339).into(),
            ];
            conn.execute(sql::INSERT_RECEIPT, &params)
                .await
                .map_err(|e| failed(e, "receipt"))?;
            let what = format!("receipt {} saved", r.kind.as_str());
            note(
                notes,
                &r.run_id,
                &r.call_id,
                what,
                Some(r.receipt_id.clone()),
            );
        }
        Change::ReceiptStatus {
            receipt_id,
            status,
            error,
            attempt,
        } => {
            let status = *status;
            let delivered_at = (status == ReceiptStatus::Delivered).then(now_rfc3339);
            let params: Vec<Param> = vec![
                receipt_id.into(),
                status.as_str().into(),
                error.into(),
                i64::from(*attempt).into(),
                delivered_at.into(),
            ];
            let rows = conn
                .rows(sql::RECEIPT_STATUS, &params)
                .await
                .map_err(|e| failed(e, "receipt status"))?;
            if let Some([run, call, kind]) = rows.first().map(Vec::as_slice)
                && status != ReceiptStatus::Pending
            {
                let what = format!("receipt {kind} {}", status.as_str());
                let detail = match error {
                    Some(e) => format!("{receipt_id}: {e}"),
                    None => receipt_id.clone(),
                };
                note(notes, run, call, what, Some(detail));
            }
        }
        Change::SettlePending {
            run_id,
            call_id,
            keep,
            only_kind,
            status,
            error,
        } => {
            let params: Vec<Param> = vec![
                run_id.into(),
                call_id.into(),
                status.as_str().into(),
                error.into(),
                keep.into(),
                only_kind
                    .map(toolrunner_protocol::wire::ReceiptKind::as_str)
                    .into(),
            ];
            let rows = conn
                .rows(sql::SETTLE_PENDING, &params)
                .await
                .map_err(|e| failed(e, "receipt status"))?;
            for row in rows {
                if let [id, kind] = row.as_slice() {
                    let what = format!("receipt {kind} {}", status.as_str());
                    note(notes, run_id, call_id, what, Some(format!("{id}: {error}")));
                }
            }
        }
        Change::AddAttempt(a) => {
            let params: Vec<Param> = vec![
                (&a.run_id).into(),
                (&a.call_id).into(),
                (&a.operation_key).into(),
                (&a.executor_id).into(),
                (&a.assignment_id).into(),
                rfc3339(&a.created_at).into(),
            ];
            conn.execute(sql::INSERT_ATTEMPT, &params)
                .await
                .map_err(|e| failed(e, "attempt"))?;
        }
        Change::Note {
            run_id,
            call_id,
            what,
            detail,
        } => note(notes, run_id, call_id, what.clone(), detail.clone()),
        Change::Prune {
            settled_before,
            limit,
        } => return prune(conn, settled_before, *limit).await,
        Change::Probe { at } => {
            conn.execute(sql::PROBE, &[rfc3339(at).into()])
                .await
                .map_err(|e| failed(e, "probe"))?;
        }
    }
    Ok(0)
}

/// Deletes up to `limit` calls settled for good before `settled_before`,
/// with everything kept for them; how many calls went.
async fn prune<C: Conn>(
    conn: &mut C,
    settled_before: &Timestamp,
    limit: u32,
) -> Result<u64, StoreError> {
    if C::PRUNE_IN_ONE {
        return conn
            .execute(
                sql::PRUNE_ALL,
                &[rfc3339(settled_before).into(), i64::from(limit).into()],
            )
            .await
            .map_err(|e| failed(e, "prune"));
    }
    let select = format!("{PRUNABLE}{}", C::LOCK_ROWS);
    let keys = conn
        .rows(
            &select,
            &[rfc3339(settled_before).into(), i64::from(limit).into()],
        )
        .await
        .map_err(|e| failed(e, "prune"))?;
    let mut deleted = 0;
    for key in keys {
        let [run_id, call_id] = key.as_slice() else {
            continue;
        };
        let params: [Param; 2] = [run_id.into(), call_id.into()];
        for statement in sql::PRUNE {
            let n = conn
                .execute(statement, &params)
                .await
                .map_err(|e| failed(e, "prune"))?;
            if statement == sql::PRUNE[3] {
                deleted += n;
            }
        }
    }
    Ok(deleted)
}

/// Writes a transaction's timeline rows, in their order, in one statement.
///
/// # Errors
/// The database's failure.
pub(crate) async fn write_notes<C: Conn>(conn: &mut C, notes: Vec<Note>) -> Result<(), StoreError> {
    // Chunks of 64, 32, …, 1 rows: a handful of statement texts, each
    // prepared once and cached by both backends.
    let mut rest = notes.as_slice();
    while !rest.is_empty() {
        let size = if rest.len() >= 64 {
            64
        } else {
            1 << (usize::BITS - 1 - rest.len().leading_zeros())
        };
        let (chunk, after) = rest.split_at(size);
        rest = after;
        let mut statement = String::from(sql::INSERT_EVENTS);
        let mut params = Vec::with_capacity(chunk.len() * 5);
        for (i, n) in chunk.iter().enumerate() {
            let k = i * 5;
            if i > 0 {
                statement.push_str(", ");
            }
            statement.push_str(&format!(
                "(${}, ${}, ${}, ${}, ${})",
                k + 1,
                k + 2,
                k + 3,
                k + 4,
                k + 5
            ));
            params.extend([
                Param::from(&n.run_id),
                (&n.call_id).into(),
                (&n.at).into(),
                (&n.what).into(),
                (&n.detail).into(),
            ]);
        }
        conn.execute(&statement, &params)
            .await
            .map_err(|e| failed(e, "timeline"))?;
    }
    Ok(())
}
