//! Calls that must not simply complete: a lost lease at the commit point,
//! bad arguments, an output that breaks its schema, a panicking handler, a
//! refusal by the product's authorizer.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{LocalState, Store};

use crate::fixture::*;
use crate::tools::*;

/// Control for the lease test: with a live lease, `commit_point()` says yes
/// and the irreversible step runs (so the lease test below can tell).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_point_passes_while_the_lease_is_live() -> Result<()> {
    let env = Env::start(Opts::default(), &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder("exe-commit-ok")
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::LateCommit(Duration::from_millis(100)),
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 5, "memo": "ok"}))],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;
    assert_eq!(writes.notes(), vec!["commit_point: Ok(())".to_owned()]);
    assert_eq!(writes.effects().len(), 1);
    assert_eq!(state(&call_of(&run, WRITE)), "completed", "{run:#}");
    env.shutdown().await;
    Ok(())
}

/// The executor cannot confirm its lease right before the irreversible
/// step: while the handler sleeps, the platform starts refusing every
/// executor request (fault injection, error_rate 1.0), so the lease check
/// of `commit_point()` fails and it answers `Err(LeaseLost)`; the
/// irreversible step never runs. (The SDK heartbeats at most every third of
/// the lease, so a lease does not lapse by itself while the platform is
/// reachable.) With `retry_attempts(1)` the SDK turns the refusal ("nothing
/// happened") into `failed` / `retries_exhausted` once the platform answers
/// again: never `completed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_point_refuses_when_the_lease_cannot_be_confirmed() -> Result<()> {
    let opts = Opts {
        lease_ttl_ms: 3_000,
        heartbeat_interval_ms: 1_000,
        ..Opts::default()
    };
    let env = Env::start(opts, &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder("exe-lease")
        .capacity(1)
        .retry_attempts(1)
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::LateCommit(Duration::from_millis(900)),
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 5, "memo": "late"}))],
        )
        .await?;
    let running = exec.start().await?;
    assert!(
        eventually(Duration::from_secs(5), || writes.calls() == 1).await,
        "the handler never started"
    );
    env.faults(1.0).await?;
    assert!(
        eventually(Duration::from_secs(10), || !writes.notes().is_empty()).await,
        "the handler never reached its commit point"
    );
    env.faults(0.0).await?;
    let notes = writes.notes();
    assert!(
        is_lease_lost_note(&notes[0]),
        "commit_point without a confirmable lease answered {notes:?}"
    );
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    assert_eq!(writes.effects(), Vec::<serde_json::Value>::new());
    assert_eq!(writes.calls(), 1, "the handler is not re-run: {notes:?}");
    let call = call_of(&run, WRITE);
    assert_ne!(state(&call), "completed", "{call:#}");
    assert!(
        !kinds(&call).iter().any(|(k, _)| k == "completed"),
        "{call:#}"
    );
    assert_eq!(state(&call), "failed", "{call:#}");
    assert_eq!(
        receipt_body(&call, "failed")["error"]["code"],
        "retries_exhausted",
        "{call:#}"
    );
    env.shutdown().await;
    Ok(())
}

/// Runs created with `unchecked: true` and arguments that break the input
/// schema (below the minimum, wrong type, unknown field, missing field):
/// each call is settled `failed` with a sequence-0 receipt whose code is
/// `invalid_arguments`, and the handler never runs. A valid call in the same
/// run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_arguments_fail_before_the_handler() -> Result<()> {
    let env = Env::start(Opts::default(), &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder("exe-badargs")
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::Append,
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let bad = [
        json!({"amount": 0, "memo": "below minimum"}),
        json!({"amount": "ten", "memo": "wrong type"}),
        json!({"amount": 3, "memo": "extra", "admin": true}),
        json!({"memo": "no amount"}),
    ];
    let mut new_calls: Vec<serde_json::Value> = bad
        .iter()
        .map(|a| json!({"tool_name": WRITE, "arguments": a, "unchecked": true}))
        .collect();
    new_calls.push(json!({"tool_name": WRITE, "arguments": {"amount": 4, "memo": "good"}}));
    let run_id = env.run_with(&agv, "user_42", new_calls).await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    let store = env.open_store().await?;
    for c in calls(&run) {
        if c["arguments"]["memo"] == "good" {
            assert_eq!(state(&c), "completed", "{c:#}");
            continue;
        }
        assert_eq!(state(&c), "failed", "{c:#}");
        assert_eq!(kinds(&c), pairs(&[("failed", 0)]), "{c:#}");
        let error = &receipt_body(&c, "failed")["error"];
        assert_eq!(error["code"], "invalid_arguments", "{c:#}");
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{c:#}"
        );
        let local = store
            .call(&run_id, c["call_id"].as_str().unwrap())
            .await?
            .expect("known locally");
        assert_eq!(local.state, LocalState::Delivered, "{local:?}");
    }
    assert_eq!(writes.calls(), 1, "only the valid call reached the handler");
    assert_eq!(writes.effects()[0]["memo"], "good");
    env.shutdown().await;
    Ok(())
}

