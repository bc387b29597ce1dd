//! `toolrunner dev up` and `toolrunner dev run`: a crate's tools from a
//! definitions file to a completed call, against a fresh development
//! platform and an executor serving in this process.

use std::collections::BTreeMap;

use toolrunner::{CallContext, Executor, Shutdown, ToolError};

use super::*;

/// What the lookup tool is asked.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct Lookup {
    /// The key to look up.
    key: String,
}

/// What it answers.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Found {
    /// The call's operation key.
    key: String,
}

/// Answers the call's operation key.
async fn lookup(ctx: CallContext, _q: Lookup) -> Result<Found, ToolError> {
    Ok(Found {
        key: ctx.operation_key().to_owned(),
    })
}

/// Always a confirmed business failure.
async fn refuse(_ctx: CallContext, q: Lookup) -> Result<Found, ToolError> {
    Err(ToolError::failed(
        "declined",
        format!("the key {} is closed", q.key),
    ))
}

/// The executor of these tests, with `settings` (`TOOLRUNNER_*` names).
fn executor(settings: &BTreeMap<String, String>, store: &Path) -> toolrunner::ExecutorBuilder {
    let get = |name: &str| {
        settings
            .get(name)
            .unwrap_or_else(|| panic!("no {name} in {settings:?}"))
            .clone()
    };
    Executor::builder()
        .base_url(get("TOOLRUNNER_BASE_URL"))
        .token(get("TOOLRUNNER_TOKEN"))
        .executor_id(get("TOOLRUNNER_EXECUTOR_ID"))
        .binding_id(get("TOOLRUNNER_BINDING_ID"))
        .store_url(format!("sqlite://{}", store.display()))
        .allow_all()
        .tool(toolrunner::tool::read("dev.lookup", lookup).describe("Looks a key up"))
        .tool(toolrunner::tool::write("dev.refuse", refuse).describe("Refuses every key"))
}

/// The tool definitions as an executor built without a binding yet would
/// print them (a placeholder binding id), as `{"tools": [...]}`.
fn definitions() -> String {
    let placeholders: BTreeMap<String, String> = [
        ("TOOLRUNNER_BASE_URL", "http://127.0.0.1:9"),
        ("TOOLRUNNER_TOKEN", "unused"),
        ("TOOLRUNNER_EXECUTOR_ID", "unused"),
        ("TOOLRUNNER_BINDING_ID", "bnd_placeholder"),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect();
    let built = executor(&placeholders, Path::new("/nonexistent/unused.db"))
        .build()
        .expect("the executor builds");
    json!({"tools": built.tool_definitions()}).to_string()
}

/// A development platform in this process with nothing on it, with its
/// default tokens.
pub(crate) struct Dev {
    // Dropped before the runtime that serves it.
    _server: DevServer,
    pub(crate) base: String,
    pub(crate) http: toolrunner::platform::Platform,
    pub(crate) rt: tokio::runtime::Runtime,
}

impl Dev {
    pub(crate) fn start() -> Dev {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = runtime();
        let server = rt
            .block_on(
                DevServer::builder()
                    .listen("127.0.0.1:0".parse().expect("addr"))
                    .start(),
            )
            .expect("devserver starts");
        Dev {
            base: server.base_url(),
            http: toolrunner::platform::Platform::new(&server.base_url(), ADMIN)
                .expect("platform client"),
            _server: server,
            rt,
        }
    }

    /// Every binding on the platform.
    pub(crate) fn bindings(&self) -> Vec<Value> {
        let resp = self
            .rt
            .block_on(
                self.http
                    .request(toolrunner::platform::Method::GET, "/executor-bindings")
                    .send(),
            )
            .expect("the platform answers");
        assert_eq!(resp.status, 200);
        resp.json()["data"].as_array().cloned().unwrap_or_default()
    }
}

/// The `export NAME=VALUE` lines of `dev up`, which must be exactly the
/// five, in order, and nothing else.
fn exports(stdout: &str) -> BTreeMap<String, String> {
    let names = [
        "TOOLRUNNER_BASE_URL",
        "TOOLRUNNER_TOKEN",
        "TOOLRUNNER_EXECUTOR_ID",
        "TOOLRUNNER_BINDING_ID",
        "TOOLRUNNER_AGENT_ID",
    ];
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), names.len(), "five lines on stdout:\n{stdout}");
    let mut out = BTreeMap::new();
    for (line, name) in lines.iter().zip(names) {
        let value = line
            .strip_prefix(&format!("export {name}="))
            .unwrap_or_else(|| panic!("{line:?} is not `export {name}=…`"));
        out.insert(name.to_owned(), value.to_owned());
    }
    out
}

