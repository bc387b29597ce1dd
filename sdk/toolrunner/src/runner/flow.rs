//! Flow control in this process: each limited tool's slots, taken before a
//! call of the tool is claimed and held until its drive ends (the final
//! receipt delivered, or the call waiting in `reconciliation_required`).
//!
//! A new claim takes a slot only below the limit ([`Flow::try_take`]); a
//! call this process resumes takes one whatever the count
//! ([`Flow::take_owed`]): it is its own work, already claimed, and never
//! refused. The count may then stand above the limit for a while, and new
//! claims wait until it is below again.
//! Flow control in this process: each limited tool's slots and rate
//! tokens, taken before a call of the tool is claimed.
//!
//! - **Slots** (concurrency): a new claim takes one only below the limit
//!   ([`Flow::try_take`]) and holds it until the call's drive ends (the
//!   final receipt delivered, or the call waiting in
//!   `reconciliation_required`). A call this process resumes takes one
//!   whatever the count ([`Flow::take_owed`]): it is its own work, already
//!   claimed, and never refused; new claims wait until the count is below
//!   the limit again.
//! - **Tokens** (rate): no sliding second holds more than the limit of
//!   first `accepted` sends of the tool. A new claim reserves a token for
//!   at most [`WINDOW`]; the accept step turns it into a send just before
//!   `accepted` is saved ([`ToolHold::sending`]), or, the reservation
//!   lapsed, gives the claim back instead. A send counts from then until a
//!   second after its answer. A resumed call's send is counted whatever
//!   the count ([`ToolHold::sending_owed`]).
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::Limits;

/// The sliding window of a rate limit, and the longest a reservation
/// lasts.
pub(crate) const WINDOW: Duration = Duration::from_secs(1);

/// Every limited tool's slots and tokens (a part of [`super::Calls`]).
#[derive(Default)]
pub(crate) struct Flow {
    tools: BTreeMap<String, ToolFlow>,
}

/// One limited tool's slots and tokens.
struct ToolFlow {
    slots: Option<Arc<ToolSlots>>,
    rate: Option<Arc<RateWindow>>,
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

/// Where a token of a rate limit is.
#[derive(Debug, Clone, Copy)]
enum Stage {
    /// Reserved at the claim, at this instant: lapses after [`WINDOW`].
    Reserved(Instant),
    /// `accepted` is being saved and sent: counts until its answer.
    Sending,
    /// Sent; its answer came at this instant: counts for [`WINDOW`] more.
    Sent(Instant),
}

/// One tool's rate: its limit and the tokens that count now.
#[derive(Debug)]
struct RateWindow {
    limit: u32,
    next_id: AtomicU64,
    tokens: Mutex<Vec<(u64, Stage)>>,
}

impl RateWindow {
    fn tokens(&self) -> std::sync::MutexGuard<'_, Vec<(u64, Stage)>> {
        self.tokens.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tokens that still count at `now` (the others are dropped).
    fn counting(tokens: &mut Vec<(u64, Stage)>, now: Instant) -> u32 {
        tokens.retain(|(_, stage)| match stage {
            Stage::Reserved(at) | Stage::Sent(at) => now.saturating_duration_since(*at) < WINDOW,
            Stage::Sending => true,
        });
        u32::try_from(tokens.len()).unwrap_or(u32::MAX)
    }

    /// A token in `stage`, below the limit unless `owed`.
    fn take(self: &Arc<Self>, stage: Stage, owed: bool) -> Option<Token> {
        let mut tokens = self.tokens();
        if Self::counting(&mut tokens, Instant::now()) >= self.limit && !owed {
            return None;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        tokens.push((id, stage));
        Some(Token {
            window: self.clone(),
            id,
        })
    }

    fn stage(&self, id: u64) -> Option<Stage> {
        self.tokens()
            .iter()
            .find(|(t, _)| *t == id)
            .map(|(_, stage)| *stage)
    }

    fn set(&self, id: u64, stage: Option<Stage>) {
        let mut tokens = self.tokens();
        match stage {
            Some(stage) => {
                if let Some(token) = tokens.iter_mut().find(|(t, _)| *t == id) {
                    token.1 = stage;
                }
            }
            None => tokens.retain(|(t, _)| *t != id),
        }
    }
}

/// One call's token of its tool's rate. Dropped while reserved, it is
/// given back; while sending, it counts for [`WINDOW`] from then.
#[derive(Debug)]
struct Token {
    window: Arc<RateWindow>,
    id: u64,
}

impl Drop for Token {
    fn drop(&mut self) {
        match self.window.stage(self.id) {
            Some(Stage::Reserved(_)) => self.window.set(self.id, None),
            Some(Stage::Sending) => self.window.set(self.id, Some(Stage::Sent(Instant::now()))),
            Some(Stage::Sent(_)) | None => {}
        }
    }
}

/// The reservation of a rate token lapsed before `accepted` was due: the
/// claim is given back.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Lapsed;

/// What a call holds of its tool's limits: nothing for a tool without
/// limits; else a slot, a token, each if the tool has that limit (boxed:
/// every call's drive holds one, and most tools have no limit).
#[derive(Debug, Default)]
pub(crate) struct ToolHold(Option<Box<Limited>>);

/// What a call of a limited tool holds.
#[derive(Debug)]
struct Limited {
    // Held only to be dropped: never read.
    #[allow(dead_code)]
    slot: Option<Slot>,
    /// The tool's rate window, if it has one.
    rate: Option<Arc<RateWindow>>,
    token: Mutex<Option<Token>>,
    /// The first send began (its token counts as sent from then).
    started: std::sync::atomic::AtomicBool,
}

impl ToolHold {
    fn limited(slot: Option<Slot>, rate: Option<Arc<RateWindow>>, token: Option<Token>) -> Self {
        if slot.is_none() && rate.is_none() {
            return ToolHold(None);
        }
        ToolHold(Some(Box::new(Limited {
            slot,
            rate,
            token: Mutex::new(token),
            started: Default::default(),
        })))
    }

