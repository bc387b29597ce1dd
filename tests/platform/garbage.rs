//! Garbage in, for every endpoint of §2, §4, §5 and §7: malformed JSON,
//! arrays instead of objects, wrong types, huge and negative numbers,
//! non-UTF-8 bytes, missing headers, nonsense path ids and queries. Every
//! answer must be a 4xx with the error envelope; afterwards the server still
//! answers and the stored state is unchanged.

use serde_json::{Value, json};

use crate::common::*;

/// A fixture with some state: run `run` has a pending `tasks.read` call
/// (calls[0]), a running `payments.charge` call (calls[1]) and a claimed
/// `tasks.read` call (calls[2]); `exe_a` is connected.
struct Ctx {
    fx: Fixture,
    conn: Conn,
    run: Run,
    running: Asg,
}

async fn ctx() -> Ctx {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[
            (READ, json!({})),
            (CHARGE, charge_args()),
            (READ, json!({})),
        ])
        .await;
    let conn = fx.connect("exe_a").await;
    let running = fx.running(&conn, &run.run_id, &run.calls[1]).await;
    fx.receipt(&running, progress(&running, 1)).await.ok();
    fx.claim_ok(&conn, &run.run_id, &run.calls[2]).await;
    Ctx {
        fx,
        conn,
        run,
        running,
    }
}

/// What must not change.
async fn snapshot(cx: &Ctx) -> (Value, Value, Value) {
    let run = cx.fx.get_run(&cx.run.run_id).await;
    let version = cx
        .fx
        .srv
        .get(
            ADMIN,
            &format!(
                "/agents/{}/versions/{}",
                cx.fx.agent_id, cx.fx.agent_version
            ),
        )
        .await
        .ok()
        .clone();
    let diag = cx.fx.diagnostics().await;
    (run, version, diag["calls"].clone())
}

async fn assert_unchanged(cx: &Ctx, before: &(Value, Value, Value)) {
    let after = snapshot(cx).await;
    assert_eq!(after.0, before.0, "run changed by garbage");
    assert_eq!(after.1, before.1, "version changed by garbage");
    assert_eq!(after.2, before.2, "call counts changed by garbage");
    // the connection is still the live one, not drained or superseded
    cx.fx.heartbeat(&cx.conn, json!([])).await.ok();
    assert_eq!(cx.fx.exec_diag("exe_a").await["status"], "online");
    // faults were not switched on
    cx.fx.pending(&cx.conn, "").await.ok();
}

