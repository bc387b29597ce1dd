//! The store's statements ([`crate::store::write`]) on a PostgreSQL
//! connection (sqlx): the PostgreSQL store's commits and a handler's
//! transaction.

use sqlx::PgConnection;

use crate::store::write::{Conn, Param, SqlFailure};

/// A connection of the PostgreSQL store inside a transaction.
pub(crate) struct Pg<'c>(pub(crate) &'c mut PgConnection);

/// A constraint the schema enforces failed (SQLSTATE class 23: unique,
/// check, foreign key, not null): a row that must never exist.
fn failure(e: sqlx::Error) -> SqlFailure {
    if let sqlx::Error::Database(d) = &e
        && d.code().is_some_and(|c| c.starts_with("23"))
    {
        return SqlFailure::Constraint(d.message().to_owned());
    }
    SqlFailure::Other(e.into())
}

fn query<'q>(
    sql: &'q str,
    params: &'q [Param],
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    for p in params {
        q = match p {
            Param::Text(s) => q.bind(s.as_deref()),
            Param::Int(n) => q.bind(*n),
        };
    }
    q
}

impl Conn for Pg<'_> {
    const LOCK_ROWS: &'static str = " FOR UPDATE";

    async fn execute(&mut self, sql: &str, params: &[Param]) -> Result<u64, SqlFailure> {
        query(sql, params)
            .execute(&mut *self.0)
            .await
            .map(|done| done.rows_affected())
            .map_err(failure)
    }

    async fn rows(&mut self, sql: &str, params: &[Param]) -> Result<Vec<Vec<String>>, SqlFailure> {
        use sqlx::Row;
        let rows = query(sql, params)
            .fetch_all(&mut *self.0)
            .await
            .map_err(failure)?;
        rows.iter()
            .map(|row| {
                (0..row.len())
                    .map(|i| row.try_get::<String, _>(i).map_err(failure))
                    .collect()
            })
            .collect()
    }
}
