//! Runs and their calls (protocol §7 admin endpoints and run statuses).
use toolrunner_protocol::ApiError;
use toolrunner_protocol::json::arguments_digest;
use toolrunner_protocol::wire::{
    AddToolCalls, CallState, CreateRun, NewToolCall, Run, RunCall, RunStatus, StoredReceipt,
    StreamFrame,
};

use super::model::{AssignmentStatus, CallRec, ReceiptRec, RunRec, Table};
use super::{Notice, State, new_id, rfc3339};

impl State {
    pub(crate) fn create_run(&mut self, body: CreateRun, now: i64) -> Result<Run, ApiError> {
        let Some(version) = self.versions.get(&body.agent_version) else {
            return Err(ApiError::invalid(
                "unknown_agent_version",
                format!("no agent version {}", body.agent_version),
            )
            .with_param("agent_version"));
        };
        if body.subject.trim().is_empty() {
            return Err(
                ApiError::invalid("invalid_value", "subject must not be blank")
                    .with_param("subject"),
            );
        }
        let agent_id = version.agent_id.clone();
        self.check_new_calls(&body.agent_version, &body.tool_calls)?;
        let run = RunRec {
            run_id: new_id("run_"),
            agent_id,
            agent_version: body.agent_version,
            subject: body.subject,
            status: RunStatus::Active,
            created_at: rfc3339(now),
            call_ids: Vec::new(),
            last_change_ms: now,
        };
        let run_id = run.run_id.clone();
        self.runs.insert(run_id.clone(), run);
        self.add_checked_calls(&run_id, body.tool_calls, now);
        self.get_run(&run_id)
    }

    pub(crate) fn add_calls(
        &mut self,
        run_id: &str,
        body: AddToolCalls,
        now: i64,
    ) -> Result<Run, ApiError> {
        let run = self.run_in_path(run_id)?;
        let version = run.agent_version.clone();
        if run.status != RunStatus::Active {
            return Err(ApiError::conflict(
                "run_terminated",
                format!("run {run_id} has ended"),
            ));
        }
        self.check_new_calls(&version, &body.tool_calls)?;
        self.add_checked_calls(run_id, body.tool_calls, now);
        self.get_run(run_id)
    }

    fn check_new_calls(&mut self, version: &str, calls: &[NewToolCall]) -> Result<(), ApiError> {
        if calls.is_empty() {
            return Err(ApiError::invalid(
                "invalid_value",
                "tool_calls must hold at least one call",
            )
            .with_param("tool_calls"));
        }
        for (i, c) in calls.iter().enumerate() {
            let known = self.versions[version]
                .tools
                .iter()
                .any(|t| t.name == c.tool_name);
            if !known {
                return Err(ApiError::invalid(
                    "unknown_tool",
                    format!("agent version {version} has no tool {}", c.tool_name),
                )
                .with_param(format!("tool_calls[{i}].tool_name")));
            }
            if c.unchecked {
                continue;
            }
            let schema = self.schema(version, &c.tool_name, false);
            let errors = schema
                .map(|s| s.violations(&c.arguments))
                .unwrap_or_default();
            if let Some(first) = errors.first() {
                return Err(ApiError::invalid(
                    "invalid_arguments",
                    format!(
                        "arguments do not match input_schema at '{}': {}",
                        first.path, first.message
                    ),
                )
                .with_param(format!("tool_calls[{i}].arguments")));
            }
        }
        Ok(())
    }

    fn add_checked_calls(&mut self, run_id: &str, calls: Vec<NewToolCall>, now: i64) {
        let version = self.runs[run_id].agent_version.clone();
        for c in calls {
            let binding_id = self.versions[&version]
                .tools
                .iter()
                .find(|t| t.name == c.tool_name)
                .map(|t| t.binding_id.clone())
                .unwrap_or_default();
            let call = CallRec {
                call_id: new_id("call_"),
                run_id: run_id.to_owned(),
                seq: self.next_seq(),
                tool_name: c.tool_name,
                binding_id,
                arguments_digest: arguments_digest(&c.arguments),
                arguments: c.arguments,
                state: CallState::Terminated,
                executor_id: None,
                assignment_id: None,
                accepted_at: None,
                receipts: Vec::new(),
                late_receipts: Vec::new(),
                projection: None,
                pending_delivery: false,
                created_at: rfc3339(now),
            };
            let call_id = call.call_id.clone();
            self.calls.insert(call_id.clone(), call);
            self.runs
                .get_mut(run_id)
                .expect("exists")
                .call_ids
                .push(call_id.clone());
            // From a placeholder state so that the move to pending indexes it.
            self.set_call_state(&call_id, CallState::Pending, now);
        }
        self.touch(Table::Runs, run_id);
    }

