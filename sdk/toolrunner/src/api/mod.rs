//! The handler API: what product code writes and reads. The context of a
//! call ([`context`]), the tool trait and its erased route ([`handler`]),
//! function tools ([`function`]), the product's authorization
//! ([`authorizer`]) and the approval requests it may ask for
//! ([`approval`]), a tool's own approval policy ([`policy`]), and the
//! call's transaction ([`transaction`]). It
//! depends on nothing of the runner: a [`CallContext`](context::CallContext)
//! reaches the executor running its call through
//! [`CallHost`](context::CallHost), a trait this layer owns and the runner
//! implements.

pub(crate) mod approval;
pub(crate) mod authorizer;
pub(crate) mod context;
pub(crate) mod function;
pub(crate) mod handler;
pub(crate) mod limits;
pub(crate) mod policy;
pub(crate) mod transaction;
