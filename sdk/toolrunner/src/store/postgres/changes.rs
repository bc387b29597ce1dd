//! The SQL of each [`Change`], in the commit's transaction (as
//! `store/sqlite/changes.rs`, statement for statement).
use sqlx::PgConnection;

use crate::store::columns::{assignment_json, report_str, seq};
use crate::store::{Change, LocalCall, ReceiptStatus, StoreError, Timestamp, now_rfc3339, rfc3339};

/// A constraint the schema enforces failed (SQLSTATE class 23: unique,
/// check, foreign key, not null): a row that must never exist.
fn refused(e: sqlx::Error, what: &str) -> StoreError {
    if let sqlx::Error::Database(d) = &e
        && d.code().is_some_and(|c| c.starts_with("23"))
    {
        return StoreError::Refused(format!("{what}: {}", d.message()));
    }
    e.into()
}

/// A timeline row, written with the others of its transaction at its end.
pub(super) struct Note {
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

/// Writes a transaction's timeline rows, in their order, in one statement.
pub(super) async fn write_notes(
    conn: &mut PgConnection,
    notes: Vec<Note>,
) -> Result<(), StoreError> {
    if notes.is_empty() {
        return Ok(());
    }
    let mut runs = Vec::with_capacity(notes.len());
    let mut calls = Vec::with_capacity(notes.len());
    let mut ats = Vec::with_capacity(notes.len());
    let mut whats = Vec::with_capacity(notes.len());
    let mut details = Vec::with_capacity(notes.len());
    for n in notes {
        runs.push(n.run_id);
        calls.push(n.call_id);
        ats.push(n.at);
        whats.push(n.what);
        details.push(n.detail);
    }
    sqlx::query(
        "INSERT INTO events (run_id, call_id, at, what, detail)
         SELECT run_id, call_id, at, what, detail
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::text[])
              WITH ORDINALITY AS n (run_id, call_id, at, what, detail, i)
         ORDER BY i",
    )
    .bind(runs)
    .bind(calls)
    .bind(ats)
    .bind(whats)
    .bind(details)
    .execute(conn)
    .await?;
    Ok(())
}

