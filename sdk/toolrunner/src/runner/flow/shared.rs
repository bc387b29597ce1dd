//! Flow control shared by the replicas of one PostgreSQL database: the
//! holds kept as the store's rows ([`SharedFlow`]) rather than in this
//! process, so that a tool's limits count every replica and identity.
//!
//! - The limits that apply are the store's (`toolrunner limits set`) over
//!   this process's (configuration over code), limit by limit; a tool
//!   limited nowhere never asks the database.
//! - The store's limits are read again at most once a [`REFRESH`]: a
//!   change reaches every replica within about a second.
//! - Until the store's limits were read once, nothing new is claimed: a
//!   tool limited only there is not taken as unlimited.
//! - A hold's drop gives its rows back on a task of its own (the drop
//!   itself cannot wait), trying again until the database answers, and
//!   only its own rows (`hold_id`): never a newer hold's of the same call.
//! - A hold taken back after a pause asserts its rows again (a taker may
//!   have forgotten them while this identity's lease looked lapsed).
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{NoToken, lock};
use crate::store::flow::{Caps, Counted, HoldAt, SharedFlow, Take};

/// How often the store's limits are read again.
pub(super) const REFRESH: Duration = Duration::from_secs(1);

/// The identity that takes a hold: its executor id and fencing token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) executor_id: String,
    pub(crate) lease_token: i64,
}

/// The store's limits as last read.
#[derive(Default)]
struct Stored {
    tried: Option<Instant>,
    read: bool,
    limits: BTreeMap<String, Caps>,
}

/// A new hold's id (unique in the process, random across processes).
fn hold_id() -> i64 {
    i64::from_ne_bytes(rand::random::<u64>().to_ne_bytes())
}

/// The shared part of a process's [`super::Flow`].
pub(super) struct Shared {
    pub(super) store: Arc<dyn SharedFlow>,
    /// The store's limits, when they were last read (or tried), and
    /// whether a read ever succeeded.
    stored: Mutex<Stored>,
    /// Each tool's limits and use as last counted (for the gauges).
    pub(super) counted: Mutex<HashMap<String, Counted>>,
}

impl Shared {
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))] // a PostgreSQL store's
    pub(super) fn new(store: Arc<dyn SharedFlow>) -> Shared {
        Shared {
            store,
            stored: Mutex::default(),
            counted: Mutex::default(),
        }
    }

    /// The store's limits of `tool` (read again once a [`REFRESH`]);
    /// `None` until a read succeeded.
    pub(super) async fn stored(&self, tool: &str) -> Option<Caps> {
        let due = lock(&self.stored)
            .tried
            .is_none_or(|at| at.elapsed() >= REFRESH);
        if due {
            let read = self.store.stored_limits().await;
            let mut stored = lock(&self.stored);
            stored.tried = Some(Instant::now());
            match read {
                Ok(limits) => {
                    stored.read = true;
                    stored.limits = limits;
                }
                Err(e) => tracing::debug!(error = %e, "reading the store's flow limits failed"),
            }
        }
        let stored = lock(&self.stored);
        stored
            .read
            .then(|| stored.limits.get(tool).copied().unwrap_or_default())
    }

    /// The key of a new hold of `tool` for `call` by `holder`.
    pub(super) fn hold_at(holder: &Holder, call: &super::CallKey, tool: &str) -> HoldAt {
        HoldAt {
            tool: tool.to_owned(),
            run_id: call.run_id.clone(),
            call_id: call.call_id.clone(),
            executor_id: holder.executor_id.clone(),
            lease_token: holder.lease_token,
            hold_id: hold_id(),
        }
    }

    /// Takes `take` of `tool` for `at` under `limits`: the hold if taken.
    /// A call this identity owns ([`Take::Owed`]) is never refused: when
    /// the database fails, it gets a hold without rows, which still needs
    /// a token for each `accepted`.
    pub(super) async fn take(
        self: &Arc<Self>,
        at: HoldAt,
        limits: Caps,
        take: Take,
    ) -> Option<SharedHold> {
        let hold = |slot: bool| SharedHold {
            shared: self.clone(),
            slot,
            limits,
            send: Mutex::new(Send {
                reserved: take == Take::New && limits.rate.is_some(),
                sent: None,
            }),
            at: at.clone(),
        };
        match self.store.take(&at, limits, take, "").await {
            Ok(counted) => {
                // A tool's own use, for the gauges (a key's is not one).
                if !at.tool.contains(KEY_SEPARATOR) {
                    lock(&self.counted).insert(at.tool.clone(), counted);
                }
                counted
                    .taken
                    .then(|| hold(take != Take::SendNow && limits.concurrency.is_some()))
            }
            Err(e) if take == Take::Owed => {
                tracing::warn!(tool = %tool_of(&at.tool), run_id = %at.run_id, call_id = %at.call_id, error = %e, "the database could not count the tool's limits: this identity's own call goes on without its slot (the concurrency limit may be exceeded), and its accepted still waits for a token");
                Some(hold(false))
            }
            Err(e) => {
                tracing::warn!(tool = %tool_of(&at.tool), run_id = %at.run_id, call_id = %at.call_id, error = %e, "the database could not count the tool's limits: the call is not taken now");
                None
            }
        }
    }
}

/// Between a tool's name and a concurrency key's digest, where a key's
/// slots are held in the store.
pub(super) const KEY_SEPARATOR: char = '\u{1f}';

/// The tool a hold's name is of (a key's hold: the tool before the
/// separator), for labels.
fn tool_of(held_as: &str) -> &str {
    held_as.split(KEY_SEPARATOR).next().unwrap_or(held_as)
}

