//! A stored row of either backend decoded once: [`call_row`] and
//! [`receipt_row`] read through [`Columns`], which each backend's row type
//! implements.
use toolrunner_protocol::wire::{Assignment, ReceiptKind};

use super::columns::{corrupt, parse_state, time};
use super::{LocalCall, OutboxReceipt, PendingReport, ReceiptStatus, StoreError};

/// The columns of a row, by name.
pub(super) trait Columns {
    /// A text column.
    fn text(&self, name: &str) -> Result<String, StoreError>;
    /// A text column that may be `NULL`.
    fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError>;
    /// An integer column.
    fn int(&self, name: &str) -> Result<i64, StoreError>;
}

macro_rules! columns_of {
    ($row:ty) => {
        impl Columns for $row {
            fn text(&self, name: &str) -> Result<String, StoreError> {
                Ok(sqlx::Row::try_get(self, name)?)
            }
            fn opt_text(&self, name: &str) -> Result<Option<String>, StoreError> {
                Ok(sqlx::Row::try_get(self, name)?)
            }
            fn int(&self, name: &str) -> Result<i64, StoreError> {
                Ok(sqlx::Row::try_get(self, name)?)
            }
        }
    };
}

columns_of!(sqlx::sqlite::SqliteRow);
#[cfg(feature = "postgres")]
columns_of!(sqlx::postgres::PgRow);

/// A call row.
pub(super) fn call_row(row: &impl Columns) -> Result<LocalCall, StoreError> {
    let state: String = row.text("state")?;
    let assignment: Option<String> = row.opt_text("assignment")?;
    let report: Option<String> = row.opt_text("report")?;
    let seq: i64 = row.int("next_sequence")?;
    Ok(LocalCall {
        run_id: row.text("run_id")?,
        call_id: row.text("call_id")?,
        tool_name: row.text("tool_name")?,
        operation_key: row.text("operation_key")?,
        state: parse_state(&state)?,
        assignment: assignment
            .map(|a| serde_json::from_str::<Assignment>(&a))
            .transpose()
            .map_err(corrupt)?,
        next_sequence: u64::try_from(seq).map_err(corrupt)?,
        reason: row.opt_text("reason")?,
        report: report
            .map(|r| serde_json::from_value::<PendingReport>(serde_json::Value::String(r)))
            .transpose()
            .map_err(corrupt)?,
        created_at: time(&row.text("created_at")?)?,
        updated_at: time(&row.text("updated_at")?)?,
        version: u64::try_from(row.int("version")?).map_err(corrupt)?,
    })
}

/// A receipt row.
pub(super) fn receipt_row(row: &impl Columns) -> Result<OutboxReceipt, StoreError> {
    let kind: String = row.text("kind")?;
    let status: String = row.text("status")?;
    let seq: i64 = row.int("sequence")?;
    let attempts: i64 = row.int("attempts")?;
    Ok(OutboxReceipt {
        receipt_id: row.text("receipt_id")?,
        run_id: row.text("run_id")?,
        call_id: row.text("call_id")?,
        assignment_id: row.text("assignment_id")?,
        kind: serde_json::from_value::<ReceiptKind>(serde_json::Value::String(kind))
            .map_err(corrupt)?,
        sequence: u64::try_from(seq).map_err(corrupt)?,
        body: row.text("body")?,
        status: ReceiptStatus::parse(&status)
            .ok_or_else(|| corrupt(format!("unknown receipt status {status}")))?,
        attempts: u32::try_from(attempts).unwrap_or(u32::MAX),
        last_error: row.opt_text("last_error")?,
        created_at: time(&row.text("created_at")?)?,
        delivered_at: row
            .opt_text("delivered_at")?
            .as_deref()
            .map(time)
            .transpose()?,
    })
}