    /// `accepted` is about to be saved and sent for the first time: the
    /// reserved token becomes a send. `Err(Lapsed)` when the reservation
    /// is older than [`WINDOW`] (the token is gone: give the claim back).
    pub(crate) fn sending(&self) -> Result<(), Lapsed> {
        match &self.0 {
            Some(limited) => limited.sending(),
            None => Ok(()),
        }
    }

    /// An `accepted` saved earlier goes out (a resumed call, a send
    /// again): counted whatever the count.
    pub(crate) fn sending_owed(&self) {
        if self.sending().is_err() {
            let _ = self.sending();
        }
    }

    /// The platform answered the send (or it gave up): the token counts
    /// for [`WINDOW`] from now.
    pub(crate) fn sent(&self) {
        if let Some(limited) = &self.0 {
            limited.sent();
        }
    }

    /// Whether it holds a slot of its tool's concurrency.
    #[cfg(test)]
    fn has_slot(&self) -> bool {
        self.0.as_ref().is_some_and(|l| l.slot.is_some())
    }
}

impl Limited {
    fn token(&self) -> std::sync::MutexGuard<'_, Option<Token>> {
        self.token.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sending(&self) -> Result<(), Lapsed> {
        let Some(rate) = &self.rate else {
            return Ok(());
        };
        let mut token = self.token();
        if self.started.load(Ordering::SeqCst) {
            return Ok(());
        }
        match token.as_ref().map(|t| (t.id, rate.stage(t.id))) {
            // A resumed call (no reservation): counted as owed.
            None => *token = rate.take(Stage::Sending, true),
            Some((id, Some(Stage::Reserved(at)))) if at.elapsed() < WINDOW => {
                rate.set(id, Some(Stage::Sending));
            }
            // Lapsed (perhaps already dropped from the window): dropping
            // it gives it back.
            Some(_) => {
                *token = None;
                return Err(Lapsed);
            }
        }
        self.started.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn sent(&self) {
        if let (Some(rate), Some(t)) = (&self.rate, self.token().as_ref())
            && matches!(rate.stage(t.id), Some(Stage::Sending))
        {
            rate.set(t.id, Some(Stage::Sent(Instant::now())));
        }
    }
}

impl Flow {
    /// The slots and windows of the tools `limits` limits (a tool without
    /// a limit has none).
    pub(crate) fn new(limits: &BTreeMap<String, Limits>) -> Flow {
        let tools = limits
            .iter()
            .filter(|(_, l)| l.max_concurrency().is_some() || l.max_rate().is_some())
            .map(|(tool, l)| {
                let flow = ToolFlow {
                    slots: l.max_concurrency().map(|limit| {
                        Arc::new(ToolSlots {
                            limit,
                            held: AtomicU32::new(0),
                        })
                    }),
                    rate: l.max_rate().map(|limit| {
                        Arc::new(RateWindow {
                            limit,
                            next_id: AtomicU64::new(0),
                            tokens: Mutex::new(Vec::new()),
                        })
                    }),
                };
                (tool.clone(), flow)
            })
            .collect();
        Flow { tools }
    }

    /// A slot and a token of `tool` for a new claim, only when both are
    /// free now (`None`: do not claim the call now).
    pub(crate) fn try_take(&self, tool: &str) -> Option<ToolHold> {
        let Some(flow) = self.tools.get(tool) else {
            return Some(ToolHold::default());
        };
        let slot = match &flow.slots {
            None => None,
            Some(slots) => {
                let taken = slots
                    .held
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |held| {
                        (held < slots.limit).then_some(held + 1)
                    });
                taken.ok()?;
                Some(Slot(slots.clone()))
            }
        };
        // The slot (if any) is given back if no token is free.
        let token = match &flow.rate {
            None => None,
            Some(rate) => Some(rate.take(Stage::Reserved(Instant::now()), false)?),
        };
        Some(ToolHold::limited(slot, flow.rate.clone(), token))
    }

