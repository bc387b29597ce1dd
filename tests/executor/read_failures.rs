//! A read tool's error, panic or timeout changed nothing: it is tried
//! again as a `Retry` is, then the call fails with `read_failed`, a code
//! the model can read; no person is paged (`docs/protocol.md`, choice 75).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::store::{LocalState, Store};
use toolrunner::{CallContext, State, ToolError};

use crate::fixture::*;

/// How many times each tool ran.
#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>, Arc<AtomicUsize>);

/// What to look up.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct Lookup {
    /// The ticket.
    ticket: String,
}

/// A ticket found.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
struct Ticket {
    /// Its title.
    title: String,
}

/// Looks a ticket up; its backend is down.
#[toolrunner::tool(name = "tickets.down", effect = read)]
async fn down(
    State(runs): State<Runs>,
    _ctx: CallContext,
    _l: Lookup,
) -> Result<Ticket, ToolError> {
    runs.0.fetch_add(1, Ordering::SeqCst);
    let text = std::fs::read_to_string("/nonexistent/tickets/secret-path.json")?;
    Ok(Ticket { title: text })
}

/// Looks a ticket up; panics the first time.
#[toolrunner::tool(name = "tickets.flaky", effect = read)]
async fn flaky(
    State(runs): State<Runs>,
    _ctx: CallContext,
    l: Lookup,
) -> Result<Ticket, ToolError> {
    if runs.1.fetch_add(1, Ordering::SeqCst) == 0 {
        panic!("the first look panics");
    }
    Ok(Ticket { title: l.ticket })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_that_errors_fails_with_its_code_and_pages_nobody() -> Result<()> {
    let env = Env::start(Opts::default(), &["tickets.down", "tickets.flaky"]).await?;
    let runs = Runs::default();
    let exec = env
        .builder("exe-reads")
        .state(runs.clone())
        .retry_attempts(3)
        .tool(down)
        .tool(flaky)
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_1",
            &[
                ("tickets.down", json!({"ticket": "T-1"})),
                ("tickets.flaky", json!({"ticket": "T-2"})),
            ],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(20)).await?;
    let down_call = call_of(&run, "tickets.down");
    assert_eq!(state(&down_call), "failed", "{run:#}");
    let failed = receipt_body(&down_call, "failed");
    assert_eq!(failed["error"]["code"], "read_failed", "{failed:#}");
    let message = failed["error"]["message"].as_str().unwrap_or_default();
    assert!(
        !message.contains("secret-path"),
        "the model reads no internals: {message}"
    );
    assert_eq!(
        runs.0.load(Ordering::SeqCst),
        3,
        "tried as often as the retry policy says"
    );
    let flaky_call = call_of(&run, "tickets.flaky");
    assert_eq!(state(&flaky_call), "completed", "{run:#}");
    assert_eq!(
        receipt_body(&flaky_call, "completed")["result"],
        json!({"title": "T-2"})
    );
    assert_eq!(
        runs.1.load(Ordering::SeqCst),
        2,
        "the panic, then the answer"
    );
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    let store = env.open_store().await?;
    let call_id = down_call["call_id"].as_str().unwrap_or_default();
    let local = store.call(&run_id, call_id).await?.expect("known locally");
    assert_eq!(
        local.state,
        LocalState::Delivered,
        "no person paged: {local:?}"
    );
    env.shutdown().await;
    Ok(())
}
