//! Every request and answer body of the protocol, as serde types.
//!
//! Request types reject fields they do not list (`deny_unknown_fields`);
//! answer types ignore unknown fields, as clients must.

mod admin;
mod calls;
mod config;
mod executor;
mod present;

pub use admin::*;
pub use calls::*;
pub use config::*;
pub use executor::*;

use serde::{Deserialize, Serialize};

/// `{"data": [...], "next_cursor": null}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct List<T> {
    /// The items of this page.
    pub data: Vec<T>,
    /// Opaque cursor of the next page, `None` on the last one.
    pub next_cursor: Option<String>,
}

/// A `(run_id, call_id)` pair. It appears in answers too, so it ignores
/// fields it does not know (clients must).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CallRef {
    /// The run.
    pub run_id: String,
    /// The call within the run.
    pub call_id: String,
}
