#![doc = include_str!("../README.md")]

// The layers, from the bottom up (docs/architecture.md, "Layers"; the test
// `layers` keeps them): base, the store and the network, the lifecycle and
// the handler API, the runner, the executor (builder, reconciler), the
// testing kit. Each imports only from the layers below it.
mod api;
mod builder;
mod error;
mod gate;
mod lifecycle;
mod net;
mod reconciler;
mod runner;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;

pub use net::platform;

pub use api::authorizer::{AllowAll, AuthorizationRequest, Authorizer, Denied};
pub use api::context::{CallContext, CommitPointError, Progress, ProgressError};
pub use api::function::{FnTool, Handler, IntoTool, ReconcileHandler, State};
#[doc(hidden)]
pub use api::function::{Registered, StateNeed, States};
pub use api::handler::{DEFAULT_COMMIT_WINDOW, Effect, OutcomeExt, Reconciled, Tool, ToolError};
pub use api::transaction::Transaction;
pub use builder::ENV_VARS;
pub use builder::{Executor, ExecutorBuilder};
pub use error::{Error, Result, shutdown_signal};
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

/// Re-exported for `#[async_trait]` on handlers.
pub use async_trait::async_trait;
/// Re-exported so handlers can derive their schemas.
pub use schemars;
/// The database library a handler's [`Transaction`] speaks (the same
/// version the store uses).
pub use sqlx;
/// The protocol's types and rules.
pub use toolrunner_protocol as protocol;
