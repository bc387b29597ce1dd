#![doc = include_str!("../README.md")]

mod authorizer;
mod builder;
mod client;
mod context;
mod error;
mod handler;
mod lifecycle;
mod reconciler;
mod runner;
pub mod store;
mod tls;

pub use authorizer::{AllowAll, AuthorizationRequest, Authorizer, Denied};
pub use builder::{Executor, ExecutorBuilder};
pub use context::{CallContext, CommitPointError, ProgressError};
pub use error::{Error, Result};
pub use handler::{Effect, Reconciled, Tool, ToolError};
pub use reconciler::{
    CallSummary, Evidence, OutboxStatus, Outcome, ReceiptView, Reconciler, Resolved, Timeline,
};
pub use runner::{RunningExecutor, Shutdown};

/// Re-exported for `#[async_trait]` on handlers.
pub use async_trait::async_trait;
/// Re-exported so handlers can derive their schemas.
pub use schemars;
/// The protocol's types and rules.
pub use toolrunner_protocol as protocol;
