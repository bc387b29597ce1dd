//! Agents, bindings, versions, diagnostics and dry runs (protocol §2).
use serde_json::Value;
use toolrunner_protocol::ApiError;
use toolrunner_protocol::projection::project;
use toolrunner_protocol::tooldef::{self, ProblemKind, ToolProblem};
use toolrunner_protocol::wire::{
    Agent, AgentVersion, Binding, CallCounts, CallState, ContextPreview, CreateAgent,
    CreateBinding, CreateVersion, Diagnostics, DryRun, DryRunAnswer, ExecutorDiagnostics,
    ExecutorStatus, ReceiptKind,
};

use super::model::{ExecutorMode, ExecutorRec, Table};
use super::{State, new_id, rfc3339};

fn nonblank(value: &str, param: &str) -> Result<(), ApiError> {
    if value.trim().is_empty() {
        return Err(
            ApiError::invalid("invalid_value", format!("{param} must not be blank"))
                .with_param(param),
        );
    }
    Ok(())
}

fn problem_error(p: &ToolProblem, total: usize) -> ApiError {
    let more = if total > 1 {
        format!(" ({} more problems)", total - 1)
    } else {
        String::new()
    };
    let msg = format!("{}{more}", p.message);
    let err = match p.kind {
        ProblemKind::InvalidRequest => ApiError::invalid(&p.code, msg),
        ProblemKind::UnsupportedConfiguration => ApiError::unsupported(&p.code, msg),
    };
    err.with_param(p.param.clone())
}

impl State {
    pub(crate) fn create_agent(&mut self, body: CreateAgent, now: i64) -> Result<Agent, ApiError> {
        nonblank(&body.name, "name")?;
        let agent = Agent {
            agent_id: new_id("agt_"),
            name: body.name,
            created_at: rfc3339(now),
        };
        self.agents.insert(agent.agent_id.clone(), agent.clone());
        self.touch(Table::Agents, &agent.agent_id);
        Ok(agent)
    }

    fn agent_in_body(&self, agent_id: &str) -> Result<(), ApiError> {
        if self.agents.contains_key(agent_id) {
            return Ok(());
        }
        Err(
            ApiError::invalid("unknown_agent", format!("no agent {agent_id}"))
                .with_param("agent_id"),
        )
    }

    pub(crate) fn create_binding(
        &mut self,
        body: CreateBinding,
        now: i64,
    ) -> Result<Binding, ApiError> {
        self.agent_in_body(&body.agent_id)?;
        nonblank(&body.name, "name")?;
        if body.tool_names.is_empty() {
            return Err(ApiError::invalid(
                "invalid_value",
                "tool_names must name at least one tool",
            )
            .with_param("tool_names"));
        }
        for (i, name) in body.tool_names.iter().enumerate() {
            let param = format!("tool_names[{i}]");
            tooldef::check_tool_name(name)
                .map_err(|m| ApiError::invalid("invalid_tool_name", m).with_param(param.clone()))?;
            if body.tool_names[..i].contains(name) {
                return Err(ApiError::invalid(
                    "duplicate_tool_name",
                    format!("{name} is listed twice"),
                )
                .with_param(param));
            }
        }
        let binding = Binding {
            binding_id: new_id("bnd_"),
            agent_id: body.agent_id,
            name: body.name,
            tool_names: body.tool_names,
            created_at: rfc3339(now),
        };
        self.bindings
            .insert(binding.binding_id.clone(), binding.clone());
        self.touch(Table::Bindings, &binding.binding_id);
        Ok(binding)
    }

    pub(crate) fn list_bindings(&self, agent_id: Option<&str>) -> Result<Vec<Binding>, ApiError> {
        if let Some(id) = agent_id {
            self.agent_in_body(id)?;
        }
        let mut list: Vec<Binding> = self
            .bindings
            .values()
            .filter(|b| agent_id.is_none_or(|id| b.agent_id == id))
            .cloned()
            .collect();
        list.sort_by(|a, b| {
            a.created_at
                .cmp(&b.created_at)
                .then(a.binding_id.cmp(&b.binding_id))
        });
        Ok(list)
    }

