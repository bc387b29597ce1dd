#![doc = include_str!("../README.md")]

pub mod error;
pub mod json;
pub mod projection;
pub mod redact;
pub mod tooldef;
pub mod wire;

pub use error::{ApiError, ErrorBody, ErrorType};
pub use projection::{Projection, project};
