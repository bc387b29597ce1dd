#![doc = include_str!("../README.md")]

// The layers, from the bottom up (docs/architecture.md, "Layers"; the test
// `layers` keeps them): base, the store and the network, the lifecycle and
// the handler API, the runner, the executor (builder, reconciler), the
// testing kit. Each imports only from the layers below it.
#[cfg(feature = "admin")]
pub mod admin;
mod api;
mod approvals;
mod builder;
#[cfg(feature = "console")]
pub mod console;
mod error;
mod gate;
mod health;
mod lifecycle;
mod limits_store;
mod net;
mod notice;
mod reconciler;
mod runner;
// The persistence SPI stays inside the crate: its `pub` items are reached
// only through the `testing` seam (`toolrunner::testing::store`).
#[cfg_attr(not(feature = "testing"), allow(unreachable_pub))]
mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use net::platform;

pub use api::authorizer::{AllowAll, AuthorizationRequest, Authorizer, Denied};
pub use api::context::{CallContext, CommitPointError, Progress, ProgressError};
pub use api::function::{FnTool, Handler, IntoTool, ReconcileHandler, State};
pub use api::handler::{
    DEFAULT_COMMIT_WINDOW, Effect, OutcomeExt, Reconciled, Tool, ToolError, ToolSchema,
};
pub use api::limits::Limits;
pub use api::policy::ApprovalPolicy;
pub use api::transaction::Transaction;
pub use approvals::{ApprovalRequest, ApprovalState, Approvals, ApproverCheck, Decision};
pub use builder::{ENV_VARS, PRINT_DEFINITIONS, UNBOUND};
pub use builder::{Executor, ExecutorBuilder};
pub use error::{Error, Result, shutdown_signal};
pub use health::{Health, HealthReport};
pub use limits_store::{StoredLimits, ToolLimits};
pub use store::sealing::{KEYS_ENV, KeyError, KeyRing, Keys, StoreKey};
pub use toolrunner_macros::{schema, tool};

/// Function tools: [`write`](tool::write), [`read`](tool::read) and
/// [`transactional`](tool::transactional) make a tool of an `async fn`
/// (the `#[toolrunner::tool]` attribute does the same from the function's
/// doc comment).
pub mod tool {
    pub use crate::api::function::{read, transactional, write};
}
pub use reconciler::{
    CallSummary, Evidence, OutboxStatus, Outcome, ReceiptView, Reconciler, Resolved, Timeline,
};
pub use runner::{RunningExecutor, Shutdown};
pub use store::Event as TimelineEvent;
pub use store::{Attempt, CallFilter, LocalState, ReceiptStatus, Timestamp, UnknownName};

/// The PostgreSQL schema that holds the store of the executor identity
/// `executor_id` on a `postgres://` store: the schema a transactional
/// tool's own tables go in, so that its writes and the call's receipt
/// commit in one transaction (`examples/orders.rs`).
#[cfg(feature = "postgres")]
pub fn postgres_schema(executor_id: &str) -> String {
    store::PgStore::identity_schema(executor_id)
}

/// Re-exported for `#[async_trait]` on handlers.
pub use async_trait::async_trait;
/// Re-exported so handlers can derive their schemas.
pub use schemars;
/// The database library a handler's [`Transaction`] speaks (the same
/// version the store uses).
pub use sqlx;
/// The protocol's types and rules.
pub use toolrunner_protocol as protocol;

/// What the `#[toolrunner::tool]` attribute's expansion names. Not part of
/// the API: nothing here is for you to name or implement, and it changes
/// without notice.
#[doc(hidden)]
pub mod __private {
    pub use crate::api::function::{Declaration, Declared, Registered, StateNeed, States};
}
