//! The claim's reply: what it brings to the stored call, or why the call
//! waits with its key.
use toolrunner_protocol::wire::{CallState, Claimed};

use super::{Pause, Reply};
use crate::lifecycle::Event;

/// What the driver does with a claim's reply (protocol §6, "what the
/// executor does with each answer", the claim's rows).
#[must_use]
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // short-lived: one per step
pub(crate) enum OnClaim {
    /// Record the answer on the stored call: the event [`answered`]
    /// decides on the row as the compare-and-set reads it.
    Record,
    /// Record this event: the claim was refused and nothing ran (the call
    /// settles `abandoned`).
    Refused(Event),
    /// Keep everything and stop claiming: the credentials are wrong
    /// (`401`, `403 missing_scope`); the error is surfaced, the call waits.
    Configuration(Pause),
    /// The call waits with its key (no answer, a lapsed lease, the
    /// platform's capacity, a connection to make again).
    Wait(Pause),
}

/// What a claim's reply asks of the driver.
pub(crate) fn on_reply(reply: &Reply<&Claimed>) -> OnClaim {
    match reply {
        Reply::Answered(_) => OnClaim::Record,
        Reply::NotSent => OnClaim::Wait(Pause::LeaseNotLive),
        Reply::Unreachable(m) => OnClaim::Wait(Pause::waits(m.clone())),
        r if r.is_configuration() => OnClaim::Configuration(Pause::waits(r.said())),
        Reply::Refused { code, message, .. } => match code.as_str() {
            "capacity_exhausted" | "executor_draining" => {
                OnClaim::Wait(Pause::Deferred(message.clone()))
            }
            "lease_expired" | "connection_superseded" => {
                OnClaim::Wait(Pause::waits(message.clone()))
            }
            _ => OnClaim::Refused(Event::ClaimRefused {
                why: format!("claim refused, nothing ran: {message}"),
            }),
        },
    }
}

/// The event a claim's answer makes of the stored call. `refused_before`:
/// this assignment's `accepted` was refused before (the claim returned an
/// assignment on which nothing may start).
pub(crate) fn answered(claimed: &Claimed, refused_before: bool) -> Event {
    let assignment = claimed.assignment.clone();
    match claimed.call_state {
        CallState::Claimed if refused_before => Event::ClaimReturnedRefused { assignment },
        CallState::Claimed => Event::ClaimAnswered { assignment },
        CallState::Pending => Event::ClaimRefused {
            why: "the claim came back pending: nothing ran".into(),
        },
        platform if platform.is_terminal() => Event::ClaimFoundEnded {
            assignment,
            platform,
        },
        platform => Event::ClaimFoundRunning {
            assignment,
            platform,
        },
    }
}
