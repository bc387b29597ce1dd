//! The platform's state and every rule of the protocol, free of HTTP and SQL.
//!
//! Handlers lock the [`State`], call one operation, then the store writes the
//! records the operation marked dirty before the answer is sent.

mod claim;
mod config;
mod executor;
pub(crate) mod json;
pub(crate) mod model;
mod receipts;
mod runs;
mod sweep;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use model::{
    AgentRec, AssignmentRec, AssignmentStatus, BindingRec, CallRec, ConnectionRec, ExecutorRec,
    RunRec, Table, VersionRec,
};
use toolrunner_protocol::ApiError;
use toolrunner_protocol::tooldef::Schema;
use toolrunner_protocol::wire::{CallRef, CallState, StreamFrame};

pub(crate) use receipts::ReceiptInput;

/// Settings the rules depend on.
#[derive(Debug, Clone)]
pub(crate) struct Limits {
    pub(crate) lease_ttl_ms: u64,
    pub(crate) heartbeat_interval_ms: u64,
    pub(crate) run_ttl_ms: u64,
}

/// Something a WebSocket stream may want to send.
#[derive(Debug, Clone)]
pub(crate) enum Notice {
    /// A call became `pending`: for executors of this binding serving the tool.
    Pending {
        binding_id: String,
        frame: StreamFrame,
    },
    /// For one executor identity.
    Cancel {
        executor_id: String,
        frame: StreamFrame,
    },
}

/// The whole platform state.
#[derive(Default)]
pub(crate) struct State {
    pub(crate) agents: BTreeMap<String, AgentRec>,
    pub(crate) bindings: BTreeMap<String, BindingRec>,
    pub(crate) versions: BTreeMap<String, VersionRec>,
    pub(crate) runs: HashMap<String, RunRec>,
    pub(crate) calls: HashMap<String, CallRec>,
    pub(crate) executors: BTreeMap<String, ExecutorRec>,
    pub(crate) connections: HashMap<String, ConnectionRec>,
    pub(crate) assignments: HashMap<String, AssignmentRec>,
    /// `(executor_id, operation_key)` → assignment, the latest one.
    op_keys: HashMap<(String, String), String>,
    /// grant → assignment.
    grants: HashMap<String, String>,
    /// `(seq, call_id)` of every `pending` call.
    pending: BTreeSet<(u64, String)>,
    /// executor_id → `(seq, call_id)` of its bound calls.
    bound: HashMap<String, BTreeSet<(u64, String)>>,
    /// Compiled schemas per `(agent_version, tool_name, output?)`.
    schemas: HashMap<(String, String, bool), Arc<Schema>>,
    next_seq: u64,
    dirty: BTreeSet<(Table, String)>,
    notices: Vec<Notice>,
}

/// Milliseconds since the Unix epoch.
pub(crate) fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// RFC 3339 UTC with milliseconds.
pub(crate) fn rfc3339(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

/// A new identifier: `prefix` + 32 hex digits of a UUIDv7 (never reused).
pub(crate) fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::now_v7().simple())
}

