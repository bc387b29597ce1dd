//! Flow control in this process: each limited tool's slots (concurrency)
//! and rate tokens, decided before a call of the tool is claimed.
//!
//! - A new claim takes a slot and reserves a token only below the limits
//!   ([`Flow::try_take`]); the claimer never claims a call to make it
//!   wait.
//! - A call holds its slot while a task drives it, and while it is parked
//!   after a pause ([`Flow::park`]): a claimed call that waits (the
//!   platform unreachable, a lapsed lease) keeps its slot, so no other
//!   call takes it meanwhile. A parked hold is taken back when the call is
//!   picked up again ([`Flow::resume`]), and dropped once the call no
//!   longer waits in the store ([`Flow::sweep`]).
//! - A call picked up again without a hold (after a restart, a reconnect)
//!   takes a slot whatever the count when the platform already holds its
//!   claim: it is this process's own work, and is never refused. One that
//!   has still to be claimed waits for a slot like a new claim.
//! - The token becomes the call's first `accepted` ([`ToolHold::sending`])
//!   just before it is saved; see [`rate`].
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::CallKey;
use crate::Limits;
use crate::store::flow::{Caps, SharedFlow, Take};

mod keys;
mod rate;
mod shared;
mod slots;

pub(crate) use keys::key_digest;
use keys::{KeySlot, KeySlots, KeyWake};
use rate::{RateWindow, Token};
pub(crate) use shared::Holder;
use shared::{Shared, SharedHold};
use slots::{Slot, ToolSlots};

/// How long a call whose rate token lapsed before `accepted` waits before
/// it is claimed again, at first (doubled each time, up to
/// [`LAPSE_BACKOFF_MAX`]).
const LAPSE_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait after lapsed tokens.
const LAPSE_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// How long a call given back because its concurrency key was at its
/// limit waits before it is claimed again, at first (doubled each time,
/// up to [`KEY_BACKOFF_MAX`]), unless a slot of its key comes back in this
/// process first (it is woken then, the oldest first).
const KEY_BACKOFF: Duration = Duration::from_secs(1);
/// The longest wait of a call whose key was at its limit.
const KEY_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Every limited tool's slots and tokens (a part of [`super::Calls`]),
/// with the holds of the calls that paused.
#[derive(Default)]
pub(crate) struct Flow {
    tools: BTreeMap<String, ToolFlow>,
    /// Every tool's limits from code and configuration (a tool without
    /// one: none).
    limits: BTreeMap<String, Limits>,
    /// On a PostgreSQL store shared by replicas: the holds are the store's
    /// rows, and `tools` (this process's alone) is not used.
    shared: OnceLock<Arc<Shared>>,
    /// By call: the identity whose call it is (one process serves its own
    /// and the identities it adopted, each sweeping only its own), and
    /// the hold.
    parked: Mutex<HashMap<CallKey, (String, ToolHold)>>,
    /// The calls held by concurrency key, in this process.
    keys: Arc<KeySlots>,
    /// Calls whose token lapsed before `accepted`: not claimed again
    /// before the instant, and how many times in a row.
    lapsed: Mutex<HashMap<CallKey, BackOff>>,
}

/// A call backing off: whose it is, until when, how many times in a row.
#[derive(Debug)]
struct BackOff {
    owner: String,
    until: Instant,
    times: u32,
}

/// One limited tool's slots and tokens.
struct ToolFlow {
    slots: Option<Arc<ToolSlots>>,
    rate: Option<Arc<RateWindow>>,
}

/// No token for an `accepted` now.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum NoToken {
    /// The reservation made before the claim is older than a window.
    Lapsed,
    /// The tool's rate is at its limit.
    Full,
}

/// What a call holds of its tool's limits: nothing for a tool without
/// limits; else a slot, a token, each if the tool has that limit (boxed:
/// every call's drive holds one, and most tools have no limit).
#[derive(Debug, Default)]
pub(crate) struct ToolHold {
    kept: Option<Box<Kept>>,
    /// Its slot of its concurrency key, once taken (after the claim).
    key: Mutex<Option<Box<KeyHold>>>,
}

/// A call's slot of its concurrency key (held only to be dropped), and
/// the waker of the next call waiting for the key.
#[derive(Debug)]
#[allow(dead_code)]
enum KeyHold {
    Local(KeySlot, KeyWake),
    Shared(SharedHold, KeyWake),
}

/// Where a limited tool's hold is kept.
#[derive(Debug)]
enum Kept {
    /// In this process.
    Local(Limited),
    /// In the store shared by replicas.
    Shared(SharedHold),
}

