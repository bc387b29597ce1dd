//! Connect, heartbeat, pending, report and disconnect (protocol §4).
use toolrunner_protocol::ApiError;
use toolrunner_protocol::wire::{
    CallRef, CallReport, CallState, Connect, Connected, Disconnect, DisconnectMode, Disconnected,
    Heartbeat, HeartbeatAnswer, Outstanding, PendingCall, Report, ReportAnswer, ReportOutcome,
    ReportResult, ReportState,
};

use super::model::{ConnectionRec, ExecutorMode, ExecutorRec, Table};
use super::{State, is_token_id, new_id, rfc3339};

/// Most calls in one report.
const MAX_REPORT_CALLS: usize = 100;
/// Largest capacity an executor may ask for.
const MAX_CAPACITY: u32 = 1024;

impl State {
    pub(crate) fn connect(
        &mut self,
        body: Connect,
        now: i64,
        limits: &super::Limits,
    ) -> Result<Connected, ApiError> {
        if !is_token_id(&body.executor_id) {
            return Err(ApiError::invalid(
                "invalid_executor_id",
                "executor_id must be 1-128 characters of [A-Za-z0-9_.:-]",
            )
            .with_param("executor_id"));
        }
        if let Some(instance) = &body.instance_id
            && !is_token_id(instance)
        {
            return Err(ApiError::invalid(
                "invalid_instance_id",
                "instance_id must be 1-128 characters of [A-Za-z0-9_.:-]",
            )
            .with_param("instance_id"));
        }
        if !(1..=MAX_CAPACITY).contains(&body.capacity) {
            return Err(ApiError::invalid(
                "out_of_range",
                format!("capacity must be 1-{MAX_CAPACITY}"),
            )
            .with_param("capacity"));
        }
        let Some(binding) = self.bindings.get(&body.binding_id) else {
            return Err(ApiError::invalid(
                "unknown_binding",
                format!("no executor binding {}", body.binding_id),
            )
            .with_param("binding_id"));
        };
        if body.tools.is_empty() {
            return Err(
                ApiError::invalid("invalid_value", "tools must name at least one tool")
                    .with_param("tools"),
            );
        }
        for (i, tool) in body.tools.iter().enumerate() {
            if !binding.tool_names.contains(tool) || body.tools[..i].contains(tool) {
                return Err(ApiError::invalid(
                    "unknown_tool",
                    format!(
                        "tool {tool} is not one of binding {}'s tools (or is listed twice)",
                        binding.binding_id
                    ),
                )
                .with_param(format!("tools[{i}]")));
            }
        }
        let connection_id = new_id("con_");
        // Every earlier connection of this identity now names the newest
        // instance in its `connection_superseded` answer.
        let earlier: Vec<String> = self
            .connections
            .values()
            .filter(|c| c.executor_id == body.executor_id)
            .map(|c| c.connection_id.clone())
            .collect();
        for id in earlier {
            if let Some(c) = self.connections.get_mut(&id) {
                c.superseded_by = Some(body.instance_id.clone());
            }
            self.touch(Table::Connections, &id);
        }
        self.connections.insert(
            connection_id.clone(),
            ConnectionRec {
                connection_id: connection_id.clone(),
                executor_id: body.executor_id.clone(),
                instance_id: body.instance_id.clone(),
                superseded_by: None,
                ended: false,
            },
        );
        self.touch(Table::Connections, &connection_id);
        let notices = self
            .executors
            .get(&body.executor_id)
            .map(|e| e.cancel_notices.clone());
        let ttl = i64::try_from(limits.lease_ttl_ms).unwrap_or(i64::MAX);
        self.executors.insert(
            body.executor_id.clone(),
            ExecutorRec {
                executor_id: body.executor_id.clone(),
                connection_id: connection_id.clone(),
                instance_id: body.instance_id,
                binding_id: body.binding_id,
                tools: body.tools,
                capacity: body.capacity,
                sdk: body.sdk,
                mode: ExecutorMode::Active,
                last_heartbeat_ms: now,
                lease_expires_ms: now.saturating_add(ttl),
                cancel_notices: notices.unwrap_or_default(),
            },
        );
        self.touch(Table::Executors, &body.executor_id);
        let outstanding = self
            .bound_calls(&body.executor_id)
            .into_iter()
            .map(|c| Outstanding {
                run_id: c.run_id.clone(),
                call_id: c.call_id.clone(),
                assignment_id: c.assignment_id.clone().unwrap_or_default(),
                state: c.state,
            })
            .collect();
        Ok(Connected {
            stream_path: format!("/v1/executors/{}/stream", body.executor_id),
            executor_id: body.executor_id,
            connection_id,
            heartbeat_interval_ms: limits.heartbeat_interval_ms,
            lease_ttl_ms: limits.lease_ttl_ms,
            outstanding,
        })
    }

