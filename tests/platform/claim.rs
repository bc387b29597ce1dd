//! §5 Claim: the answer, one live claim, replay, released assignments, and
//! every step of the precedence list checked against the next ones.

use serde_json::json;

use crate::common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_answers_assignment_with_arguments_digest_grant_and_context() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let c = fx.connect("exe_payments_01").await;
    let r = fx.claim(&c, &run_id, &call_id, "op_01HF_abc").await;
    let v = r.ok();
    assert_eq!(v["replayed"], false);
    assert_eq!(v["call_state"], "claimed");
    let a = &v["assignment"];
    assert_id(&a["assignment_id"], "asg_");
    assert_eq!(a["run_id"], run_id.as_str());
    assert_eq!(a["call_id"], call_id.as_str());
    assert_eq!(a["tool_name"], CHARGE);
    assert_eq!(a["arguments"], charge_args());
    assert_eq!(a["arguments_digest"], CHARGE_ARGS_DIGEST);
    assert_id(&a["grant"], "grt_");
    assert_eq!(a["subject"], "user_42");
    assert_eq!(a["agent_id"], fx.agent_id.as_str());
    assert_eq!(a["agent_version"], fx.agent_version.as_str());
    assert_eq!(a["binding_id"], fx.binding_id.as_str());
    assert_eq!(a["max_result_context_bytes"], 16384);
    let tool = charge_tool(&fx.binding_id);
    assert_eq!(a["input_schema"], tool["input_schema"]);
    assert_eq!(a["output_schema"], tool["output_schema"]);
    let run = fx.get_run(&run_id).await;
    let call = call_in(&run, &call_id);
    assert_eq!(call["state"], "claimed");
    assert_eq!(call["executor_id"], "exe_payments_01");
    assert_eq!(call["assignment_id"], a["assignment_id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_arguments_digest_is_sha256_of_canonical_json() {
    let fx = Fixture::new().await;
    // keys out of order, non-ASCII and a character outside the BMP as a value
    let raw = r#"{"agent_version":"AGV","subject":"u","tool_calls":[{"tool_name":"notes.write","arguments":{"note":"é€😀","a":[1,2,{"z":null,"b":true}]}}]}"#
        .replace("AGV", &fx.agent_version);
    let r = fx.srv.send(Req::post("/runs").token(ADMIN).raw(raw)).await;
    let run_id = r.ok()["run_id"].as_str().unwrap().to_string();
    let run = fx.get_run(&run_id).await;
    let call_id = run["tool_calls"][0]["call_id"]
        .as_str()
        .unwrap()
        .to_string();
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    assert_eq!(
        a.answer["assignment"]["arguments_digest"],
        "sha256:62bd1509709a32c5991488f82f2f2bcd4ef7248c2724ae680db1195ff421ccad"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_one_live_claim_per_call_other_executor_gets_already_claimed() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    let asg = fx.claim_ok(&a, &run_id, &call_id).await;
    fx.claim(&b, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "already_claimed");
    // same executor, another key: also another claim
    fx.claim(&a, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "already_claimed");
    // running: still live
    fx.receipt(&asg, accepted(&asg)).await.ok();
    fx.claim(&b, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "already_claimed");
    // another executor reusing the same key is not a replay
    fx.claim(&b, &run_id, &call_id, &asg.operation_key)
        .await
        .err(409, "already_claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_same_key_replays_the_assignment_with_call_state() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    let r = fx.claim(&c, &run_id, &call_id, &a.operation_key).await;
    let v = r.ok();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "claimed");
    assert_eq!(
        v["assignment"], a.answer["assignment"],
        "the same assignment, grant included"
    );
    fx.receipt(&a, accepted(&a)).await.ok();
    let v = fx
        .claim(&c, &run_id, &call_id, &a.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "running");
    assert_eq!(v["assignment"]["grant"], a.grant.as_str());
    // also after a reconnect (the key, not the connection, identifies it)
    let c2 = fx.connect("exe_a").await;
    let v = fx
        .claim(&c2, &run_id, &call_id, &a.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["assignment"]["assignment_id"], a.assignment_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_replay_also_when_the_assignment_is_closed() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    let done = fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.complete(&done, json!({})).await.ok();
    let v = fx
        .claim(&c, &run.run_id, &run.calls[0], &done.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "completed");
    assert_eq!(
        v["assignment"]["assignment_id"],
        done.assignment_id.as_str()
    );
    let f = fx.claim_ok(&c, &run.run_id, &run.calls[1]).await;
    fx.receipt(&f, failed(&f, 0, "forbidden")).await.ok();
    let v = fx
        .claim(&c, &run.run_id, &run.calls[1], &f.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_released_assignment_is_never_returned_same_key_makes_a_new_claim() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "released").await,
        "updated"
    );
    let r = fx.claim(&c, &run_id, &call_id, &a.operation_key).await;
    let v = r.ok();
    assert_eq!(v["replayed"], false);
    assert_eq!(v["call_state"], "claimed");
    assert_ne!(v["assignment"]["assignment_id"], a.assignment_id.as_str());
    assert_ne!(v["assignment"]["grant"], a.grant.as_str());
    let b = asg_from(&r, "exe_a", &a.operation_key);
    fx.receipt(&a, accepted(&a)).await.err(403, "invalid_grant");
    assert_eq!(fx.receipt(&b, accepted(&b)).await.ok()["accepted"], true);
    // and that new claim is now what the key replays
    let v = fx
        .claim(&c, &run_id, &call_id, &a.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["assignment"]["assignment_id"], b.assignment_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_after_lease_expiry_release_same_key_makes_a_new_claim() {
    let fx = Fixture::with(Opts::lease(400)).await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    sleep_ms(700).await;
    let c2 = fx.connect("exe_a").await;
    assert_eq!(
        c2.answer["outstanding"],
        json!([]),
        "the released claim is not outstanding"
    );
    let v = fx
        .claim(&c2, &run_id, &call_id, &a.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], false);
    assert_ne!(v["assignment"]["assignment_id"], a.assignment_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_operation_key_reused_for_another_call_is_400() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let r = fx
        .claim(&c, &run.run_id, &run.calls[1], &a.operation_key)
        .await;
    r.bad("operation_key_reused");
    r.param_is("operation_key");
    assert_eq!(fx.state(&run.run_id, &run.calls[1]).await, "pending");
    let long = "k".repeat(129);
    for bad in ["", "has space", long.as_str()] {
        fx.claim(&c, &run.run_id, &run.calls[1], bad).await.is(400);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_call_of_another_binding_is_403_tool_not_connected() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(SIDE, json!({})).await;
    let c = fx.connect("exe_a").await;
    fx.claim(&c, &run_id, &call_id, &uid("op"))
        .await
        .err(403, "tool_not_connected");
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let narrow = fx.connect_with("exe_n", &[READ], 2).await;
    fx.claim(&narrow, &run_id, &call_id, &uid("op"))
        .await
        .err(403, "tool_not_connected");
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_running_call_is_never_handed_to_another_executor() {
    let fx = Fixture::with(Opts::lease(400)).await;
    let (run_id, call_id) = fx.read_call().await;
    let a = fx.connect("exe_a").await;
    fx.running(&a, &run_id, &call_id).await;
    sleep_ms(700).await; // exe_a's lease is gone; the call stays bound
    let b = fx.connect("exe_b").await;
    fx.claim(&b, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "already_claimed");
    let run = fx.get_run(&run_id).await;
    assert_eq!(call_in(&run, &call_id)["executor_id"], "exe_a");
    assert_eq!(call_in(&run, &call_id)["state"], "running");
}

// ---------------------------------------------------------------- precedence

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_unknown_run_404_first() {
    let fx = Fixture::new().await;
    // unknown run + unknown call + unknown connection
    let r = fx
        .claim_as("exe_x", "con_never", "run_missing", "call_missing", "k1")
        .await;
    r.is(404);
    // unknown run with a call id that exists elsewhere
    let (_, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.claim(&c, "run_missing", &call_id, "k2").await.is(404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_unknown_call_beats_connection_superseded() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({}))]).await;
    let other = fx.run(&[(READ, json!({}))]).await;
    let old = fx.connect("exe_a").await;
    let _new = fx.connect("exe_a").await;
    fx.claim(&old, &run.run_id, "call_missing", "k1")
        .await
        .bad("unknown_call");
    // a call of another run is unknown in this run
    fx.claim(&old, &run.run_id, &other.calls[0], "k2")
        .await
        .bad("unknown_call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_unknown_call_beats_lease_expired() {
    let fx = Fixture::new().await;
    let (run_id, _) = fx.read_call().await;
    fx.claim_as("exe_x", "con_never", &run_id, "call_missing", "k1")
        .await
        .bad("unknown_call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_connection_superseded_beats_lease_expired() {
    let fx = Fixture::with(Opts::lease(300)).await;
    let (run_id, call_id) = fx.read_call().await;
    let old = fx.connect("exe_a").await;
    let _new = fx.connect("exe_a").await;
    sleep_ms(600).await; // both leases have run out
    fx.claim(&old, &run_id, &call_id, "k1")
        .await
        .err(409, "connection_superseded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_connection_superseded_beats_tool_not_connected() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(SIDE, json!({})).await;
    let old = fx.connect("exe_a").await;
    let _new = fx.connect("exe_a").await;
    fx.claim(&old, &run_id, &call_id, "k1")
        .await
        .err(409, "connection_superseded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_lease_expired_beats_tool_not_connected() {
    let fx = Fixture::with(Opts::lease(300)).await;
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let c = fx.connect_with("exe_a", &[READ], 2).await;
    sleep_ms(600).await;
    fx.claim(&c, &run_id, &call_id, "k1")
        .await
        .err(409, "lease_expired");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_tool_not_connected_beats_replay() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let wide = fx.connect_with("exe_a", &[READ, CHARGE], 2).await;
    let a = fx.claim_ok(&wide, &run_id, &call_id).await;
    let narrow = fx.connect_with("exe_a", &[READ], 2).await;
    fx.claim(&narrow, &run_id, &call_id, &a.operation_key)
        .await
        .err(403, "tool_not_connected");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_replay_beats_run_terminated() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    fx.cancel(&run_id).await.ok();
    let v = fx
        .claim(&c, &run_id, &call_id, &a.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "terminated");
    assert_eq!(v["assignment"]["assignment_id"], a.assignment_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_replay_beats_executor_draining() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    fx.disconnect(&c, "drain").await.ok();
    let v = fx
        .claim(&c, &run_id, &call_id, &a.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_replay_beats_capacity_exhausted() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect_with("exe_a", &[READ], 1).await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    let v = fx
        .claim(&c, &run_id, &call_id, &a.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_run_terminated_beats_executor_draining() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.disconnect(&c, "drain").await.ok();
    fx.cancel(&run_id).await.ok();
    fx.claim(&c, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "run_terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_run_terminated_beats_call_not_claimable() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    fx.running(&a, &run.run_id, &run.calls[0]).await;
    let done = fx.running(&a, &run.run_id, &run.calls[1]).await;
    fx.complete(&done, json!({})).await.ok();
    // call 0 is still bound to exe_a when the run ends
    fx.cancel(&run.run_id).await.ok();
    fx.claim(&b, &run.run_id, &run.calls[0], &uid("op"))
        .await
        .err(409, "run_terminated");
    fx.claim(&b, &run.run_id, &run.calls[1], &uid("op"))
        .await
        .err(409, "run_terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_run_terminated_for_a_completed_run() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    fx.complete(&a, json!({})).await.ok();
    assert_eq!(fx.get_run(&run_id).await["status"], "completed");
    let b = fx.connect("exe_b").await;
    fx.claim(&b, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "run_terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_executor_draining_beats_already_claimed() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    fx.claim_ok(&b, &run_id, &call_id).await;
    fx.disconnect(&a, "drain").await.ok();
    fx.claim(&a, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "executor_draining");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_executor_draining_beats_call_not_claimable_and_capacity() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let a = fx.connect_with("exe_a", &[READ], 1).await;
    let b = fx.connect("exe_b").await;
    let done = fx.running(&b, &run.run_id, &run.calls[0]).await;
    fx.complete(&done, json!({})).await.ok();
    fx.running(&a, &run.run_id, &run.calls[1]).await; // a is at capacity
    fx.disconnect(&a, "drain").await.ok();
    fx.claim(&a, &run.run_id, &run.calls[0], &uid("op"))
        .await
        .err(409, "executor_draining");
    fx.claim(&a, &run.run_id, &run.calls[2], &uid("op"))
        .await
        .err(409, "executor_draining");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_already_claimed_beats_call_not_claimable() {
    // a claimed (or running) call is "no longer pending" too; the live
    // claim is what is reported
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    fx.claim_ok(&a, &run.run_id, &run.calls[0]).await;
    fx.running(&a, &run.run_id, &run.calls[1]).await;
    fx.claim(&b, &run.run_id, &run.calls[0], &uid("op"))
        .await
        .err(409, "already_claimed");
    fx.claim(&b, &run.run_id, &run.calls[1], &uid("op"))
        .await
        .err(409, "already_claimed");
    fx.report1(&a, &run.run_id, &run.calls[1], "reconciliation_required")
        .await;
    fx.claim(&b, &run.run_id, &run.calls[1], &uid("op"))
        .await
        .err(409, "already_claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_already_claimed_beats_capacity_exhausted() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let a = fx.connect_with("exe_a", &[READ], 1).await;
    let b = fx.connect("exe_b").await;
    fx.claim_ok(&a, &run.run_id, &run.calls[0]).await; // a is full
    fx.claim_ok(&b, &run.run_id, &run.calls[1]).await;
    fx.claim(&a, &run.run_id, &run.calls[1], &uid("op"))
        .await
        .err(409, "already_claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_precedence_call_not_claimable_beats_capacity_exhausted() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let a = fx.connect_with("exe_a", &[READ], 1).await;
    let b = fx.connect("exe_b").await;
    let done = fx.running(&b, &run.run_id, &run.calls[0]).await;
    fx.complete(&done, json!({})).await.ok();
    fx.claim_ok(&a, &run.run_id, &run.calls[1]).await; // a is full
    fx.claim(&a, &run.run_id, &run.calls[0], &uid("op"))
        .await
        .err(409, "call_not_claimable");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_call_not_claimable_for_every_terminal_state() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[
            (READ, json!({})),
            (READ, json!({})),
            (READ, json!({})),
            (READ, json!({})),
        ])
        .await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    let x = fx.running(&a, &run.run_id, &run.calls[0]).await;
    fx.complete(&x, json!({})).await.ok();
    let y = fx.running(&a, &run.run_id, &run.calls[1]).await;
    fx.receipt(&y, failed(&y, 1, "declined")).await.ok();
    let z = fx.running(&a, &run.run_id, &run.calls[2]).await;
    fx.receipt(&z, cancelled(&z, 1)).await.ok();
    for (i, state) in ["completed", "failed", "cancelled"].iter().enumerate() {
        assert_eq!(fx.state(&run.run_id, &run.calls[i]).await, *state);
        fx.claim(&b, &run.run_id, &run.calls[i], &uid("op"))
            .await
            .err(409, "call_not_claimable");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_capacity_exhausted_is_the_last_rule() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let a = fx.connect_with("exe_a", &[READ], 1).await;
    fx.claim_ok(&a, &run.run_id, &run.calls[0]).await;
    fx.claim(&a, &run.run_id, &run.calls[1], &uid("op"))
        .await
        .err(409, "capacity_exhausted");
}
