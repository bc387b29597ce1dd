//! Approval requests as a store keeps them ([`ApprovalBook`]): one row per
//! (run, call, arguments' digest), where every identity that may claim the
//! call reads it (a SQLite store's own file; on PostgreSQL the schema every
//! replica and identity of the database shares). The rules (who asks, what
//! a decision lets the call do) are the runner's and the
//! [`Approvals`](crate::Approvals) API's; the store keeps the rows and
//! decides each request at most once (a compare-and-set on `waiting`).
use super::{StoreError, Timestamp};

/// Where a request stands as stored. An expired request is a `waiting` one
/// whose expiry has passed (the readers say so; nothing rewrites it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stored {
    /// Nobody decided yet.
    Waiting,
    /// An approver said yes.
    Approved,
    /// An approver said no.
    Denied,
    /// The call ended otherwise (the platform gave it to nobody here, or
    /// ended its run): the request no longer matters.
    Closed,
}

impl Stored {
    /// The state's name in the column.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Stored::Waiting => "waiting",
            Stored::Approved => "approved",
            Stored::Denied => "denied",
            Stored::Closed => "closed",
        }
    }

    /// The state a column names.
    pub(crate) fn parse(name: &str) -> Result<Stored, StoreError> {
        Ok(match name {
            "waiting" => Stored::Waiting,
            "approved" => Stored::Approved,
            "denied" => Stored::Denied,
            "closed" => Stored::Closed,
            other => {
                return Err(StoreError::Corrupt(format!(
                    "unknown approval state {other}"
                )));
            }
        })
    }
}

/// One approval request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApprovalRow {
    pub(crate) run_id: String,
    pub(crate) call_id: String,
    /// The arguments' digest the request (and any decision) is bound to.
    pub(crate) digest: String,
    pub(crate) tool: String,
    pub(crate) subject: String,
    pub(crate) agent_id: String,
    pub(crate) agent_version: String,
    /// The arguments as JSON text (shown to the approver).
    pub(crate) arguments: String,
    /// Why a person must decide (the product's words).
    pub(crate) reason: String,
    /// The identity that asked.
    pub(crate) executor_id: String,
    pub(crate) asked_at: Timestamp,
    pub(crate) expires_at: Timestamp,
    pub(crate) state: Stored,
    /// Who decided (or why the request was closed).
    pub(crate) decided_by: Option<String>,
    pub(crate) note: Option<String>,
    pub(crate) decided_at: Option<Timestamp>,
    /// Why the request was closed.
    pub(crate) closed_why: Option<String>,
    /// When the product was told that it waits.
    pub(crate) notified_at: Option<Timestamp>,
}

impl ApprovalRow {
    /// Whether nobody decided and its expiry has passed at `now`.
    pub(crate) fn expired_at(&self, now: Timestamp) -> bool {
        self.state == Stored::Waiting && self.expires_at <= now
    }
}

/// A decision a person makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Yes: the call may run.
    Approve,
    /// No: the call is settled `forbidden`.
    Deny,
}

impl Verdict {
    /// The state the request takes.
    pub(crate) fn stored(self) -> Stored {
        match self {
            Verdict::Approve => Stored::Approved,
            Verdict::Deny => Stored::Denied,
        }
    }
}

/// Approval requests of every identity that may claim a call.
#[async_trait::async_trait]
pub(crate) trait ApprovalBook: Send + Sync {
    /// Stores `row` (as `waiting`) unless a request of its run, call and
    /// digest is stored already; answers the stored one either way.
    ///
    /// # Errors
    /// The database failed (nothing may be assumed stored).
    async fn ask(&self, row: &ApprovalRow) -> Result<ApprovalRow, StoreError>;

    /// The requests of one call (every digest), the newest first.
    ///
    /// # Errors
    /// The database failed.
    async fn of_call(&self, run_id: &str, call_id: &str) -> Result<Vec<ApprovalRow>, StoreError>;

    /// Every request, the newest first.
    ///
    /// # Errors
    /// The database failed.
    async fn list(&self) -> Result<Vec<ApprovalRow>, StoreError>;

    /// Decides the request if it is `waiting` and expires after `now`:
    /// `true` if this call decided it (`false`: it was decided, closed or
    /// expired before; read it again to see how).
    ///
    /// # Errors
    /// The database failed (read it again: the decision may be stored).
    async fn decide(
        &self,
        at: (&str, &str, &str),
        verdict: Verdict,
        who: &str,
        note: Option<&str>,
        now: Timestamp,
    ) -> Result<bool, StoreError>;