/// What a call of a limited tool holds in this process.
#[derive(Debug)]
struct Limited {
    // Held only to be dropped: never read.
    #[allow(dead_code)]
    slot: Option<Slot>,
    rate: Option<Arc<RateWindow>>,
    send: Mutex<Sending>,
}

/// A call's token of its tool's rate, and the assignment whose `accepted`
/// it became (`None`: still a reservation).
#[derive(Debug, Default)]
struct Sending {
    token: Option<Token>,
    assignment_id: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ToolHold {
    fn limited(slot: Option<Slot>, rate: Option<Arc<RateWindow>>, token: Option<Token>) -> Self {
        if slot.is_none() && rate.is_none() {
            return ToolHold::default();
        }
        ToolHold::kept(Kept::Local(Limited {
            slot,
            rate,
            send: Mutex::new(Sending {
                token,
                assignment_id: None,
            }),
        }))
    }

    fn kept(kept: Kept) -> Self {
        ToolHold {
            kept: Some(Box::new(kept)),
            key: Mutex::default(),
        }
    }

    /// Whether it holds a slot of its call's concurrency key.
    fn has_key(&self) -> bool {
        lock(&self.key).is_some()
    }

    /// The token for the first `accepted` of `assignment_id`, as
    /// [`sending`](Self::sending) says, wherever the hold is kept.
    ///
    /// # Errors
    /// As [`sending`](Self::sending); a shared hold whose database failed
    /// counts as lapsed before its first send, else as full.
    pub(crate) async fn take_token(&self, assignment_id: &str) -> Result<(), NoToken> {
        match self.kept.as_deref() {
            Some(Kept::Shared(hold)) => hold.sending(assignment_id).await,
            _ => self.sending(assignment_id),
        }
    }

    /// The platform answered the `accepted`, wherever the hold is kept.
    pub(crate) async fn token_answered(&self) {
        match self.kept.as_deref() {
            Some(Kept::Shared(hold)) => hold.answered().await,
            _ => self.answered(),
        }
    }

    /// The first `accepted` of assignment `assignment_id` is about to be
    /// saved or sent: it takes the token reserved before the claim, or,
    /// with none (a call picked up again, a new assignment), a token below
    /// the limit. Asked again for the same assignment (a send again), it
    /// takes nothing more.
    ///
    /// # Errors
    /// [`NoToken::Lapsed`] when the reservation is older than a window,
    /// [`NoToken::Full`] when no token is free now.
    pub(crate) fn sending(&self, assignment_id: &str) -> Result<(), NoToken> {
        let Some(Kept::Local(limited)) = self.kept.as_deref() else {
            return Ok(());
        };
        let Some(rate) = &limited.rate else {
            return Ok(());
        };
        let mut send = lock(&limited.send);
        if send.assignment_id.as_deref() == Some(assignment_id) {
            return Ok(());
        }
        if send.assignment_id.is_none()
            && let Some(reserved) = send.token.take()
        {
            if !reserved.start_send() {
                // Dropping a lapsed reservation gives it back.
                return Err(NoToken::Lapsed);
            }
            send.token = Some(reserved);
            send.assignment_id = Some(assignment_id.to_owned());
            return Ok(());
        }
        // Another assignment's token (it keeps counting as sent), or none.
        send.token = None;
        send.assignment_id = None;
        send.token = Some(rate.send_now().ok_or(NoToken::Full)?);
        send.assignment_id = Some(assignment_id.to_owned());
        Ok(())
    }

    /// The platform answered the `accepted` (or the client gave up): its
    /// token counts for a window from now.
    pub(crate) fn answered(&self) {
        if let Some(Kept::Local(limited)) = self.kept.as_deref()
            && let Some(token) = &lock(&limited.send).token
        {
            token.answered();
        }
    }

    /// How long until a token of this call's tool may be free, when it has
    /// a rate at its limit.
    pub(crate) fn token_frees_in(&self) -> Option<Duration> {
        match self.kept.as_deref()? {
            Kept::Local(limited) => limited.rate.as_ref()?.frees_in(),
            // Counted by the database: looked at again soon.
            Kept::Shared(_) => Some(Duration::from_millis(50)),
        }
    }

    fn is_empty(&self) -> bool {
        self.kept.is_none() && !self.has_key()
    }

    /// Whether it holds a slot of its tool's concurrency.
    #[cfg(test)]
    fn has_slot(&self) -> bool {
        matches!(self.kept.as_deref(), Some(Kept::Local(l)) if l.slot.is_some())
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
                    slots: l.max_concurrency().map(ToolSlots::new),
                    rate: l.max_rate().map(RateWindow::new),
                };
                (tool.clone(), flow)
            })
            .collect();
        Flow {
            tools,
            limits: limits.clone(),
            ..Flow::default()
        }
    }

    /// From now on the holds are `store`'s rows, shared by every replica
    /// of its database (the first store given wins: one per process).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // a PostgreSQL store's
    pub(crate) fn share(&self, store: Arc<dyn SharedFlow>) {
        let _ = self.shared.set(Arc::new(Shared::new(store)));
    }

    /// The limits of `tool` where holds are shared (the store's over this
    /// process's; `None` until the store's were read once) and whether it
    /// has any.
    async fn shared_limits(&self, shared: &Shared, tool: &str) -> Option<Caps> {
        let own = self.limits.get(tool).copied().unwrap_or_default();
        let own = Caps::of(own.max_concurrency(), own.max_rate());
        Some(own.overridden_by(shared.stored(tool).await?))
    }

    /// This process's own limits of `tool`, as the store takes them.
    fn own_caps(&self, tool: &str) -> Caps {
        let own = self.limits.get(tool).copied().unwrap_or_default();
        Caps::of(own.max_concurrency(), own.max_rate())
    }

    /// What a new claim of `key` holds, wherever holds are kept: as
    /// [`try_take`](Self::try_take), or a shared take by `holder`.
    pub(crate) async fn take_for_claim(
        &self,
        holder: Option<&Holder>,
        key: &CallKey,
        tool: &str,
    ) -> Option<ToolHold> {
        let Some(holder) = holder.filter(|_| self.shared.get().is_some()) else {
            return self.try_take(key, tool);
        };
        let shared = self.shared.get()?;
        if self.backing_off(key) {
            return None;
        }
        // Until the store's limits were read once, nothing new: a tool
        // limited only there would run unlimited.
        let limits = self.shared_limits(shared, tool).await?;
        if limits == Caps::default() {
            return Some(ToolHold::default());
        }
        let hold = shared
            .take(Shared::hold_at(holder, key, tool), limits, Take::New)
            .await?;
        Some(ToolHold::kept(Kept::Shared(hold)))
    }

    /// What a call picked up again holds, wherever holds are kept: as
    /// [`resume`](Self::resume), or shared.
    pub(crate) async fn take_for_resume(
        &self,
        holder: Option<&Holder>,
        key: &CallKey,
        tool: &str,
        claimed: bool,
    ) -> Option<ToolHold> {
        let Some(holder) = holder.filter(|_| self.shared.get().is_some()) else {
            return self.resume(key, tool, claimed);
        };
        let parked = lock(&self.parked).remove(key);
        if let Some((_, hold)) = parked {
            // A taker may have forgotten its rows while this identity's
            // lease looked lapsed: asserted again before it goes on.
            if let Some(Kept::Shared(shared)) = hold.kept.as_deref() {
                shared.reassert().await;
            }
            return Some(hold);
        }
        if !claimed {
            return Box::pin(self.take_for_claim(Some(holder), key, tool)).await;
        }
        let shared = self.shared.get()?;
        // Its own work is never refused: with the store's limits unknown,
        // this process's; without the database, a hold without rows
        // (the limit may be exceeded; said in the log).
        let limits = self
            .shared_limits(shared, tool)
            .await
            .unwrap_or_else(|| self.own_caps(tool));
        if limits == Caps::default() {
            return Some(ToolHold::default());
        }
        let hold = shared
            .take(Shared::hold_at(holder, key, tool), limits, Take::Owed)
            .await;
        Some(hold.map_or_else(ToolHold::default, |h| ToolHold::kept(Kept::Shared(h))))
    }

    /// How many calls back off now (a lapsed token, a key at its limit):
    /// the claimer asks the platform for that many candidates more, so
    /// that calls backing off never fill its page and hide the others.
    pub(crate) fn backing_off_now(&self) -> usize {
        let calls: Vec<CallKey> = lock(&self.lapsed).keys().cloned().collect();
        calls.iter().filter(|c| self.backs_off(c)).count()
    }

    /// Whether `key` backs off now, as a look at it (a woken call does
    /// not: it is claimed at once).
    pub(crate) fn backs_off(&self, key: &CallKey) -> bool {
        let within = lock(&self.lapsed)
            .get(key)
            .map(|b| Instant::now() < b.until);
        match within {
            None => false,
            Some(true) => true,
            // Over, but its key is still full here: claimed now, it would
            // only be given back (it is woken when a slot comes back).
            Some(false) => self.key_still_full(key),
        }
    }

    /// Whether `key` waits for a concurrency key whose slots this process
    /// holds all of.
    fn key_still_full(&self, key: &CallKey) -> bool {
        self.keys.waits_for_full(key, |tool| {
            self.limits.get(tool).and_then(Limits::max_per_key)
        })
    }

    /// Whether `key` backs off (a lapsed token, its concurrency key at its
    /// limit and no slot of it back since).
    fn backing_off(&self, key: &CallKey) -> bool {
        if self.keys.take_woken(key) {
            lock(&self.lapsed).remove(key);
            return false;
        }
        self.backs_off(key)
    }

    /// A slot and a token of `tool` for a new claim of `key`, only when
    /// both are free now and the call is not backing off after a lapsed
    /// token (`None`: do not claim it now).
    pub(crate) fn try_take(&self, key: &CallKey, tool: &str) -> Option<ToolHold> {
        if self.backing_off(key) {
            return None;
        }
        let Some(flow) = self.tools.get(tool) else {
            return Some(ToolHold::default());
        };
        let slot = match &flow.slots {
            Some(slots) => Some(slots.take()?),
            None => None,
        };
        // The slot (if any) is given back if no token is free.
        let token = match &flow.rate {
            Some(rate) => Some(rate.reserve()?),
            None => None,
        };
        Some(ToolHold::limited(slot, flow.rate.clone(), token))
    }

    /// What a call this process picks up again holds: the hold it parked
    /// when it paused; else, when the platform already holds its claim
    /// (`claimed`), a slot whatever the count; else what a new claim takes
    /// (`None`: at a limit, it waits in the store).
    pub(crate) fn resume(&self, key: &CallKey, tool: &str, claimed: bool) -> Option<ToolHold> {
        let parked = lock(&self.parked).remove(key);
        if let Some((_, hold)) = parked {
            return Some(hold);
        }
        if !claimed {
            return self.try_take(key, tool);
        }
        let Some(flow) = self.tools.get(tool) else {
            return Some(ToolHold::default());
        };
        let slot = flow.slots.as_ref().map(ToolSlots::take_owed);
        Some(ToolHold::limited(slot, flow.rate.clone(), None))
    }

    /// Keeps the hold of a call of identity `owner` that paused until it
    /// is picked up again.
    pub(crate) fn park(&self, owner: &str, key: CallKey, hold: ToolHold) {
        if !hold.is_empty() {
            lock(&self.parked).insert(key, (owner.to_owned(), hold));
        }
    }

    /// Drops the parked holds of `owner`'s calls that no longer wait in
    /// its store (`waiting`: the calls that do) and are not driven
    /// (`driven`), and its back-offs that are over; another identity's
    /// are its own to sweep.
    pub(crate) fn sweep(
        &self,
        owner: &str,
        waiting: &[CallKey],
        driven: impl Fn(&CallKey) -> bool,
    ) {
        lock(&self.parked)
            .retain(|key, (whose, _)| whose != owner || waiting.contains(key) || driven(key));
        let now = Instant::now();
        let full: std::collections::HashSet<CallKey> = lock(&self.lapsed)
            .keys()
            .filter(|k| self.key_still_full(k))
            .cloned()
            .collect();
        let mut lapsed = lock(&self.lapsed);
        lapsed.retain(|key, b| {
            b.owner != owner || b.until > now || waiting.contains(key) || full.contains(key)
        });
        self.keys.retain(|call| lapsed.contains_key(call));
    }

    /// The call's rate token lapsed before `accepted`: it is not claimed
    /// again for a while, longer each time in a row.
    pub(crate) fn lapsed(&self, owner: &str, key: &CallKey, tool: &str) {
        let (times, wait) = self.back_off(owner, key, LAPSE_BACKOFF, LAPSE_BACKOFF_MAX);
        tracing::warn!(
            run_id = %key.run_id,
            call_id = %key.call_id,
            tool,
            times,
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            "the checks after the claim took longer than a rate token lasts (a second): the claim is given back and the call claimed again later; a slow authorizer keeps a rate-limited tool from running"
        );
    }

    /// Backs `key` off: not claimed again for `first`, doubled each time
    /// in a row, up to `max`; how many times in a row, and the wait.
    fn back_off(
        &self,
        owner: &str,
        key: &CallKey,
        first: Duration,
        max: Duration,
    ) -> (u32, Duration) {
        let mut lapsed = lock(&self.lapsed);
        let times = lapsed.get(key).map_or(0, |b| b.times).saturating_add(1);
        let wait = first
            .saturating_mul(1 << times.saturating_sub(1).min(5))
            .min(max);
        let until = Instant::now() + wait;
        let owner = owner.to_owned();
        lapsed.insert(
            key.clone(),
            BackOff {
                owner,
                until,
                times,
            },
        );
        (times, wait)
    }

    /// After the claim of `call`: a slot of its concurrency key `key` (of
    /// `tool`), kept in `hold` for as long as the call's drive; `false`
    /// when the key is at its limit (give the claim back). A tool without
    /// a per-key limit, or a hold that has its key's slot already, needs
    /// none.
    pub(crate) async fn take_key(
        &self,
        holder: Option<&Holder>,
        call: &CallKey,
        tool: &str,
        key: &str,
        hold: &ToolHold,
    ) -> bool {
        let Some(limit) = self.limits.get(tool).and_then(Limits::max_per_key) else {
            return true;
        };
        if hold.has_key() {
            return true;
        }
        let taken = match (holder, self.shared.get()) {
            (Some(holder), Some(shared)) => {
                let at = Shared::hold_at(holder, call, &key_tool(tool, key));
                match shared.take_key(at, limit).await {
                    Ok(taken) => {
                        taken.map(|h| KeyHold::Shared(h, self.keys.wake_on_drop(tool, key)))
                    }
                    // Never a reason to hold the call back: it runs
                    // without its key's slot (said in the log).
                    Err(()) => return true,
                }
            }
            _ => self
                .keys
                .take(tool, key, limit)
                .map(|s| KeyHold::Local(s, self.keys.wake_on_drop(tool, key))),
        };
        match taken {
            Some(slot) => {
                *lock(&hold.key) = Some(Box::new(slot));
                self.keys.waited(call);
                lock(&self.lapsed).remove(call);
                true
            }
            None => false,
        }
    }

    /// The call's concurrency key was at its limit: it is not claimed
    /// again for a while, longer each time in a row.
    pub(crate) fn key_limited(&self, owner: &str, call: &CallKey, tool: &str, key: &str) {
        self.keys.wait(tool, key, call);
        let (times, wait) = self.back_off(owner, call, KEY_BACKOFF, KEY_BACKOFF_MAX);
        tracing::debug!(
            run_id = %call.run_id,
            call_id = %call.call_id,
            tool,
            times,
            wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX),
            "given back: the call's concurrency key is at its limit; claimed again after a back-off"
        );
    }

    /// How long until a token of some tool at its rate limit may be free
    /// (the claimer looks again then rather than at its next poll).
    pub(crate) fn next_token_in(&self) -> Option<Duration> {
        self.tools
            .values()
            .filter_map(|f| f.rate.as_ref()?.frees_in())
            .min()
    }

    /// Each limited tool: its concurrency limit and slots held, its rate
    /// limit and tokens counting now.
    /// On a shared store, as last counted there (every replica's).
    pub(crate) fn in_use(&self) -> Vec<ToolUse> {
        if let Some(shared) = self.shared.get() {
            let counted = lock(&shared.counted);
            let mut used: Vec<ToolUse> = counted
                .iter()
                .map(|(tool, c)| ToolUse {
                    tool: tool.clone(),
                    slots: c.limits.concurrency.map(|l| (l, c.slots)),
                    tokens: c.limits.rate.map(|l| (l, c.tokens)),
                })
                .collect();
            used.sort_by(|a, b| a.tool.cmp(&b.tool));
            return used;
        }
        self.tools
            .iter()
            .map(|(tool, f)| ToolUse {
                tool: tool.clone(),
                slots: f.slots.as_ref().map(|s| (s.limit, s.held())),
                tokens: f.rate.as_ref().map(|r| (r.limit, r.in_use())),
            })
            .collect()
    }
}

/// The name a tool's concurrency key is held under in a shared store
/// (the tool, a unit separator, the key): a tool name never holds the
/// separator.
fn key_tool(tool: &str, key: &str) -> String {
    format!("{tool}{}{key}", shared::KEY_SEPARATOR)
}

/// One limited tool's use, for the gauges.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ToolUse {
    pub(crate) tool: String,
    /// Its concurrency limit and the slots held.
    pub(crate) slots: Option<(u32, u32)>,
    /// Its rate limit and the tokens counting.
    pub(crate) tokens: Option<(u32, u32)>,
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
mod shared_tests;
#[cfg(test)]
mod tests;
