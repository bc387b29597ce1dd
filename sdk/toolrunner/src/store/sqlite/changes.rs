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

impl ToSql for Param<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            Param::Text(Some(s)) => ToSqlOutput::from(s.as_ref()),
            Param::Text(None) => ToSqlOutput::Owned(Value::Null),
            Param::Int(n) => ToSqlOutput::from(*n),
        })
    }
}

/// Where SQLite put each `$n` of `sql` (`$1` first): it numbers named
/// parameters in the order they first appear. Worked out once per
/// statement text and kept.
fn indexes_of(sql: &str) -> std::rc::Rc<Vec<Option<usize>>> {
    thread_local! {
        static KNOWN: std::cell::RefCell<std::collections::HashMap<String, std::rc::Rc<Vec<Option<usize>>>>> =
            std::cell::RefCell::default();
    }
    KNOWN.with(|known| {
        if let Some(found) = known.borrow().get(sql) {
            return found.clone();
        }
        let mut seen: Vec<usize> = Vec::new();
        let bytes = sql.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'$' {
                let digits = bytes[i + 1..]
                    .iter()
                    .take_while(|b| b.is_ascii_digit())
                    .count();
                if let Ok(n) = sql[i + 1..i + 1 + digits].parse::<usize>()
                    && !seen.contains(&n)
                {
                    seen.push(n);
                }
                i += 1 + digits;
            } else {
                i += 1;
            }
        }
        let most = seen.iter().copied().max().unwrap_or(0);
        let indexes: Vec<Option<usize>> = (1..=most)
            .map(|n| seen.iter().position(|m| *m == n).map(|p| p + 1))
            .collect();
        let indexes = std::rc::Rc::new(indexes);
        known.borrow_mut().insert(sql.to_owned(), indexes.clone());
        indexes
    })
}

/// The writer's connection inside its transaction.
pub(super) struct Writer<'c>(pub(super) &'c Connection);

impl Writer<'_> {
    /// The statement, prepared (and cached), its `$n` bound by name.
    fn prepared(
        &self,
        sql: &str,
        params: &[Param<'_>],
    ) -> rusqlite::Result<rusqlite::CachedStatement<'_>> {
        let mut statement = self.0.prepare_cached(sql)?;
        let indexes = indexes_of(sql);
        for (p, index) in params.iter().zip(indexes.iter()) {
            if let Some(index) = index {
                statement.raw_bind_parameter(*index, p)?;
            }
        }
        Ok(statement)
    }

    fn run(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, SqlFailure> {
        let mut statement = self.prepared(sql, params).map_err(failure)?;
        let changed = statement.raw_execute().map_err(failure)?;
        Ok(changed as u64)
    }

    fn fetch(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Vec<String>>, SqlFailure> {
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
    const PRUNE_IN_ONE: bool = false;

    fn execute(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<u64, SqlFailure>> + Send {
        std::future::ready(self.run(sql, params))
    }

    fn rows(
        &mut self,
        sql: &str,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<Vec<String>>, SqlFailure>> + Send {
        std::future::ready(self.fetch(sql, params))
    }
}

/// The outcome of a future the writer's statements make: ready at once.
pub(super) fn now<T>(work: impl Future<Output = T>) -> T {
    futures_util::FutureExt::now_or_never(work)
        .expect("the SQLite writer's statements complete at once")
}

#[cfg(test)]
mod tests {
    use super::indexes_of;

    /// SQLite numbers named parameters as they first appear: `$3` first is
    /// index 1, and a `$n` used twice keeps its index.
    #[test]
    fn each_dollar_parameter_is_found_where_sqlite_put_it() {
        let sql = "UPDATE t SET a = $3, b = $4 WHERE k = $1 AND l = $2 AND (CAST($4 AS TEXT) IS NULL OR m = $4)";
        assert_eq!(*indexes_of(sql), vec![Some(3), Some(4), Some(1), Some(2)]);
        assert_eq!(*indexes_of("SELECT $2"), vec![None, Some(1)]);
    }
}
