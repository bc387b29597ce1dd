//! The platform's records. Each is stored as one JSON document per row.
use serde::{Deserialize, Serialize};
use serde_json::Value;
use toolrunner_protocol::Projection;
use toolrunner_protocol::wire::{
    Agent, AgentVersion, Binding, CallRef, CallState, ReceiptKind, RunStatus, SdkInfo,
};

/// A run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct RunRec {
    pub(crate) run_id: String,
    pub(crate) agent_id: String,
    pub(crate) agent_version: String,
    pub(crate) subject: String,
    pub(crate) status: RunStatus,
    pub(crate) created_at: String,
    pub(crate) call_ids: Vec<String>,
    /// Milliseconds since the epoch of the last change to any of its calls.
    pub(crate) last_change_ms: i64,
}

/// A receipt as stored: the body exactly as received plus its canonical form.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ReceiptRec {
    pub(crate) receipt_id: String,
    pub(crate) assignment_id: String,
    pub(crate) kind: ReceiptKind,
    pub(crate) sequence: u64,
    pub(crate) received_at: String,
    /// The request body byte-for-byte (it is valid UTF-8: it parsed as JSON).
    pub(crate) raw: String,
    /// RFC 8785 form, for "same body" comparisons.
    pub(crate) canonical: String,
}

/// A tool call of a run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct CallRec {
    pub(crate) call_id: String,
    pub(crate) run_id: String,
    /// Creation order across the platform (pending lists are oldest first).
    pub(crate) seq: u64,
    pub(crate) tool_name: String,
    pub(crate) binding_id: String,
    pub(crate) arguments: Value,
    pub(crate) arguments_digest: String,
    pub(crate) state: CallState,
    pub(crate) executor_id: Option<String>,
    pub(crate) assignment_id: Option<String>,
    pub(crate) accepted_at: Option<String>,
    pub(crate) receipts: Vec<ReceiptRec>,
    pub(crate) late_receipts: Vec<ReceiptRec>,
    pub(crate) projection: Option<Projection>,
    pub(crate) pending_delivery: bool,
    pub(crate) created_at: String,
}

impl CallRec {
    pub(crate) fn call_ref(&self) -> CallRef {
        CallRef {
            run_id: self.run_id.clone(),
            call_id: self.call_id.clone(),
        }
    }

    /// `claimed`, `running` or `reconciliation_required`: bound to an executor.
    pub(crate) fn is_bound(&self) -> bool {
        matches!(
            self.state,
            CallState::Claimed | CallState::Running | CallState::ReconciliationRequired
        )
    }
}

/// How an executor identity left (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum ExecutorMode {
    Active,
    Draining,
    Detached,
    /// The lease ran out.
    Expired,
}

/// An executor identity and its current connection.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ExecutorRec {
    pub(crate) executor_id: String,
    pub(crate) connection_id: String,
    pub(crate) instance_id: Option<String>,
    pub(crate) binding_id: String,
    pub(crate) tools: Vec<String>,
    pub(crate) capacity: u32,
    pub(crate) sdk: Option<SdkInfo>,
    pub(crate) mode: ExecutorMode,
    pub(crate) last_heartbeat_ms: i64,
    pub(crate) lease_expires_ms: i64,
    /// Calls whose run was cancelled or expired while bound here, and
    /// whether a heartbeat has announced them yet.
    pub(crate) cancel_notices: Vec<(CallRef, bool)>,
}

/// One connection of an executor identity.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct ConnectionRec {
    pub(crate) connection_id: String,
    pub(crate) executor_id: String,
    pub(crate) instance_id: Option<String>,
    /// The `instance_id` of the connection that replaced this one.
    pub(crate) superseded_by: Option<Option<String>>,
    /// Detached or expired.
    pub(crate) ended: bool,
}

/// Whether an assignment's grant still works.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum AssignmentStatus {
    Live,
    /// The call returned to `pending`: the grant stops working.
    Released,
    /// The call or run ended: the grant still authenticates retries.
    Closed,
}

/// A claim of one call by one executor.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct AssignmentRec {
    pub(crate) assignment_id: String,
    pub(crate) run_id: String,
    pub(crate) call_id: String,
    pub(crate) executor_id: String,
    pub(crate) operation_key: String,
    pub(crate) grant: String,
    pub(crate) status: AssignmentStatus,
    pub(crate) created_at: String,
}

/// Every kind of stored record, one table each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Table {
    Agents,
    Bindings,
    Versions,
    Runs,
    Calls,
    Executors,
    Connections,
    Assignments,
}

impl Table {
    pub(crate) const ALL: [Table; 8] = [
        Table::Agents,
        Table::Bindings,
        Table::Versions,
        Table::Runs,
        Table::Calls,
        Table::Executors,
        Table::Connections,
        Table::Assignments,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Table::Agents => "agents",
            Table::Bindings => "bindings",
            Table::Versions => "agent_versions",
            Table::Runs => "runs",
            Table::Calls => "calls",
            Table::Executors => "executors",
            Table::Connections => "connections",
            Table::Assignments => "assignments",
        }
    }
}

/// Configuration records kept as their wire form.
pub(crate) type AgentRec = Agent;
pub(crate) type BindingRec = Binding;
pub(crate) type VersionRec = AgentVersion;