    /// What a call this process resumes holds of `tool`'s limits: a slot
    /// whatever the count; its `accepted`, if it sends one, counted as
    /// owed.
    pub(crate) fn take_owed(&self, tool: &str) -> ToolHold {
        let Some(flow) = self.tools.get(tool) else {
            return ToolHold::default();
        };
        let slot = flow.slots.as_ref().map(|slots| {
            slots.held.fetch_add(1, Ordering::SeqCst);
            Slot(slots.clone())
        });
        ToolHold::limited(slot, flow.rate.clone(), None)
    }

    /// Each tool with a concurrency limit: its limit and the slots held now.
    pub(crate) fn in_use(&self) -> Vec<(&str, u32, u32)> {
        self.tools
            .iter()
            .filter_map(|(tool, f)| {
                let s = f.slots.as_ref()?;
                Some((tool.as_str(), s.limit, s.held.load(Ordering::SeqCst)))
            })
            .collect()
    }
}

/// What a call's drive holds while it runs: a slot of the executor's
/// capacity if it took one, and what it holds of its tool's limits.
/// Dropping it gives them back.
#[derive(Debug, Default)]
pub(crate) struct Held {
    // Held only to be dropped: never read.
    #[allow(dead_code)]
    pub(crate) capacity: Option<tokio::sync::OwnedSemaphorePermit>,
    pub(crate) tool: ToolHold,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flow(limits: Limits) -> Flow {
        Flow::new(&BTreeMap::from([("t".to_owned(), limits)]))
    }

    #[test]
    fn a_new_claim_takes_a_slot_only_below_the_limit_and_a_dropped_slot_comes_back() {
        let f = flow(Limits::none().concurrency(2));
        let a = f.try_take("t");
        let b = f.try_take("t");
        assert!(a.is_some() && b.is_some());
        assert!(f.try_take("t").is_none());
        drop(a);
        assert!(f.try_take("t").is_some());
        assert_eq!(
            f.in_use(),
            vec![("t", 2, 1)],
            "the slot just taken was dropped"
        );
    }

    #[test]
    fn a_tool_without_a_limit_is_never_full() {
        let f = flow(Limits::none().concurrency(1));
        let _held = f.try_take("t");
        assert!(f.try_take("other").is_some());
        assert!(!f.take_owed("other").has_slot());
    }

    #[test]
    fn a_resumed_call_takes_its_slot_over_the_limit_and_new_claims_wait_below_it() {
        let f = flow(Limits::none().concurrency(1));
        let first = f.try_take("t");
        let owed = f.take_owed("t");
        assert!(owed.has_slot());
        assert_eq!(f.in_use(), vec![("t", 1, 2)]);
        drop(first);
        assert!(
            f.try_take("t").is_none(),
            "still at the limit with the resumed call"
        );
        drop(owed);
        assert!(f.try_take("t").is_some());
    }

    #[test]
    fn a_rate_counts_reservations_and_sends_and_frees_a_reservation_dropped_unsent() {
        let f = flow(Limits::none().rate(2));
        let a = f.try_take("t").expect("a token");
        let b = f.try_take("t").expect("a token");
        assert!(f.try_take("t").is_none(), "two reserved: none left");
        drop(b);
        let c = f
            .try_take("t")
            .expect("the reservation dropped unsent came back");
        assert_eq!(a.sending(), Ok(()));
        a.sent();
        drop(a);
        assert!(
            f.try_take("t").is_none(),
            "a send counts for a second after its answer, even once its call is done"
        );
        drop(c);
    }

    #[test]
    fn a_send_frees_its_token_a_window_after_its_answer() {
        let f = flow(Limits::none().rate(1));
        let a = f.try_take("t").expect("a token");
        assert_eq!(a.sending(), Ok(()));
        std::thread::sleep(WINDOW + Duration::from_millis(50));
        assert!(
            f.try_take("t").is_none(),
            "still sending (no answer yet): it counts however long it takes"
        );
        a.sent();
        assert!(f.try_take("t").is_none());
        std::thread::sleep(WINDOW + Duration::from_millis(50));
        assert!(f.try_take("t").is_some(), "a window after the answer");
    }

    #[test]
    fn a_reservation_older_than_the_window_lapses_and_its_token_is_free() {
        let f = flow(Limits::none().rate(1));
        let a = f.try_take("t").expect("a token");
        std::thread::sleep(WINDOW + Duration::from_millis(50));
        assert_eq!(a.sending(), Err(Lapsed), "the claim is given back");
        let b = f.try_take("t").expect("the lapsed token is free");
        assert_eq!(b.sending(), Ok(()));
    }

    #[test]
    fn a_resumed_send_counts_whatever_the_count() {
        let f = flow(Limits::none().rate(1));
        let a = f.try_take("t").expect("a token");
        let owed = f.take_owed("t");
        owed.sending_owed();
        owed.sent();
        assert_eq!(a.sending(), Ok(()), "the reservation made before holds");
        drop(a);
        drop(owed);
        assert!(f.try_take("t").is_none(), "both sends count for a window");
    }
}
