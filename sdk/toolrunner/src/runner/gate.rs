//! Faults of one executor process for tests and the simulation
//! (`toolrunner::testing::ProcessFaults`): frozen, as a process stopped
//! with SIGSTOP (every request to the store or the platform waits before
//! it goes out and before its answer is taken in; timers go on); its
//! store unreachable while the platform answers; the platform unreachable
//! while the store answers. Inert unless a test sets one on the builder.
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

/// One process's faults.
#[derive(Debug)]
pub(crate) struct Gate {
    frozen: watch::Sender<bool>,
    store_cut: AtomicBool,
    platform_cut: AtomicBool,
}

impl Default for Gate {
    fn default() -> Self {
        Gate {
            frozen: watch::channel(false).0,
            store_cut: AtomicBool::new(false),
            platform_cut: AtomicBool::new(false),
        }
    }
}

/// What a request reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reach {
    Store,
    Platform,
}

// Set only through `toolrunner::testing::ProcessFaults`.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
impl Gate {
    pub(crate) fn freeze(&self, frozen: bool) {
        self.frozen.send_replace(frozen);
    }

    pub(crate) fn is_frozen(&self) -> bool {
        *self.frozen.borrow()
    }

    pub(crate) fn cut(&self, what: Reach, cut: bool) {
        match what {
            Reach::Store => self.store_cut.store(cut, Ordering::SeqCst),
            Reach::Platform => self.platform_cut.store(cut, Ordering::SeqCst),
        }
    }

    /// Waits while the process is frozen.
    pub(crate) async fn thawed(&self) {
        let mut rx = self.frozen.subscribe();
        while *rx.borrow_and_update() {
            if rx.changed().await.is_err() {
                return;
            }
        }
    }

    /// Before a request to `what`: waits while frozen; `Err` (as a
    /// connection refused) while `what` is cut off.
    pub(crate) async fn before(&self, what: Reach) -> Result<(), String> {
        self.thawed().await;
        let cut = match what {
            Reach::Store => self.store_cut.load(Ordering::SeqCst),
            Reach::Platform => self.platform_cut.load(Ordering::SeqCst),
        };
        if cut {
            return Err(match what {
                Reach::Store => "the store cannot be reached (a simulated outage)".into(),
                Reach::Platform => "the platform cannot be reached (a simulated outage)".into(),
            });
        }
        Ok(())
    }
}

/// A process's gate, if a test set one: [`Gate::before`], or nothing.
pub(crate) async fn before(gate: Option<&Gate>, what: Reach) -> Result<(), String> {
    match gate {
        Some(g) => g.before(what).await,
        None => Ok(()),
    }
}

/// A process's gate, if a test set one: [`Gate::thawed`], or nothing.
pub(crate) async fn thawed(gate: Option<&Gate>) {
    if let Some(g) = gate {
        g.thawed().await;
    }
}
