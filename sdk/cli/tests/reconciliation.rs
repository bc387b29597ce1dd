//! End to end: calls forced into `reconciliation_required` by the `ledger`
//! example's `boom`, listed by the CLI (also while an executor runs on the
//! same store), one resolved by hand with evidence, the rest settled by the
//! automatic hook, every call terminal on the platform, and the timeline
//! printed by `calls show`.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The `ledger` example binary, built by `cargo test` (or built here).
fn ledger_binary() -> PathBuf {
    let exe = std::env::current_exe().expect("test path");
    let target = exe.parent().and_then(Path::parent).expect("target dir");
    let path = target.join("examples").join("ledger");
    if !path.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "--example", "ledger"])
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
            .status()
            .expect("cargo build --example ledger");
        assert!(status.success());
    }
    path
}

struct Platform {
    http: toolrunner::platform::Platform,
    base: String,
}

impl Platform {
    async fn send(&self, req: toolrunner::platform::RawRequest) -> Value {
        let resp = req.send().await.expect("platform answers");
        let body = resp.json();
        assert!((200..300).contains(&resp.status), "{} {body}", resp.status);
        body
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        self.send(
            self.http
                .request(toolrunner::platform::Method::POST, path)
                .json(&body),
        )
        .await
    }

    async fn run(&self, run_id: &str) -> Value {
        self.send(self.http.request(
            toolrunner::platform::Method::GET,
            &format!("/runs/{run_id}"),
        ))
        .await
    }

