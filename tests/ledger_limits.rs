//! The `ledger` example's `--concurrency` and `--rate`, as a process: the
//! platform's receipt times show at most N calls between their first
//! `accepted` and their final receipt at once, and at most N first
//! `accepted` in any second; every call completes.

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::json;
use toolrunner_devserver::DevServer;

#[path = "support/ledger.rs"]
mod ledger;
#[path = "support/limits.rs"]
mod limits;

const CALLS: usize = 12;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ledger_holds_its_concurrency_and_rate_limits() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let bin = ledger::ledger_binary()?;
    let tmp = tempfile::tempdir()?;
    let platform = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let admin = toolrunner::platform::Platform::new(&platform.base_url(), "dev-admin")?;
    let published = ledger::publish_ledger(&admin, "limits").await?;
    let calls = (0..CALLS)
        .map(|i| {
            toolrunner::platform::NewToolCall::new(
                "ledger.append",
                json!({"amount": 100 + i, "memo": "coffee"}),
            )
        })
        .collect();
    let run = admin
        .create_run(&published.agent_version, "user_42", calls)
        .await?;
    let ledger_file = tmp.path().join("ledger.jsonl");
    let log = tmp.path().join("ledger.log");
    let db = tmp.path().join("exec.db").display().to_string();
    let args = ledger::Serving {
        base_url: &platform.base_url(),
        token: "dev-executor",
        executor_id: "ledger-limits-01",
        binding_id: &published.binding_id,
        db: &db,
        ledger: &ledger_file,
        capacity: 8,
        effect_delay_ms: 150,
    }
    .args(&["--concurrency", "2", "--rate", "5"]);
    let mut child = ledger::spawn(&bin, &args, &[], &log)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    let run = loop {
        let now = admin.run(&run.run_id).await?;
        if now
            .tool_calls
            .iter()
            .all(|c| c.state.as_str() == "completed")
        {
            break now;
        }
        if Instant::now() > deadline || child.try_wait()?.is_some() {
            let _ = child.kill();
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            anyhow::bail!(
                "not every call of agent {} completed in time:\n{said}",
                published.agent_id
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    child.kill()?;
    child.wait()?;

    // Each call from its first `accepted` to its final receipt, as the
    // platform received them.
    let spans = limits::spans(&run)?;
    let (most_at_once, most_a_second) = limits::most(&spans);
    ensure!(
        most_at_once <= 2,
        "{most_at_once} calls between accepted and their final receipt at once: {spans:?}"
    );
    ensure!(
        most_a_second <= 5,
        "{most_a_second} first accepted within a second: {spans:?}"
    );
    ensure!(
        most_at_once == 2,
        "the concurrency limit was never reached, so the test shows nothing: {spans:?}"
    );
    platform.shutdown().await;
    Ok(())
}
