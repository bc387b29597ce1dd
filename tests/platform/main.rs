//! Black-box conformance tests of the development platform against
//! `shared/protocol.md` (see `docs/protocol-tests.md` for the row-by-row map).
//! One integration-test binary: `cargo test --test platform`.

#![allow(missing_docs, unreachable_pub)]

#[allow(dead_code)]
mod common;

mod claim;
mod configuration;
mod connection;
mod conventions;
mod devplatform;
mod garbage;
mod lifecycle;
mod persistence;
mod projection;
mod receipts;
mod review;