impl Shared {
    /// A slot of a concurrency key (`at.tool`: the tool and the key's
    /// digest) below `limit`: `Ok(None)` when the key is at its limit,
    /// `Err` when the database could not tell.
    pub(super) async fn take_key(
        self: &Arc<Self>,
        at: HoldAt,
        limit: u32,
    ) -> Result<Option<SharedHold>, ()> {
        let caps = Caps::of(Some(limit), None);
        match self.store.take(&at, caps, Take::New, "").await {
            Ok(counted) => Ok(counted.taken.then(|| SharedHold {
                shared: self.clone(),
                slot: true,
                limits: caps,
                send: Mutex::new(Send {
                    reserved: false,
                    sent: None,
                }),
                at,
            })),
            Err(e) => {
                tracing::warn!(tool = %tool_of(&at.tool), run_id = %at.run_id, call_id = %at.call_id, error = %e, "the database could not count the call's concurrency key: the call goes on without its key's slot");
                Err(())
            }
        }
    }
}

/// Where a hold's rate token is.
#[derive(Debug)]
struct Send {
    /// A reservation taken before the claim, not yet a send (or known
    /// gone).
    reserved: bool,
    /// The assignment whose `accepted` holds a token.
    sent: Option<String>,
}

/// What a call holds of its tool's shared limits (rows in the store).
pub(crate) struct SharedHold {
    shared: Arc<Shared>,
    at: HoldAt,
    /// Whether it holds a slot row.
    slot: bool,
    /// The tool's limits as this process applies them.
    limits: Caps,
    send: Mutex<Send>,
}

impl std::fmt::Debug for SharedHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedHold")
            .field("at", &self.at)
            .field("slot", &self.slot)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl SharedHold {
    /// As [`super::ToolHold::sending`], in the store. A reservation that
    /// lapsed (or whose turn into a send failed) is spent: the next try
    /// takes a token below the limit, as a call picked up again does.
    pub(super) async fn sending(&self, assignment_id: &str) -> Result<(), NoToken> {
        if self.limits.rate.is_none() {
            return Ok(());
        }
        let (reserved, before) = {
            let send = lock(&self.send);
            (send.reserved, send.sent.clone())
        };
        if before.as_deref() == Some(assignment_id) {
            return Ok(());
        }
        let store = &self.shared.store;
        if before.is_none() && reserved {
            let turned = store.start_send(&self.at, assignment_id).await;
            let mut send = lock(&self.send);
            send.reserved = false;
            return match turned {
                Ok(true) => {
                    send.sent = Some(assignment_id.to_owned());
                    Ok(())
                }
                Ok(false) => Err(NoToken::Lapsed),
                Err(e) => {
                    tracing::warn!(error = %e, "the database could not turn the reservation into a send");
                    Err(NoToken::Lapsed)
                }
            };
        }
        if let Some(old) = before {
            // Another assignment's token keeps counting as sent.
            if let Err(e) = store.answered(&self.at, &old).await {
                tracing::debug!(error = %e, "marking an earlier assignment's token sent failed (it counts until the hold is given back)");
            }
        }
        match store
            .take(&self.at, self.limits, Take::SendNow, assignment_id)
            .await
        {
            Ok(counted) if counted.taken => {
                lock(&self.send).sent = Some(assignment_id.to_owned());
                Ok(())
            }
            Ok(_) => Err(NoToken::Full),
            Err(e) => {
                tracing::debug!(error = %e, "the database could not count the tool's rate");
                Err(NoToken::Full)
            }
        }
    }

    /// As [`super::ToolHold::answered`], in the store.
    pub(super) async fn answered(&self) {
        let sent = lock(&self.send).sent.clone();
        if let Some(assignment_id) = sent
            && let Err(e) = self.shared.store.answered(&self.at, &assignment_id).await
        {
            tracing::debug!(error = %e, "marking a token sent failed (it counts until the hold is given back)");
        }
    }

    /// Taken back after a pause: its slot row asserted again (a taker may
    /// have forgotten it while this identity's lease looked lapsed), as a
    /// call this identity owns.
    pub(super) async fn reassert(&self) {
        if !self.slot {
            return;
        }
        let caps = Caps::of(self.limits.concurrency, None);
        if let Err(e) = self.shared.store.take(&self.at, caps, Take::Owed, "").await {
            tracing::warn!(tool = %tool_of(&self.at.tool), run_id = %self.at.run_id, call_id = %self.at.call_id, error = %e, "the database could not assert a resumed call's slot again: it goes on, and the concurrency limit may be exceeded");
        }
    }
}

/// The longest wait between two tries to give a hold back.
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(5);

impl Drop for SharedHold {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(tool = %tool_of(&self.at.tool), run_id = %self.at.run_id, call_id = %self.at.call_id, "a flow hold dropped outside the runtime is not given back: it counts until this identity's lease lapses or is let go");
            return;
        };
        let store = self.shared.store.clone();
        let at = self.at.clone();
        let slot = self.slot;
        runtime.spawn(async move {
            let mut wait = Duration::from_millis(50);
            loop {
                match store.release(&at, slot).await {
                    Ok(true) => return,
                    Ok(false) => {
                        super::super::telemetry::flow_slot_lost(tool_of(&at.tool));
                        tracing::warn!(tool = %tool_of(&at.tool), run_id = %at.run_id, call_id = %at.call_id, "this call's slot was taken back while it ran (this identity's lease looked lapsed to another replica: a pause, a stall): the tool's concurrency limit may have been exceeded meanwhile");
                        return;
                    }
                    Err(e) => {
                        // Until the database answers: a hold not given back
                        // counts for as long as this identity lives.
                        tracing::debug!(error = %e, "giving a flow hold back failed; trying again");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(RELEASE_RETRY_MAX);
                    }
                }
            }
        });
    }
}
