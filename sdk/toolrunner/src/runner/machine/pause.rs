//! Why a step of a call stopped before the call was final. The call
//! resumes from the store; what the step's caller does next depends on the
//! kind of pause, never on the text of a message.

/// Why a step of a call stopped short (the call resumes from the store).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Pause {
    /// The process stopped: at a fail point, or dropped, detached or
    /// fenced. Nothing more is done, as after a real process loss, and
    /// nothing is logged as a pause.
    Halted,
    /// The platform asked to claim later (`capacity_exhausted`,
    /// `executor_draining`): the capacity slot goes to another call, and
    /// this one waits a moment before it is asked again.
    Deferred(String),
    /// The executor's lease is not live (it could not be renewed): no
    /// request that takes work goes out, and the call waits.
    LeaseNotLive,
    /// Anything else that stopped the step (the store or the platform
    /// failed, the executor shuts down, the call left the store): said in
    /// the log, and the call is driven again later.
    Waits(String),
}

impl Pause {
    /// A pause for the reason `why`.
    pub(crate) fn waits(why: impl Into<String>) -> Pause {
        Pause::Waits(why.into())
    }
}

impl std::fmt::Display for Pause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pause::Halted => f.write_str("the process stopped (a fail point, or a halt)"),
            Pause::Deferred(why) => write!(f, "claim deferred: {why}"),
            Pause::LeaseNotLive => f.write_str(
                "the executor's lease is not live (it could not be renewed): the call waits",
            ),
            Pause::Waits(why) => f.write_str(why),
        }
    }
}
