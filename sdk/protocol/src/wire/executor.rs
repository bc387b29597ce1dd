//! Executor connection bodies (protocol §4).
use serde::{Deserialize, Serialize};

use super::{CallRef, CallState, SdkInfo};

/// `POST /executors/connect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Connect {
    /// Stable identity of the deployment slot.
    pub executor_id: String,
    /// Random per process start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instance_id: Option<String>,
    /// The binding served.
    pub binding_id: String,
    /// Tools served (a subset of the binding's).
    pub tools: Vec<String>,
    /// Most `claimed` + `running` calls at once.
    pub capacity: u32,
    /// The SDK.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sdk: Option<SdkInfo>,
}

/// A call still bound to the executor identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Outstanding {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// Its assignment.
    pub assignment_id: String,
    /// `claimed`, `running` or `reconciliation_required`.
    pub state: CallState,
}

/// The connect answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Connected {
    /// Echo.
    pub executor_id: String,
    /// `con_…`.
    pub connection_id: String,
    /// Advised heartbeat interval.
    pub heartbeat_interval_ms: u64,
    /// Lease time to live.
    pub lease_ttl_ms: u64,
    /// WebSocket path.
    pub stream_path: String,
    /// Calls still bound to this identity.
    pub outstanding: Vec<Outstanding>,
}

/// `POST /executors/{id}/heartbeat`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heartbeat {
    /// Current connection.
    pub connection_id: String,
    /// Calls the executor is working on.
    #[serde(default)]
    pub in_flight: Vec<InFlight>,
}

/// One call in a heartbeat's `in_flight` (a request item: strict).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InFlight {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
}

impl InFlight {
    /// Whether this names `call`.
    pub fn is(&self, call: &CallRef) -> bool {
        self.run_id == call.run_id && self.call_id == call.call_id
    }
}

/// The heartbeat answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeartbeatAnswer {
    /// RFC 3339.
    pub lease_expires_at: String,
    /// Advised interval.
    pub heartbeat_interval_ms: u64,
    /// Calls whose run was cancelled or expired.
    pub cancel_requested: Vec<CallRef>,
}

/// One item of `GET /executors/{id}/pending`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingCall {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// Tool.
    pub tool_name: String,
    /// RFC 3339.
    pub created_at: String,
}

/// A WebSocket text frame (a frame of a type this version does not know
/// reads as [`StreamFrame::Unknown`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
#[non_exhaustive]
pub enum StreamFrame {
    /// A call became `pending`.
    #[serde(rename = "call.pending")]
    CallPending {
        /// Run.
        run_id: String,
        /// Call.
        call_id: String,
        /// Tool.
        tool_name: String,
    },
    /// The run of a call bound to this executor was cancelled.
    #[serde(rename = "call.cancel_requested")]
    CancelRequested {
        /// Run.
        run_id: String,
        /// Call.
        call_id: String,
    },
    /// Keep-alive.
    #[serde(rename = "ping")]
    Ping,
    /// A frame type this version does not know.
    #[serde(other)]
    Unknown,
}

/// A state an executor reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportState {
    /// The outcome is unknown (only from `running`).
    ReconciliationRequired,
    /// A final receipt is saved and will arrive.
    PendingDelivery,
    /// The claim is given back without starting (only from `claimed`).
    Released,
}

/// One call in a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CallReport {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// Reported state.
    pub state: ReportState,
    /// Why (for `reconciliation_required`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The saved receipt (for `pending_delivery`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt_id: Option<String>,
}

/// `POST /executors/{id}/calls/report`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// Current connection.
    pub connection_id: String,
    /// The calls.
    pub calls: Vec<CallReport>,
}

/// What a report did to one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ReportOutcome {
    /// Changed.
    Updated,
    /// Already so.
    Unchanged,
    /// The call already ended.
    Terminal,
    /// The run ended.
    RunTerminated,
    /// Not allowed from the call's state.
    NotApplicable,
    /// Not bound to this executor.
    NotBound,
    /// An outcome this version does not know.
    #[serde(other)]
    Unknown,
}

/// One result of a report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportResult {
    /// Run.
    pub run_id: String,
    /// Call.
    pub call_id: String,
    /// Outcome.
    pub outcome: ReportOutcome,
}

/// The report answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportAnswer {
    /// How many outcomes are `updated`.
    pub updated: u64,
    /// One per call, in request order.
    pub results: Vec<ReportResult>,
}

/// How an executor leaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DisconnectMode {
    /// Finish bound calls, take no new ones.
    Drain,
    /// Leave now; running calls stay bound to the identity.
    Detach,
}

/// `POST /executors/{id}/disconnect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Disconnect {
    /// Current connection.
    pub connection_id: String,
    /// Drain or detach.
    pub mode: DisconnectMode,
}

/// The disconnect answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Disconnected {
    /// Claims given back.
    pub released: Vec<CallRef>,
    /// Calls still bound.
    pub retained: Vec<CallRef>,
}
