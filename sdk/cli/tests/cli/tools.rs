//! `tools check`.

use super::*;

// ---------------------------------------------------------------- tools check

fn valid_tools() -> Value {
    json!({"tools": [{
        "name": TOOL, "description": "Post a ledger entry", "binding_id": "bnd_1",
        "input_schema": {"type": "object", "properties": {
            "amount": {"type": "integer"},
            "currency": {"type": "string"},
            "memo": {"type": "string"}
        }},
        "output_schema": entry_schema(),
        "max_result_context_bytes": 4096
    }]})
}

fn invalid_tools() -> Value {
    json!({"tools": [
        {"name": "ok.tool", "description": "Fine", "binding_id": "bnd_1",
         "input_schema": {"type": "object", "properties": {}, "additionalProperties": false}},
        {"name": "bad name", "description": "Broken", "binding_id": "bnd_1",
         "input_schema": {"type": "object", "additionalProperties": false},
         "max_result_context_bytes": 100,
         "max_result_tokens": 1000}
    ]})
}

#[test]
fn tools_check_accepts_a_valid_file_and_warns_about_loose_schemas() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tools.json");
    std::fs::write(&file, valid_tools().to_string()).expect("write");
    let file = file.to_str().expect("utf-8");

    let out = run(&["tools", "check", file, "--json"]);
    out.code(0);
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["valid", "problems", "warnings"]));
    assert_eq!(v["valid"], json!(true));
    assert_eq!(v["problems"], json!([]));
    let warnings = v["warnings"].as_array().expect("warnings");
    for w in warnings {
        assert_eq!(key_set(w), keys(&["param", "message"]), "{w}");
    }
    let with = |param: &str, text: &str| {
        warnings.iter().any(|w| {
            w["param"] == json!(param) && w["message"].as_str().is_some_and(|m| m.contains(text))
        })
    };
    assert!(with("tools[0].input_schema", "additionalProperties"), "{v}");
    assert!(with("tools[0].input_schema", "required"), "{v}");
    assert!(
        with("tools[0].input_schema.properties.currency", "enum"),
        "{v}"
    );
    assert_eq!(warnings.len(), 3, "memo is not categorical: {v}");

    let human = run(&["tools", "check", file]);
    human.code(0);
    assert!(
        human
            .stdout
            .contains("warning tools[0].input_schema.properties.currency"),
        "{}",
        human.stdout
    );
    assert!(
        human.stdout.contains("0 problems, 3 warnings"),
        "{}",
        human.stdout
    );

    // The bare array and stdin are accepted too.
    let tools = valid_tools()["tools"].to_string();
    let out = run_stdin(&["tools", "check", "-", "--json"], &tools);
    out.code(0);
    assert_eq!(out.json()["valid"], json!(true));

    // A strict schema gets no warning.
    let strict = json!([{"name": "strict.tool", "description": "d", "binding_id": "b",
        "input_schema": {"type": "object", "properties": {"currency": {"type": "string",
            "enum": ["EUR", "USD"]}}, "required": ["currency"], "additionalProperties": false}}]);
    let out = run_stdin(&["tools", "check", "-", "--json"], &strict.to_string());
    out.code(0);
    assert_eq!(
        out.json(),
        json!({"valid": true, "problems": [], "warnings": []})
    );
}

#[test]
fn tools_check_lists_every_problem_of_an_invalid_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("tools.json");
    std::fs::write(&file, invalid_tools().to_string()).expect("write");
    let file = file.to_str().expect("utf-8");

    let out = run(&["tools", "check", file, "--json"]);
    out.code(1);
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["valid", "problems", "warnings"]));
    assert_eq!(v["valid"], json!(false));
    let problems = v["problems"].as_array().expect("problems");
    for p in problems {
        assert_eq!(
            key_set(p),
            keys(&["param", "code", "type", "message"]),
            "{p}"
        );
        assert!(!p["message"].as_str().unwrap_or_default().is_empty());
    }
    let find = |param: &str| {
        problems
            .iter()
            .find(|p| p["param"] == json!(param))
            .unwrap_or_else(|| panic!("a problem at {param}: {v}"))
            .clone()
    };
    let name = find("tools[1].name");
    assert_eq!(name["code"], json!("invalid_tool_name"));
    assert_eq!(name["type"], json!("invalid_request_error"));
    let budget = find("tools[1].max_result_context_bytes");
    assert_eq!(budget["code"], json!("out_of_range"));
    assert_eq!(budget["type"], json!("invalid_request_error"));
    let removed = find("tools[1].max_result_tokens");
    assert_eq!(removed["code"], json!("unsupported_field"));
    assert_eq!(problems.len(), 3, "{v}");
    assert!(v["warnings"].is_array());
    assert!(out.stderr.contains("3 problems"), "{}", out.stderr);

    let human = run(&["tools", "check", file]);
    human.code(1);
    for p in [
        "error   tools[1].name",
        "error   tools[1].max_result_context_bytes",
        "error   tools[1].max_result_tokens",
        "(unsupported_field)",
        "3 problems",
    ] {
        assert!(human.stdout.contains(p), "{p:?} in\n{}", human.stdout);
    }

    // Version-level problems: tool_search without a deferred tool.
    let doc = json!({"tools": valid_tools()["tools"], "tool_search": true});
    let out = run_stdin(&["tools", "check", "-", "--json"], &doc.to_string());
    out.code(1);
    let v = out.json();
    assert_eq!(v["problems"][0]["param"], json!("tool_search"));
    assert_eq!(
        v["problems"][0]["type"],
        json!("unsupported_or_invalid_configuration")
    );
    // A document without tools.
    let out = run_stdin(&["tools", "check", "-", "--json"], "{}");
    out.code(1);
    assert_eq!(out.json()["problems"][0]["param"], json!("tools"));
}

#[test]
fn tools_check_of_an_unreadable_or_unparsable_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("missing.json");
    let out = run(&["tools", "check", missing.to_str().expect("utf-8")]);
    out.code(2);
    assert!(out.stdout.is_empty());
    assert!(out.stderr.contains("cannot read"), "{}", out.stderr);
    let out = run(&["tools", "check", dir.path().to_str().expect("utf-8")]);
    out.code(2);
    run(&["tools", "check"]).code(2);
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "{\"tools\": [").expect("write");
    let out = run(&["tools", "check", garbage.to_str().expect("utf-8")]);
    out.code(1);
    assert!(out.stderr.contains("not acceptable JSON"), "{}", out.stderr);
}
