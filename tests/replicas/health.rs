//! An executor identity's health on PostgreSQL, as an orchestrator and a
//! Prometheus scrape see it: the lease's age and its failed renewals are
//! published (the metrics the table in `docs/operations.md` marks
//! PostgreSQL-only), and while the database does not answer (its
//! connections paused, as by a network partition) the executor turns not
//! ready, then ready again once the database is back.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Result, bail, ensure};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};
use toolrunner::platform::Platform;
use toolrunner::{CallContext, Executor, Health, Shutdown, ToolError};
use toolrunner_devserver::DevServer;

use super::pause::{Proxy, address_of};

/// The lease of the identity under test.
const TTL: Duration = Duration::from_millis(1000);

/// Nothing.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Nothing {}

/// Nothing either.
#[toolrunner::schema]
#[derive(Serialize)]
struct Done {}

/// Does nothing.
#[toolrunner::tool(name = "health.noop", effect = read)]
async fn noop(_ctx: CallContext, _input: Nothing) -> Result<Done, ToolError> {
    Ok(Done {})
}

/// The recorder of the PostgreSQL suite's process (only this test reads
/// it).
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .install_recorder()
            .expect("the only recorder of the PostgreSQL suite")
    })
}

/// Waits (up to `within`) until the report's verdict is `ready`; the
/// report last seen.
async fn until_ready(
    health: &Health,
    ready: bool,
    within: Duration,
) -> Result<toolrunner::HealthReport> {
    let since = Instant::now();
    loop {
        let report = health.report();
        if report.ready() == ready {
            return Ok(report);
        }
        if since.elapsed() > within {
            bail!("still {report:?} after {within:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The line of `name` for executor `id` in the scrape, if any.
fn sample(scrape: &str, name: &str, id: &str) -> Option<f64> {
    let prefix = format!("{name}{{executor_id=\"{id}\"}} ");
    scrape
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

pub(crate) async fn the_lease_shows_in_health_and_metrics_and_readiness_follows_the_database(
    url: &str,
) -> Result<()> {
    let prometheus = prometheus();
    let server = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .heartbeat_interval_ms(200)
        .start()
        .await?;
    let admin = Platform::new(&server.base_url(), "dev-admin")?;
    let agent = admin.create_agent("health").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "health", &["health.noop"])
        .await?;
    let database = Proxy::start(address_of(url)).await?;
    let id = format!("health-{:08x}", rand::random::<u32>());
    let executor = Executor::builder()
        .base_url(server.base_url())
        .token("dev-executor")
        .executor_id(&id)
        .binding_id(&binding.binding_id)
        .store_url(database.url(url))
        .lease_ttl(TTL)
        .allow_all()
        .tool(noop)
        .build()?;
    let health = executor.health();
    let running = executor.start().await?;
    let outcome = async {
        let report = until_ready(&health, true, Duration::from_secs(10)).await?;
        ensure!(
            report.lease_age().is_some_and(|age| age < TTL),
            "a fresh lease: {report:?}"
        );
        // The gauges are published once a second.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let scrape = prometheus.render();
        let age = sample(&scrape, "toolrunner_lease_age_seconds", &id);
        ensure!(
            age.is_some_and(|a| a < TTL.as_secs_f64()),
            "the lease's age: {age:?} in\n{scrape}"
        );
        ensure!(
            sample(&scrape, "toolrunner_lease_renewals_failed_total", &id) == Some(0.0),
            "no renewal failed yet:\n{scrape}"
        );

        // The database stops answering: the lease cannot be renewed, the
        // store cannot be written; the executor says it is not ready.
        database.pause();
        let report = until_ready(&health, false, TTL * 4).await?;
        let reason = report.reason().unwrap_or_default().to_owned();
        ensure!(
            reason.starts_with("lease not live") || reason.starts_with("store not writable"),
            "why it is not ready: {reason}"
        );
        database.resume();
        until_ready(&health, true, Duration::from_secs(20)).await?;
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let failed = sample(
            &prometheus.render(),
            "toolrunner_lease_renewals_failed_total",
            &id,
        );
        ensure!(
            failed.is_some_and(|n| n >= 1.0),
            "the failed renewals were counted: {failed:?}"
        );
        Ok(())
    }
    .await;
    let stopped = running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await;
    server.shutdown().await;
    let cleaned = super::clean_up(url, &[id]).await;
    outcome.and(stopped.map_err(Into::into)).and(cleaned)
}
