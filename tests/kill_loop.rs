//! A real process, killed again and again: the `ledger` example is started
//! against an in-process development platform that loses and refuses
//! requests, and SIGKILLed after a random moment, at least 30 times, on the
//! same store and ledger file. A last start without faults settles
//! everything; then the ledger, the platform and the local store must agree
//! that no entry was written twice, none without `accepted` first, and no
//! receipt ever conflicted.
//!
//! `cargo test --test kill_loop -- --nocapture` prints the figures.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

#[path = "support/ledger.rs"]
mod ledger;

use serde_json::{Value, json};
use toolrunner::testing::store::{CallFilter, LocalState, ReceiptStatus, SqliteStore, Store};
use toolrunner_devserver::{DevServer, Faults};

const ADMIN: &str = "dev-admin";
const EXEC_TOKEN: &str = "dev-executor";
const EXECUTOR_ID: &str = "ledger-kill-01";
const CALLS: usize = 40;
const MIN_KILLS: usize = 30;
const SEED: u64 = 0x5eed_1ed6_e4c0_ffee;

/// xorshift64*: reproducible waits without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low + 1)
    }
}

struct Admin {
    http: toolrunner::platform::Platform,
}

impl Admin {
    async fn send(&self, what: String, req: toolrunner::platform::RawRequest) -> Value {
        let resp = req.send().await.expect("platform answers");
        let body = resp.json();
        assert!(
            (200..300).contains(&resp.status),
            "platform answered {} to {what}: {body}",
            resp.status
        );
        body
    }

    async fn post(&self, path: &str, body: Value) -> Value {
        let req = self
            .http
            .request(toolrunner::platform::Method::POST, path)
            .json(&body);
        self.send(format!("POST {path}"), req).await
    }

    async fn put(&self, path: &str, body: Value) -> Value {
        let req = self
            .http
            .request(toolrunner::platform::Method::PUT, path)
            .json(&body);
        self.send(format!("PUT {path}"), req).await
    }

    async fn get(&self, path: &str) -> Value {
        let req = self.http.request(toolrunner::platform::Method::GET, path);
        self.send(format!("GET {path}"), req).await
    }
}

struct LedgerProcess {
    bin: PathBuf,
    args: Vec<String>,
    stderr: PathBuf,
}

