//! A `running` call about to run: started by this very task's
//! confirmation, or found again (the crash table's "`accepted` confirmed,
//! no final receipt saved" row).
use super::Pause;
use crate::api::handler::Effect;
use crate::lifecycle::Event;

/// Whether this build re-runs a write tool after a crash: a deliberate
/// bug, compiled only with `RUSTFLAGS='--cfg toolrunner_planted="rerun"'`,
/// which the simulation must catch (`docs/simulation.md`).
pub(crate) const PLANTED_RERUN: bool = cfg!(toolrunner_planted = "rerun");

/// Whether this build runs a transactional call again after the platform
/// ended it while the process was away: a deliberate bug, compiled only
/// with `RUSTFLAGS='--cfg toolrunner_planted="resume"'`, which the
/// simulation must catch (`docs/simulation.md`).
pub(crate) const PLANTED_RESUME: bool = cfg!(toolrunner_planted = "resume");

/// What the run step does with a `running` call.
#[must_use]
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // short-lived: one per step
pub(crate) enum OnRunning {
    /// Start the handler.
    Run,
    /// Settle the call with this event instead.
    Settle(Event),
    /// A transactional call found again: first a live lease (a heartbeat
    /// that also brings any cancellation of its run), then
    /// [`transactional_again`].
    CheckLease,
}

/// What the run step does with a `running` call of a tool with `effect`
/// (`None`: a tool this executor does not serve); `resumed`: found again,
/// not started by this task's own confirmation.
pub(crate) fn on_running(effect: Option<Effect>, resumed: bool) -> OnRunning {
    let unknown = |why: &str| {
        OnRunning::Settle(Event::OutcomeUnknown {
            why: why.to_owned(),
            evidence: None,
        })
    };
    match effect {
        None => unknown("running call of a tool this executor does not serve"),
        // A write tool's effect may have happened: its outcome is unknown.
        Some(Effect::Write) if resumed && !PLANTED_RERUN => {
            unknown("the process stopped after accepted: the outcome is unknown")
        }
        // A transactional tool's writes commit with its final receipt: a
        // `running` row means none of them is stored, so it may run again.
        Some(Effect::Transactional) if resumed => OnRunning::CheckLease,
        // A read tool runs again.
        Some(_) => OnRunning::Run,
    }
}

/// What the platform says of a transactional call to run again (its
/// replayed claim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StillRuns {
    /// It still runs under this assignment.
    Yes,
    /// It ended (cancelled, or settled by an operator).
    Ended,
    /// The platform no longer knows its run.
    Forgotten,
}

/// What the run step does next with a transactional call found again,
/// once its lease is live: `cancelled`, whether a cancellation of its run
/// was seen; `platform`, what the platform said when asked (`None`: not
/// asked yet). The cancel notice comes once and may have been lost
/// (choice 68), so the platform is asked right before the handler runs
/// again.
pub(crate) fn transactional_again(
    cancelled: bool,
    platform: Option<Option<StillRuns>>,
) -> Result<Again, Pause> {
    if PLANTED_RESUME {
        return Ok(Again::Run);
    }
    if cancelled {
        return Ok(Again::Settle(Event::TransactionalEnded));
    }
    match platform {
        None => Ok(Again::AskPlatform),
        Some(Some(StillRuns::Yes)) => Ok(Again::Run),
        Some(Some(StillRuns::Ended)) => Ok(Again::Settle(Event::TransactionalEnded)),
        Some(Some(StillRuns::Forgotten)) => Ok(Again::Settle(Event::TransactionalForgotten)),
        Some(None) => Err(Pause::waits(
            "a transactional call to run again waits until the platform says that it still runs",
        )),
    }
}

/// The next step for a transactional call found again.
#[must_use]
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // short-lived: one per step
pub(crate) enum Again {
    /// Start the handler again.
    Run,
    /// Settle the call with this event (it is not run again).
    Settle(Event),
    /// Ask the platform whether the call still runs (its replayed claim).
    AskPlatform,
}
