//! The SQL of each [`Change`], on the writer's connection.
use rusqlite::{Connection, ErrorCode, OptionalExtension, params};

use crate::store::columns::{assignment_json, report_str, seq};
use crate::store::{
    Change, DatabaseError, LocalCall, ReceiptStatus, StoreError, now_rfc3339, rfc3339,
};

/// What the database said, kept as the source.
pub(super) fn db(e: rusqlite::Error) -> StoreError {
    StoreError::Database(DatabaseError(Box::new(e)))
}

/// A constraint the schema enforces failed: a row that must never exist.
fn refused(e: rusqlite::Error, what: &str) -> StoreError {
    if let rusqlite::Error::SqliteFailure(f, message) = &e
        && f.code == ErrorCode::ConstraintViolation
    {
        use rusqlite::ffi;
        let kinds = [
            ffi::SQLITE_CONSTRAINT_UNIQUE,
            ffi::SQLITE_CONSTRAINT_PRIMARYKEY,
            ffi::SQLITE_CONSTRAINT_CHECK,
            ffi::SQLITE_CONSTRAINT_FOREIGNKEY,
        ];
        if kinds.contains(&f.extended_code) {
            let message = message.clone().unwrap_or_else(|| f.to_string());
            return StoreError::Refused(format!("{what}: {message}"));
        }
    }
    db(e)
}

/// A timeline row, written with the others of its transaction in one
/// statement at its end.
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

/// Writes a transaction's timeline rows.
pub(super) fn write_notes(conn: &Connection, notes: &[Note]) -> Result<(), StoreError> {
    let mut insert = conn
        .prepare_cached(
            "INSERT INTO events (run_id, call_id, at, what, detail) VALUES (?1, ?2, ?3, ?4, ?5)",
        )
        .map_err(db)?;
    for n in notes {
        insert
            .execute(params![n.run_id, n.call_id, n.at, n.what, n.detail])
            .map_err(db)?;
    }
    Ok(())
}

