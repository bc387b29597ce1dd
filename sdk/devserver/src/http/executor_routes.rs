//! Executor endpoints (protocol §4).
use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use toolrunner_protocol::ApiError;
use toolrunner_protocol::wire::{
    Connect, Connected, Disconnect, Disconnected, Heartbeat, HeartbeatAnswer, List, PendingCall,
    Report, ReportAnswer,
};

use super::auth::{Auth, Scope};
use super::decode::Body;
use super::query;
use super::respond::{Answer, ok};
use super::shared::Shared;

type S = State<Arc<Shared>>;

/// Most items on one page of `pending`.
const MAX_PAGE: usize = 100;
/// Items on a page of `pending` when `limit` is not given.
const DEFAULT_PAGE: usize = 50;

pub(crate) async fn connect(State(sh): S, auth: Auth, body: Body) -> Answer<Connected> {
    auth.require(&[Scope::ExecutorsConnect])?;
    let req: Connect = body.json()?;
    let limits = sh.limits.clone();
    ok(sh.apply(|s, now| s.connect(req, now, &limits)).await)
}

pub(crate) async fn heartbeat(
    State(sh): S,
    auth: Auth,
    Path(executor_id): Path<String>,
    body: Body,
) -> Answer<HeartbeatAnswer> {
    auth.require(&[Scope::ExecutorsConnect])?;
    let req: Heartbeat = body.json()?;
    let limits = sh.limits.clone();
    ok(sh
        .apply(|s, now| s.heartbeat(&executor_id, req, now, &limits))
        .await)
}

pub(crate) async fn pending(
    State(sh): S,
    auth: Auth,
    Path(executor_id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Answer<List<PendingCall>> {
    auth.require(&[Scope::ExecutorsConnect])?;
    query::only(&q, &["connection_id", "limit", "cursor"])?;
    let connection_id = query::required(&q, "connection_id")?.to_owned();
    let limit = match q.get("limit") {
        None => DEFAULT_PAGE,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=MAX_PAGE).contains(n))
            .ok_or_else(|| {
                ApiError::invalid(
                    "out_of_range",
                    format!("limit must be an integer 1-{MAX_PAGE}"),
                )
                .with_param("limit")
            })?,
    };
    let after = match q.get("cursor") {
        None => None,
        Some(c) => Some(
            c.strip_prefix("cur_")
                .and_then(|n| n.parse::<u64>().ok())
                // Only the exact form this platform gives out.
                .filter(|n| format!("cur_{n}") == *c && *n < u64::MAX)
                .ok_or_else(|| {
                    ApiError::invalid("invalid_cursor", "cursor is not one this platform gave out")
                        .with_param("cursor")
                })?,
        ),
    };
    let page = sh
        .apply(|s, _| s.pending_page(&executor_id, &connection_id, limit, after))
        .await;
    ok(page.map(|(data, next)| List {
        data,
        next_cursor: next.map(|n| format!("cur_{n}")),
    }))
}

pub(crate) async fn report(
    State(sh): S,
    auth: Auth,
    Path(executor_id): Path<String>,
    body: Body,
) -> Answer<ReportAnswer> {
    auth.require(&[Scope::ExecutorsConnect])?;
    let req: Report = body.json()?;
    ok(sh.apply(|s, now| s.report(&executor_id, req, now)).await)
}

pub(crate) async fn disconnect(
    State(sh): S,
    auth: Auth,
    Path(executor_id): Path<String>,
    body: Body,
) -> Answer<Disconnected> {
    auth.require(&[Scope::ExecutorsConnect])?;
    let req: Disconnect = body.json()?;
    ok(sh
        .apply(|s, now| s.disconnect(&executor_id, req, now))
        .await)
}
