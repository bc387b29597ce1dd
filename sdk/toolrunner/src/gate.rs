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

#[cfg(feature = "testing")]
/// Faults of one executor process, set on its builder with
/// [`ExecutorBuilder::process_faults`](crate::ExecutorBuilder::process_faults)
/// (the seeded simulation's pauses and outages; cheap to clone, every clone
/// the same switches):
///
/// - [`freeze`](Self::freeze): the process stands still as if stopped with
///   SIGSTOP: every request to its store or its platform waits before it
///   goes out and before its answer is taken in, while its timers go on
///   and the world does not wait; [`thaw`](Self::thaw) lets it go on,
///   handlers mid-way included. Product code under test stands still too
///   where it awaits [`stand_still`](Self::stand_still).
/// - [`cut_store`](Self::cut_store): its store cannot be reached (every
///   request fails at once), while the platform answers;
///   [`cut_platform`](Self::cut_platform): the reverse.
#[derive(Clone, Default)]
pub struct ProcessFaults(std::sync::Arc<Gate>);

#[cfg(feature = "testing")]
impl std::fmt::Debug for ProcessFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessFaults")
            .field("frozen", &self.is_frozen())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "testing")]
impl ProcessFaults {
    /// No faults yet.
    pub fn new() -> ProcessFaults {
        ProcessFaults::default()
    }

    pub(crate) fn gate(&self) -> std::sync::Arc<Gate> {
        self.0.clone()
    }

    /// Freezes the process (see the type's documentation).
    pub fn freeze(&self) {
        self.0.freeze(true);
    }

    /// Lets a frozen process go on.
    pub fn thaw(&self) {
        self.0.freeze(false);
    }

    /// Whether the process is frozen.
    pub fn is_frozen(&self) -> bool {
        self.0.is_frozen()
    }

    /// Completes at once, or once the process is thawed: product code
    /// awaits it where a frozen process would stand still.
    pub async fn stand_still(&self) {
        self.0.thawed().await;
    }

    /// Cuts the process off from its store (`true`), or mends it.
    pub fn cut_store(&self, cut: bool) {
        self.0.cut(Reach::Store, cut);
    }

    /// Cuts the process off from the platform (`true`), or mends it.
    pub fn cut_platform(&self, cut: bool) {
        self.0.cut(Reach::Platform, cut);
    }
}
