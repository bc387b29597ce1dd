//! The executor's life around a call: platform cancellation reaching a
//! handler (stream and heartbeat), another instance superseding it, drain
//! and detach at shutdown.

use std::time::{Duration, Instant};

use anyhow::Result;
use serde_json::json;
use toolrunner::Shutdown;
use toolrunner::testing::store::{LocalState, Store};

use crate::fixture::*;
use crate::tools::*;

/// Starts a run with one waiting write call, cancels the run once the
/// handler runs, and checks that the handler saw the cancellation within
/// `bound`, took no side effect, and that its late `cancelled` receipt was
/// kept by the platform for audit without reviving the run.
async fn cancellation_reaches_the_handler(opts: Opts, executor_id: &str) -> Result<()> {
    let bound = Duration::from_secs(2);
    let env = Env::start(opts, &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder(executor_id)
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::WaitCancel(Duration::from_secs(8)),
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 5, "memo": "wait"}))],
        )
        .await?;
    let running = exec.start().await?;
    env.wait_run(&run_id, Duration::from_secs(5), "running", |run| {
        state(&calls(run)[0]) == "running"
    })
    .await?;
    assert!(
        eventually(Duration::from_secs(5), || writes.calls() == 1).await,
        "the handler never started"
    );

    let asked = Instant::now();
    env.cancel(&run_id).await?;
    let seen = eventually(bound, || !writes.notes().is_empty()).await;
    let took = asked.elapsed();
    assert!(
        seen,
        "the handler did not see the cancellation within {bound:?}"
    );
    let notes = writes.notes();
    assert!(notes[0].starts_with("cancelled after"), "{notes:?}");
    assert!(writes.effects().is_empty(), "no side effect after cancel");
    eprintln!("{executor_id}: cancellation reached the handler after {took:?}");

    let run = env
        .wait_run(
            &run_id,
            Duration::from_secs(5),
            "holding the late receipt",
            |run| {
                calls(run)[0]["late_receipts"]
                    .as_array()
                    .is_some_and(|l| !l.is_empty())
            },
        )
        .await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    assert_eq!(run["status"], "cancelled", "{run:#}");
    let call = call_of(&run, WRITE);
    assert_eq!(state(&call), "terminated", "{call:#}");
    assert_eq!(kinds(&call), pairs(&[("accepted", 0)]), "{call:#}");
    assert_eq!(call["late_receipts"][0]["kind"], "cancelled", "{call:#}");

    let local = env
        .open_store()
        .await?
        .call(&run_id, call["call_id"].as_str().unwrap())
        .await?
        .expect("known locally");
    assert_eq!(
        local.state,
        LocalState::Rejected,
        "a final receipt answered run_terminated is kept rejected: {local:?}"
    );
    env.shutdown().await;
    Ok(())
}

/// Cancellation through the stream: the advised heartbeat is 10 s, so only
/// the stream's `call.cancel_requested` can reach the handler in time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_reaches_a_long_handler_through_the_stream() -> Result<()> {
    let opts = Opts {
        heartbeat_interval_ms: 10_000,
        lease_ttl_ms: 30_000,
        ..Opts::default()
    };
    cancellation_reaches_the_handler(opts, "exe-cancel-stream").await
}

/// Cancellation through the heartbeat's `cancel_requested`: no stream, an
/// advised heartbeat of 200 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancellation_reaches_a_long_handler_through_heartbeats() -> Result<()> {
    let opts = Opts {
        heartbeat_interval_ms: 200,
        lease_ttl_ms: 5_000,
        stream: false,
        ..Opts::default()
    };
    cancellation_reaches_the_handler(opts, "exe-cancel-heartbeat").await
}

/// Two live processes with one executor id: A runs, B connects with the
/// same id (another `Executor`, so another instance id). A notices on its
/// next heartbeat (100 ms advised) and `wait()` returns an error with
/// `is_superseded()`; A does not reconnect (which would supersede B), and B
/// serves the next runs, also after A shut down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_supersedes_and_the_old_one_stops() -> Result<()> {
    let opts = Opts {
        heartbeat_interval_ms: 100,
        lease_ttl_ms: 3_000,
        ..Opts::default()
    };
    let env = Env::start(opts, &[WRITE]).await?;
    let probe_a = Probe::new();
    let probe_b = Probe::new();
    let exec_a = env
        .builder("exe-shared")
        .tool(WriteTool {
            probe: probe_a.clone(),
            mode: Mode::Append,
        })
        .build()?;
    let exec_b = env
        .builder("exe-shared")
        .store_url(env.other_store_url("b.db"))
        .tool(WriteTool {
            probe: probe_b.clone(),
            mode: Mode::Append,
        })
        .build()?;
    assert_ne!(exec_a.instance_id(), exec_b.instance_id());
    let agv = env.publish_for(&exec_a).await?;

    let a = exec_a.start().await?;
    let first = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 1, "memo": "a"}))],
        )
        .await?;
    env.wait_settled(&first, Duration::from_secs(8)).await?;
    assert_eq!(probe_a.calls(), 1, "A served while alone");

    let b = exec_b.start().await?;
    let stopped = bounded(Duration::from_secs(3), "A noticing the supersede", a.wait()).await;
    let err = stopped.expect_err("A must stop with an error");
    assert!(err.is_superseded(), "A stopped with {err:?}");

    // B keeps the id: A must not have taken it back.
    for i in 0..3 {
        let run = env
            .run(
                &agv,
                "user_42",
                &[(WRITE, json!({"amount": 10 + i, "memo": "b"}))],
            )
            .await?;
        let run = env.wait_settled(&run, Duration::from_secs(5)).await?;
        assert_eq!(state(&call_of(&run, WRITE)), "completed", "{run:#}");
    }
    // A leaves; its disconnect must not touch B's connection.
    let a_left = bounded(Duration::from_secs(10), "A shutdown", a.shutdown(DRAIN)).await;
    eprintln!("A's shutdown after being superseded: {a_left:?}");
    let last = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 20, "memo": "b"}))],
        )
        .await?;
    let last = env.wait_settled(&last, Duration::from_secs(5)).await?;
    assert_eq!(state(&call_of(&last, WRITE)), "completed", "{last:#}");
    assert_eq!(probe_a.calls(), 1, "A took nothing after B connected");
    assert_eq!(probe_b.calls(), 4, "B served every later call");
    let diag = env.diagnostics().await?;
    assert_eq!(diag["executors"][0]["status"], "online", "{diag:#}");
    bounded(Duration::from_secs(10), "B drain", b.shutdown(DRAIN)).await?;
    env.shutdown().await;
    Ok(())
}

