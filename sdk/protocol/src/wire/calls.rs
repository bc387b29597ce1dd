//! Claim and receipt bodies (protocol §5).
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::present;

/// A call's state on the platform. An answer naming a state this version
/// does not know reads as [`CallState::Unknown`] instead of failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum CallState {
    /// Waiting for a claim.
    Pending,
    /// Claimed, not yet accepted.
    Claimed,
    /// Accepted: side effects may be under way.
    Running,
    /// Ended with a result.
    Completed,
    /// Ended with a confirmed business failure.
    Failed,
    /// Ended with a confirmed business cancellation.
    Cancelled,
    /// The executor does not know the outcome.
    ReconciliationRequired,
    /// The run was cancelled or expired first.
    Terminated,
    /// A state this version of the protocol types does not know.
    #[serde(other)]
    Unknown,
}

impl CallState {
    /// `completed`, `failed`, `cancelled` or `terminated`.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Completed | Self::Failed | Self::Cancelled | Self::Terminated
        )
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Claimed => "claimed",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
            Self::ReconciliationRequired => "reconciliation_required",
            Self::Terminated => "terminated",
            Self::Unknown => "unknown",
        }
    }
}

/// A run's status (an unknown one reads as [`RunStatus::Unknown`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum RunStatus {
    /// Still going.
    Active,
    /// Every call terminal.
    Completed,
    /// Cancelled by the platform.
    Cancelled,
    /// No call changed for the run TTL.
    Expired,
    /// A status this version does not know.
    #[serde(other)]
    Unknown,
}

/// A grant: the credential for one assignment's receipts. Its `Debug` and
/// `Display` never show the secret.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Grant(String);

impl Grant {
    /// Wraps a grant string.
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    /// The secret, for the `Tool-Grant` header only.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grant(<redacted>)")
    }
}

/// `POST /runs/{run_id}/tool-calls/{call_id}/claim`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    /// Claiming executor.
    pub executor_id: String,
    /// Its connection.
    pub connection_id: String,
    /// Random per claim, saved before sending.
    pub operation_key: String,
}

/// Everything an executor needs to run one call.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct Assignment {
    /// `asg_…`.
    pub assignment_id: String,
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// Tool.
    pub tool_name: String,
    /// Arguments the model gave.
    pub arguments: Value,
    /// `sha256:` + hex of the canonical arguments.
    pub arguments_digest: String,
    /// Credential for receipts.
    pub grant: Grant,
    /// Whom the run acts for.
    pub subject: String,
    /// Agent.
    pub agent_id: String,
    /// Agent version.
    pub agent_version: String,
    /// Binding.
    pub binding_id: String,
    /// Result context budget.
    pub max_result_context_bytes: u64,
    /// Arguments schema.
    pub input_schema: Value,
    /// Result schema.
    #[serde(default)]
    pub output_schema: Option<Value>,
}

crate::debug_without_payloads!(Assignment { assignment_id, run_id, call_id, tool_name, arguments_digest, grant, subject, agent_id, agent_version, binding_id, max_result_context_bytes, input_schema, output_schema } hiding { arguments });

/// The claim answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Claimed {
    /// Whether this is an earlier claim given back.
    pub replayed: bool,
    /// The call's state now.
    pub call_state: CallState,
    /// The assignment.
    pub assignment: Assignment,
}

/// Receipt kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReceiptKind {
    /// About to start.
    Accepted,
    /// Long-running work.
    Progress,
    /// Terminal with a result.
    Completed,
    /// Terminal, confirmed business failure.
    Failed,
    /// Terminal, confirmed business cancellation.
    Cancelled,
}

impl ReceiptKind {
    /// `completed`, `failed` or `cancelled`.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Completed | Self::Failed | Self::Cancelled)
    }

    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::Progress => "progress",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }
}

/// Progress of long-running work.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Progress {
    /// For a human.
    pub message: String,
    /// 0–1, or unknown.
    #[serde(default)]
    pub fraction: Option<f64>,
    /// Anything.
    #[serde(default)]
    pub data: Value,
}

/// A business failure.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptError {
    /// Product-chosen code.
    pub code: String,
    /// Short message a model can read.
    pub message: String,
}

/// `POST /runs/{run_id}/tool-calls/{call_id}/receipts` (header `Tool-Grant`).
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Receipt {
    /// Executor-chosen, unique within the call.
    pub receipt_id: String,
    /// Sender.
    pub executor_id: String,
    /// Assignment.
    pub assignment_id: String,
    /// Per-call order; `accepted` is 0.
    pub sequence: u64,
    /// Kind.
    pub kind: ReceiptKind,
    /// For `progress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// For `completed`.
    #[serde(
        default,
        deserialize_with = "present::value",
        skip_serializing_if = "Option::is_none"
    )]
    pub result: Option<Value>,
    /// For `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ReceiptError>,
    /// For `cancelled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

crate::debug_without_payloads!(Receipt { receipt_id, executor_id, assignment_id, sequence, kind } hiding { result, error, reason, progress });

impl Receipt {
    /// The field a receipt of this kind must carry and no other kind may,
    /// as `(name, present)` for each of `progress`, `result`, `error`, `reason`.
    pub fn extra_fields(&self) -> [(&'static str, bool); 4] {
        [
            ("progress", self.progress.is_some()),
            ("result", self.result.is_some()),
            ("error", self.error.is_some()),
            ("reason", self.reason.is_some()),
        ]
    }

    /// The extra field `kind` requires, if any.
    pub fn required_field(kind: ReceiptKind) -> Option<&'static str> {
        match kind {
            ReceiptKind::Accepted => None,
            ReceiptKind::Progress => Some("progress"),
            ReceiptKind::Completed => Some("result"),
            ReceiptKind::Failed => Some("error"),
            ReceiptKind::Cancelled => Some("reason"),
        }
    }
}

/// The receipt answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReceiptAnswer {
    /// Echo.
    pub receipt_id: String,
    /// Whether this receipt was already stored.
    pub replayed: bool,
    /// The call's state now.
    pub call_state: CallState,
    /// For `accepted` only: whether side effects may start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted: Option<bool>,
}
