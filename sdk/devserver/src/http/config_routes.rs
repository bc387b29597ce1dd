//! Configuration endpoints (protocol §2).
use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use toolrunner_protocol::ApiError;
use toolrunner_protocol::wire::{
    Agent, AgentVersion, Binding, CreateAgent, CreateBinding, CreateVersion, Diagnostics, DryRun,
    DryRunAnswer, List,
};

use super::auth::{Auth, Scope};
use super::decode::Body;
use super::respond::{Answer, ok};
use super::shared::Shared;

type S = State<Arc<Shared>>;

pub(crate) async fn create_agent(State(sh): S, auth: Auth, body: Body) -> Answer<Agent> {
    auth.require(&[Scope::ConfigurationWrite])?;
    let req: CreateAgent = body.json()?;
    ok(sh.apply(|s, now| s.create_agent(req, now)).await)
}

pub(crate) async fn create_binding(State(sh): S, auth: Auth, body: Body) -> Answer<Binding> {
    auth.require(&[Scope::ConfigurationWrite])?;
    let req: CreateBinding = body.json()?;
    ok(sh.apply(|s, now| s.create_binding(req, now)).await)
}

pub(crate) async fn list_bindings(
    State(sh): S,
    auth: Auth,
    Query(q): Query<HashMap<String, String>>,
) -> Answer<List<Binding>> {
    auth.require(&[Scope::ConfigurationRead])?;
    super::query::only(&q, &["agent_id"])?;
    let agent = q.get("agent_id").cloned();
    let list = sh.apply(|s, _| s.list_bindings(agent.as_deref())).await;
    ok(list.map(|data| List {
        data,
        next_cursor: None,
    }))
}

pub(crate) async fn create_version(
    State(sh): S,
    auth: Auth,
    Path(agent_id): Path<String>,
    body: Body,
) -> Answer<AgentVersion> {
    auth.require(&[Scope::ConfigurationWrite])?;
    // A path resource that does not exist is 404 before the body is judged.
    sh.apply(|s, _| agent_exists(s, &agent_id)).await?;
    let req: CreateVersion = body.json()?;
    ok(sh
        .apply(|s, now| s.create_version(&agent_id, req, now))
        .await)
}

/// `GET /agents/{agent_id}/versions` (this platform's own): every
/// published version of the agent, oldest first.
pub(crate) async fn list_versions(
    State(sh): S,
    auth: Auth,
    Path(agent_id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Answer<List<AgentVersion>> {
    auth.require(&[Scope::ConfigurationRead])?;
    super::query::only(&q, &[])?;
    let list = sh.apply(|s, _| s.list_versions(&agent_id)).await;
    ok(list.map(|data| List {
        data,
        next_cursor: None,
    }))
}

fn agent_exists(s: &mut crate::engine::State, agent_id: &str) -> Result<(), ApiError> {
    if s.agents.contains_key(agent_id) {
        Ok(())
    } else {
        Err(ApiError::not_found(
            "unknown_agent",
            format!("no agent {agent_id}"),
        ))
    }
}

pub(crate) async fn get_version(
    State(sh): S,
    auth: Auth,
    Path((agent_id, version)): Path<(String, String)>,
) -> Answer<AgentVersion> {
    auth.require(&[Scope::ConfigurationRead])?;
    ok(sh.apply(|s, _| s.get_version(&agent_id, &version)).await)
}

pub(crate) async fn diagnostics(
    State(sh): S,
    auth: Auth,
    Path((agent_id, binding_id)): Path<(String, String)>,
) -> Answer<Diagnostics> {
    auth.require(&[Scope::ConfigurationRead])?;
    ok(sh
        .apply(|s, now| s.diagnostics(&agent_id, &binding_id, now))
        .await)
}

pub(crate) async fn dry_run(State(sh): S, auth: Auth, body: Body) -> Answer<DryRunAnswer> {
    auth.require(&[
        Scope::RuntimeRead,
        Scope::ConfigurationRead,
        Scope::ToolsExecute,
    ])?;
    let req: DryRun = body.json()?;
    ok(sh.apply(|s, _| s.dry_run(req)).await)
}
