//! Calls that go well: receipts on the platform, handlers run once, the
//! local store agrees; progress receipts; polling without a stream.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Result;
use serde_json::{Value, json};
use toolrunner::testing::store::{LocalState, ReceiptStatus, Store};

use crate::fixture::*;
use crate::tools::*;

/// A run with a read and a write call: both `completed`, each handler ran
/// exactly once with the right context, the platform stored `accepted`
/// (sequence 0) then `completed` (sequence 1) with the handlers' results,
/// and the local store shows both calls and all four receipts `delivered`,
/// with the same receipt ids and bodies the platform stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn happy_path_read_and_write_complete_exactly_once() -> Result<()> {
    let env = Env::start(Opts::default(), &[READ, WRITE]).await?;
    let reads = Probe::new();
    let writes = Probe::new();
    let exec = env
        .builder("exe-happy")
        .tool(ReadTool {
            probe: reads.clone(),
        })
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
                (READ, json!({"cursor": "p1"})),
                (WRITE, json!({"amount": 1200, "memo": "coffee"})),
            ],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    assert_eq!(run["status"], "completed", "{run:#}");
    let read = call_of(&run, READ);
    let write = call_of(&run, WRITE);
    for c in [&read, &write] {
        assert_eq!(state(c), "completed", "{c:#}");
        assert_eq!(
            kinds(c),
            pairs(&[("accepted", 0), ("completed", 1)]),
            "{c:#}"
        );
        assert_eq!(c["executor_id"], "exe-happy");
    }
    assert_eq!(reads.calls(), 1, "the read handler ran exactly once");
    assert_eq!(writes.calls(), 1, "the write handler ran exactly once");
    assert_eq!(writes.effects().len(), 1, "exactly one side effect");

    assert_eq!(
        receipt_body(&read, "completed")["result"],
        page_for(Some("p1"))
    );
    assert_eq!(read["context_projection"]["result"], page_for(Some("p1")));
    assert_eq!(
        receipt_body(&write, "completed")["result"],
        json!({"entry": 1, "amount": 1200})
    );

    // What the handler saw is what the platform holds.
    let seen = writes.seen().remove(0);
    assert_eq!(seen.run_id, run_id);
    assert_eq!(seen.call_id, write["call_id"].as_str().unwrap());
    assert_eq!(seen.subject, "user_42");
    assert_eq!(seen.agent_id, env.agent_id);
    assert_eq!(seen.agent_version, agv);
    assert_eq!(seen.tool_name, WRITE);
    assert_eq!(
        writes.effects()[0]["operation_key"],
        seen.operation_key,
        "the effect used the call's operation key"
    );

    // The local store, opened as another process would after shutdown.
    let store = env.open_store().await?;
    for (c, probe) in [(&read, &reads), (&write, &writes)] {
        let call_id = c["call_id"].as_str().unwrap();
        let local = store
            .call(&run_id, call_id)
            .await?
            .expect("the store knows the call");
        assert_eq!(local.state, LocalState::Delivered, "{local:?}");
        assert_eq!(local.operation_key, probe.seen()[0].operation_key);
        let stored = store.receipts(&run_id, call_id).await?;
        let platform: Vec<Value> = c["receipts"].as_array().unwrap().clone();
        assert_eq!(stored.len(), platform.len(), "{stored:?}");
        for (mine, theirs) in stored.iter().zip(&platform) {
            assert_eq!(mine.status, ReceiptStatus::Delivered, "{mine:?}");
            assert_eq!(mine.receipt_id, theirs["receipt_id"].as_str().unwrap());
            let body: Value = serde_json::from_str(&mine.body)?;
            assert_eq!(body, theirs["body"], "the stored body is the sent body");
        }
    }
    env.shutdown().await;
    Ok(())
}

