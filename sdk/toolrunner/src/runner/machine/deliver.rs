//! A stored receipt's delivery: what its reply makes of the receipt and
//! of the call (protocol §6, the final receipt's rows; a progress receipt
//! refused for good is dropped).
use toolrunner_protocol::wire::{ReceiptAnswer, ReceiptKind};

use super::Reply;
use crate::lifecycle::Event;

/// A receipt's mark after a delivery that settles nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mark {
    /// Delivered.
    Delivered,
    /// Refused for good (a progress receipt: dropped).
    Rejected,
}

/// What the driver does with the reply to a receipt.
#[must_use]
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // short-lived: one per step
pub(crate) enum OnDelivery {
    /// A final receipt's fate: record this event on the settled call.
    Settle(Event),
    /// A progress receipt's fate: mark it.
    Mark(Mark),
    /// No verdict, or wrong credentials: the receipt stays pending and is
    /// sent again later. `defer`: a final receipt's call records
    /// `DeliveryDeferred` (it is reported meanwhile).
    Later {
        /// Whether the call records `DeliveryDeferred`.
        defer: bool,
    },
}

/// What the reply to receipt `receipt_id` (of `kind`, at `sequence`) asks
/// of the driver.
pub(crate) fn on_reply(
    reply: &Reply<&ReceiptAnswer>,
    kind: ReceiptKind,
    sequence: u64,
    receipt_id: &str,
) -> OnDelivery {
    let is_final = kind.is_final();
    let receipt_id = receipt_id.to_owned();
    match reply {
        Reply::Answered(_) if is_final => OnDelivery::Settle(Event::Delivered { receipt_id }),
        Reply::Answered(_) => OnDelivery::Mark(Mark::Delivered),
        // Not a verdict on the receipt: the credentials are wrong.
        r if r.is_configuration() => OnDelivery::Later { defer: false },
        r if r.is_silence() => OnDelivery::Later { defer: is_final },
        _ if !is_final => OnDelivery::Mark(Mark::Rejected),
        Reply::Refused { status, code, .. } => {
            let error = reply.said();
            OnDelivery::Settle(match (*status, code.as_str()) {
                // A sequence-0 `failed` settles a call refused before
                // start: nothing ran, so its refusal leaves nothing
                // unknown.
                _ if kind == ReceiptKind::Failed && sequence == 0 => {
                    Event::FinalRefusedNothingRan { receipt_id, error }
                }
                (_, "run_terminated" | "call_already_terminal") => {
                    Event::FinalRejected { receipt_id, error }
                }
                (404, _) => Event::FinalOrphaned { receipt_id, error },
                _ => Event::FinalRefused { receipt_id, error },
            })
        }
        Reply::Unreachable(_) | Reply::NotSent => OnDelivery::Later { defer: is_final },
    }
}
