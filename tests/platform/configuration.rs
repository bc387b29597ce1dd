//! §2 Configuration: tool definition rules, endpoints, diagnostics, dry run.

use serde_json::{Value, json};

use crate::common::*;

/// Creates an agent with one binding holding `tool_names`; answers
/// `(agent_id, binding_id)`.
async fn agent_with_binding(srv: &Srv, tool_names: &[&str]) -> (String, String) {
    let a = srv.post(ADMIN, "/agents", json!({"name": "cfg"})).await;
    let agent_id = a.ok()["agent_id"].as_str().unwrap().to_string();
    let b = srv
        .post(
            ADMIN,
            "/executor-bindings",
            json!({"agent_id": agent_id, "name": "b", "tool_names": tool_names}),
        )
        .await;
    let binding_id = b.ok()["binding_id"].as_str().unwrap().to_string();
    (agent_id, binding_id)
}

fn tool(name: &str, binding_id: &str) -> Value {
    json!({"name": name, "description": "d", "binding_id": binding_id, "input_schema": {"type": "object"}})
}

async fn publish(srv: &Srv, agent_id: &str, body: Value) -> Resp {
    srv.post(ADMIN, &format!("/agents/{agent_id}/versions"), body)
        .await
}

/// Publishes one tool mutated by `f` on a fresh agent with binding tool `t.a`.
async fn publish_one(srv: &Srv, f: impl FnOnce(&mut Value)) -> Resp {
    let (agent_id, bid) = agent_with_binding(srv, &["t.a"]).await;
    let mut t = tool("t.a", &bid);
    f(&mut t);
    publish(srv, &agent_id, json!({"tools": [t]})).await
}

