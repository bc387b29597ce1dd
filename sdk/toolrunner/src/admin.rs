//! Health and metrics over HTTP, for an orchestrator's probes and a
//! Prometheus scrape: an axum [`Router`] to mount in the product's own
//! server (feature `admin`).
//!
//! | path | answers |
//! |---|---|
//! | `GET /healthz` | `200` while the process serves, with the [`HealthReport`] as JSON |
//! | `GET /readyz` | `200` `{"ready":true}` when the executor takes calls; `503` `{"ready":false,"reason":…}` otherwise |
//! | `GET /metrics` | the Prometheus text the product's recorder renders ([`router_with_metrics`]) |
//!
//! ```no_run
//! # async fn demo(
//! #     executor: toolrunner::Executor,
//! #     prometheus: impl Fn() -> String + Send + Sync + 'static,
//! # ) -> Result<(), Box<dyn std::error::Error>> {
//! // `prometheus`: e.g. `move || handle.render()` with the `PrometheusHandle`
//! // of `metrics_exporter_prometheus::PrometheusBuilder::install_recorder`.
//! let admin = toolrunner::admin::router_with_metrics(executor.health(), prometheus);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:9090").await?;
//! tokio::spawn(async move { axum::serve(listener, admin).await });
//! executor.serve(toolrunner::shutdown_signal()).await?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::health::{Health, HealthReport};

/// `/healthz` and `/readyz` for `health`.
pub fn router(health: Health) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(health)
}

/// [`router`], and `/metrics` answered with what `render` returns (the
/// text format of Prometheus, e.g. `PrometheusHandle::render` of
/// `metrics-exporter-prometheus`: the recorder stays the product's
/// choice, since it is process-wide).
pub fn router_with_metrics<F>(health: Health, render: F) -> Router
where
    F: Fn() -> String + Send + Sync + 'static,
{
    let render: Arc<dyn Fn() -> String + Send + Sync> = Arc::new(render);
    let metrics = Router::new()
        .route("/metrics", get(metrics))
        .with_state(render);
    router(health).merge(metrics)
}

async fn healthz(State(health): State<Health>) -> axum::Json<HealthReport> {
    axum::Json(health.report())
}

async fn readyz(State(health): State<Health>) -> Response {
    let report = health.report();
    let status = if report.ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = match report.reason() {
        None => serde_json::json!({ "ready": true }),
        Some(reason) => serde_json::json!({ "ready": false, "reason": reason }),
    };
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(render): State<Arc<dyn Fn() -> String + Send + Sync>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        render(),
    )
        .into_response()
}
