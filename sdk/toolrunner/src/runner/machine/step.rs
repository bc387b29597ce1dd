//! Which step a call takes next, by the state its stored row is in: the
//! same steps resume a call after a crash (the crash table's rows).
use crate::store::LocalState;

/// The next step of a call's drive.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Claim with the saved operation key.
    Claim,
    /// The checks, then the `accepted` saved and sent.
    Accept,
    /// The handler (or, found again, the crash table's decision).
    Run,
    /// Deliver the saved final receipt, the same id and bytes.
    Deliver,
    /// Ask the tool's `reconcile` hook once.
    Check,
    /// Nothing more for this drive (the call is final here, or waits for
    /// a person or for the next check).
    Done,
}

/// The step a call in `state` takes next; `checked`: this drive asked its
/// `reconcile` hook already.
pub(crate) fn next(state: LocalState, checked: bool) -> Step {
    match state {
        LocalState::Claiming => Step::Claim,
        LocalState::Assigned => Step::Accept,
        LocalState::Running => Step::Run,
        LocalState::Settled => Step::Deliver,
        LocalState::ReconciliationRequired if !checked => Step::Check,
        _ => Step::Done,
    }
}
