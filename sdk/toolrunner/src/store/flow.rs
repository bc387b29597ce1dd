//! Flow control held in a store shared by replicas: what the runner asks
//! of it ([`SharedFlow`], which the PostgreSQL store implements), so that a
//! tool's slots and rate tokens count every replica and identity of one
//! database. The rules (what counts, which limit wins) are the runner's;
//! the store keeps the rows and counts them under one lock per tool.
use std::collections::BTreeMap;

use super::StoreError;

/// A tool's limits as the store keeps them (`None`: no such limit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Caps {
    /// At most this many slots held at once.
    pub(crate) concurrency: Option<u32>,
    /// At most this many first `accepted` in a sliding second.
    pub(crate) rate: Option<u32>,
}

impl Caps {
    /// Limits of these values.
    pub(crate) const fn of(concurrency: Option<u32>, rate: Option<u32>) -> Caps {
        Caps { concurrency, rate }
    }

    /// These, with each limit `over` sets in place of this one's.
    pub(crate) fn overridden_by(self, over: Caps) -> Caps {
        Caps {
            concurrency: over.concurrency.or(self.concurrency),
            rate: over.rate.or(self.rate),
        }
    }
}

/// One call's hold of its tool's limits, as the store keys it: the tool,
/// the call, the identity (with its fencing token) that holds it, and the
/// hold itself (`hold_id`, unique in the process: a hold gives back only
/// its own rows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HoldAt {
    pub(crate) tool: String,
    pub(crate) run_id: String,
    pub(crate) call_id: String,
    pub(crate) executor_id: String,
    pub(crate) lease_token: i64,
    pub(crate) hold_id: i64,
}

/// What a take asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Take {
    /// A new claim: a slot and a reserved token, only below the limits.
    New,
    /// A call the platform already holds as this identity's: a slot
    /// whatever the count (never refused), no token.
    Owed,
    /// A token for an `accepted` due now (no reservation), only below the
    /// rate limit; no slot.
    SendNow,
}

/// What a take found and did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counted {
    /// Whether the hold was taken.
    pub(crate) taken: bool,
    /// The tool's slots held (after the take).
    pub(crate) slots: u32,
    /// The tool's tokens counting (after the take).
    pub(crate) tokens: u32,
    /// The tool's limits as they applied (the store's over the process's).
    pub(crate) limits: Caps,
}

/// The slots and tokens of every replica of one database.
#[async_trait::async_trait]
pub(crate) trait SharedFlow: Send + Sync {
    /// The limits an operator set in the store, by tool (each over the
    /// process's own, limit by limit).
    ///
    /// # Errors
    /// The database failed.
    async fn stored_limits(&self) -> Result<BTreeMap<String, Caps>, StoreError>;

    /// Counts the tool's live holds under its lock (forgetting those that
    /// no longer count) and takes what `take` asks for when `limits` (the
    /// process's, under the store's) allow it. `assignment_id` names the
    /// assignment for [`Take::SendNow`].
    ///
    /// # Errors
    /// The database failed (nothing was taken).
    async fn take(
        &self,
        at: &HoldAt,
        limits: Caps,
        take: Take,
        assignment_id: &str,
    ) -> Result<Counted, StoreError>;

    /// The reservation becomes the `accepted` of `assignment_id`, if it is
    /// younger than a second by the database's clock (`false`: it lapsed,
    /// or a taker forgot it as its holder's lease looked lapsed).
    ///
    /// # Errors
    /// The database failed.
    async fn start_send(&self, at: &HoldAt, assignment_id: &str) -> Result<bool, StoreError>;

    /// The `accepted` of `assignment_id` was answered: its token counts for
    /// a second from now.
    ///
    /// # Errors
    /// The database failed.
    async fn answered(&self, at: &HoldAt, assignment_id: &str) -> Result<(), StoreError>;

    /// The call is done with its hold: its slot (if it held one, `slot`)
    /// and reservation go, a token being sent counts for a second from
    /// now. `false`: the slot was no longer there (a taker forgot it while
    /// this identity's lease looked lapsed: the limit may have been
    /// exceeded meanwhile).
    ///
    /// # Errors
    /// The database failed.
    async fn release(&self, at: &HoldAt, slot: bool) -> Result<bool, StoreError>;

    /// Sets the store's limits of `tool`: each one `limits` sets replaces
    /// the stored one, the others stay; `clear` drops both first.
    ///
    /// # Errors
    /// The database failed.
    async fn set_limits(&self, tool: &str, limits: Caps, clear: bool) -> Result<(), StoreError>;

    /// Every tool the store knows: its stored limits, slots held and
    /// tokens counting now.
    ///
    /// # Errors
    /// The database failed.
    async fn list(&self) -> Result<Vec<ToolRow>, StoreError>;
}

/// One tool as the store holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ToolRow {
    /// The tool's name.
    pub(crate) tool: String,
    /// The limits an operator set (each `None`: the process's own).
    pub(crate) stored: Caps,
    /// The slots held now, by every identity.
    pub(crate) slots: u32,
    /// The tokens in the last second.
    pub(crate) tokens: u32,
}
