//! Every mistake a newcomer makes with the command line gets a message that
//! says what was wrong and what to do: one row per mistake (as the SDK's
//! `tests/executor/error_messages.rs` does for an executor's start).

use super::dev::Dev;
use super::*;

/// One mistake: how to make it, how the command must end, and what its
/// message must (and must not) say.
struct Row {
    mistake: &'static str,
    out: Out,
    code: i32,
    must_say: Vec<String>,
    must_not_say: Vec<&'static str>,
}

#[test]
fn every_mistake_on_the_command_line_says_what_to_do() {
    let p = Platform::start();
    let dev = Dev::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let tools = dir.path().join("tools.json");
    std::fs::write(
        &tools,
        json!({"tools": [{"name": TOOL, "description": "Post a ledger entry",
                          "binding_id": p.binding_id, "input_schema": input_schema()}]})
        .to_string(),
    )
    .expect("write");
    let tools = tools.to_str().expect("utf-8").to_owned();
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        json!([{"name": TOOL, "description": "d", "input_schema": {"type": "string"}}]).to_string(),
    )
    .expect("write");
    let bad = bad.to_str().expect("utf-8").to_owned();
    let agent = p.agent_id();
    let publish = |base: &str, token: &str| {
        run(&[
            "tools",
            "publish",
            &tools,
            "--base-url",
            base,
            "--token",
            token,
            "--agent",
            &agent,
        ])
    };
    // An agent set up, with nothing serving its binding (its own row: the
    // rows that use it fail without it, each saying so).
    let up = run(&["dev", "up", "--tools", &tools, "--base-url", &dev.base]);
    let unserved = up
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("export TOOLRUNNER_AGENT_ID="))
        .unwrap_or("agt_not_set_up")
        .to_owned();
    // An agent with no version.
    let (s, bare) = p.post("/agents", ADMIN, &json!({"name": "bare"}), None);
    assert_eq!(s, 200, "{bare}");
    let bare = bare["agent_id"].as_str().expect("agent_id").to_owned();

    let v1 = format!("{}/v1", p.base);
    let v1_slash = format!("{}/v1/", p.base);
    let rows = vec![
        Row {
            mistake: "none: dev up of good definitions (the agent of the rows below)",
            out: up,
            code: 0,
            must_say: vec!["export TOOLRUNNER_AGENT_ID=agt_".into()],
            must_not_say: vec![],
        },
        Row {
            mistake: "tools publish with an executor's token",
            out: publish(&p.base, EXEC),
            code: 1,
            must_say: vec![
                "configuration:write".into(),
                "give it configuration:write".into(),
            ],
            must_not_say: vec!["executors:connect and tools:execute"],
        },
        Row {
            mistake: "a base URL ending in /v1",
            out: publish(&v1, ADMIN),
            code: 2,
            must_say: vec![
                format!("the base URL `{v1}` ends in /v1: remove it"),
                "toolrunner adds /v1 to every path".into(),
                format!("TOOLRUNNER_BASE_URL={}", p.base),
            ],
            must_not_say: vec!["every path is under /v1"],
        },
        Row {
            mistake: "a base URL ending in /v1/",
            out: publish(&v1_slash, ADMIN),
            code: 2,
            must_say: vec![
                "ends in /v1: remove it".into(),
                format!("TOOLRUNNER_BASE_URL={}", p.base),
            ],
            must_not_say: vec!["every path is under /v1"],
        },
        Row {
            mistake: "dev up with no development platform running",
            out: run(&[
                "dev",
                "up",
                "--tools",
                &tools,
                "--base-url",
                "http://127.0.0.1:9",
            ]),
            code: 2,
            must_say: vec!["http://127.0.0.1:9".into(), "toolrunner devserver".into()],
            must_not_say: vec![],
        },
        Row {
            mistake: "dev up with a definition that fails the checks",
            out: run(&["dev", "up", "--tools", &bad, "--base-url", &dev.base]),
            code: 1,
            must_say: vec!["tools[0].input_schema".into(), "nothing was created".into()],
            must_not_say: vec![],
        },
        Row {
            mistake: "dev up with an executor id an executor would refuse",
            out: run(&[
                "dev",
                "up",
                "--tools",
                &tools,
                "--base-url",
                &dev.base,
                "--executor-id",
                "my executor",
            ]),
            code: 2,
            must_say: vec![
                "--executor-id \"my executor\"".into(),
                "[A-Za-z0-9_.:-]".into(),
                "nothing was created".into(),
            ],
            must_not_say: vec![],
        },
        Row {
            mistake: "dev run with no executor serving the binding",
            out: run(&[
                "dev",
                "run",
                "--tool",
                TOOL,
                "--arguments",
                r#"{"amount": 5}"#,
                "--agent",
                &unserved,
                "--base-url",
                &dev.base,
                "--wait",
                "1",
            ]),
            code: 2,
            must_say: vec![
                "still pending after 1 s".into(),
                "TOOLRUNNER_BINDING_ID".into(),
            ],
            must_not_say: vec![],
        },
        Row {
            mistake: "dev run without an agent",
            out: run(&["dev", "run", "--tool", TOOL, "--base-url", &dev.base]),
            code: 2,
            must_say: vec!["TOOLRUNNER_AGENT_ID".into(), "toolrunner dev up".into()],
            must_not_say: vec![],
        },
        Row {
            mistake: "dev run for an agent with no published version",
            out: run(&[
                "dev",
                "run",
                "--tool",
                TOOL,
                "--agent",
                &bare,
                "--base-url",
                &p.base,
            ]),
            code: 1,
            must_say: vec![bare.clone(), "no published version".into()],
            must_not_say: vec![],
        },
        Row {
            mistake: "dev run of a tool the agent does not have",
            out: run(&[
                "dev",
                "run",
                "--tool",
                "no.such.tool",
                "--agent",
                &unserved,
                "--base-url",
                &dev.base,
            ]),
            code: 1,
            must_say: vec!["no.such.tool".into()],
            must_not_say: vec![],
        },
    ];
    let mut failures = Vec::new();
    for row in rows {
        let text = format!("{}{}", row.out.stdout, row.out.stderr);
        let mut wrong = Vec::new();
        if row.out.code != row.code {
            wrong.push(format!("exits {}, not {}", row.out.code, row.code));
        }
        for part in &row.must_say {
            if !text.contains(part.as_str()) {
                wrong.push(format!("does not say {part:?}"));
            }
        }
        for part in &row.must_not_say {
            if text.contains(part) {
                wrong.push(format!("says {part:?}"));
            }
        }
        if text.contains(GRANT) {
            wrong.push("shows a grant".into());
        }
        if !wrong.is_empty() {
            failures.push(format!(
                "{}: {}\n    {}",
                row.mistake,
                text.trim_end(),
                wrong.join("; ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A client of its own that doubles `/v1` (a base URL ending in `/v1`)
/// hears so from the development platform.
#[test]
fn the_development_platform_names_a_doubled_v1() {
    let p = Platform::start();
    let (status, body) = p.rt.block_on(async {
        let resp = p
            .http
            .request_to(toolrunner::platform::Method::POST, "/v1/v1/agents")
            .json(&json!({"name": "x"}))
            .send()
            .await
            .expect("the platform answers");
        (resp.status, resp.json())
    });
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["code"], json!("unknown_route"), "{body}");
    let message = body["error"]["message"].as_str().expect("a message");
    assert!(
        message.contains("/v1/v1/agents") && message.contains("remove"),
        "{message}"
    );
    assert!(!message.contains("every path is under /v1"), "{message}");
}