/// Inserts a call row (`expect_version` `None`) or replaces it if its
/// stored version is `expect_version`; a conflict otherwise.
fn write_call(
    conn: &Connection,
    c: &LocalCall,
    expect_version: Option<u64>,
) -> Result<(), StoreError> {
    let assignment = assignment_json(c)?;
    let (created_at, updated_at) = (rfc3339(&c.created_at), rfc3339(&c.updated_at));
    let values = params![
        c.run_id,
        c.call_id,
        c.tool_name,
        c.operation_key,
        c.state.as_str(),
        assignment,
        seq(c.next_sequence),
        c.reason,
        report_str(c.report),
        seq(c.version),
        created_at,
        updated_at,
    ];
    let written = match expect_version {
        None => conn
            .prepare_cached(
                "INSERT INTO calls (run_id, call_id, tool_name, operation_key, state, assignment, next_sequence, reason, report, version, created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12) ON CONFLICT (run_id, call_id) DO NOTHING",
            )
            .and_then(|mut s| s.execute(values)),
        Some(v) => conn
            .prepare_cached(
                "UPDATE calls SET tool_name = ?3, operation_key = ?4, state = ?5, assignment = ?6, next_sequence = ?7,
                   reason = ?8, report = ?9, version = ?10, created_at = ?11, updated_at = ?12
                 WHERE run_id = ?1 AND call_id = ?2 AND version = ?13",
            )
            .and_then(|mut s| {
                let mut all = values.to_vec();
                let v = seq(v);
                all.push(&v);
                s.execute(all.as_slice())
            }),
    }
    .map_err(|e| refused(e, "call row"))?;
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

/// Applies one change; its timeline rows go to `notes`.
pub(super) fn apply(
    conn: &Connection,
    change: &Change,
    notes: &mut Vec<Note>,
) -> Result<(), StoreError> {
    match change {
        Change::InsertCall(c) => write_call(conn, c, None)?,
        Change::UpdateCall {
            expect_version,
            call,
        } => write_call(conn, call, Some(*expect_version))?,
        Change::AddReceipt(r) => {
            conn.prepare_cached(
                "INSERT INTO receipts (receipt_id, run_id, call_id, assignment_id, kind, sequence, body, status, attempts, last_error, created_at, delivered_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    r.receipt_id,
                    r.run_id,
                    r.call_id,
                    r.assignment_id,
                    r.kind.as_str(),
                    seq(r.sequence),
                    r.body,
                    r.status.as_str(),
                    i64::from(r.attempts),
                    r.last_error,
                    rfc3339(&r.created_at),
                    r.delivered_at.as_ref().map(rfc3339),
                ])
            })
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
            let row: Option<(String, String, String)> = conn
                .prepare_cached(
                    "UPDATE receipts SET status = ?2, last_error = COALESCE(?3, last_error), attempts = attempts + ?4,
                       delivered_at = COALESCE(?5, delivered_at)
                     WHERE receipt_id = ?1 AND status = 'pending' RETURNING run_id, call_id, kind",
                )
                .and_then(|mut s| {
                    s.query_row(
                        params![
                            receipt_id,
                            status.as_str(),
                            error,
                            i64::from(*attempt),
                            delivered_at
                        ],
                        |row| Ok((row.get(0)?, row.get(1)?, row.get(2)?)),
                    )
                    .optional()
                })
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
            let rows: Vec<(String, String)> = conn
                .prepare_cached(
                    "UPDATE receipts SET status = ?3, last_error = ?4
                     WHERE run_id = ?1 AND call_id = ?2 AND status = 'pending'
                       AND (?5 IS NULL OR assignment_id <> ?5) AND (?6 IS NULL OR kind = ?6)
                     RETURNING receipt_id, kind",
                )
                .and_then(|mut s| {
                    s.query_map(
                        params![
                            run_id,
                            call_id,
                            status.as_str(),
                            error,
                            keep,
                            only_kind.map(|k| k.as_str())
                        ],
                        |row| Ok((row.get(0)?, row.get(1)?)),
                    )?
                    .collect()
                })
                .map_err(|e| refused(e, "receipt status"))?;
            for (id, kind) in rows {
                let what = format!("receipt {kind} {}", status.as_str());
                note(notes, run_id, call_id, what, Some(format!("{id}: {error}")));
            }
        }
        Change::AddAttempt(a) => {
            conn.prepare_cached(
                "INSERT INTO attempts (run_id, call_id, operation_key, executor_id, assignment_id, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            )
            .and_then(|mut s| {
                s.execute(params![
                    a.run_id,
                    a.call_id,
                    a.operation_key,
                    a.executor_id,
                    a.assignment_id,
                    rfc3339(&a.created_at),
                ])
            })
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
        } => {
            prune(conn, settled_before, *limit)?;
        }
    }
    Ok(())
}

/// The calls [`Change::Prune`] may delete (`?1`: settled before; `?2`: at
/// most this many).
pub(super) const PRUNABLE: &str = concat!(prunable_calls!(), " AND updated_at < ?1 LIMIT ?2");

/// Deletes up to `limit` calls settled for good before `settled_before`,
/// with everything kept for them.
fn prune(
    conn: &Connection,
    settled_before: &crate::store::Timestamp,
    limit: u32,
) -> Result<(), StoreError> {
    let keys: Vec<(String, String)> = conn
        .prepare_cached(PRUNABLE)
        .and_then(|mut s| {
            s.query_map(params![rfc3339(settled_before), limit], |row| {
                Ok((row.get(0)?, row.get(1)?))
            })?
            .collect()
        })
        .map_err(db)?;
    for (run_id, call_id) in &keys {
        for sql in [
            "DELETE FROM events WHERE run_id = ?1 AND call_id = ?2",
            "DELETE FROM attempts WHERE run_id = ?1 AND call_id = ?2",
            "DELETE FROM receipts WHERE run_id = ?1 AND call_id = ?2",
            "DELETE FROM calls WHERE run_id = ?1 AND call_id = ?2",
        ] {
            conn.prepare_cached(sql)
                .and_then(|mut s| s.execute(params![run_id, call_id]))
                .map_err(|e| refused(e, "prune"))?;
        }
    }
    Ok(())
}
