//! The store's statements ([`crate::store::write`]) on a sqlx connection:
//! a handler's transaction on SQLite, and the PostgreSQL store's commits
//! and handler transactions. One adapter, written once for both.

use crate::store::write::{Param, SqlFailure};

/// A constraint the schema enforces failed (unique, check, foreign key,
/// not null; on PostgreSQL any of SQLSTATE class 23): a row that must
/// never exist.
fn failure(e: sqlx::Error) -> SqlFailure {
    use sqlx::error::ErrorKind;
    if let sqlx::Error::Database(d) = &e
        && (matches!(
            d.kind(),
            ErrorKind::UniqueViolation
                | ErrorKind::ForeignKeyViolation
                | ErrorKind::NotNullViolation
                | ErrorKind::CheckViolation
        ) || d.code().is_some_and(|c| c.starts_with("23")))
    {
        return SqlFailure::Constraint(d.message().to_owned());
    }
    SqlFailure::Other(e.into())
}

/// An adapter named `$name` over `&mut $conn` of database `$db`.
macro_rules! sqlx_conn {
    ($(#[$meta:meta])* $name:ident, $conn:ty, $db:ty, $args:ty, $lock:literal, $prune_in_one:literal) => {
        $(#[$meta])*
        pub(crate) struct $name<'c>(pub(crate) &'c mut $conn);

        impl $name<'_> {
            fn query<'q>(
                sql: &'q str,
                params: &'q [Param<'q>],
            ) -> sqlx::query::Query<'q, $db, $args> {
                let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
                for p in params {
                    q = match p {
                        Param::Text(s) => q.bind(s.as_deref()),
                        Param::Int(n) => q.bind(*n),
                    };
                }
                q
            }
        }

        impl crate::store::write::Conn for $name<'_> {
            const LOCK_ROWS: &'static str = $lock;
            const PRUNE_IN_ONE: bool = $prune_in_one;

            async fn execute(&mut self, sql: &str, params: &[Param<'_>]) -> Result<u64, SqlFailure> {
                Self::query(sql, params)
                    .execute(&mut *self.0)
                    .await
                    .map(|done| done.rows_affected())
                    .map_err(failure)
            }

            async fn rows(
                &mut self,
                sql: &str,
                params: &[Param<'_>],
            ) -> Result<Vec<Vec<String>>, SqlFailure> {
                use sqlx::Row;
                let rows = Self::query(sql, params)
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
    };
}

sqlx_conn!(
    /// A handler's transaction on SQLite.
    SqliteTx,
    sqlx::SqliteConnection,
    sqlx::Sqlite,
    sqlx::sqlite::SqliteArguments,
    "",
    false
);

#[cfg(feature = "postgres")]
sqlx_conn!(
    /// A PostgreSQL connection inside a transaction (the store's commits, a
    /// handler's transaction).
    Pg,
    sqlx::PgConnection,
    sqlx::Postgres,
    sqlx::postgres::PgArguments,
    " FOR UPDATE",
    true
);