    pub(crate) fn get_run(&self, run_id: &str) -> Result<Run, ApiError> {
        let run = self.run_in_path(run_id)?;
        let tool_calls = run
            .call_ids
            .iter()
            .map(|id| run_call(&self.calls[id]))
            .collect();
        Ok(Run {
            run_id: run.run_id.clone(),
            agent_id: run.agent_id.clone(),
            agent_version: run.agent_version.clone(),
            subject: run.subject.clone(),
            status: run.status,
            created_at: run.created_at.clone(),
            tool_calls,
        })
    }

    /// Forgets a run as a platform whose own retention deleted it: the
    /// run, its calls and their assignments are gone, and every path that
    /// names the run answers `404` (a final receipt for it then leaves the
    /// executor's call `orphaned`). Development only: no wire path does
    /// this.
    pub(crate) fn forget_run(&mut self, run_id: &str) -> Result<(), ApiError> {
        self.run_in_path(run_id)?;
        let run = self.runs.remove(run_id).expect("looked up above");
        self.touch(Table::Runs, run_id);
        for id in &run.call_ids {
            self.calls.remove(id);
            self.touch(Table::Calls, id);
        }
        let assignments: Vec<String> = self
            .assignments
            .values()
            .filter(|a| a.run_id == run_id)
            .map(|a| a.assignment_id.clone())
            .collect();
        for id in assignments {
            self.assignments.remove(&id);
            self.touch(Table::Assignments, &id);
        }
        self.reindex();
        Ok(())
    }

    pub(crate) fn cancel_run(&mut self, run_id: &str, now: i64) -> Result<Run, ApiError> {
        match self.run_in_path(run_id)?.status {
            RunStatus::Active => self.end_run(run_id, RunStatus::Cancelled, now),
            RunStatus::Cancelled => {}
            _ => {
                return Err(ApiError::conflict(
                    "run_terminated",
                    format!("run {run_id} has already ended"),
                ));
            }
        }
        self.get_run(run_id)
    }

    /// Cancels or expires a run: non-terminal calls become `terminated`,
    /// their assignments close, and executors holding them hear of it.
    pub(crate) fn end_run(&mut self, run_id: &str, status: RunStatus, now: i64) {
        let call_ids = self.runs[run_id].call_ids.clone();
        for id in call_ids {
            let call = &self.calls[&id];
            if call.state.is_terminal() {
                continue;
            }
            let bound = call
                .is_bound()
                .then(|| (call.executor_id.clone(), call.assignment_id.clone()));
            let call_ref = call.call_ref();
            self.set_call_state(&id, CallState::Terminated, now);
            let Some((Some(executor_id), asg)) = bound else {
                continue;
            };
            if let Some(asg) = asg {
                self.set_assignment(&asg, AssignmentStatus::Closed);
            }
            if let Some(e) = self.executors.get_mut(&executor_id) {
                e.cancel_notices.push((call_ref.clone(), false));
                self.dirty.insert((Table::Executors, executor_id.clone()));
            }
            self.notices.push(Notice::Cancel {
                executor_id,
                frame: StreamFrame::CancelRequested {
                    run_id: call_ref.run_id,
                    call_id: call_ref.call_id,
                },
            });
        }
        let run = self.runs.get_mut(run_id).expect("exists");
        run.status = status;
        self.touch(Table::Runs, run_id);
    }

    /// A run whose every call is terminal is `completed`.
    pub(crate) fn complete_run_if_done(&mut self, run_id: &str) {
        let run = &self.runs[run_id];
        if run.status == RunStatus::Active
            && run
                .call_ids
                .iter()
                .all(|id| self.calls[id].state.is_terminal())
        {
            self.runs.get_mut(run_id).expect("exists").status = RunStatus::Completed;
            self.touch(Table::Runs, run_id);
        }
    }
}

fn stored(r: &ReceiptRec) -> StoredReceipt {
    StoredReceipt {
        receipt_id: r.receipt_id.clone(),
        kind: r.kind,
        sequence: r.sequence,
        received_at: r.received_at.clone(),
        body: serde_json::value::RawValue::from_string(r.raw.clone()).unwrap_or_else(|_| {
            serde_json::value::RawValue::from_string("null".into()).expect("valid")
        }),
    }
}

fn run_call(c: &CallRec) -> RunCall {
    RunCall {
        call_id: c.call_id.clone(),
        tool_name: c.tool_name.clone(),
        arguments: c.arguments.clone(),
        state: c.state,
        executor_id: c.executor_id.clone(),
        assignment_id: c.assignment_id.clone(),
        accepted_at: c.accepted_at.clone(),
        receipts: c.receipts.iter().map(stored).collect(),
        late_receipts: c.late_receipts.iter().map(stored).collect(),
        context_projection: c.projection.clone(),
    }
}
