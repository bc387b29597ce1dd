//! Flow control in this process: each limited tool's slots, taken before a
//! call of the tool is claimed and held until its drive ends (the final
//! receipt delivered, or the call waiting in `reconciliation_required`).
//!
//! A new claim takes a slot only below the limit ([`Flow::try_take`]); a
//! call this process resumes takes one whatever the count
//! ([`Flow::take_owed`]): it is its own work, already claimed, and never
//! refused. The count may then stand above the limit for a while, and new
//! claims wait until it is below again.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::Limits;

/// Every limited tool's slots (a part of [`super::Calls`]).
#[derive(Default)]
pub(crate) struct Flow {
    tools: BTreeMap<String, Arc<ToolSlots>>,
}

/// One tool's concurrency: its limit and how many slots are held.
#[derive(Debug)]
struct ToolSlots {
    limit: u32,
    held: AtomicU32,
}

/// One call's slot of its tool, given back when dropped.
#[derive(Debug)]
pub(crate) struct Slot(Arc<ToolSlots>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether a call of a tool may be claimed now.
#[derive(Debug)]
pub(crate) enum Take {
    /// The tool has no limit in this process.
    Unlimited,
    /// A slot, held until the call's drive ends.
    Slot(Slot),
    /// The tool is at its limit: do not claim the call now.
    Full,
}

impl Flow {
    /// The slots of the tools `limits` limits (a tool without a limit has
    /// none).
    pub(crate) fn new(limits: &BTreeMap<String, Limits>) -> Flow {
        let tools = limits
            .iter()
            .filter_map(|(tool, l)| {
                let limit = l.max_concurrency()?;
                Some((
                    tool.clone(),
                    Arc::new(ToolSlots {
                        limit,
                        held: AtomicU32::new(0),
                    }),
                ))
            })
            .collect();
        Flow { tools }
    }

    /// A slot of `tool` for a new claim, only below its limit.
    pub(crate) fn try_take(&self, tool: &str) -> Take {
        let Some(slots) = self.tools.get(tool) else {
            return Take::Unlimited;
        };
        let taken = slots
            .held
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                (held < slots.limit).then_some(held + 1)
            });
        match taken {
            Ok(_) => Take::Slot(Slot(slots.clone())),
            Err(_) => Take::Full,
        }
    }

    /// A slot of `tool` for a call this process resumes: taken whatever
    /// the count (`None` for a tool without a limit).
    pub(crate) fn take_owed(&self, tool: &str) -> Option<Slot> {
        let slots = self.tools.get(tool)?;
        slots.held.fetch_add(1, Ordering::SeqCst);
        Some(Slot(slots.clone()))
    }

    /// Each limited tool's limit and the slots held now.
    pub(crate) fn in_use(&self) -> Vec<(&str, u32, u32)> {
        self.tools
            .iter()
            .map(|(tool, s)| (tool.as_str(), s.limit, s.held.load(Ordering::SeqCst)))
            .collect()
    }
}

/// What a call's drive holds while it runs: a slot of the executor's
/// capacity and one of its tool's limit, each if it took one. Dropping it
/// gives both back.
#[derive(Debug, Default)]
pub(crate) struct Held {
    // Held only to be dropped: never read.
    #[allow(dead_code)]
    pub(crate) capacity: Option<tokio::sync::OwnedSemaphorePermit>,
    #[allow(dead_code)]
    pub(crate) tool: Option<Slot>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(limit: u32) -> Flow {
        Flow::new(&BTreeMap::from([(
            "t".to_owned(),
            Limits::none().concurrency(limit),
        )]))
    }

    #[test]
    fn a_new_claim_takes_a_slot_only_below_the_limit_and_a_dropped_slot_comes_back() {
        let f = flow(2);
        let a = f.try_take("t");
        let b = f.try_take("t");
        assert!(matches!(a, Take::Slot(_)) && matches!(b, Take::Slot(_)));
        assert!(matches!(f.try_take("t"), Take::Full));
        drop(a);
        assert!(matches!(f.try_take("t"), Take::Slot(_)));
        assert_eq!(
            f.in_use(),
            vec![("t", 2, 1)],
            "the slot just taken was dropped"
        );
    }

    #[test]
    fn a_tool_without_a_limit_is_never_full() {
        let f = flow(1);
        let _held = f.try_take("t");
        assert!(matches!(f.try_take("other"), Take::Unlimited));
        assert!(f.take_owed("other").is_none());
    }

    #[test]
    fn a_resumed_call_takes_its_slot_over_the_limit_and_new_claims_wait_below_it() {
        let f = flow(1);
        let first = f.try_take("t");
        let owed = f.take_owed("t").expect("a limited tool");
        assert_eq!(f.in_use(), vec![("t", 1, 2)]);
        drop(first);
        assert!(
            matches!(f.try_take("t"), Take::Full),
            "still at the limit with the resumed call"
        );
        drop(owed);
        assert!(matches!(f.try_take("t"), Take::Slot(_)));
    }
}
