//! Why the store failed.

/// Why the store failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database answered an error.
    #[error("store database error: {0}")]
    Database(DatabaseError),
    /// The migrations failed.
    #[error("store migration failed: {0}")]
    Migrate(DatabaseError),
    /// A stored row does not parse.
    #[error("store row is corrupt: {0}")]
    Corrupt(String),
    /// A compare-and-set lost: someone else changed the call first (or a
    /// constraint refused a row that must never exist).
    #[error("call {0} changed under this write: {1}")]
    Conflict(String, String),
    /// The store's lock file cannot be created or locked.
    #[error("cannot lock the store: {0}")]
    Lock(String),
    /// Another process holds the store (two executors must never drive one
    /// store file).
    #[error(
        "store {path} is in use by another executor process (it holds the lock file {path}-lock); give every executor process its own store file"
    )]
    Locked {
        /// The store file.
        path: String,
    },
    /// The schema refused a row that must never exist (a second live final
    /// for a call, two receipts with one assignment and sequence, …): a bug
    /// caught before it wrote a second truth.
    #[error("store refused an impossible row: {0}")]
    Refused(String),
    /// The writer task is gone (the store was closed).
    #[error("store writer has stopped")]
    Closed,
    /// Another replica holds this executor identity now (it adopted it, or
    /// a newer process of it started): this process must stop, and its
    /// writes are refused.
    #[error("{0}")]
    Fenced(String),
    /// Another live process holds this executor identity on the shared
    /// database (it keeps renewing its lease): two processes were started
    /// with one executor id. The running one serves on.
    #[error("{0}")]
    InUse(String),
    /// This store cannot do what was asked (a store of your own that
    /// keeps the trait's default [`Store::begin`](super::Store::begin)).
    #[error("{0}")]
    Unsupported(String),
}

/// What the database said (its cause is the source; the database library
/// stays out of the public API).
#[derive(Debug)]
pub struct DatabaseError(pub(super) Box<dyn std::error::Error + Send + Sync>);

impl DatabaseError {
    /// A database failure told in words (no cause to keep).
    pub(crate) fn said(why: impl Into<String>) -> DatabaseError {
        DatabaseError(why.into().into())
    }
}

impl std::fmt::Display for DatabaseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for DatabaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        StoreError::Database(DatabaseError(Box::new(e)))
    }
}

impl From<sqlx::migrate::MigrateError> for StoreError {
    fn from(e: sqlx::migrate::MigrateError) -> Self {
        StoreError::Migrate(DatabaseError(Box::new(e)))
    }
}

impl From<StoreError> for crate::Error {
    fn from(e: StoreError) -> Self {
        crate::Error::new(crate::error::Kind::Store, e.to_string()).with_source(e)
    }
}
