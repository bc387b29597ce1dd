//! The `accepted` receipt: what the accept step does with the one saved
//! for the assignment, and with the platform's reply to it.
use toolrunner_protocol::wire::{CallState, ReceiptAnswer};

use super::{Pause, Reply};
use crate::lifecycle::Event;

/// The `accepted` saved for the call's current assignment, as the accept
/// step finds it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Saved {
    /// None yet.
    None,
    /// Saved and not refused (pending, or delivered before).
    Sendable,
    /// Refused before, or never to be sent (its status).
    Spent {
        /// The receipt's id.
        receipt_id: String,
        /// Its status.
        status: String,
    },
}

/// What the accept step does with the saved `accepted`.
#[must_use]
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // short-lived: one per step
pub(crate) enum OnSaved {
    /// Send it again, the same id and bytes (crash table: "assignment
    /// saved, `accepted` not confirmed").
    Send,
    /// Record this event: claim again with the same key, and let the
    /// platform's answer decide.
    Reclaim(Event),
    /// None saved: the checks first, then save one (or the refusal).
    CheckThenSave,
}

/// What the accept step does with what it found saved.
pub(crate) fn on_saved(saved: &Saved) -> OnSaved {
    match saved {
        Saved::None => OnSaved::CheckThenSave,
        Saved::Sendable => OnSaved::Send,
        Saved::Spent { receipt_id, status } => OnSaved::Reclaim(Event::AcceptRefusedPending {
            receipt_id: receipt_id.clone(),
            why: format!("the saved accepted is {status}"),
        }),
    }
}

/// What the driver does with the reply to an `accepted`.
#[must_use]
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum OnAccepted {
    /// `accepted: true`: past the fail point `after_accepted_confirmed`,
    /// record this confirmation; then the handler may start.
    Confirmed(Event),
    /// Record this event: nothing may start (claim again with the same key
    /// if the call may be `pending` again, else `abandoned`), or the call
    /// is resumed as after a crash (`AcceptFoundReconciling`).
    Record(Event),
    /// Keep the assignment and the saved `accepted`, stop claiming: the
    /// credentials are wrong (`401`, `403 missing_scope`).
    Configuration(Pause),
    /// No verdict: the call waits, `assigned`, its `accepted` saved.
    Wait(Pause),
}

/// What the reply to the `accepted` receipt `receipt_id` asks of the
/// driver (protocol §6, the `accepted` rows).
pub(crate) fn on_reply(reply: &Reply<&ReceiptAnswer>, receipt_id: &str) -> OnAccepted {
    let receipt_id = receipt_id.to_owned();
    match reply {
        Reply::Answered(answer) if answer.accepted == Some(true) => {
            OnAccepted::Confirmed(Event::AcceptConfirmed { receipt_id })
        }
        // A replay answered false while the platform holds the call
        // `reconciliation_required`: this `accepted` was confirmed once
        // (its answer was lost) and another store of this executor id
        // reported the call since; the platform waits for a final receipt
        // under this assignment, which only this store holds. Resumed as
        // the crash table's "`accepted` confirmed" row says
        // (docs/protocol.md, choice 76).
        Reply::Answered(answer)
            if answer.replayed && answer.call_state == CallState::ReconciliationRequired =>
        {
            OnAccepted::Record(Event::AcceptFoundReconciling { receipt_id })
        }
        Reply::Answered(answer) => {
            let why = format!(
                "accepted answered false (call {})",
                answer.call_state.as_str()
            );
            OnAccepted::Record(if answer.call_state == CallState::Pending {
                Event::AcceptRefusedPending { receipt_id, why }
            } else {
                Event::AcceptRefused { receipt_id, why }
            })
        }
        Reply::NotSent => OnAccepted::Wait(Pause::LeaseNotLive),
        Reply::Unreachable(m) => OnAccepted::Wait(Pause::waits(m.clone())),
        r if r.is_configuration() => OnAccepted::Configuration(Pause::waits(r.said())),
        Reply::Refused { code, message, .. } => {
            let why = format!("accepted refused: {message}");
            OnAccepted::Record(if code == "invalid_grant" {
                Event::AcceptRefusedPending { receipt_id, why }
            } else {
                Event::AcceptRefused { receipt_id, why }
            })
        }
    }
}