/// `Shutdown::Drain` waits for an in-flight call: when it returns, the
/// handler has finished and the platform already shows the call
/// `completed`; the drained executor then shows `offline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_waits_for_the_call_in_flight() -> Result<()> {
    let env = Env::start(Opts::default(), &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder("exe-drain")
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::Slow(Duration::from_millis(1_500)),
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 5, "memo": "slow"}))],
        )
        .await?;
    let running = exec.start().await?;
    assert!(
        eventually(Duration::from_secs(5), || writes.calls() == 1).await,
        "the handler never started"
    );
    assert!(writes.effects().is_empty(), "still in flight");
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    assert_eq!(writes.effects().len(), 1, "drain let the handler finish");
    let run = env.get_run(&run_id).await?;
    let call = call_of(&run, WRITE);
    assert_eq!(state(&call), "completed", "{call:#}");
    assert_eq!(
        kinds(&call),
        pairs(&[("accepted", 0), ("completed", 1)]),
        "{call:#}"
    );
    let diag = env.diagnostics().await?;
    assert_eq!(diag["executors"][0]["status"], "offline", "{diag:#}");
    let local = env
        .open_store()
        .await?
        .call(&run_id, call["call_id"].as_str().unwrap())
        .await?
        .expect("known locally");
    assert_eq!(local.state, LocalState::Delivered, "{local:?}");
    env.shutdown().await;
    Ok(())
}

/// `Shutdown::Detach` stops the handler where it is, as a lost process
/// would (its future is dropped; it sends nothing, not even a business
/// `cancelled`): the call stays `running` and bound to the executor
/// (diagnostics: `detached`, one running call), the store says `running`.
/// The next start with the same store does not run the write again: the
/// unknown outcome goes to `reconciliation_required`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_leaves_a_running_call_bound() -> Result<()> {
    let env = Env::start(Opts::default(), &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder("exe-detach")
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::IgnoreCancel(Duration::from_secs(30)),
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 5, "memo": "stuck"}))],
        )
        .await?;
    let running = exec.start().await?;
    assert!(
        eventually(Duration::from_secs(5), || writes.calls() == 1).await,
        "the handler never started"
    );
    bounded(
        Duration::from_secs(9),
        "detach",
        running.shutdown(Shutdown::Detach),
    )
    .await?;
    // Dropped where it waited: it never saw a cancel, never went on.
    assert_eq!(writes.notes(), Vec::<String>::new());
    assert!(writes.effects().is_empty());

    let run = env.get_run(&run_id).await?;
    let call = call_of(&run, WRITE);
    assert_eq!(state(&call), "running", "{call:#}");
    assert_eq!(call["executor_id"], "exe-detach", "{call:#}");
    let diag = env.diagnostics().await?;
    assert_eq!(diag["executors"][0]["status"], "detached", "{diag:#}");
    assert_eq!(diag["calls"]["running"], 1, "{diag:#}");
    let call_id = call["call_id"].as_str().unwrap().to_owned();
    let local = env
        .open_store()
        .await?
        .call(&run_id, &call_id)
        .await?
        .expect("known locally");
    assert_eq!(local.state, LocalState::Running, "{local:?}");

    // The next start resumes from the store and never re-runs the write.
    let again = Probe::new();
    let exec = env
        .builder("exe-detach")
        .tool(WriteTool {
            probe: again.clone(),
            mode: Mode::Append,
        })
        .build()?;
    let running = exec.start().await?;
    let run = env
        .wait_run(
            &run_id,
            Duration::from_secs(5),
            "reconciliation_required",
            |run| state(&calls(run)[0]) == "reconciliation_required",
        )
        .await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    assert_eq!(again.calls(), 0, "the write was not run again");
    assert_eq!(
        kinds(&call_of(&run, WRITE)),
        pairs(&[("accepted", 0)]),
        "{run:#}"
    );
    env.shutdown().await;
    Ok(())
}