    pub(crate) fn create_version(
        &mut self,
        agent_id: &str,
        body: CreateVersion,
        now: i64,
    ) -> Result<AgentVersion, ApiError> {
        if !self.agents.contains_key(agent_id) {
            return Err(ApiError::not_found(
                "unknown_agent",
                format!("no agent {agent_id}"),
            ));
        }
        let checked = tooldef::check_version(&body.tools, body.tool_search.as_ref())
            .map_err(|problems| problem_error(&problems[0], problems.len()))?;
        for (i, tool) in checked.tools.iter().enumerate() {
            let param = format!("tools[{i}].binding_id");
            let binding = self
                .bindings
                .get(&tool.binding_id)
                .filter(|b| b.agent_id == agent_id);
            let Some(binding) = binding else {
                return Err(ApiError::invalid(
                    "unknown_binding",
                    format!(
                        "agent {agent_id} has no executor binding {}",
                        tool.binding_id
                    ),
                )
                .with_param(param));
            };
            if !binding.tool_names.contains(&tool.name) {
                return Err(ApiError::unsupported(
                    "tool_not_in_binding",
                    format!(
                        "binding {} does not serve tool {}",
                        binding.binding_id, tool.name
                    ),
                )
                .with_param(format!("tools[{i}].name")));
            }
        }
        let version = AgentVersion {
            agent_version: new_id("agv_"),
            agent_id: agent_id.to_owned(),
            tools: checked.tools,
            tool_search: checked.tool_search,
            created_at: rfc3339(now),
        };
        self.versions
            .insert(version.agent_version.clone(), version.clone());
        self.touch(Table::Versions, &version.agent_version);
        Ok(version)
    }

    /// Every published version of the agent, oldest first.
    pub(crate) fn list_versions(&self, agent_id: &str) -> Result<Vec<AgentVersion>, ApiError> {
        if !self.agents.contains_key(agent_id) {
            return Err(ApiError::not_found(
                "unknown_agent",
                format!("no agent {agent_id}"),
            ));
        }
        let mut list: Vec<AgentVersion> = self
            .versions
            .values()
            .filter(|v| v.agent_id == agent_id)
            .cloned()
            .collect();
        list.sort_by(|a, b| {
            a.created_at
                .cmp(&b.created_at)
                .then(a.agent_version.cmp(&b.agent_version))
        });
        Ok(list)
    }

    pub(crate) fn get_version(
        &self,
        agent_id: &str,
        version: &str,
    ) -> Result<AgentVersion, ApiError> {
        if !self.agents.contains_key(agent_id) {
            return Err(ApiError::not_found(
                "unknown_agent",
                format!("no agent {agent_id}"),
            ));
        }
        match self.versions.get(version) {
            Some(v) if v.agent_id == agent_id => Ok(v.clone()),
            _ => Err(ApiError::not_found(
                "unknown_agent_version",
                format!("agent {agent_id} has no version {version}"),
            )),
        }
    }

    pub(crate) fn diagnostics(
        &self,
        agent_id: &str,
        binding_id: &str,
        now: i64,
    ) -> Result<Diagnostics, ApiError> {
        if !self.agents.contains_key(agent_id) {
            return Err(ApiError::not_found(
                "unknown_agent",
                format!("no agent {agent_id}"),
            ));
        }
        if self
            .bindings
            .get(binding_id)
            .is_none_or(|b| b.agent_id != agent_id)
        {
            return Err(ApiError::not_found(
                "unknown_binding",
                format!("agent {agent_id} has no executor binding {binding_id}"),
            ));
        }
        let mut calls = CallCounts::default();
        for c in self.calls.values().filter(|c| c.binding_id == binding_id) {
            match c.state {
                CallState::Pending => calls.pending += 1,
                CallState::Claimed => calls.claimed += 1,
                CallState::Running => calls.running += 1,
                CallState::ReconciliationRequired => calls.reconciliation_required += 1,
                _ => {}
            }
            calls.pending_delivery += u64::from(c.pending_delivery);
        }
        let executors = self
            .executors
            .values()
            .filter(|e| e.binding_id == binding_id)
            .map(|e| self.executor_diagnostics(e, now))
            .collect();
        Ok(Diagnostics {
            binding_id: binding_id.to_owned(),
            executors,
            calls,
        })
    }