#[test]
fn dev_up_then_dev_run_completes_a_call_of_a_served_tool() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let tools = dir.path().join("tools.json");
    std::fs::write(&tools, definitions()).expect("write");
    let tools = tools.to_str().expect("utf-8");

    let out = run(&["dev", "up", "--tools", tools, "--base-url", &dev.base]);
    out.code(0);
    let env = exports(&out.stdout);
    assert_eq!(env["TOOLRUNNER_BASE_URL"], dev.base);
    assert_eq!(env["TOOLRUNNER_TOKEN"], EXEC);
    assert_eq!(env["TOOLRUNNER_EXECUTOR_ID"], "dev-01");
    let binding = env["TOOLRUNNER_BINDING_ID"].clone();
    let agent = env["TOOLRUNNER_AGENT_ID"].clone();
    assert!(binding.starts_with("bnd_"), "{binding}");
    assert!(agent.starts_with("agt_"), "{agent}");
    for part in [
        agent.as_str(),
        binding.as_str(),
        "dev-agent",
        "agv_",
        "dev.lookup",
        "dev.refuse",
        "toolrunner dev run --tool NAME --arguments JSON",
    ] {
        assert!(out.stderr.contains(part), "{part:?} in\n{}", out.stderr);
    }
    // The binding serves both tools, for the executor id.
    let listed = dev.bindings();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["binding_id"], json!(binding));
    assert_eq!(listed[0]["agent_id"], json!(agent));
    assert_eq!(listed[0]["tool_names"], json!(["dev.lookup", "dev.refuse"]));

    // Nothing serves the binding yet: the call stays pending.
    let waiting = run_cmd(toolrunner().env("TOOLRUNNER_AGENT_ID", &agent).args([
        "dev",
        "run",
        "--tool",
        "dev.lookup",
        "--arguments",
        r#"{"key": "k1"}"#,
        "--base-url",
        &dev.base,
        "--wait",
        "1",
    ]));
    assert_ne!(waiting.code, 0, "{}", waiting.stderr);
    assert!(
        waiting.stderr.contains("still pending after 1 s")
            && waiting.stderr.contains("TOOLRUNNER_BINDING_ID"),
        "{}",
        waiting.stderr
    );

    // An executor with the exported settings serves it.
    let running = dev
        .rt
        .block_on(
            executor(&env, &dir.path().join("exec.db"))
                .build()
                .expect("builds")
                .start(),
        )
        .expect("the executor starts");
    let dev_run = |tool: &str| {
        run_cmd(toolrunner().env("TOOLRUNNER_AGENT_ID", &agent).args([
            "dev",
            "run",
            "--tool",
            tool,
            "--arguments",
            r#"{"key": "k1"}"#,
            "--base-url",
            &dev.base,
        ]))
    };
    let done = dev_run("dev.lookup");
    done.code(0);
    let line = done.stdout.trim_end();
    assert_eq!(done.stdout.lines().count(), 1, "{}", done.stdout);
    let rest = line
        .strip_prefix("call call_")
        .unwrap_or_else(|| panic!("{line:?}"));
    let (_, rest) = rest.split_once(' ').expect("call id, then state");
    let result = rest
        .strip_prefix("completed ")
        .unwrap_or_else(|| panic!("{line:?} is not completed"));
    let result: Value = serde_json::from_str(result).expect("the result as JSON");
    assert!(
        result["key"].as_str().is_some_and(|k| !k.is_empty()),
        "{result}"
    );

    // A failed call: its code and message, and the refused exit code.
    let failed = dev_run("dev.refuse");
    failed.code(1);
    let line = failed.stdout.trim_end();
    assert!(
        line.starts_with("call call_") && line.ends_with(" failed declined: the key k1 is closed"),
        "{line:?}"
    );
    assert!(failed.stderr.contains("failed"), "{}", failed.stderr);

    dev.rt
        .block_on(running.shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        }))
        .expect("the executor drains");
}

