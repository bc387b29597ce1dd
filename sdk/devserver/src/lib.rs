#![doc = include_str!("../README.md")]

// Layers, from the bottom up (docs/architecture.md; the test `layers`
// keeps them): the engine, free of HTTP and SQL; the store; `http/`, the
// only module that names axum or hyper; the server that puts them together.
mod engine;
mod http;
mod server;
mod store;

pub use http::auth::Scope;
pub use http::faults::{Faults, ReceivedConnect, ReceivedReceipt};
pub use server::{DEFAULT_TOKENS, DevServer, DevServerBuilder, Error};