/// Sends every request; collects the answers that are not a 4xx with the
/// error envelope.
async fn expect_4xx(cx: &Ctx, reqs: Vec<(String, Req)>) {
    let mut failures = Vec::new();
    for (what, req) in reqs {
        match cx.fx.srv.try_send(req).await {
            Err(e) => failures.push(format!("{what}: transport error {e}")),
            Ok(r) => {
                if !(400..500).contains(&r.status) {
                    failures.push(format!("{what}: not a 4xx: {r:?}"));
                } else if let Some(issue) = r.envelope_issue() {
                    failures.push(format!("{what}: {issue}: {r:?}"));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} garbage answers were not a 4xx error envelope:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Bodies that are garbage for any endpoint.
fn generic_bodies(allow_empty: bool) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(&str, Vec<u8>)> = vec![
        ("unterminated object", b"{\"a\":".to_vec()),
        ("lone brace", b"{".to_vec()),
        ("array", b"[]".to_vec()),
        ("array of object", b"[{}]".to_vec()),
        ("null", b"null".to_vec()),
        ("number", b"42".to_vec()),
        ("string", b"\"x\"".to_vec()),
        ("boolean", b"true".to_vec()),
        ("trailing data", b"{} {}".to_vec()),
        ("non-UTF-8 value", b"{\"a\":\"\xff\xfe\"}".to_vec()),
        ("non-UTF-8 key", b"{\"\xc3\x28\":1}".to_vec()),
        ("raw binary", vec![0, 159, 146, 150, 255, 1, 2]),
        ("lone surrogate", br#"{"a":"\ud800"}"#.to_vec()),
        ("duplicate key", br#"{"a":1,"a":1}"#.to_vec()),
        ("huge integer", b"123456789012345678901234567890".to_vec()),
        ("overflowing double", b"1e400".to_vec()),
        ("deep nesting", nest(5000).into_bytes()),
        ("raw control character", b"{\"a\":\"\x01\"}".to_vec()),
        ("single quotes", b"{'a':1}".to_vec()),
        ("NaN", b"{\"a\":NaN}".to_vec()),
        ("comment", b"{/* c */}".to_vec()),
        ("UTF-16", b"\xff\xfe{\x00}\x00".to_vec()),
    ];
    if !allow_empty {
        v.push(("empty", Vec::new()));
    }
    v.into_iter().map(|(n, b)| (n.to_string(), b)).collect()
}

/// `template` with `key` set to the raw JSON text `raw`.
fn with_raw(template: &Value, key: &str, raw: &str) -> Vec<u8> {
    let mut t = template.clone();
    t[key] = json!("__RAW_PLACEHOLDER__");
    serde_json::to_string(&t)
        .unwrap()
        .replace("\"__RAW_PLACEHOLDER__\"", raw)
        .into_bytes()
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Wrong types, huge and negative numbers for each top-level member, plus
/// an unlisted member. `optional` members are not set to `null`; `skip`
/// members are not touched.
fn mutations(template: &Value, optional: &[&str], skip: &[&str]) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let obj = template.as_object().unwrap();
    for (k, v) in obj {
        if skip.contains(&k.as_str()) {
            continue;
        }
        let replacements: [(&str, &str); 10] = [
            ("12345", "number"),
            ("-1", "negative"),
            ("-1.5", "negative"),
            ("1e400", "huge"),
            ("123456789012345678901234567890", "huge"),
            ("\"garbage\"", "string"),
            ("[]", "array"),
            ("{}", "object"),
            ("true", "bool"),
            ("null", "null"),
        ];
        for (raw, what) in replacements {
            let same_type = what == kind(v);
            if same_type || (what == "null" && optional.contains(&k.as_str())) {
                continue;
            }
            out.push((format!("{k} = {raw}"), with_raw(template, k, raw)));
        }
    }
    let mut extra = template.clone();
    extra["zz_unlisted"] = json!(1);
    out.push((
        "unlisted member".to_string(),
        serde_json::to_vec(&extra).unwrap(),
    ));
    out
}

/// The full battery for a body endpoint.
fn body_battery(
    method: toolrunner::platform::Method,
    path: &str,
    token: &str,
    grant: Option<&str>,
    template: Option<&Value>,
    optional: &[&str],
    skip: &[&str],
) -> Vec<(String, Req)> {
    let base = || {
        let mut r = Req::new(method.clone(), path).token(token);
        if let Some(g) = grant {
            r = r.header("tool-grant", g);
        }
        r
    };
    let mut reqs = Vec::new();
    for (what, body) in generic_bodies(template.is_none()) {
        reqs.push((format!("{method} {path}: {what}"), base().raw(body)));
    }
    if let Some(t) = template {
        for (what, body) in mutations(t, optional, skip) {
            reqs.push((format!("{method} {path}: {what}"), base().raw(body)));
        }
        let valid = serde_json::to_vec(t).unwrap();
        // missing headers
        let mut no_auth = Req::new(method.clone(), path).raw(valid.clone());
        if let Some(g) = grant {
            no_auth = no_auth.header("tool-grant", g);
        }
        reqs.push((format!("{method} {path}: no Authorization"), no_auth));
        reqs.push((
            format!("{method} {path}: bearer garbage"),
            Req::new(method.clone(), path)
                .header("authorization", "Bearer")
                .raw(valid.clone()),
        ));
        if grant.is_some() {
            reqs.push((
                format!("{method} {path}: no Tool-Grant"),
                Req::new(method.clone(), path).token(token).raw(valid),
            ));
        }
    } else {
        let mut extra = json!({});
        extra["zz_unlisted"] = json!(1);
        reqs.push((
            format!("{method} {path}: unlisted member"),
            base().json(&extra),
        ));
        reqs.push((
            format!("{method} {path}: no Authorization"),
            Req::new(method.clone(), path),
        ));
    }
    reqs
}

/// Requests to `path` variants with nonsense ids (all must be 4xx).
fn path_battery(
    method: toolrunner::platform::Method,
    token: &str,
    paths: &[String],
    body: Option<&Value>,
) -> Vec<(String, Req)> {
    paths
        .iter()
        .map(|p| {
            let mut r = Req::new(method.clone(), p).token(token);
            if let Some(b) = body {
                r = r.json(b);
            }
            (format!("{method} {p}"), r)
        })
        .collect()
}

fn garbage_ids() -> Vec<String> {
    vec![
        "%FF%FE".into(),
        "%00".into(),
        "x'%20OR%201=1".into(),
        "..%2F..".into(),
        "a".repeat(1500),
        "%E2%80%AE".into(),
    ]
}

async fn run_battery(cx: &Ctx, reqs: Vec<(String, Req)>) {
    let before = snapshot(cx).await;
    expect_4xx(cx, reqs).await;
    assert_unchanged(cx, &before).await;
}

// ================================================================ §2

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_agents() {
    let cx = ctx().await;
    let t = json!({"name": "n"});
    run_battery(
        &cx,
        body_battery(
            toolrunner::platform::Method::POST,
            "/agents",
            ADMIN,
            None,
            Some(&t),
            &[],
            &[],
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_executor_bindings() {
    let cx = ctx().await;
    let t = json!({"agent_id": cx.fx.agent_id, "name": "g", "tool_names": ["g.a"]});
    run_battery(
        &cx,
        body_battery(
            toolrunner::platform::Method::POST,
            "/executor-bindings",
            ADMIN,
            None,
            Some(&t),
            &[],
            &[],
        ),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_agent_versions() {
    let cx = ctx().await;
    let t = json!({"tools": [read_tool(&cx.fx.binding_id)], "tool_search": false});
    let path = format!("/agents/{}/versions", cx.fx.agent_id);
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        &path,
        ADMIN,
        None,
        Some(&t),
        &["tool_search"],
        &[],
    );
    let paths: Vec<String> = garbage_ids()
        .iter()
        .map(|g| format!("/agents/{g}/versions"))
        .collect();
    reqs.extend(path_battery(
        toolrunner::platform::Method::POST,
        ADMIN,
        &paths,
        Some(&t),
    ));
    // garbage inside a tool definition
    for (k, raw) in [
        ("name", "5"),
        ("max_result_context_bytes", "1e400"),
        ("max_result_context_bytes", "-16384"),
        ("input_schema", "[]"),
        ("defer_loading", "\"no\""),
        ("binding_id", "{}"),
    ] {
        let tool = String::from_utf8(with_raw(&read_tool(&cx.fx.binding_id), k, raw)).unwrap();
        let body = format!("{{\"tools\":[{tool}]}}");
        reqs.push((
            format!("tools[0].{k} = {raw}"),
            Req::post(&path).token(ADMIN).raw(body),
        ));
    }
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_get_agent_version() {
    let cx = ctx().await;
    let mut paths = Vec::new();
    for g in garbage_ids() {
        paths.push(format!("/agents/{}/versions/{g}", cx.fx.agent_id));
        paths.push(format!("/agents/{g}/versions/{}", cx.fx.agent_version));
    }
    let mut reqs = path_battery(toolrunner::platform::Method::GET, ADMIN, &paths, None);
    let good = format!(
        "/agents/{}/versions/{}",
        cx.fx.agent_id, cx.fx.agent_version
    );
    reqs.push(("no Authorization".into(), Req::get(&good)));
    reqs.push(("connect token".into(), Req::get(&good).token(CONNECT_ONLY)));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_get_executor_bindings() {
    let cx = ctx().await;
    let paths: Vec<String> = garbage_ids()
        .iter()
        .map(|g| format!("/executor-bindings?agent_id={g}"))
        .collect();
    let mut reqs = path_battery(toolrunner::platform::Method::GET, ADMIN, &paths, None);
    reqs.push(("no Authorization".into(), Req::get("/executor-bindings")));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_get_binding_diagnostics() {
    let cx = ctx().await;
    let mut paths = Vec::new();
    for g in garbage_ids() {
        paths.push(format!(
            "/agents/{}/executor-bindings/{g}/diagnostics",
            cx.fx.agent_id
        ));
        paths.push(format!(
            "/agents/{g}/executor-bindings/{}/diagnostics",
            cx.fx.binding_id
        ));
    }
    let mut reqs = path_battery(toolrunner::platform::Method::GET, ADMIN, &paths, None);
    reqs.push((
        "no Authorization".into(),
        Req::get(&format!(
            "/agents/{}/executor-bindings/{}/diagnostics",
            cx.fx.agent_id, cx.fx.binding_id
        )),
    ));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_tools_dry_run() {
    let cx = ctx().await;
    let t = json!({"agent_version": cx.fx.agent_version, "tool_name": READ, "arguments": {},
                   "mock_receipts": [{"receipt_id": "m", "kind": "completed", "result": {}}]});
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        "/tools/dry-run",
        ADMIN,
        None,
        Some(&t),
        &["mock_receipts"],
        &["arguments"],
    );
    for raw in [
        r#"[{"receipt_id":"m","kind":"bogus"}]"#,
        r#"[5]"#,
        r#"[{"receipt_id":7,"kind":"completed","result":{}}]"#,
    ] {
        reqs.push((
            format!("mock_receipts = {raw}"),
            Req::post("/tools/dry-run")
                .token(ADMIN)
                .raw(with_raw(&t, "mock_receipts", raw)),
        ));
    }
    run_battery(&cx, reqs).await;
}

// ================================================================ §4

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_executors_connect() {
    let cx = ctx().await;
    let t = cx.fx.connect_body("exe_a", &[READ, CHARGE, NOTE], 8);
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        "/executors/connect",
        EXEC,
        None,
        Some(&t),
        &["instance_id", "sdk"],
        &[],
    );
    for (k, raw) in [
        ("tools", "[\"tasks.read\", 5]"),
        ("sdk", "{\"name\": 1, \"version\": []}"),
        ("capacity", "0"),
        ("capacity", "4294967296"),
    ] {
        reqs.push((
            format!("{k} = {raw}"),
            Req::post("/executors/connect")
                .token(EXEC)
                .raw(with_raw(&t, k, raw)),
        ));
    }
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_executor_heartbeat() {
    let cx = ctx().await;
    let t = json!({"connection_id": cx.conn.connection_id, "in_flight": [{"run_id": cx.run.run_id, "call_id": cx.run.calls[1]}]});
    let path = "/executors/exe_a/heartbeat";
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        path,
        EXEC,
        None,
        Some(&t),
        &["in_flight"],
        &[],
    );
    reqs.push((
        "in_flight item garbage".into(),
        Req::post(path)
            .token(EXEC)
            .raw(with_raw(&t, "in_flight", "[1, \"x\", {\"run_id\": 5}]")),
    ));
    let paths: Vec<String> = garbage_ids()
        .iter()
        .map(|g| format!("/executors/{g}/heartbeat"))
        .collect();
    reqs.extend(path_battery(
        toolrunner::platform::Method::POST,
        EXEC,
        &paths,
        Some(&t),
    ));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_get_executor_pending() {
    let cx = ctx().await;
    let con = &cx.conn.connection_id;
    let mut paths: Vec<String> = [
        "limit=0",
        "limit=101",
        "limit=-1",
        "limit=abc",
        "limit=1e400",
        "limit=99999999999999999999999",
        "limit=1.5",
        "limit=%FF",
        "cursor=%FF%FE",
        "cursor=garbage",
    ]
    .iter()
    .map(|q| format!("/executors/exe_a/pending?connection_id={con}&{q}"))
    .collect();
    paths.push("/executors/exe_a/pending".into());
    paths.push("/executors/exe_a/pending?connection_id=%FF".into());
    paths.push("/executors/exe_a/pending?connection_id=".into());
    for g in garbage_ids() {
        paths.push(format!("/executors/{g}/pending?connection_id={con}"));
    }
    let mut reqs = path_battery(toolrunner::platform::Method::GET, EXEC, &paths, None);
    reqs.push((
        "no Authorization".into(),
        Req::get(&format!("/executors/exe_a/pending?connection_id={con}")),
    ));
    reqs.push((
        "execute-only token".into(),
        Req::get(&format!("/executors/exe_a/pending?connection_id={con}")).token(EXECUTE_ONLY),
    ));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_get_executor_stream() {
    let cx = ctx().await;
    let con = &cx.conn.connection_id;
    // plain HTTP (no WebSocket upgrade), bad queries, bad ids, no token
    let mut paths = vec![
        format!("/executors/exe_a/stream?connection_id={con}"),
        "/executors/exe_a/stream".to_string(),
        "/executors/exe_a/stream?connection_id=%FF".to_string(),
    ];
    for g in garbage_ids() {
        paths.push(format!("/executors/{g}/stream?connection_id={con}"));
    }
    let mut reqs = path_battery(toolrunner::platform::Method::GET, EXEC, &paths, None);
    reqs.push((
        "no Authorization".into(),
        Req::get(&format!("/executors/exe_a/stream?connection_id={con}")),
    ));
    run_battery(&cx, reqs).await;
    // and as WebSocket handshakes: refused with an HTTP error status
    for q in [
        "connection_id=%FF".to_string(),
        String::new(),
        "connection_id=con_garbage".into(),
    ] {
        match cx.fx.open_stream_raw("exe_a", &q, Some(EXEC)).await {
            Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => {
                assert!(resp.status().is_client_error(), "{q}: {:?}", resp.status())
            }
            other => panic!(
                "stream with {q:?} was not refused: {:?}",
                other.map(|_| "opened")
            ),
        }
    }
    let before = snapshot(&cx).await;
    assert_unchanged(&cx, &before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_executor_calls_report() {
    let cx = ctx().await;
    let t = json!({"connection_id": cx.conn.connection_id,
                   "calls": [{"run_id": cx.run.run_id, "call_id": cx.run.calls[1], "state": "pending_delivery"}]});
    let path = "/executors/exe_a/calls/report";
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        path,
        EXEC,
        None,
        Some(&t),
        &[],
        &[],
    );
    for raw in [
        r#"[{"run_id": 5, "call_id": "x", "state": "released"}]"#,
        r#"[{"state": "released"}]"#,
        r#"["released"]"#,
        r#"[null]"#,
        r#"[{"run_id": "RUN", "call_id": "CALL", "state": "exploded"}]"#,
        r#"[{"run_id": "RUN", "call_id": "CALL", "state": "reconciliation_required", "reason": 5}]"#,
        r#"[{"run_id": "RUN", "call_id": "CALL", "state": "pending_delivery", "extra": true}]"#,
    ] {
        let raw = raw
            .replace("RUN", &cx.run.run_id)
            .replace("CALL", &cx.run.calls[1]);
        reqs.push((
            format!("calls = {raw}"),
            Req::post(path).token(EXEC).raw(with_raw(&t, "calls", &raw)),
        ));
    }
    let paths: Vec<String> = garbage_ids()
        .iter()
        .map(|g| format!("/executors/{g}/calls/report"))
        .collect();
    reqs.extend(path_battery(
        toolrunner::platform::Method::POST,
        EXEC,
        &paths,
        Some(&t),
    ));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_executor_disconnect() {
    let cx = ctx().await;
    let t = json!({"connection_id": cx.conn.connection_id, "mode": "drain"});
    let path = "/executors/exe_a/disconnect";
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        path,
        EXEC,
        None,
        Some(&t),
        &[],
        &[],
    );
    for mode in ["\"DRAIN\"", "\"\"", "\"detach \""] {
        reqs.push((
            format!("mode = {mode}"),
            Req::post(path).token(EXEC).raw(with_raw(&t, "mode", mode)),
        ));
    }
    let paths: Vec<String> = garbage_ids()
        .iter()
        .map(|g| format!("/executors/{g}/disconnect"))
        .collect();
    reqs.extend(path_battery(
        toolrunner::platform::Method::POST,
        EXEC,
        &paths,
        Some(&t),
    ));
    run_battery(&cx, reqs).await;
}

// ================================================================ §5

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_claim() {
    let cx = ctx().await;
    let t = json!({"executor_id": "exe_a", "connection_id": cx.conn.connection_id, "operation_key": "op_garbage_1"});
    let path = format!(
        "/runs/{}/tool-calls/{}/claim",
        cx.run.run_id, cx.run.calls[0]
    );
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        &path,
        EXEC,
        None,
        Some(&t),
        &[],
        &[],
    );
    for g in garbage_ids() {
        let paths = [
            format!("/runs/{g}/tool-calls/{}/claim", cx.run.calls[0]),
            format!("/runs/{}/tool-calls/{g}/claim", cx.run.run_id),
        ];
        reqs.extend(path_battery(
            toolrunner::platform::Method::POST,
            EXEC,
            &paths,
            Some(&t),
        ));
    }
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_receipts() {
    let cx = ctx().await;
    let a = &cx.running;
    let t = progress(a, 2);
    let path = format!("/runs/{}/tool-calls/{}/receipts", a.run_id, a.call_id);
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        &path,
        EXEC,
        Some(&a.grant),
        Some(&t),
        &[],
        &[],
    );
    for raw in [
        r#"{"message": 5, "fraction": null, "data": null}"#,
        r#"{"message": "m", "fraction": 2, "data": null}"#,
        r#"{"message": "m", "fraction": -1e400, "data": null}"#,
        r#"[]"#,
        r#"{"message": "m", "fraction": null, "data": null, "zz": 1}"#,
    ] {
        reqs.push((
            format!("progress = {raw}"),
            Req::post(&path)
                .token(EXEC)
                .header("tool-grant", &a.grant)
                .raw(with_raw(&t, "progress", raw)),
        ));
    }
    // a completed receipt whose result does not match the output schema
    let bad_result = completed(a, 3, json!({"charge_id": 5}));
    reqs.push((
        "bad result".into(),
        Req::post(&path)
            .token(EXEC)
            .header("tool-grant", &a.grant)
            .json(&bad_result),
    ));
    let long_grant = "g".repeat(5000);
    for g in ["grt_garbage", "", "grt_%00", long_grant.as_str()] {
        reqs.push((
            format!("grant {g:.20}"),
            Req::post(&path)
                .token(EXEC)
                .header("tool-grant", g)
                .json(&t),
        ));
    }
    for g in garbage_ids() {
        let paths = [
            format!("/runs/{g}/tool-calls/{}/receipts", a.call_id),
            format!("/runs/{}/tool-calls/{g}/receipts", a.run_id),
        ];
        for p in paths {
            reqs.push((
                format!("POST {p}"),
                Req::post(&p)
                    .token(EXEC)
                    .header("tool-grant", &a.grant)
                    .json(&t),
            ));
        }
    }
    run_battery(&cx, reqs).await;
}

// ================================================================ §7

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_runs() {
    let cx = ctx().await;
    let t = json!({"agent_version": cx.fx.agent_version, "subject": "u",
                   "tool_calls": [{"tool_name": READ, "arguments": {}}]});
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        "/runs",
        ADMIN,
        None,
        Some(&t),
        &[],
        &[],
    );
    for raw in [
        r#"[{"tool_name": 5, "arguments": {}}]"#,
        r#"[{"tool_name": "tasks.read", "arguments": []}]"#,
        r#"[{"tool_name": "tasks.read", "arguments": {}, "unchecked": "yes"}]"#,
        r#"[{"tool_name": "tasks.read", "arguments": {}, "extra": 1}]"#,
        r#"[{"tool_name": "tasks.read"}]"#,
        r#"[[]]"#,
    ] {
        reqs.push((
            format!("tool_calls = {raw}"),
            Req::post("/runs")
                .token(ADMIN)
                .raw(with_raw(&t, "tool_calls", raw)),
        ));
    }
    let before_pending = cx.fx.diagnostics().await["calls"]["pending"].clone();
    run_battery(&cx, reqs).await;
    assert_eq!(
        cx.fx.diagnostics().await["calls"]["pending"],
        before_pending,
        "no run was started"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_run_tool_calls() {
    let cx = ctx().await;
    let t = json!({"tool_calls": [{"tool_name": READ, "arguments": {}}]});
    let path = format!("/runs/{}/tool-calls", cx.run.run_id);
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        &path,
        ADMIN,
        None,
        Some(&t),
        &[],
        &[],
    );
    for raw in [
        r#"[{"tool_name": "tasks.read", "arguments": 5}]"#,
        r#"[]"#,
        r#"[{"tool_name": "nope", "arguments": {}}]"#,
    ] {
        reqs.push((
            format!("tool_calls = {raw}"),
            Req::post(&path)
                .token(ADMIN)
                .raw(with_raw(&t, "tool_calls", raw)),
        ));
    }
    let paths: Vec<String> = garbage_ids()
        .iter()
        .map(|g| format!("/runs/{g}/tool-calls"))
        .collect();
    reqs.extend(path_battery(
        toolrunner::platform::Method::POST,
        ADMIN,
        &paths,
        Some(&t),
    ));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_post_run_cancel() {
    let cx = ctx().await;
    let path = format!("/runs/{}/cancel", cx.run.run_id);
    let mut reqs = body_battery(
        toolrunner::platform::Method::POST,
        &path,
        ADMIN,
        None,
        None,
        &[],
        &[],
    );
    reqs.push((
        "runtime:read token".into(),
        Req::post(&path).token(RUNTIME_READ),
    ));
    let paths: Vec<String> = garbage_ids()
        .iter()
        .map(|g| format!("/runs/{g}/cancel"))
        .collect();
    reqs.extend(path_battery(
        toolrunner::platform::Method::POST,
        ADMIN,
        &paths,
        None,
    ));
    run_battery(&cx, reqs).await;
    assert_eq!(cx.fx.get_run(&cx.run.run_id).await["status"], "active");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_get_run() {
    let cx = ctx().await;
    let paths: Vec<String> = garbage_ids().iter().map(|g| format!("/runs/{g}")).collect();
    let mut reqs = path_battery(toolrunner::platform::Method::GET, ADMIN, &paths, None);
    reqs.push((
        "no Authorization".into(),
        Req::get(&format!("/runs/{}", cx.run.run_id)),
    ));
    reqs.push((
        "executor token".into(),
        Req::get(&format!("/runs/{}", cx.run.run_id)).token(EXEC),
    ));
    run_battery(&cx, reqs).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_put_dev_faults() {
    let cx = ctx().await;
    let t = json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 7});
    let mut reqs = body_battery(
        toolrunner::platform::Method::PUT,
        "/dev/faults",
        ADMIN,
        None,
        Some(&t),
        &[],
        &[],
    );
    for (k, raw) in [
        ("error_rate", "1.0000001"),
        ("drop_response_rate", "7"),
        ("latency_ms", "0.5"),
        ("seed", "18446744073709551616"),
    ] {
        reqs.push((
            format!("{k} = {raw}"),
            Req::put("/dev/faults")
                .token(ADMIN)
                .raw(with_raw(&t, k, raw)),
        ));
    }
    run_battery(&cx, reqs).await;
}