    /// Checks that `connection_id` is `executor_id`'s live connection:
    /// `409 connection_superseded` or `409 lease_expired` otherwise.
    pub(crate) fn live_connection(
        &self,
        executor_id: &str,
        connection_id: &str,
    ) -> Result<&ExecutorRec, ApiError> {
        let expired = || {
            ApiError::conflict(
                "lease_expired",
                format!("connection {connection_id} is not live: connect again"),
            )
            .with_param("connection_id")
        };
        let conn = self
            .connections
            .get(connection_id)
            .filter(|c| c.executor_id == executor_id)
            .ok_or_else(expired)?;
        // A connection that was over (its lease expired, or it
        // disconnected) before a newer connect superseded it answers as
        // what happened first: `lease_expired` (docs/protocol.md, choice
        // 67).
        if conn.ended {
            return Err(expired());
        }
        if let Some(by) = &conn.superseded_by {
            let by = by.as_deref().unwrap_or("(none given)");
            return Err(ApiError::conflict(
                "connection_superseded",
                format!("connection {connection_id} was superseded by a new connect from instance_id {by}"),
            )
            .with_param("connection_id"));
        }
        let exec = self.executors.get(executor_id).ok_or_else(expired)?;
        if conn.ended || exec.connection_id != connection_id {
            return Err(expired());
        }
        Ok(exec)
    }

    pub(crate) fn heartbeat(
        &mut self,
        executor_id: &str,
        body: Heartbeat,
        now: i64,
        limits: &super::Limits,
    ) -> Result<HeartbeatAnswer, ApiError> {
        self.live_connection(executor_id, &body.connection_id)?;
        let ttl = i64::try_from(limits.lease_ttl_ms).unwrap_or(i64::MAX);
        let exec = self.executors.get_mut(executor_id).expect("checked above");
        exec.last_heartbeat_ms = now;
        exec.lease_expires_ms = now.saturating_add(ttl);
        let mut cancel_requested = Vec::new();
        exec.cancel_notices.retain_mut(|(call, announced)| {
            let listed = body.in_flight.iter().any(|f| f.is(call));
            if listed || !*announced {
                cancel_requested.push(call.clone());
            }
            *announced = true;
            listed
        });
        let answer = HeartbeatAnswer {
            lease_expires_at: rfc3339(exec.lease_expires_ms),
            heartbeat_interval_ms: limits.heartbeat_interval_ms,
            cancel_requested,
        };
        self.touch(Table::Executors, executor_id);
        Ok(answer)
    }

    pub(crate) fn pending_page(
        &self,
        executor_id: &str,
        connection_id: &str,
        limit: usize,
        after: Option<u64>,
    ) -> Result<(Vec<PendingCall>, Option<u64>), ApiError> {
        let exec = self.live_connection(executor_id, connection_id)?;
        let start = after.map_or(0, |s| s + 1);
        let mut page = Vec::new();
        let mut last = None;
        for (seq, call_id) in self.pending.range((start, String::new())..) {
            let c = &self.calls[call_id];
            if c.binding_id != exec.binding_id || !exec.tools.contains(&c.tool_name) {
                continue;
            }
            if page.len() == limit {
                return Ok((page, last));
            }
            page.push(PendingCall {
                run_id: c.run_id.clone(),
                call_id: c.call_id.clone(),
                tool_name: c.tool_name.clone(),
                created_at: c.created_at.clone(),
            });
            last = Some(*seq);
        }
        Ok((page, None))
    }

