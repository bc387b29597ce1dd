//! §7 The development platform: start options (the flags table), admin
//! endpoints, the run object, fault injection.

use std::time::Instant;

use serde_json::{Value, json};
use toolrunner_devserver::Faults;

use crate::common::*;

// ================================================================ flags table

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_port_0_picks_a_free_port() {
    let a = Srv::start().await;
    let b = Srv::start().await;
    for s in [&a, &b] {
        let port: u16 = s
            .base
            .strip_prefix("http://127.0.0.1:")
            .expect("http://127.0.0.1:PORT")
            .parse()
            .unwrap();
        assert_ne!(port, 0);
        assert!(!s.base.ends_with('/'));
    }
    assert_ne!(a.base, b.base);
    a.post(ADMIN, "/agents", json!({"name": "a"})).await.ok();
    b.post(ADMIN, "/agents", json!({"name": "b"})).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_frees_the_port() {
    let mut s = Srv::start().await;
    let base = s.base.clone();
    s.stop().await;
    let r = api(&base)
        .request(toolrunner::platform::Method::GET, "/runs/run_x")
        .send()
        .await;
    assert!(r.is_err(), "server still answers after shutdown: {r:?}");
    let addr = base.strip_prefix("http://").unwrap();
    std::net::TcpListener::bind(addr).expect("the port is free again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_tokens_are_dev_admin_star_and_dev_executor() {
    let srv = Srv::start_with(Opts {
        default_tokens: true,
        ..Opts::default()
    })
    .await;
    let adm = "dev-admin";
    let exe = "dev-executor";
    let agent = srv.post(adm, "/agents", json!({"name": "d"})).await;
    let agent_id = agent.ok()["agent_id"].as_str().unwrap().to_string();
    let b = srv
        .post(
            adm,
            "/executor-bindings",
            json!({"agent_id": agent_id, "name": "b", "tool_names": [READ]}),
        )
        .await;
    let bid = b.ok()["binding_id"].as_str().unwrap().to_string();
    let v = srv
        .post(
            adm,
            &format!("/agents/{agent_id}/versions"),
            json!({"tools": [read_tool(&bid)]}),
        )
        .await;
    let agv = v.ok()["agent_version"].as_str().unwrap().to_string();
    let run = srv
        .post(adm, "/runs", json!({"agent_version": agv, "subject": "u", "tool_calls": [{"tool_name": READ, "arguments": {}}]}))
        .await;
    let run_id = run.ok()["run_id"].as_str().unwrap().to_string();
    let got = srv.get(adm, &format!("/runs/{run_id}")).await;
    let call_id = got.ok()["tool_calls"][0]["call_id"]
        .as_str()
        .unwrap()
        .to_string();
    // dev-executor: executors:connect + tools:execute, nothing else
    let c = srv
        .post(
            exe,
            "/executors/connect",
            json!({"executor_id": "exe_a", "binding_id": bid, "tools": [READ], "capacity": 1}),
        )
        .await;
    let con = c.ok()["connection_id"].as_str().unwrap().to_string();
    let r = srv
        .post(
            exe,
            &format!("/runs/{run_id}/tool-calls/{call_id}/claim"),
            json!({"executor_id": "exe_a", "connection_id": con, "operation_key": "k1"}),
        )
        .await;
    assert_eq!(r.ok()["call_state"], "claimed");
    srv.post(exe, "/agents", json!({"name": "x"}))
        .await
        .err(403, "missing_scope");
    srv.get(exe, &format!("/runs/{run_id}"))
        .await
        .err(403, "missing_scope");
    // dev-admin has `*`, so also the faults endpoint
    srv.put(
        adm,
        "/dev/faults",
        json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 1}),
    )
    .await
    .ok();
    // the tokens this suite normally configures do not exist here
    srv.post(ADMIN, "/agents", json!({"name": "x"}))
        .await
        .is(401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_scopes_are_comma_separated_and_star_means_all() {
    let fx = Fixture::new().await;
    // ALL_LISTED names every scope: it can do everything but the `*` endpoint
    fx.srv
        .post(ALL_LISTED, "/agents", json!({"name": "x"}))
        .await
        .ok();
    let (run_id, _) = fx.read_call().await;
    fx.srv
        .get(ALL_LISTED, &format!("/runs/{run_id}"))
        .await
        .ok();
    fx.srv
        .put(
            ALL_LISTED,
            "/dev/faults",
            json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 1}),
        )
        .await
        .err(403, "missing_scope");
    // single-scope tokens get exactly that scope
    fx.srv
        .get(RUNTIME_READ, &format!("/runs/{run_id}"))
        .await
        .ok();
    fx.srv
        .post(RUNTIME_READ, "/agents", json!({"name": "x"}))
        .await
        .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_ttl_and_heartbeat_interval_default_to_15000_and_5000() {
    // a builder that does not set them
    let server = toolrunner_devserver::DevServer::builder()
        .listen("127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap())
        .token(ADMIN, "*")
        .token(EXEC, "executors:connect,tools:execute")
        .start()
        .await
        .expect("starts with defaults");
    let base = server.base_url();
    let http = api(&base);
    let post = |path: &str, tok: &str, body: Value| {
        let req = http
            .request(toolrunner::platform::Method::POST, path)
            .token(Some(tok))
            .json(&body);
        async move {
            let r = req.send().await.unwrap();
            assert_eq!(r.status, 200);
            r.json()
        }
    };
    let agent = post("/agents", ADMIN, json!({"name": "d"})).await;
    let b = post(
        "/executor-bindings",
        ADMIN,
        json!({"agent_id": agent["agent_id"], "name": "b", "tool_names": [READ]}),
    )
    .await;
    let con = post(
        "/executors/connect",
        EXEC,
        json!({"executor_id": "exe_d", "binding_id": b["binding_id"], "tools": [READ], "capacity": 1}),
    )
    .await;
    assert_eq!(con["lease_ttl_ms"], 15000);
    assert_eq!(con["heartbeat_interval_ms"], 5000);
    server.shutdown().await;
}

// ================================================================ admin endpoints

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_runs_starts_a_run_with_pending_calls() {
    let fx = Fixture::new().await;
    let r = fx.post_run(json!([{"tool_name": CHARGE, "arguments": charge_args()}, {"tool_name": READ, "arguments": {"cursor": "c1"}}])).await;
    let v = r.ok();
    assert_id(&v["run_id"], "run_");
    let run = fx.get_run(v["run_id"].as_str().unwrap()).await;
    assert_eq!(run["status"], "active");
    assert_eq!(run["subject"], "user_42");
    let calls = run["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["tool_name"], CHARGE);
    assert_eq!(calls[0]["arguments"], charge_args());
    assert_eq!(calls[1]["arguments"], json!({"cursor": "c1"}));
    for c in calls {
        assert_eq!(c["state"], "pending");
        assert_eq!(c["receipts"], json!([]));
        assert_eq!(c["late_receipts"], json!([]));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_runs_validates_arguments_against_input_schema() {
    let fx = Fixture::new().await;
    for bad in [
        json!({"amount": "12", "currency": "EUR"}),
        json!({"currency": "EUR"}),
        json!({"amount": 1, "currency": "EUR", "x": 1}),
    ] {
        let r = fx
            .post_run(json!([{"tool_name": CHARGE, "arguments": bad}]))
            .await;
        r.bad("invalid_arguments");
    }
    // the whole run is refused when one call is bad
    let r = fx.post_run(json!([{"tool_name": READ, "arguments": {}}, {"tool_name": READ, "arguments": {"cursor": 1}}])).await;
    r.bad("invalid_arguments");
    let d = fx.diagnostics().await;
    assert_eq!(d["calls"]["pending"], 0, "no call was created: {d}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_runs_unchecked_true_skips_argument_validation() {
    let fx = Fixture::new().await;
    let bad = json!({"amount": "twelve"});
    let r = fx
        .post_run(json!([{"tool_name": CHARGE, "arguments": bad, "unchecked": true}]))
        .await;
    let run_id = r.ok()["run_id"].as_str().unwrap().to_string();
    let run = fx.get_run(&run_id).await;
    let call_id = run["tool_calls"][0]["call_id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(run["tool_calls"][0]["arguments"], bad);
    // an executor gets the bad arguments and settles the call safely
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    assert_eq!(a.answer["assignment"]["arguments"], bad);
    assert_eq!(
        fx.receipt(&a, failed(&a, 0, "invalid_arguments"))
            .await
            .ok()["call_state"],
        "failed"
    );
    // unchecked: false validates
    fx.post_run(json!([{"tool_name": CHARGE, "arguments": bad, "unchecked": false}]))
        .await
        .bad("invalid_arguments");
    fx.post_run(json!([{"tool_name": CHARGE, "arguments": bad, "unchecked": "yes"}]))
        .await
        .is(400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_runs_rejects_unknown_tools_empty_lists_and_missing_fields() {
    let fx = Fixture::new().await;
    let r = fx.post_run(json!([{"tool_name": READ, "arguments": {}}, {"tool_name": "no.such", "arguments": {}}])).await;
    r.bad("unknown_tool");
    r.param_is("tool_calls[1].tool_name");
    fx.post_run(json!([])).await.is(400);
    fx.srv.post(ADMIN, "/runs", json!({"agent_version": fx.agent_version, "tool_calls": [{"tool_name": READ, "arguments": {}}]})).await.bad("missing_field");
    // scope: runs:write
    let body = json!({"agent_version": fx.agent_version, "subject": "u", "tool_calls": [{"tool_name": READ, "arguments": {}}]});
    fx.srv.post(RUNS_WRITE, "/runs", body.clone()).await.ok();
    fx.srv
        .post(RUNTIME_READ, "/runs", body)
        .await
        .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_run_tool_calls_adds_calls_to_an_active_run() {
    let fx = Fixture::new().await;
    let (run_id, first) = fx.read_call().await;
    let r = fx
        .srv
        .post(
            RUNS_WRITE,
            &format!("/runs/{run_id}/tool-calls"),
            json!({"tool_calls": [{"tool_name": CHARGE, "arguments": charge_args()}]}),
        )
        .await;
    r.ok();
    let run = fx.get_run(&run_id).await;
    let calls = run["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["call_id"], first.as_str());
    assert_id(&calls[1]["call_id"], "call_");
    assert_eq!(calls[1]["state"], "pending");
    assert_eq!(calls[1]["tool_name"], CHARGE);
    // validated like POST /runs
    let r = fx
        .srv
        .post(
            ADMIN,
            &format!("/runs/{run_id}/tool-calls"),
            json!({"tool_calls": [{"tool_name": CHARGE, "arguments": {}}]}),
        )
        .await;
    r.bad("invalid_arguments");
    fx.srv
        .post(
            RUNTIME_READ,
            &format!("/runs/{run_id}/tool-calls"),
            json!({"tool_calls": [{"tool_name": READ, "arguments": {}}]}),
        )
        .await
        .err(403, "missing_scope");
    assert_eq!(
        fx.get_run(&run_id).await["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_run_tool_calls_to_an_ended_run_is_409_run_terminated() {
    let fx = Fixture::new().await;
    let (cancelled_run, _) = fx.read_call().await;
    fx.cancel(&cancelled_run).await.ok();
    let body = json!({"tool_calls": [{"tool_name": READ, "arguments": {}}]});
    fx.srv
        .post(
            ADMIN,
            &format!("/runs/{cancelled_run}/tool-calls"),
            body.clone(),
        )
        .await
        .err(409, "run_terminated");
    let (done_run, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &done_run, &call_id).await;
    fx.complete(&a, json!({})).await.ok();
    fx.srv
        .post(ADMIN, &format!("/runs/{done_run}/tool-calls"), body)
        .await
        .err(409, "run_terminated");
    assert_eq!(
        fx.get_run(&done_run).await["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_run_cancel_terminates_calls_and_requests_cancel_in_heartbeat_and_stream() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    let claimed = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let running = fx.running(&c, &run.run_id, &run.calls[1]).await;
    let mut ws = fx.open_stream(&c).await.expect("stream");
    let r = fx
        .srv
        .send(Req::post(&format!("/runs/{}/cancel", run.run_id)).token(RUNS_WRITE))
        .await;
    r.ok();
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(got["status"], "cancelled");
    for call in &run.calls {
        assert_eq!(call_in(&got, call)["state"], "terminated");
    }
    // heartbeat
    let hb = fx
        .heartbeat(&c, json!([{"run_id": run.run_id, "call_id": run.calls[0]}, {"run_id": run.run_id, "call_id": run.calls[1]}]))
        .await;
    let cr = hb.ok()["cancel_requested"].clone();
    assert!(has_pair(&cr, &run.run_id, &claimed.call_id), "{cr}");
    assert!(has_pair(&cr, &run.run_id, &running.call_id), "{cr}");
    assert!(
        !has_pair(&cr, &run.run_id, &run.calls[2]),
        "an unbound call has no executor to tell: {cr}"
    );
    // stream
    for call in [&claimed.call_id, &running.call_id] {
        let f = frame_for(&mut ws, "call.cancel_requested", call, 3000)
            .await
            .expect("cancel frame");
        assert_eq!(f["run_id"], run.run_id.as_str());
    }
    // closed, not released: the grant still authenticates (late receipt kept)
    fx.receipt(&running, completed(&running, 1, json!({})))
        .await
        .err(409, "run_terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_run_cancel_again_is_200_and_cancel_of_ended_run_is_409() {
    let fx = Fixture::new().await;
    let (run_id, _) = fx.read_call().await;
    fx.cancel(&run_id).await.ok();
    let again = fx.cancel(&run_id).await;
    assert_eq!(again.ok()["status"], "cancelled");
    let (done, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &done, &call_id).await;
    fx.complete(&a, json!({})).await.ok();
    fx.cancel(&done).await.err(409, "run_terminated");
    assert_eq!(fx.get_run(&done).await["status"], "completed");
    fx.srv
        .send(Req::post(&format!("/runs/{run_id}/cancel")).token(RUNTIME_READ))
        .await
        .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_run_answers_the_run_object() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    let done = completed(&a, 1, charge_result());
    fx.receipt(&a, done.clone()).await.ok();
    let r = fx.srv.get(RUNTIME_READ, &format!("/runs/{run_id}")).await;
    let run = r.ok();
    assert_eq!(run["run_id"], run_id.as_str());
    assert_eq!(run["agent_id"], fx.agent_id.as_str());
    assert_eq!(run["agent_version"], fx.agent_version.as_str());
    assert_eq!(run["subject"], "user_42");
    assert_eq!(run["status"], "completed");
    assert_ts(&run["created_at"]);
    let call = call_in(run, &call_id);
    assert_eq!(call["tool_name"], CHARGE);
    assert_eq!(call["arguments"], charge_args());
    assert_eq!(call["state"], "completed");
    assert_eq!(call["executor_id"], "exe_a");
    assert_eq!(call["assignment_id"], a.assignment_id.as_str());
    assert_ts(&call["accepted_at"]);
    let rs = call["receipts"].as_array().unwrap();
    assert_eq!(rs.len(), 2);
    assert_eq!(rs[0]["kind"], "accepted");
    assert_eq!(rs[0]["sequence"], 0);
    assert_eq!(rs[1]["receipt_id"], done["receipt_id"]);
    assert_eq!(rs[1]["kind"], "completed");
    assert_eq!(rs[1]["sequence"], 1);
    assert_eq!(rs[1]["body"], done);
    assert_eq!(call["late_receipts"], json!([]));
    let proj = &call["context_projection"];
    let size = canon(&charge_result()).len();
    assert_eq!(
        proj,
        &json!({"original_bytes": size, "retained_bytes": size, "truncated": false, "result": charge_result()})
    );
    // scope: runtime:read; runs:write alone cannot read
    fx.srv
        .get(RUNS_WRITE, &format!("/runs/{run_id}"))
        .await
        .err(403, "missing_scope");
}

// ================================================================ faults

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_dev_faults_needs_the_star_token() {
    let fx = Fixture::new().await;
    let body = json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 7});
    for tok in [ALL_LISTED, RUNS_WRITE, CONFIG_WRITE, EXEC] {
        fx.srv
            .put(tok, "/dev/faults", body.clone())
            .await
            .err(403, "missing_scope");
    }
    fx.srv.put(ADMIN, "/dev/faults", body).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_dev_faults_validates_its_body() {
    let fx = Fixture::new().await;
    for bad in [
        json!({"error_rate": 1.5, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 7}),
        json!({"error_rate": -0.1, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 7}),
        json!({"error_rate": 0.0, "drop_response_rate": 2, "latency_ms": 0, "seed": 7}),
        json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": -5, "seed": 7}),
        json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 7, "mode": "chaos"}),
        json!({"error_rate": "0", "drop_response_rate": 0.0, "latency_ms": 0, "seed": 7}),
    ] {
        let r = fx.srv.put(ADMIN, "/dev/faults", bad.clone()).await;
        r.envelope();
        assert_eq!(r.status, 400, "{bad}: {r:?}");
    }
    // nothing took effect
    let c = fx.connect("exe_a").await;
    fx.heartbeat(&c, json!([])).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_error_rate_answers_503_api_error_on_executor_endpoints_only() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.srv.set_faults(1.0, 0.0, 0).await;
    // executor endpoints: 503 before doing anything
    let exec_answers = vec![
        fx.claim(&c, &run_id, &call_id, "k1").await,
        fx.heartbeat(&c, json!([])).await,
        fx.pending(&c, "").await,
        fx.connect_raw(fx.connect_body("exe_b", &[READ], 1)).await,
        fx.report(
            &c,
            json!([{"run_id": run_id, "call_id": call_id, "state": "released"}]),
        )
        .await,
        fx.receipt_with(&run_id, &call_id, Some("grt_x"), &json!({}))
            .await,
        fx.disconnect(&c, "drain").await,
    ];
    for r in exec_answers {
        r.envelope();
        assert_eq!(r.status, 503, "{r:?}");
        assert_eq!(r.json["error"]["type"], "api_error");
    }
    // nothing happened
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
    assert_eq!(
        fx.exec_diag("exe_a").await["status"],
        "online",
        "the drain was not done"
    );
    // configuration and admin endpoints are not affected
    fx.srv
        .post(ADMIN, "/agents", json!({"name": "still works"}))
        .await
        .ok();
    fx.run1(READ, json!({})).await;
    fx.srv
        .get(
            ADMIN,
            &format!("/executor-bindings?agent_id={}", fx.agent_id),
        )
        .await
        .ok();
    fx.srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": fx.agent_version, "tool_name": READ, "arguments": {}}),
        )
        .await
        .ok();
    fx.diagnostics().await;
    // back to normal
    fx.srv.set_faults(0.0, 0.0, 0).await;
    fx.claim_ok(&c, &run_id, &call_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_from_the_builder_apply_from_the_start() {
    let fx = Fixture::with(Opts {
        faults: Some(Faults {
            error_rate: 1.0,
            drop_response_rate: 0.0,
            latency_ms: 0,
            seed: 7,
        }),
        ..Opts::default()
    })
    .await; // configuration endpoints worked while building the fixture
    let r = fx.connect_raw(fx.connect_body("exe_a", &[READ], 1)).await;
    assert_eq!(r.status, 503, "{r:?}");
    r.envelope();
    fx.srv.set_faults(0.0, 0.0, 0).await;
    fx.connect("exe_a").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_drop_response_commits_the_claim_and_a_retry_replays_it() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.srv.set_faults(0.0, 1.0, 0).await;
    let key = uid("op");
    let req = Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/claim"))
        .token(EXEC)
        .json(&json!({"executor_id": c.executor_id, "connection_id": c.connection_id, "operation_key": key}));
    let lost = fx.srv.try_send(req).await;
    assert!(
        lost.is_err(),
        "the connection must close without an answer, got {lost:?}"
    );
    // admin endpoints are not dropped: the claim is committed
    let run = fx.get_run(&run_id).await;
    assert_eq!(call_in(&run, &call_id)["state"], "claimed", "{run}");
    assert_eq!(call_in(&run, &call_id)["executor_id"], "exe_a");
    fx.srv.set_faults(0.0, 0.0, 0).await;
    let r = fx.claim(&c, &run_id, &call_id, &key).await;
    let v = r.ok();
    assert_eq!(v["replayed"], true);
    assert_eq!(
        v["assignment"]["assignment_id"],
        call_in(&run, &call_id)["assignment_id"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_drop_response_commits_a_receipt_and_a_retry_replays_it() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    fx.srv.set_faults(0.0, 1.0, 0).await;
    let done = completed(&a, 1, json!({"ok": true}));
    let req = Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/receipts"))
        .token(EXEC)
        .header("tool-grant", &a.grant)
        .json(&done);
    assert!(
        fx.srv.try_send(req).await.is_err(),
        "answer must be dropped"
    );
    assert_eq!(fx.state(&run_id, &call_id).await, "completed");
    fx.srv.set_faults(0.0, 0.0, 0).await;
    let v = fx.receipt(&a, done).await.ok().clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_latency_delays_executor_endpoints_only() {
    let fx = Fixture::new().await;
    let c = fx.connect("exe_a").await;
    fx.srv.set_faults(0.0, 0.0, 700).await;
    let t = Instant::now();
    fx.heartbeat(&c, json!([])).await.ok();
    let slow = t.elapsed().as_millis();
    assert!(slow >= 700, "heartbeat took {slow} ms with latency_ms 700");
    let t = Instant::now();
    fx.srv
        .post(ADMIN, "/agents", json!({"name": "fast"}))
        .await
        .ok();
    let fast = t.elapsed().as_millis();
    assert!(
        fast < 700,
        "POST /agents took {fast} ms: faults apply to executor endpoints only"
    );
}