#[test]
fn dev_up_output_sets_the_environment_through_eval() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let tools = dir.path().join("tools.json");
    std::fs::write(&tools, definitions()).expect("write");
    let bin = assert_cmd::cargo::cargo_bin("toolrunner");
    let script = format!(
        "eval \"$('{}' dev up --tools '{}' --agent 'my agent' --executor-id pay.01)\" && \
         printf '%s|%s|%s|%s|%s\\n' \"$TOOLRUNNER_BASE_URL\" \"$TOOLRUNNER_TOKEN\" \
         \"$TOOLRUNNER_EXECUTOR_ID\" \"$TOOLRUNNER_BINDING_ID\" \"$TOOLRUNNER_AGENT_ID\"",
        bin.display(),
        tools.display()
    );
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .env_remove("TOOLRUNNER_TOKEN")
        .env_remove("TOOLRUNNER_ADMIN_TOKEN")
        .env("TOOLRUNNER_BASE_URL", &dev.base)
        .output()
        .expect("sh runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let fields: Vec<&str> = stdout.trim_end().split('|').collect();
    assert_eq!(fields.len(), 5, "{stdout}");
    assert_eq!(fields[0], dev.base);
    assert_eq!(fields[1], EXEC);
    assert_eq!(fields[2], "pay.01");
    assert!(fields[3].starts_with("bnd_"), "{stdout}");
    assert!(fields[4].starts_with("agt_"), "{stdout}");
    let listed = dev.bindings();
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(listed[0]["name"], json!("pay.01"));
}

#[test]
fn dev_up_refuses_definitions_with_a_problem_and_creates_nothing() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        json!([{"name": "dev.lookup", "description": "Looks a key up",
                "input_schema": {"type": "string"}}])
        .to_string(),
    )
    .expect("write");
    let out = run(&[
        "dev",
        "up",
        "--tools",
        bad.to_str().expect("utf-8"),
        "--base-url",
        &dev.base,
    ]);
    out.code(1);
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    assert!(
        out.stderr.contains("tools[0].input_schema") && out.stderr.contains("nothing was created"),
        "{}",
        out.stderr
    );
    assert_eq!(dev.bindings(), Vec::<Value>::new(), "a binding was created");
}

#[test]
fn dev_up_reads_the_bare_array_from_stdin() {
    let dev = Dev::start();
    let doc: Value = serde_json::from_str(&definitions()).expect("JSON");
    let out = run_stdin(
        &["dev", "up", "--tools", "-", "--base-url", &dev.base],
        &doc["tools"].to_string(),
    );
    out.code(0);
    let env = exports(&out.stdout);
    assert!(env["TOOLRUNNER_BINDING_ID"].starts_with("bnd_"));
}

/// The development platform lists an agent's versions oldest first (`dev
/// run` takes the last); an unknown agent is `404`.
#[test]
fn the_versions_of_an_agent_are_listed_oldest_first() {
    let dev = Dev::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let tools = dir.path().join("tools.json");
    std::fs::write(&tools, definitions()).expect("write");
    let out = run(&[
        "dev",
        "up",
        "--tools",
        tools.to_str().expect("utf-8"),
        "--base-url",
        &dev.base,
    ]);
    out.code(0);
    let env = exports(&out.stdout);
    let agent = &env["TOOLRUNNER_AGENT_ID"];
    let (first, again) = dev.rt.block_on(async {
        let first = dev.http.versions(agent).await.expect("the versions");
        let again = dev
            .http
            .publish(agent, &first[0].tools)
            .await
            .expect("published again");
        (first, again)
    });
    assert_eq!(first.len(), 1);
    let listed = dev
        .rt
        .block_on(dev.http.versions(agent))
        .expect("the versions");
    let ids: Vec<&str> = listed.iter().map(|v| v.agent_version.as_str()).collect();
    assert_eq!(
        ids,
        [
            first[0].agent_version.as_str(),
            again.agent_version.as_str()
        ]
    );
    let e = dev
        .rt
        .block_on(dev.http.versions("agt_nope"))
        .expect_err("an unknown agent");
    assert_eq!(e.status(), Some(404), "{e}");
}
