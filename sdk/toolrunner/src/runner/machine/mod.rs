//! The call machine: what a call's steps decide, with no I/O. A reply of
//! the platform (to a claim, to an `accepted`, to a receipt) or what the
//! step found stored goes in; a `#[must_use]` decision comes out, which
//! the driver (`runner/call/`, `runner/outbox.rs`) performs: a lifecycle
//! event to record, a request to send, a pause. Nothing here is `async`,
//! and nothing names tokio, the store, the client or `Core` (the layers
//! test keeps it so): a test states a path as its inputs and the decisions
//! it expects (`tests.rs`: one per row of the contract's "what the
//! executor does with each answer" and crash tables).
mod pause;
mod reply;

pub(crate) mod accept;
pub(crate) mod claim;
pub(crate) mod deliver;
pub(crate) mod resume;
pub(crate) mod step;

pub(crate) use pause::Pause;
pub(crate) use reply::Reply;

#[cfg(test)]
mod tests;