    /// Waits until every call is in one of `states`.
    async fn settle(&self, run_id: &str, states: &[&str]) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let run = self.run(run_id).await;
            let all = run["tool_calls"]
                .as_array()
                .expect("calls")
                .iter()
                .all(|c| states.contains(&c["state"].as_str().unwrap_or("")));
            if all {
                return run;
            }
            assert!(Instant::now() < deadline, "calls did not settle: {run}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

struct Ledger(Child);

impl Ledger {
    fn start(base: &str, binding: &str, dir: &Path, auto: bool) -> Ledger {
        let mut cmd = Command::new(ledger_binary());
        cmd.args([
            "--base-url",
            base,
            "--token",
            "dev-executor",
            "--executor-id",
            "ledger-e2e",
            "--binding-id",
            binding,
        ])
        .arg("--db")
        .arg(dir.join("exec.db"))
        .arg("--ledger")
        .arg(dir.join("ledger.jsonl"))
        .args(["--capacity", "4"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if !auto {
            cmd.arg("--no-auto-reconcile");
        }
        Ledger(cmd.spawn().expect("start ledger"))
    }

    fn stop(mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.0.id().to_string())
            .status();
        let status = self.0.wait().expect("wait");
        assert!(status.success(), "ledger did not drain cleanly: {status}");
    }
}

fn toolrunner(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_toolrunner"))
        .args(args)
        .output()
        .expect("run toolrunner");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn listed(db: &str, state: &str) -> Vec<String> {
    let (code, out, err) = toolrunner(&["calls", "list", "--db", db, "--state", state, "--json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).expect("json");
    let mut ids: Vec<String> = v["calls"]
        .as_array()
        .expect("calls")
        .iter()
        .map(|c| c["call_id"].as_str().expect("id").to_owned())
        .collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boom_calls_are_listed_resolved_by_hand_and_by_the_hook() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let server = toolrunner_devserver::DevServer::builder()
        .listen("127.0.0.1:0".parse().expect("addr"))
        .heartbeat_interval_ms(200)
        .start()
        .await
        .expect("platform");
    let p = Platform {
        http: toolrunner::platform::Platform::new(&server.base_url(), "dev-admin")
            .expect("platform client"),
        base: server.base_url(),
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("exec.db").display().to_string();

    let agent = p.post("/agents", json!({"name": "e2e"})).await;
    let agent_id = agent["agent_id"].as_str().expect("agent").to_owned();
    let binding = p
        .post(
            "/executor-bindings",
            json!({"agent_id": agent_id, "name": "ledger", "tool_names": ["ledger.append"]}),
        )
        .await;
    let binding_id = binding["binding_id"].as_str().expect("binding").to_owned();
    let tool = json!({"name": "ledger.append", "description": "append", "binding_id": binding_id,
        "input_schema": {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 1}, "memo": {"type": "string"}},
                         "required": ["amount", "memo"], "additionalProperties": false},
        "output_schema": {"type": "object", "properties": {"entry": {"type": "integer"}}, "required": ["entry"]}});
    let version = p
        .post(
            &format!("/agents/{agent_id}/versions"),
            json!({"tools": [tool]}),
        )
        .await;
    let memos = ["coffee", "boom", "coffee", "boom", "boom", "coffee"];
    let calls: Vec<Value> = memos.iter().enumerate().map(|(i, m)| json!({"tool_name": "ledger.append", "arguments": {"amount": i + 1, "memo": m}})).collect();
    let run = p.post("/runs", json!({"agent_version": version["agent_version"], "subject": "user_1", "tool_calls": calls})).await;
    let run_id = run["run_id"].as_str().expect("run").to_owned();
    let mut booms: Vec<String> = run["tool_calls"]
        .as_array()
        .expect("calls")
        .iter()
        .zip(memos)
        .filter(|(_, m)| *m == "boom")
        .map(|(c, _)| c["call_id"].as_str().expect("id").to_owned())
        .collect();
    booms.sort();

    // 1. Without the hook, every boom stays reconciliation_required; the
    //    CLI lists exactly them while the executor is still running.
    let ledger = Ledger::start(&p.base, &binding_id, dir.path(), false);
    p.settle(&run_id, &["completed", "reconciliation_required"])
        .await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while listed(&db, "reconciliation_required") != booms {
        assert!(
            Instant::now() < deadline,
            "the store did not list exactly the boom calls"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ledger.stop();

    // 2. One by hand, with evidence.
    let by_hand = booms[0].clone();
    let target = format!("{run_id}/{by_hand}");
    let result = dir.path().join("result.json");
    std::fs::write(&result, r#"{"entry": 2}"#).expect("write");
    let (code, out, err) = toolrunner(&[
        "reconcile",
        "resolve",
        &target,
        "--db",
        &db,
        "--completed",
        result.to_str().expect("utf8"),
        "--evidence",
        "ledger line 2 holds the operation key",
        "--who",
        "on-call",
        "--reference",
        "INC-7",
        "--base-url",
        &p.base,
        "--token",
        "dev-executor",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("delivered"), "{out}");
    let (code, _, err) = toolrunner(&[
        "reconcile",
        "resolve",
        &target,
        "--db",
        &db,
        "--failed",
        "x",
        "--message",
        "y",
        "--evidence",
        "again",
    ]);
    assert_eq!(code, 1, "a settled call is refused: {err}");

    // 3. The hook settles the rest: their ledger lines exist.
    let ledger = Ledger::start(&p.base, &binding_id, dir.path(), true);
    let run = p.settle(&run_id, &["completed"]).await;
    ledger.stop();
    assert!(listed(&db, "reconciliation_required").is_empty());
    for c in run["tool_calls"].as_array().expect("calls") {
        assert_eq!(c["state"], "completed", "{c}");
        assert!(
            c["context_projection"]["result"]["entry"]
                .as_u64()
                .is_some(),
            "{c}"
        );
    }

    // 4. The whole timeline of the call resolved by hand.
    let (code, out, err) = toolrunner(&["calls", "show", &target, "--db", &db]);
    assert_eq!(code, 0, "{err}");
    for needle in [
        "claiming",
        "assigned",
        "running",
        "reconciliation_required",
        "resolved by operator",
        "INC-7",
        "on-call",
        "delivered",
        "completed",
    ] {
        assert!(out.contains(needle), "timeline lacks {needle}:\n{out}");
    }
    server.shutdown().await;
}