/// A handler whose result breaks the tool's own output schema: the outcome
/// is unknown, so the platform shows `reconciliation_required` (reported by
/// the executor) with no `completed` receipt, and the local store says
/// `reconciliation_required` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_violating_its_schema_needs_reconciliation() -> Result<()> {
    let env = Env::start(Opts::default(), &[BAD_OUTPUT]).await?;
    let probe = Probe::new();
    let exec = env
        .builder("exe-badout")
        .tool(BadOutputTool {
            probe: probe.clone(),
        })
        .build()?;
    assert_eq!(
        exec.tool_definitions()[0]
            .output_schema
            .as_ref()
            .expect("an output schema")["required"],
        json!(["entry"]),
        "the published output schema is the type's"
    );
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[(BAD_OUTPUT, json!({"amount": 5, "memo": "x"}))],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    let call = call_of(&run, BAD_OUTPUT);
    assert_eq!(state(&call), "reconciliation_required", "{call:#}");
    assert_eq!(kinds(&call), pairs(&[("accepted", 0)]), "{call:#}");
    assert!(call["context_projection"].is_null(), "{call:#}");
    assert_eq!(probe.calls(), 1);
    let store = env.open_store().await?;
    let call_id = call["call_id"].as_str().unwrap();
    let local = store.call(&run_id, call_id).await?.expect("known locally");
    assert_eq!(local.state, LocalState::ReconciliationRequired, "{local:?}");
    assert!(
        local
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("output_schema")),
        "{local:?}"
    );
    // Checked before it was saved: no `completed` receipt was ever made.
    let outbox = store.receipts(&run_id, call_id).await?;
    assert!(
        outbox.iter().all(|r| r.kind != ReceiptKind::Completed),
        "{outbox:?}"
    );
    env.shutdown().await;
    Ok(())
}

/// A panicking handler: that call goes to `reconciliation_required` (never
/// re-run), and the executor keeps serving: another call of the same run
/// and a call of a later run complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panicking_handler_needs_reconciliation_and_executor_keeps_serving() -> Result<()> {
    let env = Env::start(Opts::default(), &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder("exe-panic")
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::Append,
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[
                (WRITE, json!({"amount": 1, "memo": "panic"})),
                (WRITE, json!({"amount": 2, "memo": "fine"})),
            ],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    let later = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 3, "memo": "after"}))],
        )
        .await?;
    let later = env.wait_settled(&later, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    let mut panicked = None;
    for c in calls(&run) {
        if c["arguments"]["memo"] == "panic" {
            assert_eq!(state(&c), "reconciliation_required", "{c:#}");
            assert_eq!(kinds(&c), pairs(&[("accepted", 0)]), "{c:#}");
            panicked = Some(c);
        } else {
            assert_eq!(state(&c), "completed", "{c:#}");
        }
    }
    assert_eq!(state(&call_of(&later, WRITE)), "completed", "{later:#}");
    assert_eq!(writes.calls(), 3, "each handler ran once, the panic too");
    assert_eq!(writes.effects().len(), 2);
    let panicked = panicked.expect("the panicking call");
    let local = env
        .open_store()
        .await?
        .call(&run_id, panicked["call_id"].as_str().unwrap())
        .await?
        .expect("known locally");
    assert_eq!(local.state, LocalState::ReconciliationRequired, "{local:?}");
    env.shutdown().await;
    Ok(())
}

/// The product's authorizer refuses one subject: that call is `failed`
/// with a sequence-0 `forbidden` receipt carrying the authorizer's message,
/// the handler never runs; another subject's call completes. The
/// authorizer was asked with the assignment's facts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorizer_refusal_fails_forbidden_without_running() -> Result<()> {
    let env = Env::start(Opts::default(), &[WRITE]).await?;
    let writes = Probe::new();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let exec = env
        .builder("exe-authz")
        .authorizer(SubjectAuthorizer {
            denied_subject: "mallory".into(),
            asked: asked.clone(),
        })
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::Append,
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let denied = env
        .run(
            &agv,
            "mallory",
            &[(WRITE, json!({"amount": 100, "memo": "steal"}))],
        )
        .await?;
    let allowed = env
        .run(
            &agv,
            "alice",
            &[(WRITE, json!({"amount": 5, "memo": "lunch"}))],
        )
        .await?;
    let running = exec.start().await?;
    let denied_run = env.wait_settled(&denied, Duration::from_secs(8)).await?;
    let allowed_run = env.wait_settled(&allowed, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    let call = call_of(&denied_run, WRITE);
    assert_eq!(state(&call), "failed", "{call:#}");
    assert_eq!(kinds(&call), pairs(&[("failed", 0)]), "{call:#}");
    let error = &receipt_body(&call, "failed")["error"];
    assert_eq!(error["code"], "forbidden");
    assert_eq!(error["message"], "this user may not append to the ledger");
    assert_eq!(
        state(&call_of(&allowed_run, WRITE)),
        "completed",
        "{allowed_run:#}"
    );
    assert_eq!(writes.calls(), 1, "only alice's call ran");
    assert_eq!(writes.seen()[0].subject, "alice");

    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 2, "asked once per call: {asked:?}");
    let req = asked
        .iter()
        .find(|r| r.subject == "mallory")
        .expect("asked about mallory");
    assert_eq!(req.run_id, denied);
    assert_eq!(req.call_id, call["call_id"].as_str().unwrap());
    assert_eq!(req.tool_name, WRITE);
    assert_eq!(req.agent_id, env.agent_id);
    assert_eq!(req.agent_version, agv);
    assert_eq!(req.arguments, json!({"amount": 100, "memo": "steal"}));
    assert!(req.arguments_digest.starts_with("sha256:"), "{req:?}");
    env.shutdown().await;
    Ok(())
}
