//! Flow control shared by the replicas of one PostgreSQL database: the
//! holds kept as the store's rows ([`SharedFlow`]) rather than in this
//! process, so that a tool's limits count every replica and identity.
//!
//! - The limits that apply are the store's (`toolrunner limits set`) over
//!   this process's (configuration over code), limit by limit; a tool
//!   limited nowhere never asks the database.
//! - The store's limits are read again at most once a [`REFRESH`]: a
//!   change reaches every replica within about a second.
//! - A hold's drop gives its rows back on a task of its own (the drop
//!   itself cannot wait); one that cannot (the database unreachable) is
//!   forgotten by the next taker once this identity's lease lapses or its
//!   token moves on.
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

/// The shared part of a process's [`super::Flow`].
pub(super) struct Shared {
    pub(super) store: Arc<dyn SharedFlow>,
    /// The store's limits, and when they were read.
    stored: Mutex<(Option<Instant>, BTreeMap<String, Caps>)>,
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

    /// The store's limits of `tool` (read again once a [`REFRESH`]).
    pub(super) async fn stored(&self, tool: &str) -> Caps {
        let due = lock(&self.stored)
            .0
            .is_none_or(|at| at.elapsed() >= REFRESH);
        if due {
            match self.store.stored_limits().await {
                Ok(limits) => *lock(&self.stored) = (Some(Instant::now()), limits),
                Err(e) => {
                    tracing::debug!(error = %e, "reading the store's flow limits failed");
                    lock(&self.stored).0 = Some(Instant::now());
                }
            }
        }
        lock(&self.stored).1.get(tool).copied().unwrap_or_default()
    }

    /// Takes `take` of `tool` for `at` under `limits`: the hold if taken.
    pub(super) async fn take(
        self: &Arc<Self>,
        at: HoldAt,
        limits: Caps,
        take: Take,
    ) -> Option<SharedHold> {
        match self.store.take(&at, limits, take, "").await {
            Ok(counted) => {
                lock(&self.counted).insert(at.tool.clone(), counted);
                counted.taken.then(|| SharedHold {
                    shared: self.clone(),
                    slot: take != Take::SendNow && limits.concurrency.is_some(),
                    limits,
                    rate: limits.rate.is_some(),
                    reserved: take == Take::New && limits.rate.is_some(),
                    at,
                    send: Mutex::default(),
                })
            }
            Err(e) => {
                tracing::warn!(tool = %at.tool, run_id = %at.run_id, call_id = %at.call_id, error = %e, "the database could not count the tool's limits: the call is not taken now");
                None
            }
        }
    }
}

/// What a call holds of its tool's shared limits (rows in the store).
pub(crate) struct SharedHold {
    shared: Arc<Shared>,
    at: HoldAt,
    /// Whether it holds a slot row.
    slot: bool,
    /// The tool's limits as this process applies them.
    limits: Caps,
    /// Whether the tool has a rate limit.
    rate: bool,
    /// Whether a reservation row was taken before the claim.
    reserved: bool,
    /// The assignment whose `accepted` holds a token (`None`: none yet).
    send: Mutex<Option<String>>,
}

impl std::fmt::Debug for SharedHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedHold")
            .field("at", &self.at)
            .field("slot", &self.slot)
            .field("rate", &self.rate)
            .finish_non_exhaustive()
    }
}

impl SharedHold {
    /// As [`super::ToolHold::sending`], in the store.
    pub(super) async fn sending(&self, assignment_id: &str) -> Result<(), NoToken> {
        if !self.rate {
            return Ok(());
        }
        let before = lock(&self.send).clone();
        if before.as_deref() == Some(assignment_id) {
            return Ok(());
        }
        let store = &self.shared.store;
        if before.is_none() && self.reserved {
            return match store.start_send(&self.at, assignment_id).await {
                Ok(true) => {
                    *lock(&self.send) = Some(assignment_id.to_owned());
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
                tracing::debug!(error = %e, "marking an earlier assignment's token sent failed (the next taker forgets it after a window)");
            }
        }
        match store
            .take(&self.at, self.limits, Take::SendNow, assignment_id)
            .await
        {
            Ok(counted) if counted.taken => {
                *lock(&self.send) = Some(assignment_id.to_owned());
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
        let sent = lock(&self.send).clone();
        if let Some(assignment_id) = sent
            && let Err(e) = self.shared.store.answered(&self.at, &assignment_id).await
        {
            tracing::debug!(error = %e, "marking a token sent failed (the next taker forgets it after a window)");
        }
    }
}

impl Drop for SharedHold {
    fn drop(&mut self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = self.shared.store.clone();
        let at = self.at.clone();
        let slot = self.slot;
        runtime.spawn(async move {
            let mut wait = Duration::from_millis(50);
            for _ in 0..8 {
                match store.release(&at, slot).await {
                    Ok(true) => return,
                    Ok(false) => {
                        super::super::telemetry::flow_slot_lost(&at.tool);
                        tracing::warn!(tool = %at.tool, run_id = %at.run_id, call_id = %at.call_id, "this call's slot was taken back while it ran (this identity's lease looked lapsed to another replica: a pause, a stall): the tool's concurrency limit may have been exceeded meanwhile");
                        return;
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "giving a flow hold back failed; trying again");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(Duration::from_secs(2));
                    }
                }
            }
        });
    }
}
