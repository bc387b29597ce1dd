#![doc = include_str!("../README.md")]

mod authorizer;
mod builder;
mod client;
mod context;
mod error;
mod function;
mod handler;
mod lifecycle;
pub mod platform;
mod reconciler;
mod runner;
pub mod store;
#[cfg(feature = "testing")]
pub mod testing;
mod tls;

pub use authorizer::{AllowAll, AuthorizationRequest, Authorizer, Denied};
pub use builder::ENV_VARS;
pub use builder::{Executor, ExecutorBuilder};
pub use context::{CallContext, CommitPointError, Progress, ProgressError, Transaction};
pub use error::{Error, Result, shutdown_signal};
pub use function::{FnTool, Handler, IntoTool, ReconcileHandler, State};
#[doc(hidden)]
pub use function::{Registered, StateNeed, States};
pub use handler::{DEFAULT_COMMIT_WINDOW, Effect, OutcomeExt, Reconciled, Tool, ToolError};
pub use toolrunner_macros::{schema, tool};

/// Function tools: [`write`](tool::write), [`read`](tool::read) and
/// [`transactional`](tool::transactional) make a tool of an `async fn`
/// (the `#[toolrunner::tool]` attribute does the same from the function's
/// doc comment).
pub mod tool {
    pub use crate::function::{read, transactional, write};
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