    /// Closes the call's requests nobody decided (the call ended
    /// otherwise, or a request expired), saying why: a decided request
    /// keeps its decision.
    ///
    /// # Errors
    /// The database failed.
    async fn close(
        &self,
        run_id: &str,
        call_id: &str,
        why: &str,
        now: Timestamp,
    ) -> Result<(), StoreError>;

    /// Closes the request if nobody decided it and its expiry has passed at
    /// `now` (`why`: the expiry's): `true` if this call closed it (an
    /// approver's decision after that is refused).
    ///
    /// # Errors
    /// The database failed.
    async fn expire(
        &self,
        at: (&str, &str, &str),
        why: &str,
        now: Timestamp,
    ) -> Result<bool, StoreError>;

    /// Records that the product was told of the request.
    ///
    /// # Errors
    /// The database failed.
    async fn told(&self, at: (&str, &str, &str), now: Timestamp) -> Result<(), StoreError>;

    /// `executor_id`'s requests nobody decided, not expired at `now`,
    /// whose telling is not recorded; where identities share the book
    /// (PostgreSQL), also those of an asker of the same binding that
    /// stopped (its lease unrenewed for three of its periods, let go, or
    /// adopted), so that a request whose asker died before telling is
    /// told by another replica of the same product: each taken by one
    /// replica, once a minute at most.
    ///
    /// # Errors
    /// The database failed.
    async fn untold(
        &self,
        executor_id: &str,
        now: Timestamp,
    ) -> Result<Vec<ApprovalRow>, StoreError>;

    /// The calls with a request nobody decided that has not expired at
    /// `now` (the claimer passes them over).
    ///
    /// # Errors
    /// The database failed.
    async fn waiting(&self, now: Timestamp) -> Result<Vec<(String, String)>, StoreError>;

    /// Records that the request's decision was acted on (what it made of
    /// the call is saved) at `now`, once.
    ///
    /// # Errors
    /// The database failed.
    async fn acted(&self, at: (&str, &str, &str), now: Timestamp) -> Result<(), StoreError>;

    /// Deletes at most `limit` requests nobody needs any more since before
    /// `before` (see [`PRUNABLE`]); how many.
    ///
    /// # Errors
    /// The database failed.
    async fn prune(&self, before: Timestamp, limit: u32) -> Result<u64, StoreError>;
}

/// The requests [`ApprovalBook::prune`] takes, for `before` (`$1`): a
/// decision acted on before it; a request closed before it (its call
/// ended, or its expiry closed it); a request nobody decided that expired
/// before it (a call that comes back after that is asked again, never
/// run). A decision not yet acted on stays, however old.
pub(super) const PRUNABLE: &str = "(acted_at IS NOT NULL AND acted_at < $1)
     OR (state = 'closed' AND decided_at < $1)
     OR (state = 'waiting' AND expires_at < $1)";

/// Records a decision acted on (`$1`: when; then run, call, digest).
pub(super) const ACTED: &str = "UPDATE approvals SET acted_at = COALESCE(acted_at, $1)
     WHERE run_id = $2 AND call_id = $3 AND digest = $4 AND state <> 'waiting'";

/// The columns every backend selects, in this order.
pub(super) const COLUMNS: &str = "run_id, call_id, digest, tool, subject, agent_id, agent_version, arguments, reason, executor_id, asked_at, expires_at, state, decided_by, note, decided_at, closed_why, notified_at";

/// A row read back (the columns of [`COLUMNS`], times as RFC 3339 text).
pub(super) fn row_of(r: &impl super::rows::Columns) -> Result<ApprovalRow, StoreError> {
    use super::columns::time;
    Ok(ApprovalRow {
        run_id: r.text("run_id")?,
        call_id: r.text("call_id")?,
        digest: r.text("digest")?,
        tool: r.text("tool")?,
        subject: r.text("subject")?,
        agent_id: r.text("agent_id")?,
        agent_version: r.text("agent_version")?,
        arguments: r.text("arguments")?,
        reason: r.text("reason")?,
        executor_id: r.text("executor_id")?,
        asked_at: time(&r.text("asked_at")?)?,
        expires_at: time(&r.text("expires_at")?)?,
        state: Stored::parse(&r.text("state")?)?,
        decided_by: r.opt_text("decided_by")?,
        note: r.opt_text("note")?,
        decided_at: r.opt_text("decided_at")?.as_deref().map(time).transpose()?,
        closed_why: r.opt_text("closed_why")?,
        notified_at: r
            .opt_text("notified_at")?
            .as_deref()
            .map(time)
            .transpose()?,
    })
}