// ---------------------------------------------------------------- tool names

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_name_must_be_nonblank_without_whitespace_or_control_characters() {
    let srv = Srv::start().await;
    let (agent_id, bid) = agent_with_binding(&srv, &["ok.name"]).await;
    for bad in [
        "",
        " ",
        "a b",
        "a\tb",
        "a\nb",
        "a\u{0001}b",
        "a\u{007f}b",
        "a\u{00a0}b",
        "a\u{2003}b",
        " lead",
        "trail ",
    ] {
        let r = publish(&srv, &agent_id, json!({"tools": [tool(bad, &bid)]})).await;
        r.envelope();
        assert_eq!(r.status, 400, "name {bad:?}: {r:?}");
        assert_eq!(
            r.json["error"]["type"], "invalid_request_error",
            "name {bad:?} must fail the name rule: {r:?}"
        );
    }
    publish(&srv, &agent_id, json!({"tools": [tool("ok.name", &bid)]}))
        .await
        .ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_name_at_most_512_bytes() {
    let srv = Srv::start().await;
    let n512 = "n".repeat(512);
    let euro170 = "\u{20ac}".repeat(170); // 510 bytes
    let (agent_id, bid) = agent_with_binding(&srv, &[&n512, &euro170]).await;
    publish(
        &srv,
        &agent_id,
        json!({"tools": [tool(&n512, &bid), tool(&euro170, &bid)]}),
    )
    .await
    .ok();
    // 513 bytes, and 171 characters that are 513 bytes: refused (bytes, not characters)
    for bad in ["n".repeat(513), "\u{20ac}".repeat(171)] {
        let r = publish(&srv, &agent_id, json!({"tools": [tool(&bad, &bid)]})).await;
        assert_eq!(r.status, 400, "{r:?}");
        assert_eq!(r.json["error"]["type"], "invalid_request_error", "{r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_name_unique_within_a_version() {
    let srv = Srv::start().await;
    let (agent_id, bid) = agent_with_binding(&srv, &["t.a"]).await;
    let r = publish(
        &srv,
        &agent_id,
        json!({"tools": [tool("t.a", &bid), tool("t.a", &bid)]}),
    )
    .await;
    r.is(400);
    // the same name in two versions is fine
    publish(&srv, &agent_id, json!({"tools": [tool("t.a", &bid)]}))
        .await
        .ok();
    publish(&srv, &agent_id, json!({"tools": [tool("t.a", &bid)]}))
        .await
        .ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_most_64_tools_in_one_agent_version() {
    let srv = Srv::start().await;
    let a = srv.post(ADMIN, "/agents", json!({"name": "many"})).await;
    let agent_id = a.ok()["agent_id"].as_str().unwrap().to_string();
    let names: Vec<String> = (0..65).map(|i| format!("t.{i}")).collect();
    let b1 = srv
        .post(
            ADMIN,
            "/executor-bindings",
            json!({"agent_id": agent_id, "name": "b1", "tool_names": names[..33]}),
        )
        .await;
    let b2 = srv
        .post(
            ADMIN,
            "/executor-bindings",
            json!({"agent_id": agent_id, "name": "b2", "tool_names": names[33..]}),
        )
        .await;
    let b1 = b1.ok()["binding_id"].as_str().unwrap().to_string();
    let b2 = b2.ok()["binding_id"].as_str().unwrap().to_string();
    let tools: Vec<Value> = names
        .iter()
        .enumerate()
        .map(|(i, n)| tool(n, if i < 33 { &b1 } else { &b2 }))
        .collect();
    let r = publish(&srv, &agent_id, json!({"tools": tools[..64]})).await;
    assert_eq!(r.ok()["tools"].as_array().unwrap().len(), 64);
    publish(&srv, &agent_id, json!({"tools": tools}))
        .await
        .is(400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_tool_names_follow_the_name_rules() {
    let srv = Srv::start().await;
    let a = srv.post(ADMIN, "/agents", json!({"name": "b"})).await;
    let agent_id = a.ok()["agent_id"].as_str().unwrap().to_string();
    for bad in [
        json!([""]),
        json!(["a b"]),
        json!(["a\u{0000}"]),
        json!(["x".repeat(513)]),
        json!(["ok", 5]),
    ] {
        let r = srv
            .post(
                ADMIN,
                "/executor-bindings",
                json!({"agent_id": agent_id, "name": "b", "tool_names": bad}),
            )
            .await;
        r.envelope();
        assert_eq!(r.status, 400, "{bad}: {r:?}");
        assert_eq!(r.json["error"]["type"], "invalid_request_error", "{r:?}");
    }
    srv.post(
        ADMIN,
        "/executor-bindings",
        json!({"agent_id": agent_id, "name": "b", "tool_names": ["x".repeat(512)]}),
    )
    .await
    .ok();
}

// ---------------------------------------------------------------- description & schemas

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn description_must_be_a_nonempty_string() {
    let srv = Srv::start().await;
    publish_one(&srv, |t| t["description"] = json!(""))
        .await
        .is(400);
    publish_one(&srv, |t| t["description"] = json!(5))
        .await
        .is(400);
    publish_one(&srv, |t| {
        t.as_object_mut().unwrap().remove("description");
    })
    .await
    .is(400);
    publish_one(&srv, |_| {}).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_schema_root_must_be_explicit_type_object() {
    let srv = Srv::start().await;
    for bad in [
        json!({"type": "array"}),
        json!({"type": "string"}),
        json!({}),
        json!({"properties": {"a": {"type": "string"}}}),
        json!(true),
        json!([]),
    ] {
        let r = publish_one(&srv, |t| t["input_schema"] = bad.clone()).await;
        r.envelope();
        assert_eq!(r.status, 400, "{bad}: {r:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_schema_remote_ref_is_400_local_ref_ok() {
    let srv = Srv::start().await;
    let r = publish_one(&srv, |t| {
        t["input_schema"] = json!({"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/remote.json"}}})
    })
    .await;
    r.is(400);
    let r = publish_one(&srv, |t| {
        t["input_schema"] = json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/s"}},
                                   "$defs": {"s": {"type": "string"}}})
    })
    .await;
    r.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_schema_format_is_an_annotation_only() {
    let srv = Srv::start().await;
    let (agent_id, bid) = agent_with_binding(&srv, &["t.a"]).await;
    let mut t = tool("t.a", &bid);
    t["input_schema"] = json!({"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                                  "at": {"type": "string", "format": "date-time"}}});
    let v = publish(&srv, &agent_id, json!({"tools": [t]})).await;
    let agv = v.ok()["agent_version"].as_str().unwrap().to_string();
    let r = srv
        .post(ADMIN, "/tools/dry-run", json!({"agent_version": agv, "tool_name": "t.a",
                                               "arguments": {"email": "not an email", "at": "yesterday"}}))
        .await;
    assert_eq!(r.ok()["arguments_valid"], true, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_schema_is_2020_12_unless_schema_names_draft_07() {
    let srv = Srv::start().await;
    let (agent_id, bid) = agent_with_binding(&srv, &["t.d7", "t.d2020"]).await;
    let mut d7 = tool("t.d7", &bid);
    d7["input_schema"] = json!({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"a": {"type": "array", "items": [{"type": "string"}], "additionalItems": false}}});
    let mut d2020 = tool("t.d2020", &bid);
    d2020["input_schema"] = json!({"type": "object",
        "properties": {"a": {"type": "array", "prefixItems": [{"type": "string"}], "items": false}}});
    let v = publish(&srv, &agent_id, json!({"tools": [d7, d2020]})).await;
    let agv = v.ok()["agent_version"].as_str().unwrap().to_string();
    let dry = |tool: &str, args: Value| {
        let srv = &srv;
        let agv = agv.clone();
        let tool = tool.to_string();
        async move {
            let r = srv
                .post(
                    ADMIN,
                    "/tools/dry-run",
                    json!({"agent_version": agv, "tool_name": tool, "arguments": args}),
                )
                .await;
            r.ok()["arguments_valid"].clone()
        }
    };
    assert_eq!(dry("t.d7", json!({"a": ["x"]})).await, true);
    assert_eq!(
        dry("t.d7", json!({"a": ["x", 1]})).await,
        false,
        "draft-07 tuple items + additionalItems"
    );
    assert_eq!(dry("t.d2020", json!({"a": ["x"]})).await, true);
    assert_eq!(
        dry("t.d2020", json!({"a": ["x", 1]})).await,
        false,
        "2020-12 prefixItems + items false"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn output_schema_optional_and_its_root_must_be_explicit_type_object() {
    let srv = Srv::start().await;
    for bad in [
        json!({"type": "string"}),
        json!({}),
        json!({"type": "array"}),
    ] {
        let r = publish_one(&srv, |t| t["output_schema"] = bad.clone()).await;
        r.envelope();
        assert_eq!(r.status, 400, "{bad}: {r:?}");
    }
    let r = publish_one(&srv, |t| t["output_schema"] = json!({"type": "object"})).await;
    r.ok();
    let r = publish_one(&srv, |_| {}).await;
    let t = &r.ok()["tools"][0];
    assert!(
        t.get("output_schema").is_none_or(Value::is_null),
        "no output_schema was given: {t}"
    );
}

// ---------------------------------------------------------------- budget, defer_loading, removed fields

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_result_context_bytes_range_1024_to_32768_default_16384() {
    let srv = Srv::start().await;
    for bad in [
        json!(1023),
        json!(32769),
        json!(0),
        json!(-1),
        json!(2048.5),
        json!("2048"),
        json!(null),
    ] {
        let r = publish_one(&srv, |t| t["max_result_context_bytes"] = bad.clone()).await;
        r.envelope();
        assert_eq!(r.status, 400, "{bad}: {r:?}");
        r.param_is("tools[0].max_result_context_bytes");
    }
    for good in [1024, 32768, 4096] {
        let r = publish_one(&srv, |t| t["max_result_context_bytes"] = json!(good)).await;
        assert_eq!(r.ok()["tools"][0]["max_result_context_bytes"], good);
    }
    let r = publish_one(&srv, |_| {}).await;
    assert_eq!(
        r.ok()["tools"][0]["max_result_context_bytes"],
        16384,
        "default filled in"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn defer_loading_null_is_400_default_false() {
    let srv = Srv::start().await;
    let r = publish_one(&srv, |t| t["defer_loading"] = Value::Null).await;
    r.is(400);
    r.param_is("tools[0].defer_loading");
    publish_one(&srv, |t| t["defer_loading"] = json!("yes"))
        .await
        .is(400);
    let r = publish_one(&srv, |_| {}).await;
    let v = r.ok();
    assert_eq!(
        v["tools"][0]["defer_loading"], false,
        "default filled in: {v}"
    );
    assert_eq!(v["tool_search"], false, "default filled in: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_tool_without_tool_search_is_unsupported_or_invalid_configuration() {
    let srv = Srv::start().await;
    let (agent_id, bid) = agent_with_binding(&srv, &["t.a", "t.b"]).await;
    let mut t = tool("t.a", &bid);
    t["defer_loading"] = json!(true);
    publish(&srv, &agent_id, json!({"tools": [t.clone()]}))
        .await
        .unsupported_config();
    publish(
        &srv,
        &agent_id,
        json!({"tools": [t.clone()], "tool_search": false}),
    )
    .await
    .unsupported_config();
    let r = publish(
        &srv,
        &agent_id,
        json!({"tools": [t, tool("t.b", &bid)], "tool_search": true}),
    )
    .await;
    let v = r.ok();
    assert_eq!(v["tool_search"], true);
    assert_eq!(v["tools"][0]["defer_loading"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_search_without_deferred_tool_is_unsupported_or_invalid_configuration() {
    let srv = Srv::start().await;
    let (agent_id, bid) = agent_with_binding(&srv, &["t.a"]).await;
    publish(
        &srv,
        &agent_id,
        json!({"tools": [tool("t.a", &bid)], "tool_search": true}),
    )
    .await
    .unsupported_config();
    let mut t = tool("t.a", &bid);
    t["defer_loading"] = json!(false);
    publish(&srv, &agent_id, json!({"tools": [t], "tool_search": true}))
        .await
        .unsupported_config();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removed_fields_are_400_unsupported_field() {
    let srv = Srv::start().await;
    for f in ["max_result_tokens", "max_result_bytes"] {
        let r = publish_one(&srv, |t| t[f] = json!(4096)).await;
        r.envelope();
        assert_eq!(r.status, 400, "{f}: {r:?}");
        assert_eq!(r.code(), "unsupported_field", "{f}: {r:?}");
    }
}

// ---------------------------------------------------------------- bindings in tool definitions

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_binding_must_belong_to_the_same_agent() {
    let srv = Srv::start().await;
    let (agent_a, _bid_a) = agent_with_binding(&srv, &["t.a"]).await;
    let (_agent_b, bid_b) = agent_with_binding(&srv, &["t.a"]).await;
    let r = publish(&srv, &agent_a, json!({"tools": [tool("t.a", &bid_b)]})).await;
    r.is(400);
    r.param_is("tools[0].binding_id");
    let r = publish(
        &srv,
        &agent_a,
        json!({"tools": [tool("t.a", "bnd_missing")]}),
    )
    .await;
    r.is(400);
    r.param_is("tools[0].binding_id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_name_must_be_in_its_bindings_tool_names() {
    let srv = Srv::start().await;
    let (agent_id, bid) = agent_with_binding(&srv, &["t.a"]).await;
    publish(&srv, &agent_id, json!({"tools": [tool("t.other", &bid)]}))
        .await
        .unsupported_config();
}

// ---------------------------------------------------------------- endpoints

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_agents_creates_agent_with_id_name_created_at() {
    let srv = Srv::start().await;
    let r = srv.post(ADMIN, "/agents", json!({"name": "support"})).await;
    let v = r.ok();
    assert_id(&v["agent_id"], "agt_");
    assert_eq!(v["name"], "support");
    assert_ts(&v["created_at"]);
    // configuration:write is enough, configuration:read is not
    srv.post(CONFIG_WRITE, "/agents", json!({"name": "w"}))
        .await
        .ok();
    srv.post(CONFIG_READ, "/agents", json!({"name": "w"}))
        .await
        .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_executor_bindings_registers_binding() {
    let srv = Srv::start().await;
    let a = srv.post(ADMIN, "/agents", json!({"name": "x"})).await;
    let agent_id = a.ok()["agent_id"].as_str().unwrap().to_string();
    let r = srv
        .post(
            CONFIG_WRITE,
            "/executor-bindings",
            json!({"agent_id": agent_id, "name": "payments", "tool_names": ["p.a", "p.b"]}),
        )
        .await;
    let v = r.ok();
    assert_id(&v["binding_id"], "bnd_");
    assert_eq!(v["agent_id"], agent_id.as_str());
    assert_eq!(v["name"], "payments");
    assert_eq!(v["tool_names"], json!(["p.a", "p.b"]));
    assert_ts(&v["created_at"]);
    srv.post(
        CONFIG_READ,
        "/executor-bindings",
        json!({"agent_id": agent_id, "name": "p", "tool_names": ["p.a"]}),
    )
    .await
    .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_versions_publishes_with_defaults_filled_in() {
    let fx = Fixture::new().await;
    let v = &fx.version;
    assert_id(&v["agent_version"], "agv_");
    assert_eq!(v["agent_id"], fx.agent_id.as_str());
    assert_eq!(v["tool_search"], false);
    assert_ts(&v["created_at"]);
    let tools = v["tools"].as_array().unwrap();
    assert_eq!(tools.len(), 4);
    let read = tools.iter().find(|t| t["name"] == READ).unwrap();
    assert_eq!(read["description"], "Read tasks page by page");
    assert_eq!(read["binding_id"], fx.binding_id.as_str());
    assert_eq!(
        read["input_schema"],
        read_tool(&fx.binding_id)["input_schema"]
    );
    assert_eq!(read["output_schema"], json!({"type": "object"}));
    assert_eq!(read["max_result_context_bytes"], 16384);
    assert_eq!(read["defer_loading"], false);
    let note = tools.iter().find(|t| t["name"] == NOTE).unwrap();
    assert_eq!(note["max_result_context_bytes"], 1024);
    // scope
    let r = fx
        .srv
        .post(
            CONFIG_READ,
            &format!("/agents/{}/versions", fx.agent_id),
            json!({"tools": [read_tool(&fx.binding_id)]}),
        )
        .await;
    r.err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_are_immutable_and_readable() {
    let fx = Fixture::new().await;
    let path = format!("/agents/{}/versions/{}", fx.agent_id, fx.agent_version);
    let got = fx.srv.get(CONFIG_READ, &path).await;
    assert_eq!(got.ok(), &fx.version, "GET answers what POST answered");
    // publishing again makes a new version; the old one reads the same
    let v2 = fx
        .srv
        .post(
            ADMIN,
            &format!("/agents/{}/versions", fx.agent_id),
            json!({"tools": [read_tool(&fx.binding_id)]}),
        )
        .await;
    let v2 = v2.ok().clone();
    assert_ne!(v2["agent_version"], fx.version["agent_version"]);
    assert_eq!(fx.srv.get(ADMIN, &path).await.ok(), &fx.version);
    // there is no way to change a version in place
    let put = fx
        .srv
        .put(ADMIN, &path, json!({"tools": [read_tool(&fx.binding_id)]}))
        .await;
    put.envelope();
    assert!(put.status == 405 || put.status == 404, "{put:?}");
    assert_eq!(fx.srv.get(ADMIN, &path).await.ok(), &fx.version);
    // a version is read under its own agent only
    let other = fx
        .srv
        .post(ADMIN, "/agents", json!({"name": "other"}))
        .await;
    let other_id = other.ok()["agent_id"].as_str().unwrap().to_string();
    fx.srv
        .get(
            ADMIN,
            &format!("/agents/{other_id}/versions/{}", fx.agent_version),
        )
        .await
        .is(404);
    // scope: configuration:read (runtime:read is not it)
    fx.srv
        .get(RUNTIME_READ, &path)
        .await
        .err(403, "missing_scope");
}

/// The development platform's own list of an agent's versions (what
/// `toolrunner dev run` takes the latest of): oldest first, the agent's
/// only; an unknown agent is `404`, an unknown query parameter `400`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_versions_lists_an_agents_versions_oldest_first() {
    let fx = Fixture::new().await;
    let path = format!("/agents/{}/versions", fx.agent_id);
    let v2 = fx
        .srv
        .post(ADMIN, &path, json!({"tools": [read_tool(&fx.binding_id)]}))
        .await;
    let v2 = v2.ok().clone();
    let other = fx
        .srv
        .post(ADMIN, "/agents", json!({"name": "other"}))
        .await;
    let other_id = other.ok()["agent_id"].as_str().unwrap().to_string();
    let listed = fx.srv.get(CONFIG_READ, &path).await;
    let listed = listed.ok();
    assert_eq!(listed["next_cursor"], Value::Null);
    assert_eq!(listed["data"], json!([fx.version, v2]));
    let none = fx
        .srv
        .get(ADMIN, &format!("/agents/{other_id}/versions"))
        .await;
    assert_eq!(none.ok()["data"], json!([]));
    fx.srv
        .get(ADMIN, "/agents/agt_nope/versions")
        .await
        .err(404, "unknown_agent");
    fx.srv
        .get(ADMIN, &format!("{path}?limit=1"))
        .await
        .err(400, "unknown_field");
    fx.srv
        .get(RUNTIME_READ, &path)
        .await
        .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_executor_bindings_lists_bindings_of_an_agent() {
    let fx = Fixture::new().await;
    let other = fx
        .srv
        .post(ADMIN, "/agents", json!({"name": "other"}))
        .await;
    let other_id = other.ok()["agent_id"].as_str().unwrap().to_string();
    let ob = fx
        .srv
        .post(
            ADMIN,
            "/executor-bindings",
            json!({"agent_id": other_id, "name": "o", "tool_names": ["o.a"]}),
        )
        .await;
    let ob_id = ob.ok()["binding_id"].as_str().unwrap().to_string();

    let r = fx
        .srv
        .get(
            CONFIG_READ,
            &format!("/executor-bindings?agent_id={}", fx.agent_id),
        )
        .await;
    let v = r.ok();
    let data = v["data"].as_array().unwrap();
    let mut ids: Vec<&str> = data
        .iter()
        .map(|b| b["binding_id"].as_str().unwrap())
        .collect();
    ids.sort();
    let mut want = vec![fx.binding_id.as_str(), fx.side_binding_id.as_str()];
    want.sort();
    assert_eq!(ids, want, "{v}");
    let main = data
        .iter()
        .find(|b| b["binding_id"] == fx.binding_id.as_str())
        .unwrap();
    assert_eq!(main["agent_id"], fx.agent_id.as_str());
    assert_eq!(main["name"], "main");
    assert_eq!(main["tool_names"], json!([READ, CHARGE, NOTE]));
    assert_ts(&main["created_at"]);
    assert!(v["next_cursor"].is_null());
    // without agent_id: every binding
    let all = fx.srv.get(CONFIG_READ, "/executor-bindings").await;
    let all_ids: Vec<&str> = all.ok()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["binding_id"].as_str().unwrap())
        .collect();
    assert_eq!(all_ids.len(), 3, "{all:?}");
    assert!(all_ids.contains(&ob_id.as_str()));
    fx.srv
        .get(RUNTIME_READ, "/executor-bindings")
        .await
        .err(403, "missing_scope");
}

// ---------------------------------------------------------------- diagnostics

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diagnostics_report_connection_metadata_in_flight_and_call_counts() {
    let fx = Fixture::new().await;
    let calls: Vec<(&str, Value)> = (0..6).map(|_| (READ, json!({}))).collect();
    let run = fx.run(&calls).await;
    fx.run1(SIDE, json!({})).await; // other binding: not counted
    let c = fx.connect("exe_a").await;
    let cs = &run.calls;
    fx.claim_ok(&c, &run.run_id, &cs[0]).await; // claimed
    fx.running(&c, &run.run_id, &cs[1]).await; // running
    fx.running(&c, &run.run_id, &cs[2]).await;
    assert_eq!(
        fx.report1(&c, &run.run_id, &cs[2], "reconciliation_required")
            .await,
        "updated"
    );
    fx.running(&c, &run.run_id, &cs[3]).await;
    assert_eq!(
        fx.report1(&c, &run.run_id, &cs[3], "pending_delivery")
            .await,
        "updated"
    );
    // cs[4], cs[5] pending
    let d = fx
        .srv
        .get(
            CONFIG_READ,
            &format!(
                "/agents/{}/executor-bindings/{}/diagnostics",
                fx.agent_id, fx.binding_id
            ),
        )
        .await;
    let d = d.ok();
    assert_eq!(d["binding_id"], fx.binding_id.as_str());
    assert_eq!(
        d["calls"],
        json!({"pending": 2, "claimed": 1, "running": 2, "reconciliation_required": 1, "pending_delivery": 1}),
        "{d}"
    );
    let execs = d["executors"].as_array().unwrap();
    assert_eq!(execs.len(), 1, "{d}");
    let e = &execs[0];
    assert_eq!(e["executor_id"], "exe_a");
    assert_eq!(e["connection_id"], c.connection_id.as_str());
    assert_eq!(e["status"], "online");
    assert_ts(&e["last_heartbeat_at"]);
    assert_ts(&e["lease_expires_at"]);
    assert_eq!(e["capacity"], 8);
    assert_eq!(
        e["in_flight"], 3,
        "claimed + running, not reconciliation_required: {e}"
    );
    assert_eq!(
        e["sdk"],
        json!({"name": "toolrunner-tests", "version": "0.0.1"})
    );
    fx.srv
        .get(
            RUNTIME_READ,
            &format!(
                "/agents/{}/executor-bindings/{}/diagnostics",
                fx.agent_id, fx.binding_id
            ),
        )
        .await
        .err(403, "missing_scope");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diagnostics_status_offline_after_lease_expiry() {
    let fx = Fixture::with(Opts::lease(400)).await;
    let _c = fx.connect("exe_a").await;
    assert_eq!(fx.exec_diag("exe_a").await["status"], "online");
    sleep_ms(700).await;
    let e = fx.exec_diag("exe_a").await;
    assert_eq!(e["status"], "offline", "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diagnostics_status_draining_until_nothing_bound_then_offline() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    fx.disconnect(&c, "drain").await.ok();
    assert_eq!(fx.exec_diag("exe_a").await["status"], "draining");
    fx.complete(&a, json!({})).await.ok();
    assert_eq!(fx.exec_diag("exe_a").await["status"], "offline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diagnostics_status_offline_when_drained_with_nothing_bound() {
    let fx = Fixture::new().await;
    let c = fx.connect("exe_a").await;
    fx.disconnect(&c, "drain").await.ok();
    assert_eq!(fx.exec_diag("exe_a").await["status"], "offline");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diagnostics_status_detached_until_connect_again() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run_id, &call_id).await;
    fx.disconnect(&c, "detach").await.ok();
    assert_eq!(fx.exec_diag("exe_a").await["status"], "detached");
    let c2 = fx.connect("exe_a").await;
    let e = fx.exec_diag("exe_a").await;
    assert_eq!(e["status"], "online");
    assert_eq!(e["connection_id"], c2.connection_id.as_str());
    assert_eq!(e["in_flight"], 1);
}

// ---------------------------------------------------------------- dry run

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_valid_arguments_and_completed_mock_give_context_preview() {
    let fx = Fixture::new().await;
    let r = fx
        .srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": fx.agent_version, "tool_name": READ, "arguments": {},
                   "mock_receipts": [{"receipt_id": "dry-run-page-001", "kind": "completed",
                                       "result": {"next_cursor": "page-2", "tasks": []}}]}),
        )
        .await;
    assert_eq!(
        r.ok(),
        &json!({"arguments_valid": true, "argument_errors": [],
                "context_preview": {"max_result_context_bytes": 16384, "original_bytes": 35,
                                    "retained_bytes": 35, "truncated": false,
                                    "result": {"next_cursor": "page-2", "tasks": []}},
                "execution_verified": false})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_context_preview_projects_the_first_completed_mock() {
    let fx = Fixture::new().await;
    let r = fx
        .srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": fx.agent_version, "tool_name": READ, "arguments": {},
                   "mock_receipts": [
                       {"receipt_id": "m0", "kind": "failed", "error": {"code": "boom", "message": "no"}},
                       {"receipt_id": "m1", "kind": "completed", "result": {"page": 1}},
                       {"receipt_id": "m2", "kind": "completed", "result": {"page": 2}}]}),
        )
        .await;
    let p = &r.ok()["context_preview"];
    assert_eq!(p["result"], json!({"page": 1}), "{p}");
    assert_eq!(p["original_bytes"], 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_argument_errors_are_json_pointer_paths() {
    let fx = Fixture::new().await;
    let dry = |tool: &str, args: Value| {
        let body = json!({"agent_version": fx.agent_version, "tool_name": tool, "arguments": args});
        let srv = &fx.srv;
        async move { srv.post(ADMIN, "/tools/dry-run", body).await.ok().clone() }
    };
    let paths = |v: &Value| -> Vec<String> {
        v["argument_errors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["path"].as_str().unwrap().to_string())
            .collect()
    };
    let v = dry(READ, json!({"cursor": 5})).await;
    assert_eq!(v["arguments_valid"], false);
    assert_eq!(paths(&v), vec!["/cursor"]);
    for e in v["argument_errors"].as_array().unwrap() {
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{e}");
    }
    let v = dry(CHARGE, json!({"amount": "x", "currency": "EUR"})).await;
    assert_eq!(paths(&v), vec!["/amount"]);
    let v = dry(
        CHARGE,
        json!({"amount": 1, "currency": "EUR", "meta": {"tags": ["a", 5]}}),
    )
    .await;
    assert_eq!(paths(&v), vec!["/meta/tags/1"]);
    let v = dry(
        CHARGE,
        json!({"amount": 1, "currency": "EUR", "meta": {"a/b~c": "x"}}),
    )
    .await;
    assert_eq!(
        paths(&v),
        vec!["/meta/a~1b~0c"],
        "JSON Pointer escapes ~ and /"
    );
    let v = dry(CHARGE, json!({"amount": 1, "currency": "EUR"})).await;
    assert_eq!(v["arguments_valid"], true);
    assert_eq!(v["argument_errors"], json!([]));
    assert_eq!(v["execution_verified"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_context_preview_null_without_completed_mock() {
    let fx = Fixture::new().await;
    let base = json!({"agent_version": fx.agent_version, "tool_name": READ, "arguments": {}});
    let r = fx.srv.post(ADMIN, "/tools/dry-run", base.clone()).await;
    let v = r.ok();
    assert!(
        v.as_object().unwrap().contains_key("context_preview") && v["context_preview"].is_null(),
        "{v}"
    );
    let mut with_failed = base.clone();
    with_failed["mock_receipts"] =
        json!([{"receipt_id": "m1", "kind": "failed", "error": {"code": "boom", "message": "no"}}]);
    let r = fx.srv.post(ADMIN, "/tools/dry-run", with_failed).await;
    assert!(r.ok()["context_preview"].is_null(), "{r:?}");
    let mut with_empty = base;
    with_empty["mock_receipts"] = json!([]);
    let r = fx.srv.post(ADMIN, "/tools/dry-run", with_empty).await;
    assert!(r.ok()["context_preview"].is_null(), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_projects_an_oversized_mock_result_into_the_budget() {
    let fx = Fixture::new().await;
    let result = json!({"items": "x".repeat(3000), "next_cursor": "page-2"});
    let r = fx
        .srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": fx.agent_version, "tool_name": NOTE, "arguments": {},
                   "mock_receipts": [{"receipt_id": "m1", "kind": "completed", "result": result}]}),
        )
        .await;
    let p = &r.ok()["context_preview"];
    assert_eq!(p["max_result_context_bytes"], 1024);
    assert_eq!(p["original_bytes"], canon(&result).len());
    assert_eq!(p["truncated"], true);
    assert_eq!(p["retained_bytes"], canon(&p["result"]).len(), "{p}");
    assert!(p["retained_bytes"].as_u64().unwrap() <= 1024, "{p}");
    assert_eq!(p["result"]["truncated"], true);
    assert_eq!(
        p["result"]["preserved_fields"],
        json!({"next_cursor": "page-2"})
    );
    assert_eq!(r.json["execution_verified"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_execution_verified_is_always_false_and_nothing_runs() {
    let fx = Fixture::new().await;
    for args in [json!({}), json!({"cursor": 1})] {
        let r = fx
            .srv
            .post(
                ADMIN,
                "/tools/dry-run",
                json!({"agent_version": fx.agent_version, "tool_name": READ, "arguments": args,
                       "mock_receipts": [{"receipt_id": "m", "kind": "completed", "result": {}}]}),
            )
            .await;
        assert_eq!(r.ok()["execution_verified"], false);
    }
    let d = fx.diagnostics().await;
    assert_eq!(
        d["calls"],
        json!({"pending": 0, "claimed": 0, "running": 0, "reconciliation_required": 0, "pending_delivery": 0}),
        "a dry run creates no call: {d}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_allowed_with_each_of_its_three_scopes() {
    let fx = Fixture::new().await;
    let body = json!({"agent_version": fx.agent_version, "tool_name": READ, "arguments": {}});
    for tok in [RUNTIME_READ, CONFIG_READ, EXECUTE_ONLY] {
        let r = fx.srv.post(tok, "/tools/dry-run", body.clone()).await;
        assert_eq!(r.ok()["arguments_valid"], true, "{tok}");
    }
    for tok in [CONNECT_ONLY, CONFIG_WRITE, RUNS_WRITE] {
        fx.srv
            .post(tok, "/tools/dry-run", body.clone())
            .await
            .err(403, "missing_scope");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_unknown_version_or_tool_is_400() {
    let fx = Fixture::new().await;
    let r = fx
        .srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": "agv_missing", "tool_name": READ, "arguments": {}}),
        )
        .await;
    r.bad("unknown_agent_version");
    r.param_is("agent_version");
    let r = fx
        .srv
        .post(
            ADMIN,
            "/tools/dry-run",
            json!({"agent_version": fx.agent_version, "tool_name": "nope.tool", "arguments": {}}),
        )
        .await;
    r.bad("unknown_tool");
    r.param_is("tool_name");
}
