//! The loops: each decides when there is work and what it is, and hands
//! it to the one dispatch queue ([`super::dispatch`]), which starts it. No
//! loop drives, checks or delivers a call, prunes or publishes itself
//! (the `layers` test keeps this: nothing here names the call's steps,
//! the outbox, the gauges or `tokio::spawn`).

pub(crate) mod claimer;
pub(crate) mod gauges;
pub(crate) mod outbox;
pub(crate) mod reconcile;
pub(crate) mod recovery;
pub(crate) mod retention;
pub(crate) mod stream;
