//! A tool's concurrency in this process: its limit and the slots held.
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

/// One tool's slots.
#[derive(Debug)]
pub(super) struct ToolSlots {
    pub(super) limit: u32,
    held: AtomicU32,
}

/// One call's slot of its tool, given back when dropped.
#[derive(Debug)]
pub(super) struct Slot(Arc<ToolSlots>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::SeqCst);
    }
}

impl ToolSlots {
    pub(super) fn new(limit: u32) -> Arc<ToolSlots> {
        Arc::new(ToolSlots {
            limit,
            held: AtomicU32::new(0),
        })
    }

    /// A slot, only below the limit.
    pub(super) fn take(self: &Arc<Self>) -> Option<Slot> {
        self.held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                (held < self.limit).then_some(held + 1)
            })
            .ok()?;
        Some(Slot(self.clone()))
    }

    /// A slot whatever the count (the call is this process's own work).
    pub(super) fn take_owed(self: &Arc<Self>) -> Slot {
        let before = self.held.fetch_add(1, Ordering::SeqCst);
        if before >= self.limit {
            tracing::warn!(
                limit = self.limit,
                held = before + 1,
                "a call this process resumes took its tool's slot above the concurrency limit"
            );
        }
        Slot(self.clone())
    }

    /// The slots held now.
    pub(super) fn held(&self) -> u32 {
        self.held.load(Ordering::SeqCst)
    }
}