/// A new grant secret.
pub(crate) fn new_grant() -> String {
    format!(
        "grt_{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

/// Whether `s` is 1–128 of `[A-Za-z0-9_.:-]` (executor ids, keys, receipt ids).
pub(crate) fn is_token_id(s: &str) -> bool {
    (1..=128).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
}

impl State {
    /// Rebuilds the indexes after loading records.
    pub(crate) fn reindex(&mut self) {
        self.op_keys.clear();
        self.grants.clear();
        self.pending.clear();
        self.bound.clear();
        let mut assignments: Vec<&AssignmentRec> = self.assignments.values().collect();
        assignments.sort_by(|a, b| a.assignment_id.cmp(&b.assignment_id));
        for a in assignments {
            self.op_keys.insert(
                (a.executor_id.clone(), a.operation_key.clone()),
                a.assignment_id.clone(),
            );
            self.grants.insert(a.grant.clone(), a.assignment_id.clone());
        }
        for c in self.calls.values() {
            if c.state == CallState::Pending {
                self.pending.insert((c.seq, c.call_id.clone()));
            }
            if let Some(e) = c.executor_id.as_ref().filter(|_| c.is_bound()) {
                self.bound
                    .entry(e.clone())
                    .or_default()
                    .insert((c.seq, c.call_id.clone()));
            }
            self.next_seq = self.next_seq.max(c.seq + 1);
        }
    }

    /// Marks a record to be written at the end of the operation.
    pub(crate) fn touch(&mut self, table: Table, id: &str) {
        self.dirty.insert((table, id.to_owned()));
    }

    /// Takes the records to write.
    pub(crate) fn take_dirty(&mut self) -> BTreeSet<(Table, String)> {
        std::mem::take(&mut self.dirty)
    }

    /// Takes the stream notices produced since the last call.
    pub(crate) fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }

    /// Serializes one record for the store, `None` if it no longer exists.
    pub(crate) fn record_json(&self, table: Table, id: &str) -> Option<String> {
        let json = match table {
            Table::Agents => serde_json::to_string(self.agents.get(id)?),
            Table::Bindings => serde_json::to_string(self.bindings.get(id)?),
            Table::Versions => serde_json::to_string(self.versions.get(id)?),
            Table::Runs => serde_json::to_string(self.runs.get(id)?),
            Table::Calls => serde_json::to_string(self.calls.get(id)?),
            Table::Executors => serde_json::to_string(self.executors.get(id)?),
            Table::Connections => serde_json::to_string(self.connections.get(id)?),
            Table::Assignments => serde_json::to_string(self.assignments.get(id)?),
        };
        json.ok()
    }

    /// Loads one stored record.
    pub(crate) fn load_record(&mut self, table: Table, doc: &str) -> Result<(), serde_json::Error> {
        match table {
            Table::Agents => insert(&mut self.agents, doc, |r: &AgentRec| r.agent_id.clone()),
            Table::Bindings => insert(&mut self.bindings, doc, |r: &BindingRec| {
                r.binding_id.clone()
            }),
            Table::Versions => insert(&mut self.versions, doc, |r: &VersionRec| {
                r.agent_version.clone()
            }),
            Table::Runs => insert(&mut self.runs, doc, |r: &RunRec| r.run_id.clone()),
            Table::Calls => insert(&mut self.calls, doc, |r: &CallRec| r.call_id.clone()),
            Table::Executors => insert(&mut self.executors, doc, |r: &ExecutorRec| {
                r.executor_id.clone()
            }),
            Table::Connections => insert(&mut self.connections, doc, |r: &ConnectionRec| {
                r.connection_id.clone()
            }),
            Table::Assignments => insert(&mut self.assignments, doc, |r: &AssignmentRec| {
                r.assignment_id.clone()
            }),
        }
    }

    /// Looks a run up by the id in the path: `404` if unknown.
    pub(crate) fn run_in_path(&self, run_id: &str) -> Result<&RunRec, ApiError> {
        self.runs
            .get(run_id)
            .ok_or_else(|| ApiError::not_found("unknown_run", format!("no run {run_id}")))
    }

    /// Looks a call of a known run up: `400 unknown_call` if it is not there.
    pub(crate) fn call_of_run(&self, run_id: &str, call_id: &str) -> Result<&CallRec, ApiError> {
        match self.calls.get(call_id) {
            Some(c) if c.run_id == run_id => Ok(c),
            _ => Err(ApiError::invalid(
                "unknown_call",
                format!("run {run_id} has no call {call_id}"),
            )
            .with_param("call_id")),
        }
    }

    /// Moves a call to `state`, keeping the pending index, the run's change
    /// time and the stream notices right.
    pub(crate) fn set_call_state(&mut self, call_id: &str, state: CallState, now: i64) {
        let Some(call) = self.calls.get_mut(call_id) else {
            return;
        };
        let key = (call.seq, call.call_id.clone());
        if call.state == CallState::Pending {
            self.pending.remove(&key);
        }
        if let Some(set) = call
            .executor_id
            .as_ref()
            .and_then(|e| self.bound.get_mut(e))
        {
            set.remove(&key);
        }
        call.state = state;
        if state.is_terminal() || state == CallState::Pending {
            call.pending_delivery = false;
        }
        if state == CallState::Pending {
            call.executor_id = None;
            call.assignment_id = None;
            self.pending.insert(key.clone());
            self.notices.push(Notice::Pending {
                binding_id: call.binding_id.clone(),
                frame: StreamFrame::CallPending {
                    run_id: call.run_id.clone(),
                    call_id: call.call_id.clone(),
                    tool_name: call.tool_name.clone(),
                },
            });
        }
        if let Some(e) = call.executor_id.as_ref().filter(|_| call.is_bound()) {
            self.bound.entry(e.clone()).or_default().insert(key);
        }
        let run_id = call.run_id.clone();
        self.touch(Table::Calls, call_id);
        self.note_activity(&run_id, now);
    }

    /// Something changed on one of the run's calls (a state, a stored
    /// receipt, a `pending_delivery` flag): its TTL starts again.
    pub(crate) fn note_activity(&mut self, run_id: &str, now: i64) {
        if let Some(run) = self.runs.get_mut(run_id) {
            run.last_change_ms = now;
            self.dirty.insert((Table::Runs, run_id.to_owned()));
        }
    }

    /// Gives a `claimed` call back: it returns to `pending`, its assignment
    /// is released and its grant stops working.
    pub(crate) fn release_claim(&mut self, call_id: &str, now: i64) -> Option<CallRef> {
        let call = self.calls.get(call_id)?;
        if call.state != CallState::Claimed {
            return None;
        }
        let call_ref = call.call_ref();
        if let Some(asg) = call.assignment_id.clone() {
            self.set_assignment(&asg, AssignmentStatus::Released);
        }
        self.set_call_state(call_id, CallState::Pending, now);
        Some(call_ref)
    }

    /// Changes an assignment's status.
    pub(crate) fn set_assignment(&mut self, assignment_id: &str, status: AssignmentStatus) {
        if let Some(a) = self.assignments.get_mut(assignment_id)
            && a.status != status
        {
            a.status = status;
            self.touch(Table::Assignments, assignment_id);
        }
    }

    /// The calls bound to an executor identity, in creation order.
    pub(crate) fn bound_calls(&self, executor_id: &str) -> Vec<&CallRec> {
        self.bound
            .get(executor_id)
            .map(|set| set.iter().map(|(_, id)| &self.calls[id]).collect())
            .unwrap_or_default()
    }

    /// The compiled schema of a tool in a version (`output` picks which).
    pub(crate) fn schema(
        &mut self,
        agent_version: &str,
        tool_name: &str,
        output: bool,
    ) -> Option<Arc<Schema>> {
        let key = (agent_version.to_owned(), tool_name.to_owned(), output);
        if let Some(s) = self.schemas.get(&key) {
            return Some(s.clone());
        }
        let tool = self
            .versions
            .get(agent_version)?
            .tools
            .iter()
            .find(|t| t.name == tool_name)?;
        let raw = if output {
            tool.output_schema.as_ref()?
        } else {
            &tool.input_schema
        };
        let schema = Arc::new(Schema::compile(raw).ok()?);
        self.schemas.insert(key, schema.clone());
        Some(schema)
    }

    fn next_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }
}

fn insert<T: serde::de::DeserializeOwned>(
    map: &mut impl Extend<(String, T)>,
    doc: &str,
    id: impl Fn(&T) -> String,
) -> Result<(), serde_json::Error> {
    let rec: T = serde_json::from_str(doc)?;
    map.extend([(id(&rec), rec)]);
    Ok(())
}
