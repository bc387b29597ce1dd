//! Development-platform admin bodies (protocol §7).
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{CallState, ReceiptKind, RunStatus};
use crate::projection::Projection;

/// A call the model "asked" for.
#[derive(Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewToolCall {
    /// A tool of the run's agent version.
    pub tool_name: String,
    /// Arguments.
    pub arguments: Value,
    /// Skip the `input_schema` check (to test executors).
    #[serde(default)]
    pub unchecked: bool,
}

crate::debug_without_payloads!(NewToolCall { tool_name, unchecked } hiding { arguments });

impl NewToolCall {
    /// A call of `tool_name` with `arguments` (checked against the tool's
    /// `input_schema`).
    pub fn new(tool_name: impl Into<String>, arguments: Value) -> NewToolCall {
        NewToolCall {
            tool_name: tool_name.into(),
            arguments,
            unchecked: false,
        }
    }

    /// A call whose arguments the platform does not check (to test an
    /// executor's own checks).
    pub fn unchecked(tool_name: impl Into<String>, arguments: Value) -> NewToolCall {
        NewToolCall {
            tool_name: tool_name.into(),
            arguments,
            unchecked: true,
        }
    }
}

/// `POST /runs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateRun {
    /// The agent version.
    pub agent_version: String,
    /// Whom the run acts for.
    pub subject: String,
    /// The calls.
    pub tool_calls: Vec<NewToolCall>,
}

/// `POST /runs/{run_id}/tool-calls`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddToolCalls {
    /// The calls.
    pub tool_calls: Vec<NewToolCall>,
}

/// A receipt as the platform stored it.
#[derive(Clone, Serialize, Deserialize)]
pub struct StoredReceipt {
    /// Id.
    pub receipt_id: String,
    /// Kind.
    pub kind: ReceiptKind,
    /// Sequence.
    pub sequence: u64,
    /// RFC 3339.
    pub received_at: String,
    /// The body exactly as received, byte for byte.
    pub body: Box<serde_json::value::RawValue>,
}

crate::debug_without_payloads!(StoredReceipt { receipt_id, kind, sequence, received_at } hiding { body });

/// A call inside a run object.
#[derive(Clone, Serialize, Deserialize)]
pub struct RunCall {
    /// `call_…`.
    pub call_id: String,
    /// Tool.
    pub tool_name: String,
    /// Arguments.
    pub arguments: Value,
    /// State.
    pub state: CallState,
    /// Bound executor.
    pub executor_id: Option<String>,
    /// Current assignment.
    pub assignment_id: Option<String>,
    /// RFC 3339, when `accepted` was stored.
    pub accepted_at: Option<String>,
    /// Stored receipts in arrival order.
    pub receipts: Vec<StoredReceipt>,
    /// Receipts refused with `run_terminated`, kept for audit.
    pub late_receipts: Vec<StoredReceipt>,
    /// The projection of the `completed` result.
    pub context_projection: Option<Projection>,
}

crate::debug_without_payloads!(RunCall { call_id, tool_name, state, executor_id, assignment_id, accepted_at, receipts, late_receipts, context_projection } hiding { arguments });

/// `GET /runs/{run_id}`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Run {
    /// `run_…`.
    pub run_id: String,
    /// Agent.
    pub agent_id: String,
    /// Agent version.
    pub agent_version: String,
    /// Subject.
    pub subject: String,
    /// Status.
    pub status: RunStatus,
    /// RFC 3339.
    pub created_at: String,
    /// Calls in creation order.
    pub tool_calls: Vec<RunCall>,
}

/// `PUT /dev/faults`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultSettings {
    /// Share of executor requests answered `503` before doing anything.
    #[serde(default)]
    pub error_rate: f64,
    /// Share of executor requests done and committed, then dropped unanswered.
    #[serde(default)]
    pub drop_response_rate: f64,
    /// Added latency per executor request.
    #[serde(default)]
    pub latency_ms: u64,
    /// Random seed.
    #[serde(default)]
    pub seed: u64,
}