    pub(crate) fn report(
        &mut self,
        executor_id: &str,
        body: Report,
        now: i64,
    ) -> Result<ReportAnswer, ApiError> {
        self.live_connection(executor_id, &body.connection_id)?;
        if body.calls.is_empty() || body.calls.len() > MAX_REPORT_CALLS {
            return Err(ApiError::invalid(
                "invalid_value",
                format!("calls must hold 1-{MAX_REPORT_CALLS} items"),
            )
            .with_param("calls"));
        }
        for (i, r) in body.calls.iter().enumerate() {
            if !self.runs.contains_key(&r.run_id)
                || self.call_of_run(&r.run_id, &r.call_id).is_err()
            {
                return Err(ApiError::invalid(
                    "unknown_call",
                    format!("run {} has no call {}", r.run_id, r.call_id),
                )
                .with_param(format!("calls[{i}]")));
            }
        }
        let mut results = Vec::with_capacity(body.calls.len());
        for r in &body.calls {
            let outcome = self.report_one(executor_id, r, now);
            results.push(ReportResult {
                run_id: r.run_id.clone(),
                call_id: r.call_id.clone(),
                outcome,
            });
        }
        let updated = results
            .iter()
            .filter(|r| r.outcome == ReportOutcome::Updated)
            .count() as u64;
        Ok(ReportAnswer { updated, results })
    }

    fn report_one(&mut self, executor_id: &str, r: &CallReport, now: i64) -> ReportOutcome {
        let call = &self.calls[&r.call_id];
        let run_active =
            self.runs[&r.run_id].status == toolrunner_protocol::wire::RunStatus::Active;
        if call.executor_id.as_deref() != Some(executor_id) {
            return ReportOutcome::NotBound;
        }
        if !run_active {
            return ReportOutcome::RunTerminated;
        }
        if call.state.is_terminal() {
            return ReportOutcome::Terminal;
        }
        let (unchanged, allowed) = match r.state {
            ReportState::ReconciliationRequired => (
                call.state == CallState::ReconciliationRequired,
                call.state == CallState::Running,
            ),
            ReportState::PendingDelivery => (call.pending_delivery, call.is_bound()),
            ReportState::Released => (false, call.state == CallState::Claimed),
        };
        if unchanged {
            return ReportOutcome::Unchanged;
        }
        if !allowed {
            return ReportOutcome::NotApplicable;
        }
        match r.state {
            ReportState::ReconciliationRequired => {
                self.set_call_state(&r.call_id, CallState::ReconciliationRequired, now);
            }
            ReportState::PendingDelivery => {
                if let Some(c) = self.calls.get_mut(&r.call_id) {
                    c.pending_delivery = true;
                }
                self.touch(Table::Calls, &r.call_id);
                self.note_activity(&r.run_id, now);
            }
            ReportState::Released => {
                self.release_claim(&r.call_id, now);
            }
        }
        ReportOutcome::Updated
    }

    pub(crate) fn disconnect(
        &mut self,
        executor_id: &str,
        body: Disconnect,
        now: i64,
    ) -> Result<Disconnected, ApiError> {
        self.live_connection(executor_id, &body.connection_id)?;
        let released = self.release_all_claims(executor_id, now);
        let exec = self.executors.get_mut(executor_id).expect("checked above");
        match body.mode {
            DisconnectMode::Drain => exec.mode = ExecutorMode::Draining,
            DisconnectMode::Detach => {
                exec.mode = ExecutorMode::Detached;
                if let Some(c) = self.connections.get_mut(&body.connection_id) {
                    c.ended = true;
                }
                self.touch(Table::Connections, &body.connection_id);
            }
        }
        self.touch(Table::Executors, executor_id);
        let retained = self
            .bound_calls(executor_id)
            .iter()
            .map(|c| c.call_ref())
            .collect();
        Ok(Disconnected { released, retained })
    }

    /// Releases every `claimed` call of an executor identity.
    pub(crate) fn release_all_claims(&mut self, executor_id: &str, now: i64) -> Vec<CallRef> {
        let claimed: Vec<String> = self
            .bound_calls(executor_id)
            .iter()
            .filter(|c| c.state == CallState::Claimed)
            .map(|c| c.call_id.clone())
            .collect();
        claimed
            .iter()
            .filter_map(|id| self.release_claim(id, now))
            .collect()
    }
}
