//! Development-platform admin endpoints (protocol §7).
use std::sync::Arc;

use axum::extract::{Path, State};
use toolrunner_protocol::ApiError;
use toolrunner_protocol::wire::{AddToolCalls, CreateRun, FaultSettings, Run};

use super::auth::{Auth, Scope};
use super::decode::Body;
use super::respond::{Answer, ok};
use super::shared::Shared;
use crate::http::faults::{FaultState, Faults};

type S = State<Arc<Shared>>;

pub(crate) async fn create_run(State(sh): S, auth: Auth, body: Body) -> Answer<Run> {
    auth.require(&[Scope::RunsWrite])?;
    let req: CreateRun = body.json()?;
    ok(sh.apply(|s, now| s.create_run(req, now)).await)
}

pub(crate) async fn add_calls(
    State(sh): S,
    auth: Auth,
    Path(run_id): Path<String>,
    body: Body,
) -> Answer<Run> {
    auth.require(&[Scope::RunsWrite])?;
    sh.apply(|s, _| s.run_in_path(&run_id).map(|_| ())).await?;
    let req: AddToolCalls = body.json()?;
    ok(sh.apply(|s, now| s.add_calls(&run_id, req, now)).await)
}

/// `POST /runs/{id}/cancel` takes no fields: an empty body or `{}`.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoFields {}

pub(crate) async fn cancel_run(
    State(sh): S,
    auth: Auth,
    Path(run_id): Path<String>,
    body: Body,
) -> Answer<Run> {
    auth.require(&[Scope::RunsWrite])?;
    // The run in the path is found before the body is judged.
    sh.apply(|s, _| s.run_in_path(&run_id).map(|_| ())).await?;
    if !body.bytes()?.is_empty() {
        let _: NoFields = body.json()?;
    }
    ok(sh.apply(|s, now| s.cancel_run(&run_id, now)).await)
}

pub(crate) async fn get_run(State(sh): S, auth: Auth, Path(run_id): Path<String>) -> Answer<Run> {
    auth.require(&[Scope::RuntimeRead])?;
    ok(sh.apply(|s, _| s.get_run(&run_id)).await)
}

pub(crate) async fn put_faults(State(sh): S, auth: Auth, body: Body) -> Answer<FaultSettings> {
    auth.require_all()?;
    let req: FaultSettings = body.json()?;
    let faults = Faults {
        error_rate: req.error_rate,
        drop_response_rate: req.drop_response_rate,
        latency_ms: req.latency_ms,
        seed: req.seed,
    };
    faults
        .check()
        .map_err(|m| ApiError::invalid("out_of_range", m))?;
    if let Ok(mut f) = sh.faults.lock() {
        *f = FaultState::new(faults);
    }
    ok(Ok(req))
}