impl LedgerProcess {
    fn spawn(&self) -> Child {
        ledger::spawn(&self.bin, &self.args, &[], &self.stderr).expect("ledger starts")
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

const SETTLED: [&str; 3] = ["completed", "failed", "reconciliation_required"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_survives_repeated_sigkill() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    // The in-process platform's errors show in the test's output.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "toolrunner_devserver=error".into()),
        )
        .with_test_writer()
        .try_init();
    let bin = ledger::ledger_binary().expect("the ledger example builds");
    let started = Instant::now();
    let tmp = tempfile::tempdir().expect("tempdir");
    let db = tmp.path().join("exec.db");
    let ledger = tmp.path().join("ledger.jsonl");
    let stderr = tmp.path().join("ledger-stderr.log");

    // A file database: the in-memory one loses its tables when a request
    // is abandoned by its client in the middle of a write (sqlx then opens
    // a fresh, empty `:memory:` connection), which a SIGKILL loop does all
    // the time.
    let platform = DevServer::builder()
        .listen("127.0.0.1:0".parse().expect("addr"))
        .db_path(tmp.path().join("platform.db"))
        .faults(Faults {
            error_rate: 0.1,
            drop_response_rate: 0.15,
            latency_ms: 0,
            seed: 7,
        })
        .lease_ttl_ms(1000)
        .heartbeat_interval_ms(200)
        .start()
        .await
        .expect("devserver starts");
    let admin = Admin {
        http: toolrunner::platform::Platform::new(&platform.base_url(), ADMIN)
            .expect("platform client"),
    };
    let ledger::Published {
        agent_id,
        binding_id,
        agent_version,
    } = ledger::publish_ledger(&admin.http, "kill-loop")
        .await
        .expect("the ledger tool is published");
    let memos: Vec<&str> = (0..CALLS)
        .map(|i| if i == 11 || i == 29 { "fail" } else { "coffee" })
        .collect();
    let calls: Vec<Value> = memos
        .iter()
        .enumerate()
        .map(|(i, m)| json!({"tool_name": "ledger.append", "arguments": {"amount": 100 + i, "memo": m}}))
        .collect();
    let run = admin
        .post(
            "/runs",
            json!({"agent_version": agent_version, "subject": "user_42",
                   "tool_calls": calls}),
        )
        .await;
    let run_id = run["run_id"].as_str().expect("run_id").to_owned();

    let child = LedgerProcess {
        bin,
        args: ledger::Serving {
            base_url: &platform.base_url(),
            token: EXEC_TOKEN,
            executor_id: EXECUTOR_ID,
            binding_id: &binding_id,
            db: &db.display().to_string(),
            ledger: &ledger,
            capacity: 4,
            effect_delay_ms: 20,
        }
        .args(&[]),
        stderr: stderr.clone(),
    };

    // ---------------------------------------------------------- the loop
    let mut rng = Rng(SEED);
    let mut kills = 0;
    while kills < MIN_KILLS {
        let mut c = child.spawn();
        tokio::time::sleep(Duration::from_millis(rng.between(50, 400))).await;
        if let Some(status) = c.try_wait().expect("try_wait") {
            // It stopped by itself: that is a failure of its own.
            panic!(
                "the ledger exited by itself ({status}) after {kills} kills:\n{}",
                tail(&stderr, 30)
            );
        }
        c.kill().expect("SIGKILL");
        c.wait().expect("wait");
        kills += 1;
    }
    let loop_time = started.elapsed();

    // ------------------------------------------------- the settling start
    admin
        .put(
            "/dev/faults",
            json!({"error_rate": 0.0, "drop_response_rate": 0.0, "latency_ms": 0, "seed": 7}),
        )
        .await;
    let diagnostics = format!("/agents/{agent_id}/executor-bindings/{binding_id}/diagnostics");
    let connection_of = |d: &Value| {
        d["executors"]
            .as_array()
            .and_then(|e| e.iter().find(|e| e["executor_id"] == EXECUTOR_ID))
            .map(|e| e["connection_id"].clone())
    };
    let before = connection_of(&admin.get(&diagnostics).await);
    let mut last = child.spawn();
    // SIGTERM drains only once the process has its handler (installed
    // after it connected): wait for its own connection first.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = connection_of(&admin.get(&diagnostics).await);
        if now.is_some() && now != before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the last start never connected:\n{}",
            tail(&stderr, 30)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let settled_run = loop {
        let run = admin.get(&format!("/runs/{run_id}")).await;
        let all_settled = run["tool_calls"]
            .as_array()
            .expect("tool_calls")
            .iter()
            .all(|c| SETTLED.contains(&c["state"].as_str().unwrap_or("")));
        if all_settled {
            break run;
        }
        if Instant::now() > deadline || last.try_wait().expect("try_wait").is_some() {
            let _ = last.kill();
            let _ = last.wait();
            let states: Vec<(Value, Value)> = run["tool_calls"]
                .as_array()
                .expect("tool_calls")
                .iter()
                .filter(|c| !SETTLED.contains(&c["state"].as_str().unwrap_or("")))
                .map(|c| (c["call_id"].clone(), c["state"].clone()))
                .collect();
            panic!(
                "calls did not settle within 60 s of the last start: {states:?}\n{}",
                tail(&stderr, 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Its signal handler is installed right after `start()` returns.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let term = Command::new("kill")
        .args(["-TERM", &last.id().to_string()])
        .status()
        .expect("kill -TERM");
    assert!(term.success());
    let exit = loop {
        if let Some(s) = last.try_wait().expect("try_wait") {
            break s;
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(15),
            "the ledger did not exit after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        exit.success(),
        "SIGTERM must drain and exit 0, got {exit}:\n{}",
        tail(&stderr, 30)
    );

    // ------------------------------------------------------- the checks
    let run = admin.get(&format!("/runs/{run_id}")).await;
    for (a, b) in run["tool_calls"]
        .as_array()
        .expect("tool_calls")
        .iter()
        .zip(settled_run["tool_calls"].as_array().expect("tool_calls"))
    {
        // Only the automatic check may still settle an unknown outcome.
        assert!(
            a["state"] == b["state"] || b["state"] == "reconciliation_required",
            "a settled call changed during the drain: {b} -> {a}"
        );
    }
    let calls = run["tool_calls"].as_array().expect("tool_calls").clone();
    let by_id: HashMap<String, &Value> = calls
        .iter()
        .map(|c| (c["call_id"].as_str().expect("call_id").to_owned(), c))
        .collect();
    let text = std::fs::read_to_string(&ledger).unwrap_or_default();
    let mut lines_by_call: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    let mut all_lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("ledger line {} is not JSON ({e}): {line:?}", n + 1));
        lines_by_call
            .entry(v["call_id"].as_str().expect("call_id").to_owned())
            .or_default()
            .push(v.clone());
        all_lines.push(v);
    }
    let store = SqliteStore::open(&format!("sqlite://{}", db.display()))
        .await
        .expect("store opens");

    // (1) No call has two ledger lines.
    let duplicates: Vec<(&String, usize)> = lines_by_call
        .iter()
        .filter(|(_, l)| l.len() > 1)
        .map(|(c, l)| (c, l.len()))
        .collect();

    // (2) Every line belongs to a call the platform accepted, under the key
    // and assignment the executor claimed it with.
    for line in &all_lines {
        assert_eq!(line["run_id"], run_id.as_str(), "{line}");
        let call_id = line["call_id"].as_str().expect("call_id");
        let call = by_id
            .get(call_id)
            .unwrap_or_else(|| panic!("ledger line for an unknown call: {line}"));
        let accepted: Vec<&Value> = call["receipts"]
            .as_array()
            .expect("receipts")
            .iter()
            .filter(|r| r["kind"] == "accepted")
            .collect();
        assert_eq!(
            accepted.len(),
            1,
            "a ledger line without exactly one accepted receipt: {line}\n{call}"
        );
        let local = store
            .call(&run_id, call_id)
            .await
            .expect("store readable")
            .unwrap_or_else(|| panic!("the store does not know {call_id}"));
        assert_eq!(
            line["operation_key"],
            local.operation_key.as_str(),
            "the line's key is not the key the call was claimed and accepted with"
        );
        let asg = local
            .assignment
            .as_ref()
            .expect("an accepted call has its assignment");
        assert_eq!(
            accepted[0]["body"]["assignment_id"],
            asg.assignment_id.as_str()
        );
        assert_eq!(call["assignment_id"], asg.assignment_id.as_str());
        assert_eq!(line["amount"], call["arguments"]["amount"]);
    }

    // (3) No receipt conflict anywhere.
    let mut outbox = Vec::new();
    let mut late = Vec::new();
    for c in &calls {
        let call_id = c["call_id"].as_str().expect("call_id");
        if c["late_receipts"] != json!([]) {
            late.push(c.clone());
        }
        outbox.extend(store.receipts(&run_id, call_id).await.expect("readable"));
    }
    let conflicts: Vec<_> = outbox
        .iter()
        .filter(|r| {
            r.last_error
                .as_deref()
                .is_some_and(|e| e.contains("receipt_conflict") || e.contains("sequence_conflict"))
        })
        .collect();
    let mut receipt_status: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &outbox {
        *receipt_status.entry(r.status.as_str()).or_default() += 1;
    }
    let local_calls = store.calls(&CallFilter::default()).await.expect("readable");
    let mut local_states: BTreeMap<&str, usize> = BTreeMap::new();
    for c in &local_calls {
        *local_states.entry(c.state.as_str()).or_default() += 1;
    }

    // (4) Every call settled, consistently with the ledger.
    let mut platform_states: BTreeMap<String, usize> = BTreeMap::new();
    let mut not_performed = 0;
    for (i, c) in calls.iter().enumerate() {
        let state = c["state"].as_str().unwrap_or("?");
        *platform_states.entry(state.to_owned()).or_default() += 1;
        let call_id = c["call_id"].as_str().expect("call_id");
        let lines = lines_by_call.get(call_id).map_or(0, Vec::len);
        match state {
            "completed" => {
                assert_ne!(memos[i], "fail", "a declined entry completed: {c}");
                assert_eq!(
                    lines, 1,
                    "completed call {call_id} has {lines} ledger lines"
                );
                let entry = c["context_projection"]["result"]["entry"]
                    .as_u64()
                    .expect("entry");
                let at = usize::try_from(entry).expect("fits") - 1;
                assert_eq!(
                    all_lines.get(at).map(|l| l["call_id"].clone()),
                    Some(json!(call_id)),
                    "completed call {call_id} reports entry {entry}, which is another call's line"
                );
            }
            "failed" => {
                // `declined`: the handler refused a "fail" memo; or
                // `not_performed`: the automatic check found no entry for a
                // call whose process died after `accepted`.
                let code = c["receipts"]
                    .as_array()
                    .and_then(|r| r.last())
                    .map(|r| r["body"]["error"]["code"].clone())
                    .unwrap_or(Value::Null);
                match code.as_str() {
                    Some("declined") => assert_eq!(memos[i], "fail", "{c}"),
                    Some("not_performed") => not_performed += 1,
                    _ => panic!("unexpected failure: {c}"),
                }
                assert_eq!(lines, 0, "failed call {call_id} wrote a line");
            }
            "reconciliation_required" => assert!(lines <= 1),
            other => panic!("call {call_id} ended {other}"),
        }
    }
    let reconciliation = platform_states
        .get("reconciliation_required")
        .copied()
        .unwrap_or(0);

    println!("kill loop: {kills} SIGKILLs in {loop_time:.1?}");
    println!(
        "calls: {}, platform states: {platform_states:?}",
        calls.len()
    );
    println!(
        "ledger lines: {}, calls with a line: {}, duplicates: {}",
        all_lines.len(),
        lines_by_call.len(),
        duplicates.len()
    );
    let auto_checked: Vec<&str> = local_calls
        .iter()
        .filter_map(|c| c.reason.as_deref())
        .filter(|r| r.starts_with("automatic check"))
        .collect();
    println!(
        "reconciliation_required left: {reconciliation}; settled by the automatic check: {} \
         (happened: {}, not performed: {not_performed})",
        auto_checked.len(),
        auto_checked
            .iter()
            .filter(|r| r.contains("operation happened"))
            .count()
    );
    println!("local states: {local_states:?}; outbox receipts: {receipt_status:?}");
    println!(
        "receipt conflicts: {}; total time {:.1?}",
        conflicts.len(),
        started.elapsed()
    );

    assert!(
        duplicates.is_empty(),
        "calls with two ledger lines: {duplicates:?}"
    );
    assert!(conflicts.is_empty(), "conflicting receipts: {conflicts:#?}");
    assert!(late.is_empty(), "late receipts on the platform: {late:#?}");
    assert!(kills >= MIN_KILLS);
    for c in local_calls
        .iter()
        .filter(|c| c.state == LocalState::Rejected)
    {
        println!("REJECTED call {} reason {:?}", c.call_id, c.reason);
        for r in store
            .receipts(&c.run_id, &c.call_id)
            .await
            .expect("readable")
        {
            println!(
                "  receipt {} {} seq {} {} attempts {} error {:?} body {}",
                r.receipt_id,
                r.kind.as_str(),
                r.sequence,
                r.status.as_str(),
                r.attempts,
                r.last_error,
                r.body
            );
        }
        for e in store.events(&c.run_id, &c.call_id).await.expect("readable") {
            println!("  {} {} {:?}", e.at(), e.what(), e.detail());
        }
        println!("  platform: {}", by_id[c.call_id.as_str()]);
    }
    assert!(
        local_calls.iter().all(|c| c.state != LocalState::Rejected),
        "a final receipt was refused: {local_states:?} (a second final receipt for a call \
         already delivered: see crash.rs after_handler_write_tool_with_reconcile_hook_settles_once)"
    );
    assert!(
        outbox.iter().all(|r| r.status != ReceiptStatus::Pending),
        "receipts still pending after the drain"
    );
    platform.shutdown().await;
}
