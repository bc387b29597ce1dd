//! Where the executor is in its life: one [`Phase`], which only ever moves
//! on, and what a task waits for (the stop, the halt).
use std::sync::Mutex as StdMutex;

use tokio::sync::watch;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::error::Error;
use crate::store::StoreLock;

/// The executor's phase. Each follows the one before it and never goes
/// back: a later phase holds everything an earlier one says (a halted
/// executor has stopped claiming too).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    /// It takes new calls (an adopted identity never does).
    Serving,
    /// An adopted identity with nothing left to do: its adopter lets it go
    /// (only replicas adopt).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    Finished,
    /// It takes no new calls (a shutdown, or an error that stopped it); the
    /// calls in flight go on.
    Stopping,
    /// Gone as far as the world can tell (a crash, a detach, a fenced
    /// lease, the end of a shutdown): nothing more is written to the store
    /// nor sent, and every task ends.
    Halted,
}

/// The executor's life (a part of `Core`): its phase, why it stopped, and
/// its hold on its store file.
pub(crate) struct Life {
    /// The phase, watched by the tasks that wait for the stop.
    phase: watch::Sender<Phase>,
    /// Cancelled when the phase reaches [`Phase::Halted`]: the parent of
    /// each call's token, and the fence of the store the runner writes to.
    halted: CancellationToken,
    /// The error that stopped it, if one did.
    pub(crate) fatal: StdMutex<Option<Error>>,
    /// This process's hold on its store file (released by `Core::halt`).
    pub(crate) lock: StdMutex<Option<StoreLock>>,
}

impl Life {
    /// A serving executor whose halt cancels `fence` (the fenced store's),
    /// holding `lock` until it halts.
    pub(crate) fn new(fence: CancellationToken, lock: Option<StoreLock>) -> Life {
        Life {
            phase: watch::Sender::new(Phase::Serving),
            halted: fence,
            fatal: StdMutex::new(None),
            lock: StdMutex::new(lock),
        }
    }

    /// The phase now. `Halted` only once the halt's token is cancelled:
    /// whoever sees it finds the halt done (nothing more goes out).
    pub(crate) fn phase(&self) -> Phase {
        if self.halted.is_cancelled() {
            return Phase::Halted;
        }
        (*self.phase.borrow()).min(Phase::Stopping)
    }

    /// Moves on to `to`, unless the executor is there or further already.
    /// A halt cancels its token before the phase says `Halted`: whoever
    /// sees the phase finds the halt done.
    pub(crate) fn enter(&self, to: Phase) {
        if to == Phase::Halted {
            self.halted.cancel();
        }
        self.phase.send_if_modified(|now| {
            let on = *now < to;
            if on {
                *now = to;
            }
            on
        });
    }

    /// Whether it takes new calls.
    pub(crate) fn claiming(&self) -> bool {
        self.phase() < Phase::Stopping
    }

    /// Whether it stopped taking new calls (or halted).
    pub(crate) fn is_stopping(&self) -> bool {
        !self.claiming()
    }

    /// Whether it halted: nothing more is written or sent.
    pub(crate) fn is_halted(&self) -> bool {
        self.halted.is_cancelled()
    }

    /// Resolves once it stops taking new calls (at once if it has).
    pub(crate) async fn stopping(&self) {
        let mut phase = self.phase.subscribe();
        // The sender lives as long as `self`: the wait ends only by the
        // phase.
        let _ = phase.wait_for(|p| *p >= Phase::Stopping).await;
    }

    /// Resolves once it halts (at once if it has).
    pub(crate) fn halted(&self) -> WaitForCancellationFuture<'_> {
        self.halted.cancelled()
    }

    /// A token for one call, cancelled when the executor halts (or by the
    /// call's own cancel).
    pub(crate) fn call_token(&self) -> CancellationToken {
        self.halted.child_token()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_never_goes_back() {
        let life = Life::new(CancellationToken::new(), None);
        assert_eq!(life.phase(), Phase::Serving);
        assert!(life.claiming());
        life.enter(Phase::Stopping);
        life.enter(Phase::Finished);
        assert_eq!(life.phase(), Phase::Stopping, "a stop is not undone");
        assert!(life.is_stopping() && !life.is_halted());
        life.enter(Phase::Halted);
        life.enter(Phase::Serving);
        assert_eq!(life.phase(), Phase::Halted);
        assert!(life.is_stopping() && life.is_halted());
    }

    /// The phase says `Halted` only once the halt's token is cancelled,
    /// whatever the watch holds at that moment (another thread may look
    /// between the two).
    #[test]
    fn the_phase_says_halted_only_once_the_halt_is_done() {
        let life = Life::new(CancellationToken::new(), None);
        life.phase.send_replace(Phase::Halted);
        assert_eq!(
            (life.phase(), life.is_halted()),
            (Phase::Stopping, false),
            "the watch said Halted before the halt's token was cancelled"
        );
        life.halted.cancel();
        assert_eq!((life.phase(), life.is_halted()), (Phase::Halted, true));
        assert!(!life.claiming());
    }

    #[tokio::test]
    async fn a_halt_wakes_who_waits_for_the_stop_and_cancels_each_call() {
        let fence = CancellationToken::new();
        let life = std::sync::Arc::new(Life::new(fence.clone(), None));
        let call = life.call_token();
        let waiting = tokio::spawn({
            let life = life.clone();
            async move { life.stopping().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "a serving executor is not stopping");
        life.enter(Phase::Halted);
        tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the wait for the stop ended with the halt")
            .expect("the task ran");
        assert!(call.is_cancelled(), "each call's token goes with the halt");
        assert!(fence.is_cancelled(), "the store's fence goes with the halt");
        tokio::time::timeout(std::time::Duration::from_secs(5), life.halted())
            .await
            .expect("halted at once");
    }
}
