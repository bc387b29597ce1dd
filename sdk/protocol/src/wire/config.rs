//! Configuration bodies (protocol §2).
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::present;
use crate::tooldef::{SchemaViolation, ToolDefinition};

/// `POST /agents`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateAgent {
    /// Display name.
    pub name: String,
}

/// An agent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Agent {
    /// `agt_…`.
    pub agent_id: String,
    /// Display name.
    pub name: String,
    /// RFC 3339.
    pub created_at: String,
}

/// `POST /executor-bindings`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBinding {
    /// The agent the binding belongs to.
    pub agent_id: String,
    /// Display name.
    pub name: String,
    /// Tools an executor of this binding may serve.
    pub tool_names: Vec<String>,
}

/// An executor binding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Binding {
    /// `bnd_…`.
    pub binding_id: String,
    /// The agent.
    pub agent_id: String,
    /// Display name.
    pub name: String,
    /// Tools an executor of this binding may serve.
    pub tool_names: Vec<String>,
    /// RFC 3339.
    pub created_at: String,
}

/// `POST /agents/{agent_id}/versions`. `tools` stays raw JSON so that
/// [`crate::tooldef::check_version`] can report every problem with its path.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateVersion {
    /// Tool definitions.
    pub tools: Value,
    /// Whether tool search is on (default `false`).
    #[serde(default, deserialize_with = "present::value")]
    pub tool_search: Option<Value>,
}

/// A published, immutable agent version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentVersion {
    /// `agv_…`.
    pub agent_version: String,
    /// The agent.
    pub agent_id: String,
    /// Tools, defaults filled in.
    pub tools: Vec<ToolDefinition>,
    /// Whether tool search is on.
    pub tool_search: bool,
    /// RFC 3339.
    pub created_at: String,
}

/// What a program reports about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SdkInfo {
    /// SDK name.
    pub name: String,
    /// SDK version.
    pub version: String,
}

/// How an executor identity appears in diagnostics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ExecutorStatus {
    /// Lease valid.
    Online,
    /// Lease expired, or drained with nothing bound.
    Offline,
    /// Draining: no new claims, calls still bound.
    Draining,
    /// Left with `detach`.
    Detached,
    /// A status this version does not know.
    #[serde(other)]
    Unknown,
}

/// One executor in diagnostics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExecutorDiagnostics {
    /// Executor identity.
    pub executor_id: String,
    /// Its latest connection.
    pub connection_id: String,
    /// Status.
    pub status: ExecutorStatus,
    /// RFC 3339.
    pub last_heartbeat_at: String,
    /// RFC 3339.
    pub lease_expires_at: String,
    /// Connect-time capacity.
    pub capacity: u32,
    /// `claimed` + `running` calls bound to it.
    pub in_flight: u32,
    /// What the executor said about itself.
    pub sdk: Option<SdkInfo>,
}

/// Call counts in diagnostics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallCounts {
    /// `pending`.
    pub pending: u64,
    /// `claimed`.
    pub claimed: u64,
    /// `running`.
    pub running: u64,
    /// `reconciliation_required`.
    pub reconciliation_required: u64,
    /// Flagged `pending_delivery` (also counted under their state).
    pub pending_delivery: u64,
}

/// `GET /agents/{agent_id}/executor-bindings/{binding_id}/diagnostics`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Diagnostics {
    /// The binding.
    pub binding_id: String,
    /// Executors that last connected to it.
    pub executors: Vec<ExecutorDiagnostics>,
    /// Its calls by state.
    pub calls: CallCounts,
}

/// A mock receipt in a dry run.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MockReceipt {
    /// Any id.
    pub receipt_id: String,
    /// Receipt kind.
    pub kind: super::ReceiptKind,
    /// For `completed`.
    #[serde(
        default,
        deserialize_with = "present::value",
        skip_serializing_if = "Option::is_none"
    )]
    pub result: Option<Value>,
    /// For `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<super::ReceiptError>,
    /// For `cancelled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// For `progress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<super::Progress>,
}

crate::debug_without_payloads!(MockReceipt { receipt_id, kind } hiding { result, error, reason, progress });

/// `POST /tools/dry-run`.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DryRun {
    /// The published version.
    pub agent_version: String,
    /// A tool of that version.
    pub tool_name: String,
    /// Arguments to check.
    pub arguments: Value,
    /// Results to preview.
    #[serde(default)]
    pub mock_receipts: Vec<MockReceipt>,
}

crate::debug_without_payloads!(DryRun { agent_version, tool_name, mock_receipts } hiding { arguments });

/// The context preview of a dry run.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
pub struct ContextPreview {
    /// The tool's budget.
    pub max_result_context_bytes: u64,
    /// Compact bytes of the mock result.
    pub original_bytes: usize,
    /// Compact bytes of the projection.
    pub retained_bytes: usize,
    /// Whether it was cut.
    pub truncated: bool,
    /// The projection.
    pub result: Value,
}

crate::debug_without_payloads!(ContextPreview { max_result_context_bytes, original_bytes, retained_bytes, truncated } hiding { result });

/// The dry-run answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DryRunAnswer {
    /// Whether the arguments match `input_schema`.
    pub arguments_valid: bool,
    /// Every violation.
    pub argument_errors: Vec<SchemaViolation>,
    /// Projection of the first `completed` mock receipt.
    pub context_preview: Option<ContextPreview>,
    /// Always `false`: a dry run proves nothing about execution.
    pub execution_verified: bool,
}
