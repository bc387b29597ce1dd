//! The store's statements ([`crate::store::write`]) on the SQLite writer's
//! connection (rusqlite). Every statement runs at once: the futures
//! [`Conn`] hands back are ready when they are made, so the writer's thread
//! drives [`crate::store::write::apply`] without a runtime ([`now`]).
use std::future::Future;

use rusqlite::types::{ToSqlOutput, Value};
use rusqlite::{Connection, ErrorCode, ToSql};

use crate::store::write::{Conn, Param, SqlFailure};
use crate::store::{DatabaseError, StoreError};

/// What the database said, kept as the source.
pub(super) fn db(e: rusqlite::Error) -> StoreError {
    StoreError::Database(DatabaseError(Box::new(e)))
}

/// A constraint the schema enforces failed: a row that must never exist.
fn failure(e: rusqlite::Error) -> SqlFailure {
    if let rusqlite::Error::SqliteFailure(f, message) = &e
        && f.code == ErrorCode::ConstraintViolation
    {
        use rusqlite::ffi;
        let kinds = [
            ffi::SQLITE_CONSTRAINT_UNIQUE,
            ffi::SQLITE_CONSTRAINT_PRIMARYKEY,
            ffi::SQLITE_CONSTRAINT_CHECK,
            ffi::SQLITE_CONSTRAINT_FOREIGNKEY,
            ffi::SQLITE_CONSTRAINT_NOTNULL,
        ];
        if kinds.contains(&f.extended_code) {
            return SqlFailure::Constraint(message.clone().unwrap_or_else(|| f.to_string()));
        }
    }
    SqlFailure::Other(db(e))
}

impl ToSql for Param {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            Param::Text(Some(s)) => ToSqlOutput::from(s.as_str()),
            Param::Text(None) => ToSqlOutput::Owned(Value::Null),
            Param::Int(n) => ToSqlOutput::from(*n),
        })
    }
}

/// The writer's connection inside its transaction.
pub(super) struct Writer<'c>(pub(super) &'c Connection);

impl Writer<'_> {
    /// The statement, prepared (and cached), its `$n` bound by name.
    fn prepared(
        &self,
        sql: &str,
        params: &[Param],
    ) -> rusqlite::Result<rusqlite::CachedStatement<'_>> {
        let mut statement = self.0.prepare_cached(sql)?;
        for (i, p) in params.iter().enumerate() {
            if let Some(index) = statement.parameter_index(&format!("${}", i + 1))? {
                statement.raw_bind_parameter(index, p)?;
            }
        }
        Ok(statement)
    }

    fn run(&self, sql: &str, params: &[Param]) -> Result<u64, SqlFailure> {
        let mut statement = self.prepared(sql, params).map_err(failure)?;
        let changed = statement.raw_execute().map_err(failure)?;
        Ok(changed as u64)
    }

    fn fetch(&self, sql: &str, params: &[Param]) -> Result<Vec<Vec<String>>, SqlFailure> {
        let mut statement = self.prepared(sql, params).map_err(failure)?;
        let columns = statement.column_count();
        let mut rows = statement.raw_query();
        let mut out = Vec::new();
        while let Some(row) = rows.next().map_err(failure)? {
            let mut values = Vec::with_capacity(columns);
            for i in 0..columns {
                values.push(row.get::<_, String>(i).map_err(failure)?);
            }
            out.push(values);
        }
        Ok(out)
    }
}

impl Conn for Writer<'_> {
    const LOCK_ROWS: &'static str = "";

    fn execute(
        &mut self,
        sql: &str,
        params: &[Param],
    ) -> impl Future<Output = Result<u64, SqlFailure>> + Send {
        std::future::ready(self.run(sql, params))
    }

    fn rows(
        &mut self,
        sql: &str,
        params: &[Param],
    ) -> impl Future<Output = Result<Vec<Vec<String>>, SqlFailure>> + Send {
        std::future::ready(self.fetch(sql, params))
    }
}

/// The outcome of a future the writer's statements make: ready at once.
pub(super) fn now<T>(work: impl Future<Output = T>) -> T {
    futures_util::FutureExt::now_or_never(work)
        .expect("the SQLite writer's statements complete at once")
}
