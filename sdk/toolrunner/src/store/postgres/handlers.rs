//! Handlers' transactions on PostgreSQL (`docs/protocol.md`, choice 70):
//! a pool of their own, never the store's (a slow handler holds one of
//! its connections from its first closure to its call's settlement, and
//! the store's writer, its reads and the health probe never wait for
//! one), whose connections are closed once a handler used them (whatever
//! a handler changed of its session goes with them); and, before the
//! executor writes a call's settlement into a handler's transaction, the
//! store's own settings asserted again for that transaction (`SET LOCAL`)
//! and the identity's fencing token checked again.
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{PgConnection, Postgres};

use super::lease::{self, Fence};
use crate::store::StoreError;

/// The session settings the store's own statements rely on, as a handler's
/// transaction began with them: asserted again (`SET LOCAL`) before the
/// settlement is written, whatever the handler set meanwhile. (The tables
/// the store names, its count triggers, the durability of its commit,
/// the role it writes as, the text encoding sqlx reads, and no timeout of
/// the handler's choosing on its statements.)
const KEPT: [&str; 7] = [
    "search_path",
    "session_replication_role",
    "synchronous_commit",
    "role",
    "client_encoding",
    "statement_timeout",
    "lock_timeout",
];

/// How long a handler's `ctx.transaction` waits for a connection of the
/// handlers' pool (all in use: more transactional handlers at once than
/// the executor's capacity, which recovery and hooks may briefly make).
const ACQUIRE_WITHIN: Duration = Duration::from_secs(10);

/// Connections of the handlers' pool beyond the executor's capacity: for
/// calls resumed without a capacity slot and `reconcile` hooks.
const RESERVE: u32 = 2;

/// The handlers' pool of one store: sized from the executor's capacity
/// before its first transaction, opened lazily.
#[derive(Debug, Default)]
pub(in crate::store) struct Handlers {
    pool: OnceLock<PgPool>,
    /// The executor's capacity (0: not told, the store's default of 8).
    capacity: AtomicU32,
}

impl Handlers {
    /// Sizes the pool for an executor of `capacity` (before its first
    /// transaction; later calls change nothing).
    pub(in crate::store) fn size_for(&self, capacity: u32) {
        self.capacity.store(capacity, Ordering::SeqCst);
    }

    fn pool(&self, options: &PgConnectOptions) -> &PgPool {
        self.pool.get_or_init(|| {
            let capacity = match self.capacity.load(Ordering::SeqCst) {
                0 => 8,
                n => n,
            };
            PgPoolOptions::new()
                .max_connections(capacity.saturating_add(RESERVE))
                .min_connections(0)
                .acquire_timeout(ACQUIRE_WITHIN)
                // Never handed to another handler: closed, and whatever
                // the handler set on its session goes with it.
                .after_release(|_, _| Box::pin(async { Ok(false) }))
                .connect_lazy_with(options.clone())
        })
    }

    /// Begins a handler's transaction on a connection of the handlers' pool
    /// (with `options`, the store's own: its schema, its session settings),
    /// checking the fencing token at once (held, a shared row lock, until
    /// the transaction ends).
    ///
    /// # Errors
    /// No connection within [`ACQUIRE_WITHIN`], the database failed, or
    /// the identity is fenced.
    pub(in crate::store) async fn begin(
        &self,
        options: &PgConnectOptions,
        fence: Option<&Fence>,
    ) -> Result<HandlerTx, StoreError> {
        let mut tx = self.pool(options).begin().await?;
        // A handler's transaction may wait on other work than the
        // database's for as long as the handler runs.
        sqlx::query("SET LOCAL idle_in_transaction_session_timeout = 0")
            .execute(&mut *tx)
            .await?;
        if let Some(fence) = fence {
            lease::check(&mut tx, fence).await?;
        }
        let mut settings: Vec<(String, String)> =
            sqlx::query_as("SELECT n, current_setting(n) FROM unnest($1::TEXT[]) AS n")
                .bind(KEPT.as_slice())
                .fetch_all(&mut *tx)
                .await?;
        // The session's temporary schema is searched first for tables
        // unless the path names it: named last, a handler's temporary table
        // called `calls` or `receipts` takes none of the settlement's
        // writes.
        for (name, value) in &mut settings {
            if name == "search_path" && !value.contains("pg_temp") {
                value.push_str(", pg_temp");
            }
        }
        Ok(HandlerTx {
            tx,
            settings,
            fence: fence.cloned(),
        })
    }
}

/// A handler's transaction on PostgreSQL, with what the store asserts
/// again before it writes a settlement into it.
pub(crate) struct HandlerTx {
    pub(in crate::store) tx: sqlx::Transaction<'static, Postgres>,
    /// [`KEPT`] as the transaction began with them.
    settings: Vec<(String, String)>,
    /// The identity's fence, checked again before the settlement.
    fence: Option<Fence>,
}

impl HandlerTx {
    /// The transaction's connection.
    pub(in crate::store) fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// Asserts the store's settings again for the rest of the transaction
    /// (`SET LOCAL`: only those a handler changed, so a setting only a
    /// superuser may set is set only where a superuser's handler changed
    /// it) and checks the fencing token again (a handler's own `COMMIT`
    /// would have let go of the first check's lock: this one is held until
    /// the settlement commits).
    ///
    /// # Errors
    /// The database failed (a handler's failed statement aborted the
    /// transaction), or the identity is fenced.
    pub(in crate::store) async fn restore(&mut self) -> Result<(), StoreError> {
        let (names, values): (Vec<&str>, Vec<&str>) = self
            .settings
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .unzip();
        sqlx::query(
            "SELECT set_config(n, v, true) FROM unnest($1::TEXT[], $2::TEXT[]) AS w(n, v)
             WHERE current_setting(n) IS DISTINCT FROM v",
        )
        .bind(names)
        .bind(values)
        .execute(&mut *self.tx)
        .await?;
        if let Some(fence) = &self.fence {
            lease::check(&mut self.tx, fence).await?;
        }
        Ok(())
    }
}
