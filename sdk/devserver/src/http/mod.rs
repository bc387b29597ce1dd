//! The HTTP surface: routes, request ids, fault injection and the server loop.
pub(crate) mod admin_routes;
pub(crate) mod auth;
pub(crate) mod call_routes;
pub(crate) mod config_routes;
pub(crate) mod decode;
pub(crate) mod executor_routes;
pub(crate) mod faults;
pub(crate) mod query;
pub(crate) mod respond;
pub(crate) mod serve;
pub(crate) mod shared;
pub(crate) mod stream;

use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use toolrunner_protocol::ApiError;

use respond::Failure;
use shared::Shared;

static REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Every route of the platform.
pub(crate) fn router(shared: Arc<Shared>, stream: bool) -> Router {
    use {admin_routes as a, call_routes as c, config_routes as g, executor_routes as e};
    let executor = Router::new()
        .route("/executors/connect", post(e::connect))
        .route("/executors/{executor_id}/heartbeat", post(e::heartbeat))
        .route("/executors/{executor_id}/pending", get(e::pending))
        .route("/executors/{executor_id}/calls/report", post(e::report))
        .route("/executors/{executor_id}/disconnect", post(e::disconnect))
        .route("/runs/{run_id}/tool-calls/{call_id}/claim", post(c::claim))
        .route(
            "/runs/{run_id}/tool-calls/{call_id}/receipts",
            post(c::receipt),
        );
    let executor = if stream {
        executor.route(
            "/executors/{executor_id}/stream",
            get(crate::http::stream::stream),
        )
    } else {
        executor
    };
    let executor = executor.route_layer(middleware::from_fn_with_state(
        shared.clone(),
        crate::http::faults::inject,
    ));
    let other = Router::new()
        .route("/agents", post(g::create_agent))
        .route(
            "/executor-bindings",
            post(g::create_binding).get(g::list_bindings),
        )
        .route(
            "/agents/{agent_id}/versions",
            post(g::create_version).get(g::list_versions),
        )
        .route(
            "/agents/{agent_id}/versions/{agent_version}",
            get(g::get_version),
        )
        .route(
            "/agents/{agent_id}/executor-bindings/{binding_id}/diagnostics",
            get(g::diagnostics),
        )
        .route("/tools/dry-run", post(g::dry_run))
        .route("/runs", post(a::create_run))
        .route("/runs/{run_id}", get(a::get_run))
        .route("/runs/{run_id}/tool-calls", post(a::add_calls))
        .route("/runs/{run_id}/cancel", post(a::cancel_run))
        .route("/dev/faults", put(a::put_faults));
    Router::new()
        .nest("/v1", executor.merge(other))
        .fallback(unknown_route)
        .method_not_allowed_fallback(wrong_method)
        .layer(middleware::from_fn(envelope_guard))
        .layer(middleware::from_fn(request_id))
        .with_state(shared)
}

async fn unknown_route(uri: axum::extract::OriginalUri) -> Failure {
    let path = uri.path();
    if path == "/v1/v1" || path.starts_with("/v1/v1/") {
        // A client given a base URL that ends in /v1 adds it once more.
        return ApiError::not_found(
            "unknown_route",
            format!(
                "no such endpoint {path}: /v1 is in it twice, as when the base URL ends in /v1; remove /v1 from the base URL (clients add it to every path)"
            ),
        )
        .into();
    }
    ApiError::not_found("unknown_route", "no such endpoint; every path is under /v1").into()
}

async fn wrong_method() -> Response {
    let mut r = Failure(ApiError::new(
        405,
        toolrunner_protocol::ErrorType::InvalidRequestError,
        "method_not_allowed",
        "this endpoint does not take that method",
    ))
    .into_response();
    *r.status_mut() = axum::http::StatusCode::METHOD_NOT_ALLOWED;
    r
}

/// Gives every error the envelope, also those axum answers by itself
/// (an undecodable path or query, a refused WebSocket upgrade).
async fn envelope_guard(req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), 4096)
        .await
        .unwrap_or_default();
    let message = String::from_utf8_lossy(&text).trim().to_owned();
    let kind = match status.as_u16() {
        401 => toolrunner_protocol::ErrorType::AuthenticationError,
        403 => toolrunner_protocol::ErrorType::PermissionError,
        404 => toolrunner_protocol::ErrorType::NotFoundError,
        409 => toolrunner_protocol::ErrorType::ConflictError,
        429 => toolrunner_protocol::ErrorType::RateLimitError,
        s if s >= 500 => toolrunner_protocol::ErrorType::ApiError,
        _ => toolrunner_protocol::ErrorType::InvalidRequestError,
    };
    let message = if message.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        message
    };
    let mut r = Failure(ApiError::new(
        status.as_u16(),
        kind,
        "invalid_request",
        message,
    ))
    .into_response();
    *r.status_mut() = status;
    r
}

/// Echoes `x-request-id` or makes one, on every response.
async fn request_id(req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(&REQUEST_ID)
        .filter(|v| !v.is_empty() && v.len() <= 200)
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_str(&crate::engine::new_id("req_")).expect("ascii"));
    let span = tracing::debug_span!("request", method = %req.method(), path = %req.uri().path(), request_id = ?id);
    let mut response = tracing::Instrument::instrument(next.run(req), span).await;
    response.headers_mut().insert(REQUEST_ID.clone(), id);
    response
}