/// Inserts a call row (`expect_version` `None`) or replaces it if its
/// stored version is `expect_version`; a conflict otherwise.
async fn write_call(
    conn: &mut PgConnection,
    c: &LocalCall,
    expect_version: Option<u64>,
) -> Result<(), StoreError> {
    let sql = match expect_version {
        None => {
            "INSERT INTO calls (run_id, call_id, tool_name, operation_key, state, assignment, next_sequence, reason, report, version, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) ON CONFLICT (run_id, call_id) DO NOTHING"
        }
        Some(_) => {
            "UPDATE calls SET tool_name = $3, operation_key = $4, state = $5, assignment = $6, next_sequence = $7,
               reason = $8, report = $9, version = $10, created_at = $11, updated_at = $12
             WHERE run_id = $1 AND call_id = $2 AND version = $13"
        }
    };
    let mut query = sqlx::query(sql)
        .bind(&c.run_id)
        .bind(&c.call_id)
        .bind(&c.tool_name)
        .bind(&c.operation_key)
        .bind(c.state.as_str())
        .bind(assignment_json(c)?)
        .bind(seq(c.next_sequence))
        .bind(&c.reason)
        .bind(report_str(c.report))
        .bind(seq(c.version))
        .bind(rfc3339(&c.created_at))
        .bind(rfc3339(&c.updated_at));
    if let Some(v) = expect_version {
        query = query.bind(seq(v));
    }
    let written = query
        .execute(conn)
        .await
        .map_err(|e| refused(e, "call row"))?
        .rows_affected();
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
pub(super) async fn apply(
    conn: &mut PgConnection,
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
            sqlx::query(
                "INSERT INTO receipts (receipt_id, run_id, call_id, assignment_id, kind, sequence, body, status, attempts, last_error, created_at, delivered_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)",
            )
            .bind(&r.receipt_id)
            .bind(&r.run_id)
            .bind(&r.call_id)
            .bind(&r.assignment_id)
            .bind(r.kind.as_str())
            .bind(seq(r.sequence))
            .bind(&r.body)
            .bind(r.status.as_str())
            .bind(i64::from(r.attempts))
            .bind(&r.last_error)
            .bind(rfc3339(&r.created_at))
            .bind(r.delivered_at.as_ref().map(rfc3339))
            .execute(&mut *conn)
            .await
            .map_err(|e| refused(e, "receipt"))?;
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
            let row: Option<(String, String, String)> = sqlx::query_as(
                "UPDATE receipts SET status = $2, last_error = COALESCE($3, last_error), attempts = attempts + $4,
                   delivered_at = COALESCE($5, delivered_at)
                 WHERE receipt_id = $1 AND status = 'pending' RETURNING run_id, call_id, kind",
            )
            .bind(receipt_id)
            .bind(status.as_str())
            .bind(error)
            .bind(i64::from(*attempt))
            .bind(delivered_at)
            .fetch_optional(&mut *conn)
            .await
            .map_err(|e| refused(e, "receipt status"))?;
            if let Some((run, call, kind)) = row
                && status != ReceiptStatus::Pending
            {
                let what = format!("receipt {kind} {}", status.as_str());
                let detail = match error {
                    Some(e) => format!("{receipt_id}: {e}"),
                    None => receipt_id.clone(),
                };
                note(notes, &run, &call, what, Some(detail));
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
            let rows: Vec<(String, String)> = sqlx::query_as(
                "UPDATE receipts SET status = $3, last_error = $4
                 WHERE run_id = $1 AND call_id = $2 AND status = 'pending'
                   AND ($5::text IS NULL OR assignment_id <> $5) AND ($6::text IS NULL OR kind = $6)
                 RETURNING receipt_id, kind",
            )
            .bind(run_id)
            .bind(call_id)
            .bind(status.as_str())
            .bind(error)
            .bind(keep)
            .bind(only_kind.map(toolrunner_protocol::wire::ReceiptKind::as_str))
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| refused(e, "receipt status"))?;
            for (id, kind) in rows {
                let what = format!("receipt {kind} {}", status.as_str());
                note(notes, run_id, call_id, what, Some(format!("{id}: {error}")));
            }
        }
        Change::AddAttempt(a) => {
            sqlx::query(
                "INSERT INTO attempts (run_id, call_id, operation_key, executor_id, assignment_id, created_at)
                 VALUES ($1, $2, $3, $4, $5, $6)",
            )
            .bind(&a.run_id)
            .bind(&a.call_id)
            .bind(&a.operation_key)
            .bind(&a.executor_id)
            .bind(&a.assignment_id)
            .bind(rfc3339(&a.created_at))
            .execute(&mut *conn)
            .await
            .map_err(|e| refused(e, "attempt"))?;
        }
        Change::Note {
            run_id,
            call_id,
            what,
            detail,
        } => {
            note(notes, run_id, call_id, what.clone(), detail.clone());
        }
        Change::Prune {
            settled_before,
            limit,
        } => return prune(conn, settled_before, *limit).await,
    }
    Ok(0)
}

/// The calls [`Change::Prune`] may delete (`$1`: settled before; `$2`: at
/// most this many), locked until the transaction ends.
const PRUNABLE: &str = concat!(
    prunable_calls!(),
    " AND updated_at < $1 LIMIT $2 FOR UPDATE"
);

/// Deletes up to `limit` calls settled for good before `settled_before`,
/// with everything kept for them; how many calls went.
async fn prune(
    conn: &mut PgConnection,
    settled_before: &Timestamp,
    limit: u32,
) -> Result<u64, StoreError> {
    let keys: Vec<(String, String)> = sqlx::query_as(PRUNABLE)
        .bind(rfc3339(settled_before))
        .bind(i64::from(limit))
        .fetch_all(&mut *conn)
        .await?;
    if keys.is_empty() {
        return Ok(0);
    }
    let (runs, calls): (Vec<String>, Vec<String>) = keys.into_iter().unzip();
    let mut deleted = 0;
    for sql in [
        "DELETE FROM events WHERE (run_id, call_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))",
        "DELETE FROM attempts WHERE (run_id, call_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))",
        "DELETE FROM receipts WHERE (run_id, call_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))",
        "DELETE FROM calls WHERE (run_id, call_id) IN (SELECT * FROM UNNEST($1::text[], $2::text[]))",
    ] {
        deleted = sqlx::query(sql)
            .bind(&runs)
            .bind(&calls)
            .execute(&mut *conn)
            .await
            .map_err(|e| refused(e, "prune"))?
            .rows_affected();
    }
    // The last statement's count: the calls.
    Ok(deleted)
}
