//! An approval request as the product and its approvers see it (the
//! authorizer's `on_approval_requested`, [`Approvals`](crate::Approvals)).
use serde::Serialize;
use serde_json::Value;

use crate::store::Timestamp;
use crate::store::approvals::{ApprovalRow, Stored};

/// Why an executor closed a request nobody decided before its expiry (it
/// reads as `expired`).
pub(crate) const EXPIRED_WHY: &str = "approval expired";

/// Where an approval request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ApprovalState {
    /// Nobody decided yet, and it has not expired.
    Waiting,
    /// An approver said yes: the call runs (or ran) once.
    Approved,
    /// An approver said no: the call is settled `forbidden`.
    Denied,
    /// Nobody decided in time: the call is settled `forbidden`.
    Expired,
    /// The call ended otherwise (the platform gave it to no one here, or
    /// ended its run): nothing to decide any more.
    Closed,
}

impl ApprovalState {
    /// The state's name (`waiting`, `approved`, `denied`, `expired`,
    /// `closed`).
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalState::Waiting => "waiting",
            ApprovalState::Approved => "approved",
            ApprovalState::Denied => "denied",
            ApprovalState::Expired => "expired",
            ApprovalState::Closed => "closed",
        }
    }
}

impl std::fmt::Display for ApprovalState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One approval request as an approver sees it. Its `Debug` leaves the
/// arguments out (a log line never holds them).
#[derive(Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct ApprovalRequest {
    pub(crate) run_id: String,
    pub(crate) call_id: String,
    pub(crate) tool: String,
    pub(crate) digest: String,
    pub(crate) state: ApprovalState,
    pub(crate) subject: String,
    pub(crate) agent_id: String,
    pub(crate) agent_version: String,
    pub(crate) arguments: Value,
    pub(crate) reason: String,
    pub(crate) asked_at: Timestamp,
    pub(crate) expires_at: Timestamp,
    pub(crate) decided_by: Option<String>,
    pub(crate) note: Option<String>,
    pub(crate) decided_at: Option<Timestamp>,
    pub(crate) closed_why: Option<String>,
}

toolrunner_protocol::debug_without_payloads!(ApprovalRequest { run_id, call_id, tool, digest, state, subject, agent_id, agent_version, reason, asked_at, expires_at, decided_by, note, decided_at, closed_why } hiding { arguments });

impl ApprovalRequest {
    /// The request a stored row is, as of `now` (a waiting one past its
    /// expiry is `Expired`).
    pub(crate) fn of(row: ApprovalRow, now: Timestamp) -> ApprovalRequest {
        let state = match row.state {
            _ if row.expired_at(now) => ApprovalState::Expired,
            Stored::Waiting => ApprovalState::Waiting,
            Stored::Approved => ApprovalState::Approved,
            Stored::Denied => ApprovalState::Denied,
            Stored::Closed if row.closed_why.as_deref() == Some(EXPIRED_WHY) => {
                ApprovalState::Expired
            }
            Stored::Closed => ApprovalState::Closed,
        };
        ApprovalRequest {
            arguments: serde_json::from_str(&row.arguments).unwrap_or(Value::String(row.arguments)),
            run_id: row.run_id,
            call_id: row.call_id,
            tool: row.tool,
            digest: row.digest,
            state,
            subject: row.subject,
            agent_id: row.agent_id,
            agent_version: row.agent_version,
            reason: row.reason,
            asked_at: row.asked_at,
            expires_at: row.expires_at,
            decided_by: row.decided_by,
            note: row.note,
            decided_at: row.decided_at,
            closed_why: row.closed_why,
        }
    }

    /// Run.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    /// Call.
    pub fn call_id(&self) -> &str {
        &self.call_id
    }

    /// Tool.
    pub fn tool(&self) -> &str {
        &self.tool
    }

    /// The arguments' digest the request (and its decision) is bound to.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// Where it stands.
    pub fn state(&self) -> ApprovalState {
        self.state
    }

    /// Whom the run acts for.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// Agent.
    pub fn agent_id(&self) -> &str {
        &self.agent_id
    }

    /// Agent version.
    pub fn agent_version(&self) -> &str {
        &self.agent_version
    }

    /// The call's arguments (what the approver decides on).
    pub fn arguments(&self) -> &Value {
        &self.arguments
    }

    /// Why a person must decide (the product's words).
    pub fn reason(&self) -> &str {
        &self.reason
    }

    /// When it was asked.
    pub fn asked_at(&self) -> Timestamp {
        self.asked_at
    }

    /// When it expires if nobody decides.
    pub fn expires_at(&self) -> Timestamp {
        self.expires_at
    }

    /// Who decided (`toolrunner` for a request closed undecided).
    pub fn decided_by(&self) -> Option<&str> {
        self.decided_by.as_deref()
    }

    /// The approver's note.
    pub fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    /// When it was decided (or closed).
    pub fn decided_at(&self) -> Option<Timestamp> {
        self.decided_at
    }

    /// Why it was closed.
    pub fn closed_why(&self) -> Option<&str> {
        self.closed_why.as_deref()
    }
}
