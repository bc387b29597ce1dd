//! The product's own authorization, asked for every call before it runs.
use async_trait::async_trait;
use serde_json::Value;

/// What the product is asked to authorize. Its `Debug` shows the
/// arguments' size only (a log line never holds them).
#[derive(Clone)]
#[non_exhaustive]
pub struct AuthorizationRequest {
    /// Whom the run acts for.
    pub subject: String,
    /// Agent.
    pub agent_id: String,
    /// Agent version.
    pub agent_version: String,
    /// Tool.
    pub tool_name: String,
    /// Arguments (already checked against the schema and the digest).
    pub arguments: Value,
    /// Their digest.
    pub arguments_digest: String,
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
}

toolrunner_protocol::debug_without_payloads!(AuthorizationRequest { subject, agent_id, agent_version, tool_name, arguments_digest, run_id, call_id } hiding { arguments });

/// A refusal: the call is settled `failed` with code `forbidden` and this
/// message, which the model reads (keep it short, no internals).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Denied {
    pub(crate) message: String,
    /// `Some(time to decide)`: not refused but held for a person's yes
    /// (the message is the reason the approver reads).
    pub(crate) approval: Option<std::time::Duration>,
}

impl Denied {
    /// The short message for the model (for [`needs_approval`], the
    /// reason the approver reads).
    ///
    /// [`needs_approval`]: Denied::needs_approval
    pub fn message(&self) -> &str {
        &self.message
    }

    /// A refusal with a message.
    pub fn new(message: impl Into<String>) -> Denied {
        Denied {
            message: message.into(),
            approval: None,
        }
    }

    /// Not now: a person must say yes first. The call is given back to the
    /// platform with nothing accepted and nothing run, and an approval
    /// request waits in the store (`toolrunner approvals`, the console,
    /// [`Approvals`](crate::Approvals)) with `reason`, for at most
    /// `expires_in`. Approved, the call is claimed again and runs once;
    /// denied or expired, it is settled `failed` with code `forbidden`
    /// ("denied by an approver", "approval expired").
    ///
    /// Once approved, this answer for the same arguments lets the call
    /// run; a plain refusal ([`Denied::new`]) still refuses it.
    pub fn needs_approval(reason: impl Into<String>, expires_in: std::time::Duration) -> Denied {
        Denied {
            message: reason.into(),
            approval: Some(expires_in),
        }
    }

    /// Whether this answer asks for a person's approval (and for how long
    /// at most).
    pub fn approval_window(&self) -> Option<std::time::Duration> {
        self.approval
    }
}

/// The product's authorization. The platform's grant proves only that the
/// executor holds this assignment; it never replaces this check.
#[async_trait]
pub trait Authorizer: Send + Sync + 'static {
    /// Allows or refuses one call.
    async fn authorize(&self, request: &AuthorizationRequest) -> Result<(), Denied>;

    /// Told once a call's approval request (asked for by
    /// [`Denied::needs_approval`]) is stored and waits: pass it to the
    /// product's own channel (mail, chat). Called at least once per
    /// request, possibly twice after a crash, beside the call (never
    /// holding it back); a panic here, or a telling that takes longer
    /// than 30 seconds, is logged and the request is told again later.
    /// The default does nothing.
    async fn on_approval_requested(&self, _request: &crate::api::approval::ApprovalRequest) {}
}

/// Allows every call. For development only: say so explicitly with
/// [`crate::ExecutorBuilder::allow_all`].
#[derive(Debug, Clone, Copy, Default)]
pub struct AllowAll;

#[async_trait]
impl Authorizer for AllowAll {
    async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
        Ok(())
    }
}
