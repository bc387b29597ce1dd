//! Claiming a call (protocol §5, "Claim").
use toolrunner_protocol::ApiError;
use toolrunner_protocol::wire::{Assignment, CallState, Claim, Claimed, Grant, RunStatus};

use super::model::{AssignmentRec, AssignmentStatus, ExecutorMode, Table};
use super::{State, is_token_id, new_grant, new_id, rfc3339};

impl State {
    /// Claims `call_id` of `run_id`, checking the rules in the contract's
    /// order: the first that applies wins.
    pub(crate) fn claim(
        &mut self,
        run_id: &str,
        call_id: &str,
        body: Result<Claim, ApiError>,
        now: i64,
    ) -> Result<Claimed, ApiError> {
        let run_status = self.run_in_path(run_id)?.status;
        let call = self.call_of_run(run_id, call_id)?;
        let body = body?;
        let (tool, binding, state) = (call.tool_name.clone(), call.binding_id.clone(), call.state);
        if !is_token_id(&body.operation_key) {
            return Err(ApiError::invalid(
                "invalid_operation_key",
                "operation_key must be 1-128 characters of [A-Za-z0-9_.:-]",
            )
            .with_param("operation_key"));
        }
        let exec = self.live_connection(&body.executor_id, &body.connection_id)?;
        if exec.binding_id != binding || !exec.tools.contains(&tool) {
            return Err(ApiError::forbidden(
                "tool_not_connected",
                format!("tool {tool} of binding {binding} is not among this connection's tools"),
            )
            .with_param("call_id"));
        }
        let (draining, capacity) = (exec.mode == ExecutorMode::Draining, exec.capacity);
        let key = (body.executor_id.clone(), body.operation_key.clone());
        if let Some(asg) = self
            .op_keys
            .get(&key)
            .and_then(|id| self.assignments.get(id))
        {
            if asg.call_id != call_id {
                return Err(ApiError::invalid(
                    "operation_key_reused",
                    format!("operation_key was already used for call {}", asg.call_id),
                )
                .with_param("operation_key"));
            }
            if asg.status != AssignmentStatus::Released {
                let assignment = self.assignment_body(&asg.assignment_id.clone());
                return Ok(Claimed {
                    replayed: true,
                    call_state: state,
                    assignment,
                });
            }
        }
        if run_status != RunStatus::Active {
            return Err(ApiError::conflict(
                "run_terminated",
                format!("run {run_id} has ended"),
            ));
        }
        if draining {
            return Err(ApiError::conflict(
                "executor_draining",
                format!(
                    "executor {} is draining and takes no new claims",
                    body.executor_id
                ),
            ));
        }
        match state {
            CallState::Pending => {}
            s if s.is_terminal() => {
                return Err(ApiError::conflict(
                    "call_not_claimable",
                    format!(
                        "call {call_id} is {} and can no longer be claimed",
                        s.as_str()
                    ),
                ));
            }
            _ => {
                return Err(ApiError::conflict(
                    "already_claimed",
                    format!("call {call_id} already has a live claim"),
                ));
            }
        }
        let in_flight = self
            .bound_calls(&body.executor_id)
            .iter()
            .filter(|c| matches!(c.state, CallState::Claimed | CallState::Running))
            .count();
        if in_flight >= capacity as usize {
            return Err(ApiError::conflict(
                "capacity_exhausted",
                format!(
                    "executor {} already holds {in_flight} of {capacity} calls",
                    body.executor_id
                ),
            ));
        }
        let asg = AssignmentRec {
            assignment_id: new_id("asg_"),
            run_id: run_id.to_owned(),
            call_id: call_id.to_owned(),
            executor_id: body.executor_id.clone(),
            operation_key: body.operation_key.clone(),
            grant: new_grant(),
            status: AssignmentStatus::Live,
            created_at: rfc3339(now),
        };
        let asg_id = asg.assignment_id.clone();
        self.op_keys.insert(key, asg_id.clone());
        self.grants.insert(asg.grant.clone(), asg_id.clone());
        self.assignments.insert(asg_id.clone(), asg);
        self.touch(Table::Assignments, &asg_id);
        let call = self.calls.get_mut(call_id).expect("checked above");
        call.executor_id = Some(body.executor_id);
        call.assignment_id = Some(asg_id.clone());
        call.accepted_at = None;
        self.set_call_state(call_id, CallState::Claimed, now);
        Ok(Claimed {
            replayed: false,
            call_state: CallState::Claimed,
            assignment: self.assignment_body(&asg_id),
        })
    }

    /// The assignment as the claim answer carries it.
    fn assignment_body(&self, assignment_id: &str) -> Assignment {
        let asg = &self.assignments[assignment_id];
        let call = &self.calls[&asg.call_id];
        let run = &self.runs[&asg.run_id];
        let tool = self.versions[&run.agent_version]
            .tools
            .iter()
            .find(|t| t.name == call.tool_name)
            .expect("a call's tool is in its version");
        Assignment {
            assignment_id: asg.assignment_id.clone(),
            run_id: asg.run_id.clone(),
            call_id: asg.call_id.clone(),
            tool_name: call.tool_name.clone(),
            arguments: call.arguments.clone(),
            arguments_digest: call.arguments_digest.clone(),
            grant: Grant::new(asg.grant.clone()),
            subject: run.subject.clone(),
            agent_id: run.agent_id.clone(),
            agent_version: run.agent_version.clone(),
            binding_id: call.binding_id.clone(),
            max_result_context_bytes: tool.max_result_context_bytes,
            input_schema: tool.input_schema.clone(),
            output_schema: tool.output_schema.clone(),
        }
    }

    /// The assignment a grant belongs to.
    pub(crate) fn assignment_by_grant(&self, grant: &str) -> Option<&AssignmentRec> {
        self.assignments.get(self.grants.get(grant)?)
    }
}
