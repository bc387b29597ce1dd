//! The call lifecycle, written once: the local states, the table of allowed
//! transitions, and [`advance`], the only function that changes a call row.
//!
//! Every other module asks for a transition by naming an [`Event`]; none
//! assigns a state. [`plan`] turns the stored row and the event into the
//! new row and everything written with it (receipts, receipt marks,
//! attempts, timeline entries); [`advance`] commits that as a
//! compare-and-set on the row's `version`. A lost race is re-read and
//! re-decided, never overwritten. `docs/architecture.md` shows [`TABLE`] as
//! a diagram; a test keeps the two the same.
use std::time::Duration;

use serde_json::{Value, json};
use toolrunner_protocol::wire::{Assignment, CallState, ReceiptKind};

use crate::store::{
    Attempt, Change, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus, Store,
    StoreError, StoreTransaction, Timestamp, TxError, now,
};

use LocalState::{
    Abandoned, Assigned, Claiming, Compensated, Delivered, Orphaned, ReconciliationRequired,
    Rejected, Released, Running, Settled,
};

mod event;
mod plan;
mod table;
mod transition;

pub(crate) use event::*;
pub(crate) use plan::*;
pub(crate) use table::*;
pub(crate) use transition::*;

#[cfg(test)]
mod tests;