    /// The status an executor shows now.
    pub(crate) fn executor_status(&self, e: &ExecutorRec, now: i64) -> ExecutorStatus {
        match e.mode {
            ExecutorMode::Detached => ExecutorStatus::Detached,
            ExecutorMode::Expired => ExecutorStatus::Offline,
            _ if e.lease_expires_ms <= now => ExecutorStatus::Offline,
            ExecutorMode::Draining if self.bound_calls(&e.executor_id).is_empty() => {
                ExecutorStatus::Offline
            }
            ExecutorMode::Draining => ExecutorStatus::Draining,
            ExecutorMode::Active => ExecutorStatus::Online,
        }
    }

    fn executor_diagnostics(&self, e: &ExecutorRec, now: i64) -> ExecutorDiagnostics {
        let in_flight = self
            .bound_calls(&e.executor_id)
            .iter()
            .filter(|c| matches!(c.state, CallState::Claimed | CallState::Running))
            .count();
        ExecutorDiagnostics {
            executor_id: e.executor_id.clone(),
            connection_id: e.connection_id.clone(),
            status: self.executor_status(e, now),
            last_heartbeat_at: rfc3339(e.last_heartbeat_ms),
            lease_expires_at: rfc3339(e.lease_expires_ms),
            capacity: e.capacity,
            in_flight: u32::try_from(in_flight).unwrap_or(u32::MAX),
            sdk: e.sdk.clone(),
        }
    }

    pub(crate) fn dry_run(&mut self, body: DryRun) -> Result<DryRunAnswer, ApiError> {
        let Some(version) = self.versions.get(&body.agent_version) else {
            return Err(ApiError::invalid(
                "unknown_agent_version",
                format!("no agent version {}", body.agent_version),
            )
            .with_param("agent_version"));
        };
        let Some(tool) = version.tools.iter().find(|t| t.name == body.tool_name) else {
            return Err(ApiError::invalid(
                "unknown_tool",
                format!(
                    "agent version {} has no tool {}",
                    body.agent_version, body.tool_name
                ),
            )
            .with_param("tool_name"));
        };
        let budget = tool.max_result_context_bytes;
        for (i, m) in body.mock_receipts.iter().enumerate() {
            if m.kind == ReceiptKind::Completed && m.result.is_none() {
                return Err(ApiError::invalid(
                    "missing_field",
                    "a completed mock receipt needs a result",
                )
                .with_param(format!("mock_receipts[{i}].result")));
            }
        }
        let schema = self
            .schema(&body.agent_version, &body.tool_name, false)
            .ok_or_else(|| {
                ApiError::invalid("invalid_schema", "the tool's input_schema does not compile")
            })?;
        let argument_errors = schema.violations(&body.arguments);
        let context_preview = body
            .mock_receipts
            .iter()
            .find(|m| m.kind == ReceiptKind::Completed)
            .and_then(|m| m.result.as_ref())
            .map(|result| preview(result, budget));
        Ok(DryRunAnswer {
            arguments_valid: argument_errors.is_empty(),
            argument_errors,
            context_preview,
            execution_verified: false,
        })
    }
}

fn preview(result: &Value, budget: u64) -> ContextPreview {
    let p = project(result, usize::try_from(budget).unwrap_or(usize::MAX));
    ContextPreview {
        max_result_context_bytes: budget,
        original_bytes: p.original_bytes,
        retained_bytes: p.retained_bytes,
        truncated: p.truncated,
        result: p.result,
    }
}