/// A handler calling `ctx.progress(..)` twice: the platform stores
/// accepted, progress, progress, completed at sequences 0, 1, 2, 3 with the
/// handler's messages, fractions and data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_receipts_arrive_in_sequence() -> Result<()> {
    let env = Env::start(Opts::default(), &[WRITE]).await?;
    let writes = Probe::new();
    let exec = env
        .builder("exe-progress")
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::Progress,
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let run_id = env
        .run(
            &agv,
            "user_42",
            &[(WRITE, json!({"amount": 7, "memo": "long"}))],
        )
        .await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&run_id, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    let call = call_of(&run, WRITE);
    assert_eq!(state(&call), "completed", "{call:#}");
    assert_eq!(
        kinds(&call),
        pairs(&[
            ("accepted", 0),
            ("progress", 1),
            ("progress", 2),
            ("completed", 3)
        ]),
        "{call:#}"
    );
    let progress: Vec<Value> = call["receipts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["kind"] == "progress")
        .map(|r| r["body"]["progress"].clone())
        .collect();
    assert_eq!(
        progress,
        vec![
            json!({"message": "validated", "fraction": 0.25, "data": {"step": 1}}),
            json!({"message": "half way", "fraction": 0.5, "data": {"step": 2}}),
        ]
    );
    assert_eq!(writes.calls(), 1);
    assert_eq!(writes.effects().len(), 1);

    let store = env.open_store().await?;
    let call_id = call["call_id"].as_str().unwrap();
    let stored = store.receipts(&run_id, call_id).await?;
    let seqs: Vec<u64> = stored.iter().map(|r| r.sequence).collect();
    assert_eq!(seqs, vec![0, 1, 2, 3], "{stored:?}");
    assert!(
        stored.iter().all(|r| r.status == ReceiptStatus::Delivered),
        "{stored:?}"
    );
    env.shutdown().await;
    Ok(())
}

/// A platform without a stream (`without_stream()`): polling alone gets
/// every call of a run done, and also a run created later, each handler
/// running exactly once per call (capacity 2, so several polls are needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_alone_gets_every_call_done() -> Result<()> {
    let opts = Opts {
        stream: false,
        ..Opts::default()
    };
    let env = Env::start(opts, &[READ, WRITE]).await?;
    let reads = Probe::new();
    let writes = Probe::new();
    let exec = env
        .builder("exe-poll")
        .capacity(2)
        .tool(ReadTool {
            probe: reads.clone(),
        })
        .tool(WriteTool {
            probe: writes.clone(),
            mode: Mode::Append,
        })
        .build()?;
    let agv = env.publish_for(&exec).await?;
    let mut calls: Vec<(&str, Value)> = (1..=6)
        .map(|i| (WRITE, json!({"amount": i, "memo": format!("w{i}")})))
        .collect();
    calls.push((READ, json!({"cursor": "a"})));
    calls.push((READ, json!({})));
    let first = env.run(&agv, "user_42", &calls).await?;
    let running = exec.start().await?;
    let run = env.wait_settled(&first, Duration::from_secs(8)).await?;
    assert_eq!(run["status"], "completed", "{run:#}");

    // New work while the executor is idle reaches it without a stream.
    let second = env
        .run(
            &agv,
            "user_43",
            &[(WRITE, json!({"amount": 99, "memo": "later"}))],
        )
        .await?;
    let later = env.wait_settled(&second, Duration::from_secs(8)).await?;
    bounded(Duration::from_secs(10), "drain", running.shutdown(DRAIN)).await?;

    for c in calls_of_runs(&[&run, &later]) {
        assert_eq!(state(&c), "completed", "{c:#}");
        assert_eq!(kinds(&c).len(), 2, "{c:#}");
    }
    assert_eq!(writes.calls(), 7, "each write ran once");
    assert_eq!(reads.calls(), 2, "each read ran once");
    let keys: BTreeSet<String> = writes
        .effects()
        .iter()
        .map(|e| e["operation_key"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(keys.len(), 7, "one distinct operation key per effect");
    let amounts: BTreeSet<u64> = writes
        .effects()
        .iter()
        .map(|e| e["amount"].as_u64().unwrap())
        .collect();
    assert_eq!(amounts, BTreeSet::from([1, 2, 3, 4, 5, 6, 99]));
    env.shutdown().await;
    Ok(())
}

fn calls_of_runs(runs: &[&Value]) -> Vec<Value> {
    runs.iter().flat_map(|r| calls(r)).collect()
}
