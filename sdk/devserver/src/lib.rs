#![doc = include_str!("../README.md")]

mod engine;
mod faults;
mod http;
mod server;
mod store;
mod stream;

pub use faults::Faults;
pub use http::auth::Scope;
pub use server::{
    DEFAULT_TOKENS, DevServer, DevServerBuilder, Error, ReceivedConnect, ReceivedReceipt,
};
