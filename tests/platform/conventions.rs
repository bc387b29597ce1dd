//! §1 Conventions: auth, request ids, error envelope, body rules, 404 vs
//! 400, identifiers, lists, status codes.

use serde_json::{Value, json};

use crate::common::*;

// ---------------------------------------------------------------- authentication

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_missing_token_is_401_authentication_error() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let reqs = vec![
        Req::post("/agents").json(&json!({"name": "x"})),
        Req::get(&format!("/runs/{run_id}")),
        Req::post("/executors/connect").json(&fx.connect_body("exe_a", &[READ], 1)),
        Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/claim")).json(
            &json!({"executor_id": "exe_a", "connection_id": "con_x", "operation_key": "k1"}),
        ),
        Req::put("/dev/faults").json(
            &json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 1}),
        ),
    ];
    for r in reqs {
        let path = r.path.clone();
        let resp = fx.srv.send(r).await;
        assert_eq!(resp.status, 401, "{path}: {resp:?}");
        resp.is(401);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_unknown_token_is_401() {
    let fx = Fixture::new().await;
    for tok in ["nope", "t-admin-but-longer", ""] {
        let r = fx
            .srv
            .send(Req::post("/agents").token(tok).json(&json!({"name": "x"})))
            .await;
        r.envelope();
        assert_eq!(r.status, 401, "token {tok:?}: {r:?}");
        assert_eq!(r.json["error"]["type"], "authentication_error");
    }
    // Not a bearer token at all.
    let r = fx
        .srv
        .send(
            Req::post("/agents")
                .header("authorization", "Basic dDphZG1pbg==")
                .json(&json!({"name": "x"})),
        )
        .await;
    r.envelope();
    assert_eq!(r.status, 401, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_missing_scope_is_403_missing_scope() {
    let fx = Fixture::new().await;
    // executor token cannot configure
    fx.srv
        .post(EXEC, "/agents", json!({"name": "x"}))
        .await
        .err(403, "missing_scope");
    // configuration:read cannot write
    fx.srv
        .post(CONFIG_READ, "/agents", json!({"name": "x"}))
        .await
        .err(403, "missing_scope");
    // configuration:write cannot start runs
    let r = fx
        .srv
        .post(
            CONFIG_WRITE,
            "/runs",
            json!({"agent_version": fx.agent_version, "subject": "u", "tool_calls": [{"tool_name": READ, "arguments": {}}]}),
        )
        .await;
    r.err(403, "missing_scope");
    // tools:execute alone cannot connect
    fx.srv
        .post(
            EXECUTE_ONLY,
            "/executors/connect",
            fx.connect_body("exe_a", &[READ], 1),
        )
        .await
        .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_connect_scope_never_stands_in_for_tools_execute() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    // connect works with executors:connect only
    let c = fx
        .srv
        .post(
            CONNECT_ONLY,
            "/executors/connect",
            fx.connect_body("exe_a", &[READ], 2),
        )
        .await;
    let con = c.ok()["connection_id"].as_str().unwrap().to_string();
    // but claim needs tools:execute
    let r = fx
        .srv
        .post(
            CONNECT_ONLY,
            &format!("/runs/{run_id}/tool-calls/{call_id}/claim"),
            json!({"executor_id": "exe_a", "connection_id": con, "operation_key": "k1"}),
        )
        .await;
    r.err(403, "missing_scope");
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
    // receipts too
    let r = fx
        .srv
        .send(
            Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/receipts"))
                .token(CONNECT_ONLY)
                .header("tool-grant", "grt_x")
                .json(
                    &json!({"receipt_id": "r1", "executor_id": "exe_a", "assignment_id": "asg_x",
                               "sequence": 0, "kind": "accepted"}),
                ),
        )
        .await;
    r.err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_401_comes_before_403_and_body_errors() {
    let fx = Fixture::new().await;
    // no token + malformed body -> 401 (auth first)
    let r = fx.srv.send(Req::post("/agents").raw("{not json")).await;
    r.is(401);
    // missing scope + malformed body -> 403
    fx.srv
        .send(Req::post("/agents").token(EXEC).raw("{not json"))
        .await
        .err(403, "missing_scope");
    // missing scope + unknown run in path -> 403 (before the path 404)
    fx.srv
        .get(EXEC, "/runs/run_doesnotexist")
        .await
        .err(403, "missing_scope");
}

// ---------------------------------------------------------------- request ids

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_id_is_echoed_on_success_and_on_errors() {
    let fx = Fixture::new().await;
    let (run_id, _) = fx.read_call().await;
    let cases = vec![
        Req::get(&format!("/runs/{run_id}")).token(ADMIN), // 200
        Req::get("/runs/run_nope").token(ADMIN),           // 404
        Req::post("/agents").json(&json!({"name": "x"})),  // 401
        Req::post("/agents").token(ADMIN).raw("{"),        // 400
        Req::post("/agents").token(EXEC).json(&json!({"name": "x"})), // 403
        Req::get("/no/such/route").token(ADMIN),           // 404 unknown route
        Req::post("/executors/nobody/heartbeat")
            .token(EXEC)
            .json(&json!({"connection_id": "con_x", "in_flight": []})), // 409
    ];
    for (i, r) in cases.into_iter().enumerate() {
        let rid = format!("req-echo-{i}-abc");
        let resp = fx.srv.send(r.header("x-request-id", &rid)).await;
        assert_eq!(
            resp.request_id().as_deref(),
            Some(rid.as_str()),
            "case {i}: {resp:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_id_is_generated_when_absent_also_on_errors() {
    let fx = Fixture::new().await;
    let cases = vec![
        Req::post("/agents")
            .token(ADMIN)
            .json(&json!({"name": "x"})),
        Req::get("/runs/run_nope").token(ADMIN),
        Req::post("/agents").json(&json!({"name": "x"})),
        Req::post("/agents").token(ADMIN).raw("[1,"),
        Req::get("/no/such/route"),
    ];
    let mut seen = Vec::new();
    for (i, r) in cases.into_iter().enumerate() {
        let resp = fx.srv.send(r).await;
        let id = resp
            .request_id()
            .unwrap_or_else(|| panic!("case {i}: no x-request-id: {resp:?}"));
        assert!(!id.is_empty(), "case {i}");
        assert!(!seen.contains(&id), "request id {id} generated twice");
        seen.push(id);
    }
}

// ---------------------------------------------------------------- error envelope

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_envelope_shape_on_every_4xx() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    let cases: Vec<(Req, u16)> = vec![
        (Req::post("/agents").token(ADMIN).raw("{"), 400),
        (Req::post("/agents").token(ADMIN).json(&json!({"name": "x", "zz": 1})), 400),
        (Req::post("/agents").json(&json!({"name": "x"})), 401),
        (Req::post("/agents").token(EXEC).json(&json!({"name": "x"})), 403),
        (
            Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/receipts"))
                .token(EXEC)
                .header("tool-grant", "grt_wrong")
                .json(&accepted(&a)),
            403,
        ),
        (Req::get("/runs/run_missing").token(ADMIN), 404),
        (Req::get("/not-a-route").token(ADMIN), 404),
        (
            Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/claim")).token(EXEC).json(
                &json!({"executor_id": "exe_b", "connection_id": "con_missing", "operation_key": "k"}),
            ),
            409,
        ),
        (Req::new(toolrunner::platform::Method::DELETE, "/agents").token(ADMIN), 405),
    ];
    for (r, status) in cases {
        let what = format!("{} {}", r.method, r.path);
        let resp = fx.srv.send(r).await;
        resp.envelope();
        assert_eq!(resp.status, status, "{what}: {resp:?}");
        let ty = &resp.json["error"]["type"];
        assert_eq!(ty, type_for_status(status), "{what}: {resp:?}");
    }
}

// ---------------------------------------------------------------- body rules

/// A body of exactly `size` bytes: a `completed` receipt for a `notes.write`
/// call whose result is one long string.
fn receipt_of_size(a: &Asg, size: usize) -> Vec<u8> {
    let mut body = completed(a, 1, json!({"blob": ""}));
    let base = serde_json::to_vec(&body).unwrap().len();
    assert!(size >= base);
    body["result"]["blob"] = json!("x".repeat(size - base));
    let bytes = serde_json::to_vec(&body).unwrap();
    assert_eq!(bytes.len(), size);
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_over_4_mib_is_413_payload_too_large() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(NOTE, json!({})).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    let receipt = Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/receipts"))
        .token(EXEC)
        .header("tool-grant", &a.grant)
        .raw(receipt_of_size(&a, 4 * 1024 * 1024 + 1));
    let agent = Req::post("/agents")
        .token(ADMIN)
        .raw(format!("{{\"name\":\"{}\"}}", "a".repeat(16 * 1024 * 1024)));
    // a few times each, at the limit and well over it: the client must
    // actually receive the 413 (an answer lost to a connection closed
    // mid-upload is no answer, and an SDK would retry it forever)
    for req in [
        receipt.clone(),
        agent.clone(),
        receipt.clone(),
        agent.clone(),
        receipt,
        agent,
    ] {
        let what = req.path.clone();
        match fx.srv.try_send(req).await {
            Ok(r) => r.err_typed(413, "invalid_request_error", "payload_too_large"),
            Err(e) => panic!(
                "{what}: no 413 received, the connection failed while sending the body: {e:?}"
            ),
        }
    }
    assert_eq!(fx.state(&run_id, &call_id).await, "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn body_of_exactly_4_mib_is_accepted() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(NOTE, json!({})).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    let r = fx
        .srv
        .send(
            Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/receipts"))
                .token(EXEC)
                .header("tool-grant", &a.grant)
                .raw(receipt_of_size(&a, 4 * 1024 * 1024)),
        )
        .await;
    assert_eq!(r.ok()["call_state"], "completed", "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nesting_depth_128_is_accepted_129_is_400_too_deep() {
    let fx = Fixture::new().await;
    // containers: body (1) + arguments (1) + n arrays
    let body = |n: usize| {
        format!(
            "{{\"agent_version\":\"{}\",\"tool_name\":\"{NOTE}\",\"arguments\":{{\"a\":{}}}}}",
            fx.agent_version,
            nest(n)
        )
    };
    let ok = fx
        .srv
        .send(Req::post("/tools/dry-run").token(ADMIN).raw(body(126)))
        .await;
    assert_eq!(ok.ok()["arguments_valid"], true, "{ok:?}");
    fx.srv
        .send(Req::post("/tools/dry-run").token(ADMIN).raw(body(127)))
        .await
        .bad("too_deep");
    // absurd depth neither crashes nor passes
    fx.srv
        .send(Req::post("/tools/dry-run").token(ADMIN).raw(body(100_000)))
        .await
        .bad("too_deep");
    // also counted in a run's stored arguments
    let run = |n: usize| {
        format!(
            "{{\"agent_version\":\"{}\",\"subject\":\"u\",\"tool_calls\":[{{\"tool_name\":\"{NOTE}\",\"arguments\":{{\"a\":{}}}}}]}}",
            fx.agent_version,
            nest(n)
        )
    };
    // body(1) + tool_calls(1) + call(1) + arguments(1) + n
    fx.srv
        .send(Req::post("/runs").token(ADMIN).raw(run(124)))
        .await
        .ok();
    fx.srv
        .send(Req::post("/runs").token(ADMIN).raw(run(125)))
        .await
        .bad("too_deep");
    // the server still answers
    fx.srv
        .post(ADMIN, "/agents", json!({"name": "after"}))
        .await
        .ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_object_keys_are_400_duplicate_key() {
    let fx = Fixture::new().await;
    fx.srv
        .send(
            Req::post("/agents")
                .token(ADMIN)
                .raw(r#"{"name":"a","name":"b"}"#),
        )
        .await
        .bad("duplicate_key");
    fx.srv
        .send(
            Req::post("/agents")
                .token(ADMIN)
                .raw(r#"{"name":"a","name":"a"}"#),
        )
        .await
        .bad("duplicate_key");
    let nested = format!(
        r#"{{"agent_version":"{}","tool_name":"{NOTE}","arguments":{{"x":{{"k":1,"k":2}}}}}}"#,
        fx.agent_version
    );
    fx.srv
        .send(Req::post("/tools/dry-run").token(ADMIN).raw(nested))
        .await
        .bad("duplicate_key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn integer_beyond_2_pow_53_without_fraction_is_400() {
    let fx = Fixture::new().await;
    let dry = |num: &str| {
        format!(
            r#"{{"agent_version":"{}","tool_name":"{NOTE}","arguments":{{"n":{num}}}}}"#,
            fx.agent_version
        )
    };
    for bad in [
        "9007199254740993",
        "-9007199254740993",
        "123456789012345678901234567890",
    ] {
        fx.srv
            .send(Req::post("/tools/dry-run").token(ADMIN).raw(dry(bad)))
            .await
            .bad("number_out_of_range");
    }
    // exactly 2^53 is not beyond it
    let r = fx
        .srv
        .send(
            Req::post("/tools/dry-run")
                .token(ADMIN)
                .raw(dry("9007199254740992")),
        )
        .await;
    assert_eq!(r.ok()["arguments_valid"], true);
    let r = fx
        .srv
        .send(
            Req::post("/tools/dry-run")
                .token(ADMIN)
                .raw(dry("-9007199254740992")),
        )
        .await;
    r.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_with_fraction_or_exponent_are_doubles_and_accepted() {
    let fx = Fixture::new().await;
    let dry = |num: &str| {
        format!(
            r#"{{"agent_version":"{}","tool_name":"{NOTE}","arguments":{{"n":{num}}}}}"#,
            fx.agent_version
        )
    };
    for good in [
        "1e300",
        "9007199254740993.0",
        "1E+20",
        "-2.5e-7",
        "12345678901234567890e0",
    ] {
        let r = fx
            .srv
            .send(Req::post("/tools/dry-run").token(ADMIN).raw(dry(good)))
            .await;
        assert_eq!(r.ok()["arguments_valid"], true, "{good}: {r:?}");
    }
    // stored in a run and read back as the same double
    let body = format!(
        r#"{{"agent_version":"{}","subject":"u","tool_calls":[{{"tool_name":"{NOTE}","arguments":{{"n":1e300}}}}]}}"#,
        fx.agent_version
    );
    let r = fx.srv.send(Req::post("/runs").token(ADMIN).raw(body)).await;
    let run_id = r.ok()["run_id"].as_str().unwrap().to_string();
    let run = fx.get_run(&run_id).await;
    assert_eq!(
        run["tool_calls"][0]["arguments"]["n"].as_f64(),
        Some(1e300),
        "{run}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_surrogate_is_400_and_valid_pairs_are_accepted() {
    let fx = Fixture::new().await;
    for bad in [
        r#"{"name":"\ud800"}"#,
        r#"{"name":"a\udc00b"}"#,
        r#"{"name":"\ude00\ud83d"}"#,
    ] {
        let r = fx
            .srv
            .send(Req::post("/agents").token(ADMIN).raw(bad))
            .await;
        r.bad("invalid_json");
    }
    let r = fx
        .srv
        .send(
            Req::post("/agents")
                .token(ADMIN)
                .raw(r#"{"name":"\ud83d\ude00"}"#),
        )
        .await;
    assert_eq!(r.ok()["name"], "\u{1F600}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_trailing_data_and_invalid_utf8_are_400_invalid_json() {
    let fx = Fixture::new().await;
    let bodies: Vec<Vec<u8>> = vec![
        b"{\"name\":".to_vec(),
        b"{\"name\":\"a\"} {}".to_vec(),
        b"{\"name\":\"a\"}x".to_vec(),
        b"{'name':'a'}".to_vec(),
        b"{\"name\":\"\xff\xfe\"}".to_vec(),
        b"{\"name\":\"a\",}".to_vec(),
        b"{\"name\":NaN}".to_vec(),
        b"".to_vec(),
    ];
    for b in bodies {
        let shown = String::from_utf8_lossy(&b).to_string();
        let r = fx.srv.send(Req::post("/agents").token(ADMIN).raw(b)).await;
        r.envelope();
        assert_eq!(r.status, 400, "{shown}: {r:?}");
        if !shown.is_empty() {
            assert_eq!(r.code(), "invalid_json", "{shown}: {r:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_field_is_400_unknown_field() {
    let fx = Fixture::new().await;
    let r = fx
        .srv
        .post(ADMIN, "/agents", json!({"name": "a", "color": "red"}))
        .await;
    r.bad("unknown_field");
    r.param_is("color");
    // nested, in a tool definition
    let mut tool = read_tool(&fx.binding_id);
    tool["color"] = json!("red");
    let r = fx
        .srv
        .post(
            ADMIN,
            &format!("/agents/{}/versions", fx.agent_id),
            json!({"tools": [tool]}),
        )
        .await;
    r.bad("unknown_field");
    r.param_is("tools[0].color");
    // on an executor endpoint
    let mut body = fx.connect_body("exe_a", &[READ], 1);
    body["region"] = json!("eu");
    fx.connect_raw(body).await.bad("unknown_field");
    // on a claim
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let r = fx
        .srv
        .post(
            EXEC,
            &format!("/runs/{run_id}/tool-calls/{call_id}/claim"),
            json!({"executor_id": "exe_a", "connection_id": c.connection_id, "operation_key": "k1", "priority": 1}),
        )
        .await;
    r.bad("unknown_field");
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_field_and_wrong_type_are_400() {
    let fx = Fixture::new().await;
    let r = fx.srv.post(ADMIN, "/agents", json!({})).await;
    r.bad("missing_field");
    r.param_is("name");
    let r = fx.srv.post(ADMIN, "/agents", json!({"name": 5})).await;
    r.bad("invalid_type");
    r.param_is("name");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_type_is_not_enforced_but_the_body_must_be_strict_json() {
    // Choice 7: every body is judged as JSON whatever Content-Type says.
    let fx = Fixture::new().await;
    let body = br#"{"name":"ct"}"#.to_vec();
    for ct in [
        None,
        Some("application/json; charset=utf-8"),
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
    ] {
        let v = fx
            .srv
            .send(
                Req::post("/agents")
                    .token(ADMIN)
                    .raw(body.clone())
                    .content_type(ct),
            )
            .await;
        assert!(
            v.ok()["agent_id"]
                .as_str()
                .is_some_and(|id| id.starts_with("agt_"))
        );
    }
    // ...and a body that is not JSON is refused whatever the header claims.
    for ct in [Some("application/json"), Some("text/plain"), None] {
        fx.srv
            .send(
                Req::post("/agents")
                    .token(ADMIN)
                    .raw(b"name=ct".to_vec())
                    .content_type(ct),
            )
            .await
            .bad("invalid_json");
    }
    // On an executor endpoint a claim without the header works like any other.
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let claim = serde_json::to_vec(
        &json!({"executor_id": "exe_a", "connection_id": c.connection_id, "operation_key": "k1"}),
    )
    .unwrap();
    let path = format!("/runs/{run_id}/tool-calls/{call_id}/claim");
    fx.srv
        .send(Req::post(&path).token(EXEC).raw(claim).content_type(None))
        .await
        .ok();
    assert_eq!(fx.state(&run_id, &call_id).await, "claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_route_is_404_and_wrong_method_is_405() {
    let fx = Fixture::new().await;
    fx.srv
        .get(ADMIN, "/nothing/here")
        .await
        .err(404, "unknown_route");
    fx.srv
        .send(Req::get("/v2/agents").absolute().token(ADMIN))
        .await
        .err(404, "unknown_route");
    let r = fx
        .srv
        .send(
            Req::new(
                toolrunner::platform::Method::DELETE,
                &format!("/runs/{}", "run_x"),
            )
            .token(ADMIN),
        )
        .await;
    r.err_typed(405, "invalid_request_error", "method_not_allowed");
    fx.srv.get(ADMIN, "/agents").await.err_typed(
        405,
        "invalid_request_error",
        "method_not_allowed",
    );
}

// ---------------------------------------------------------------- 404 vs 400

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_found_only_for_resources_named_in_the_path() {
    let fx = Fixture::new().await;
    // path resources: 404
    fx.srv
        .get(ADMIN, "/runs/run_00000000000000000000000000000000")
        .await
        .is(404);
    fx.srv
        .get(
            ADMIN,
            &format!("/agents/agt_missing/versions/{}", fx.agent_version),
        )
        .await
        .is(404);
    fx.srv
        .get(
            ADMIN,
            &format!("/agents/{}/versions/agv_missing", fx.agent_id),
        )
        .await
        .is(404);
    fx.srv
        .post(
            ADMIN,
            "/agents/agt_missing/versions",
            json!({"tools": [read_tool(&fx.binding_id)]}),
        )
        .await
        .is(404);
    fx.srv
        .get(
            ADMIN,
            &format!(
                "/agents/{}/executor-bindings/bnd_missing/diagnostics",
                fx.agent_id
            ),
        )
        .await
        .is(404);
    fx.srv
        .get(
            ADMIN,
            &format!(
                "/agents/agt_missing/executor-bindings/{}/diagnostics",
                fx.binding_id
            ),
        )
        .await
        .is(404);
    fx.srv
        .post(
            ADMIN,
            "/runs/run_missing/tool-calls",
            json!({"tool_calls": [{"tool_name": READ, "arguments": {}}]}),
        )
        .await
        .is(404);
    fx.srv
        .send(Req::post("/runs/run_missing/cancel").token(ADMIN))
        .await
        .is(404);

    // body resources: 400 unknown_<resource> with param
    let r = fx
        .srv
        .post(
            ADMIN,
            "/executor-bindings",
            json!({"agent_id": "agt_missing", "name": "b", "tool_names": [READ]}),
        )
        .await;
    r.bad("unknown_agent");
    r.param_is("agent_id");
    let r = fx.connect_raw(json!({"executor_id": "exe_a", "binding_id": "bnd_missing", "tools": [READ], "capacity": 1})).await;
    r.bad("unknown_binding");
    r.param_is("binding_id");
    let r = fx.srv.post(ADMIN, "/runs", json!({"agent_version": "agv_missing", "subject": "u", "tool_calls": [{"tool_name": READ, "arguments": {}}]})).await;
    r.bad("unknown_agent_version");
    r.param_is("agent_version");
    let r = fx
        .srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": "agv_missing", "tool_name": READ, "arguments": {}}),
        )
        .await;
    r.bad("unknown_agent_version");
    // query resource: 400
    let r = fx
        .srv
        .get(ADMIN, "/executor-bindings?agent_id=agt_missing")
        .await;
    r.bad("unknown_agent");
    r.param_is("agent_id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_connection_id_is_409_lease_expired_even_for_unknown_executor() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let ghost = Conn {
        executor_id: "exe_never_seen".into(),
        connection_id: "con_never_issued".into(),
        answer: Value::Null,
    };
    fx.heartbeat(&ghost, json!([]))
        .await
        .err(409, "lease_expired");
    fx.pending(&ghost, "").await.err(409, "lease_expired");
    fx.report(
        &ghost,
        json!([{"run_id": run_id, "call_id": call_id, "state": "released"}]),
    )
    .await
    .err(409, "lease_expired");
    fx.disconnect(&ghost, "drain")
        .await
        .err(409, "lease_expired");
    fx.claim(&ghost, &run_id, &call_id, "k1")
        .await
        .err(409, "lease_expired");
    // known executor, unknown connection
    let c = fx.connect("exe_a").await;
    let wrong = Conn {
        connection_id: "con_never_issued".into(),
        ..c.clone()
    };
    fx.heartbeat(&wrong, json!([]))
        .await
        .err(409, "lease_expired");
    fx.claim(&wrong, &run_id, &call_id, "k2")
        .await
        .err(409, "lease_expired");
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_of_another_executor_is_409_lease_expired() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let a = fx.connect("exe_a").await;
    let _b = fx.connect("exe_b").await;
    let mixed = Conn {
        executor_id: "exe_b".into(),
        ..a.clone()
    };
    fx.heartbeat(&mixed, json!([]))
        .await
        .err(409, "lease_expired");
    fx.claim(&mixed, &run_id, &call_id, "k1")
        .await
        .err(409, "lease_expired");
}

// ---------------------------------------------------------------- ids, lists, 200, timestamps

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identifiers_carry_their_prefixes_and_are_never_reused() {
    let fx = Fixture::new().await;
    assert_id(&json!(fx.agent_id), "agt_");
    assert_id(&json!(fx.binding_id), "bnd_");
    assert_id(&json!(fx.agent_version), "agv_");
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    assert_id(&json!(run.run_id), "run_");
    for c in &run.calls {
        assert_id(&json!(c), "call_");
    }
    let c = fx.connect("exe_a").await;
    assert_id(&json!(c.connection_id), "con_");
    let a = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    assert_id(&json!(a.assignment_id), "asg_");
    assert_id(&json!(a.grant), "grt_");
    let c2 = fx.connect("exe_a").await;
    let a2 = fx.claim_ok(&c2, &run.run_id, &run.calls[1]).await;
    let run2 = fx.run(&[(READ, json!({}))]).await;
    let ids = [
        fx.agent_id.clone(),
        fx.binding_id.clone(),
        fx.side_binding_id.clone(),
        fx.agent_version.clone(),
        run.run_id.clone(),
        run.calls[0].clone(),
        run.calls[1].clone(),
        c.connection_id.clone(),
        c2.connection_id.clone(),
        a.assignment_id.clone(),
        a2.assignment_id.clone(),
        a.grant.clone(),
        a2.grant.clone(),
        run2.run_id.clone(),
        run2.calls[0].clone(),
    ];
    let mut sorted = ids.to_vec();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), ids.len(), "an id was reused: {ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_answer_data_and_next_cursor() {
    let fx = Fixture::new().await;
    let r = fx
        .srv
        .get(
            ADMIN,
            &format!("/executor-bindings?agent_id={}", fx.agent_id),
        )
        .await;
    let v = r.ok();
    let obj = v.as_object().unwrap();
    assert!(obj["data"].is_array(), "{v}");
    assert!(
        obj.contains_key("next_cursor") && obj["next_cursor"].is_null(),
        "{v}"
    );
    let c = fx.connect("exe_a").await;
    let p = fx.pending(&c, "").await;
    let v = p.ok();
    assert!(
        v["data"].is_array() && v.as_object().unwrap().contains_key("next_cursor"),
        "{v}"
    );
    assert!(v["next_cursor"].is_null(), "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_successful_answer_is_200_creations_included() {
    let fx = Fixture::new().await;
    let agent = fx.srv.post(ADMIN, "/agents", json!({"name": "n"})).await;
    assert_eq!(agent.status, 200);
    let agent_id = agent.json["agent_id"].as_str().unwrap().to_string();
    let b = fx
        .srv
        .post(
            ADMIN,
            "/executor-bindings",
            json!({"agent_id": agent_id, "name": "b", "tool_names": [READ]}),
        )
        .await;
    assert_eq!(b.status, 200, "{b:?}");
    let bid = b.json["binding_id"].as_str().unwrap();
    let v = fx
        .srv
        .post(
            ADMIN,
            &format!("/agents/{agent_id}/versions"),
            json!({"tools": [read_tool(bid)]}),
        )
        .await;
    assert_eq!(v.status, 200, "{v:?}");
    let agv = v.json["agent_version"].as_str().unwrap();
    assert_eq!(
        fx.srv
            .get(ADMIN, &format!("/agents/{agent_id}/versions/{agv}"))
            .await
            .status,
        200
    );
    assert_eq!(fx.srv.get(ADMIN, "/executor-bindings").await.status, 200);
    assert_eq!(
        fx.srv
            .get(
                ADMIN,
                &format!("/agents/{agent_id}/executor-bindings/{bid}/diagnostics")
            )
            .await
            .status,
        200
    );
    let dry = fx
        .srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": agv, "tool_name": READ, "arguments": {}}),
        )
        .await;
    assert_eq!(dry.status, 200, "{dry:?}");
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let added = fx
        .srv
        .post(
            ADMIN,
            &format!("/runs/{}/tool-calls", run.run_id),
            json!({"tool_calls": [{"tool_name": READ, "arguments": {}}]}),
        )
        .await;
    assert_eq!(added.status, 200, "{added:?}");
    let c = fx.connect("exe_a").await;
    assert_eq!(fx.heartbeat(&c, json!([])).await.status, 200);
    assert_eq!(fx.pending(&c, "").await.status, 200);
    let a = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let acc = fx.receipt(&a, accepted(&a)).await;
    assert_eq!(acc.status, 200);
    let done = fx.complete(&a, json!({})).await;
    assert_eq!(done.status, 200, "{done:?}");
    let b1 = fx.claim_ok(&c, &run.run_id, &run.calls[1]).await;
    let rep = fx
        .report(
            &c,
            json!([{"run_id": b1.run_id, "call_id": b1.call_id, "state": "released"}]),
        )
        .await;
    assert_eq!(rep.status, 200, "{rep:?}");
    assert_eq!(fx.disconnect(&c, "drain").await.status, 200);
    assert_eq!(fx.cancel(&run.run_id).await.status, 200);
    assert_eq!(fx.get_run_resp(&run.run_id).await.status, 200);
    let f = fx
        .srv
        .put(
            ADMIN,
            "/dev/faults",
            json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 3}),
        )
        .await;
    assert_eq!(f.status, 200, "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamps_are_rfc3339_utc() {
    let fx = Fixture::new().await;
    assert_ts(&fx.version["created_at"]);
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    fx.complete(&a, json!({})).await.ok();
    let run = fx.get_run(&run_id).await;
    assert_ts(&run["created_at"]);
    let call = call_in(&run, &call_id);
    assert_ts(&call["accepted_at"]);
    for r in call["receipts"].as_array().unwrap() {
        assert_ts(&r["received_at"]);
    }
    let hb = fx.heartbeat(&c, json!([])).await;
    assert_ts(&hb.ok()["lease_expires_at"]);
    let e = fx.exec_diag("exe_a").await;
    assert_ts(&e["last_heartbeat_at"]);
    assert_ts(&e["lease_expires_at"]);
    let p = fx.run(&[(READ, json!({}))]).await;
    let pend = fx.pending(&c, "").await;
    let item = pend.ok()["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["call_id"] == p.calls[0].as_str())
        .cloned();
    assert_ts(&item.expect("pending item")["created_at"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_answers_if_any_are_429_rate_limit_error_with_retry_after() {
    // The development platform has no documented rate limit; whatever a
    // burst gets must be 200 or a well-formed 429.
    let fx = Fixture::new().await;
    let c = fx.connect("exe_a").await;
    let mut futs = Vec::new();
    for _ in 0..200 {
        futs.push(fx.heartbeat(&c, json!([])));
    }
    let all = futures_util::future::join_all(futs).await;
    for r in all {
        match r.status {
            200 => {}
            429 => {
                r.is(429);
                let ra = r
                    .headers
                    .get("retry-after")
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_string();
                assert!(
                    ra.parse::<u64>().is_ok(),
                    "Retry-After is not seconds: {ra}"
                );
            }
            _ => panic!("burst answer {r:?}"),
        }
    }
}
