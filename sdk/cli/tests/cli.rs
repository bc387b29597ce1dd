//! The `toolrunner` operator command line, run as a process: every
//! subcommand with its success, refusal (exit 1, nothing changed) and usage
//! (exit 2) cases, and the stable `--json` shapes field by field.
//!
//! Stores are built directly with the library (`SqliteStore` + `Change`), so
//! no executor has to run; commands that talk to a platform run against an
//! in-process `DevServer`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use assert_cmd::Command;
use serde_json::{Value, json};
use tempfile::TempDir;
use toolrunner::protocol::wire::{Assignment, Grant, ReceiptKind};
use toolrunner::store::{
    Change, Event, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus, SqliteStore,
    Store,
};
use toolrunner_devserver::DevServer;

/// The grant of every seeded assignment: a secret that must never be printed.
const GRANT: &str = "grt_SECRET_cli_must_never_print_this";
/// The executor named in the seeded receipts.
const EXECUTOR: &str = "exe_cli_test";
/// The write tool of the seeded calls.
const TOOL: &str = "ledger.post";
/// The default tokens of the development platform.
const ADMIN: &str = "dev-admin";
const EXEC: &str = "dev-executor";

const RECON: &str = "run_1/call_recon";
const REJECTED: &str = "run_1/call_rejected";
const DELIVERED: &str = "run_2/call_delivered";
const SETTLED: &str = "run_2/call_settled";
const CLAIMING: &str = "run_3/call_claiming";

// ---------------------------------------------------------------- helpers

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn now() -> toolrunner::store::Timestamp {
    let t = chrono::Utc::now();
    chrono::DurationRound::duration_trunc(t, chrono::TimeDelta::milliseconds(1)).unwrap_or(t)
}

fn entry_schema() -> Value {
    json!({"type":"object","properties":{"entry":{"type":"integer"}},"required":["entry"]})
}

fn input_schema() -> Value {
    json!({"type":"object","properties":{"amount":{"type":"integer","minimum":1}},
           "required":["amount"],"additionalProperties":false})
}

fn key_set(v: &Value) -> BTreeSet<String> {
    v.as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect()
}

fn keys(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| (*s).to_owned()).collect()
}

/// What a finished `toolrunner` process left.
struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Out {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}):\n{}", self.stdout))
    }

    #[track_caller]
    fn code(&self, want: i32) -> &Self {
        assert_eq!(
            self.code, want,
            "exit code\n--- stdout\n{}\n--- stderr\n{}",
            self.stdout, self.stderr
        );
        self
    }

    #[track_caller]
    fn no_grant(&self) -> &Self {
        assert!(
            !self.stdout.contains(GRANT) && !self.stderr.contains(GRANT),
            "the grant was printed:\n{}\n{}",
            self.stdout,
            self.stderr
        );
        self
    }
}

/// `toolrunner` with a clean environment (no TOOLRUNNER_* from the caller).
fn toolrunner() -> Command {
    let mut c = Command::cargo_bin("toolrunner").expect("the toolrunner binary");
    for v in [
        "TOOLRUNNER_DB",
        "TOOLRUNNER_BASE_URL",
        "TOOLRUNNER_TOKEN",
        "RUST_LOG",
    ] {
        c.env_remove(v);
    }
    c.env("USER", "tester");
    c.timeout(Duration::from_secs(120));
    c
}

fn run(args: &[&str]) -> Out {
    run_cmd(toolrunner().args(args))
}

fn run_stdin(args: &[&str], stdin: &str) -> Out {
    run_cmd(toolrunner().args(args).write_stdin(stdin.to_owned()))
}

fn run_cmd(c: &mut Command) -> Out {
    let o = c.output().expect("run toolrunner");
    Out {
        code: o.status.code().expect("exit code (not killed by a signal)"),
        stdout: String::from_utf8(o.stdout).expect("utf-8 stdout"),
        stderr: String::from_utf8(o.stderr).expect("utf-8 stderr"),
    }
}

fn assignment(run_id: &str, call_id: &str, tool: &str, output_schema: Option<Value>) -> Assignment {
    Assignment {
        assignment_id: format!("asg_{call_id}"),
        run_id: run_id.into(),
        call_id: call_id.into(),
        tool_name: tool.into(),
        arguments: json!({"amount": 5}),
        arguments_digest: "sha256:00".into(),
        grant: Grant::new(GRANT),
        subject: "user_42".into(),
        agent_id: "agt_1".into(),
        agent_version: "agv_1".into(),
        binding_id: "bnd_1".into(),
        max_result_context_bytes: 16384,
        input_schema: input_schema(),
        output_schema,
    }
}

fn local_call(
    asg: Option<Assignment>,
    run_id: &str,
    call_id: &str,
    tool: &str,
    state: LocalState,
    next_sequence: u64,
) -> LocalCall {
    LocalCall {
        run_id: run_id.into(),
        call_id: call_id.into(),
        tool_name: tool.into(),
        operation_key: format!("op_{call_id}"),
        state,
        assignment: asg,
        next_sequence,
        reason: None,
        report: None,
        created_at: now(),
        updated_at: now(),
        version: 0,
    }
}

/// A receipt of `call` as the executor would have stored it.
fn receipt(
    call: &LocalCall,
    kind: ReceiptKind,
    sequence: u64,
    status: ReceiptStatus,
    extra: Value,
) -> OutboxReceipt {
    let asg = call.assignment.as_ref().expect("an assignment");
    let receipt_id = format!("rcp_{}_{sequence}", call.call_id);
    let mut body = json!({"receipt_id": receipt_id, "executor_id": EXECUTOR,
        "assignment_id": asg.assignment_id, "sequence": sequence, "kind": kind.as_str()});
    if let (Some(b), Value::Object(extra)) = (body.as_object_mut(), extra) {
        b.extend(extra);
    }
    let delivered = status == ReceiptStatus::Delivered;
    OutboxReceipt {
        receipt_id,
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        assignment_id: asg.assignment_id.clone(),
        kind,
        sequence,
        body: body.to_string(),
        status,
        attempts: u32::from(status != ReceiptStatus::Pending),
        last_error: None,
        created_at: now(),
        delivered_at: delivered.then(now),
    }
}

/// An executor store in a temporary directory.
struct Fixture {
    rt: tokio::runtime::Runtime,
    dir: TempDir,
    db: PathBuf,
}

impl Fixture {
    /// An empty (migrated) store.
    fn empty() -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("exec.db");
        let f = Fixture {
            rt: runtime(),
            dir,
            db,
        };
        f.commit(Vec::new());
        f
    }

    /// A store with one call in each interesting state:
    ///
    /// - `run_1/call_recon`: reconciliation_required, output_schema
    ///   `{entry: integer}`, receipts accepted (0) and progress (1), both
    ///   delivered, next_sequence 2;
    /// - `run_1/call_rejected`: rejected, its completed receipt rejected;
    /// - `run_2/call_delivered`: delivered (tool `tasks.read`);
    /// - `run_2/call_settled`: settled, its completed receipt pending after
    ///   3 failed attempts;
    /// - `run_3/call_claiming`: claiming, no assignment yet.
    fn seeded() -> Fixture {
        let f = Fixture::empty();
        let mut recon = local_call(
            Some(assignment(
                "run_1",
                "call_recon",
                TOOL,
                Some(entry_schema()),
            )),
            "run_1",
            "call_recon",
            TOOL,
            LocalState::ReconciliationRequired,
            2,
        );
        recon.reason = Some("handler failed after accepted".into());
        recon.report = Some(PendingReport::ReconciliationRequired);
        let recon_receipts = vec![
            receipt(
                &recon,
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
                json!({}),
            ),
            receipt(
                &recon,
                ReceiptKind::Progress,
                1,
                ReceiptStatus::Delivered,
                json!({"progress": {"message": "half way", "fraction": 0.5, "data": null}}),
            ),
        ];

        let mut rejected = local_call(
            Some(assignment(
                "run_1",
                "call_rejected",
                TOOL,
                Some(entry_schema()),
            )),
            "run_1",
            "call_rejected",
            TOOL,
            LocalState::Rejected,
            2,
        );
        rejected.reason = Some("409 run_terminated: the run was cancelled".into());
        let mut rejected_final = receipt(
            &rejected,
            ReceiptKind::Completed,
            1,
            ReceiptStatus::Rejected,
            json!({"result": {"entry": 9}}),
        );
        rejected_final.last_error = Some("409 run_terminated: the run was cancelled".into());
        let rejected_receipts = vec![
            receipt(
                &rejected,
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
                json!({}),
            ),
            rejected_final,
        ];

        let delivered = local_call(
            Some(assignment("run_2", "call_delivered", "tasks.read", None)),
            "run_2",
            "call_delivered",
            "tasks.read",
            LocalState::Delivered,
            2,
        );
        let delivered_receipts = vec![
            receipt(
                &delivered,
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
                json!({}),
            ),
            receipt(
                &delivered,
                ReceiptKind::Completed,
                1,
                ReceiptStatus::Delivered,
                json!({"result": {"tasks": []}}),
            ),
        ];

        let mut settled = local_call(
            Some(assignment(
                "run_2",
                "call_settled",
                TOOL,
                Some(entry_schema()),
            )),
            "run_2",
            "call_settled",
            TOOL,
            LocalState::Settled,
            2,
        );
        settled.report = Some(PendingReport::PendingDelivery);
        let mut settled_final = receipt(
            &settled,
            ReceiptKind::Completed,
            1,
            ReceiptStatus::Pending,
            json!({"result": {"entry": 3}}),
        );
        settled_final.attempts = 3;
        settled_final.last_error = Some("POST /runs/run_2/...: could not connect".into());
        let settled_receipts = vec![
            receipt(
                &settled,
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
                json!({}),
            ),
            settled_final,
        ];

        let claiming = local_call(
            None,
            "run_3",
            "call_claiming",
            TOOL,
            LocalState::Claiming,
            0,
        );

        for (call, receipts) in [
            (recon, recon_receipts),
            (rejected, rejected_receipts),
            (delivered, delivered_receipts),
            (settled, settled_receipts),
            (claiming, Vec::new()),
        ] {
            // As the executor's lifecycle writes it: the row and the
            // timeline entry of its state.
            let note = Change::Note {
                run_id: call.run_id.clone(),
                call_id: call.call_id.clone(),
                what: call.state.as_str().to_owned(),
                detail: call.reason.clone(),
            };
            let mut changes = vec![Change::InsertCall(call), note];
            changes.extend(receipts.into_iter().map(Change::AddReceipt));
            f.commit(changes);
        }
        f
    }

    fn url(&self) -> String {
        format!("sqlite://{}", self.db.display())
    }

    fn db(&self) -> &str {
        self.db.to_str().expect("utf-8 path")
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn write(&self, name: &str, text: &str) -> String {
        let p = self.path(name);
        std::fs::write(&p, text).expect("write file");
        p.to_str().expect("utf-8 path").to_owned()
    }

    fn with_store<T>(&self, f: impl AsyncFnOnce(&SqliteStore) -> T) -> T {
        self.rt.block_on(async {
            let s = SqliteStore::open(&self.url()).await.expect("open store");
            f(&s).await
        })
    }

    fn commit(&self, changes: Vec<Change>) {
        self.with_store(async |s| s.commit(changes).await.expect("commit"));
    }

    fn call(&self, call_ref: &str) -> LocalCall {
        let (r, c) = call_ref.split_once('/').expect("RUN/CALL");
        self.with_store(async |s| s.call(r, c).await.expect("read call"))
            .unwrap_or_else(|| panic!("no call {call_ref}"))
    }

    fn receipts(&self, call_ref: &str) -> Vec<OutboxReceipt> {
        let (r, c) = call_ref.split_once('/').expect("RUN/CALL");
        self.with_store(async |s| s.receipts(r, c).await.expect("read receipts"))
    }

    fn events(&self, call_ref: &str) -> Vec<Event> {
        let (r, c) = call_ref.split_once('/').expect("RUN/CALL");
        self.with_store(async |s| s.events(r, c).await.expect("read events"))
    }

    /// `toolrunner ARGS --db THIS_STORE`.
    fn run(&self, args: &[&str]) -> Out {
        run_cmd(toolrunner().args(args).args(["--db", self.db()]))
    }

    fn run_stdin(&self, args: &[&str], stdin: &str) -> Out {
        run_cmd(
            toolrunner()
                .args(args)
                .args(["--db", self.db()])
                .write_stdin(stdin.to_owned()),
        )
    }

    /// What an operator command must leave untouched when it refuses.
    fn snapshot(&self, call_ref: &str) -> (LocalState, u64, usize, usize) {
        let c = self.call(call_ref);
        (
            c.state,
            c.next_sequence,
            self.receipts(call_ref).len(),
            self.events(call_ref).len(),
        )
    }
}

/// A development platform in this process, with one agent, one binding
/// (`ledger.post`) and one published version.
struct Platform {
    // Dropped before the runtime that serves it.
    _server: DevServer,
    base: String,
    http: toolrunner::platform::Platform,
    agent_version: String,
    binding_id: String,
    agent: String,
    rt: tokio::runtime::Runtime,
}

impl Platform {
    fn start() -> Platform {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let rt = runtime();
        let server = rt
            .block_on(
                DevServer::builder()
                    .listen("127.0.0.1:0".parse().expect("addr"))
                    .start(),
            )
            .expect("devserver starts");
        let mut p = Platform {
            base: server.base_url(),
            http: toolrunner::platform::Platform::new(&server.base_url(), ADMIN)
                .expect("platform client"),
            _server: server,
            agent_version: String::new(),
            binding_id: String::new(),
            agent: String::new(),
            rt,
        };
        let (s, agent) = p.post("/agents", ADMIN, &json!({"name": "cli-tests"}), None);
        assert_eq!(s, 200, "{agent}");
        let agent_id = agent["agent_id"].as_str().expect("agent_id").to_owned();
        p.agent = agent_id.clone();
        let (s, binding) = p.post(
            "/executor-bindings",
            ADMIN,
            &json!({"agent_id": agent_id, "name": "main", "tool_names": [TOOL]}),
            None,
        );
        assert_eq!(s, 200, "{binding}");
        p.binding_id = binding["binding_id"]
            .as_str()
            .expect("binding_id")
            .to_owned();
        let tool = json!({"name": TOOL, "description": "Post a ledger entry",
            "binding_id": p.binding_id, "input_schema": input_schema(),
            "output_schema": entry_schema()});
        let (s, version) = p.post(
            &format!("/agents/{agent_id}/versions"),
            ADMIN,
            &json!({"tools": [tool]}),
            None,
        );
        assert_eq!(s, 200, "{version}");
        p.agent_version = version["agent_version"]
            .as_str()
            .expect("agent_version")
            .to_owned();
        p
    }

    fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        token: &str,
        body: Option<&Value>,
        grant: Option<&str>,
    ) -> (u16, Value) {
        self.rt.block_on(async {
            let mut req = self.http.request(method, path).token(Some(token));
            if let Some(b) = body {
                req = req.json(b);
            }
            if let Some(g) = grant {
                req = req.header("Tool-Grant", g);
            }
            let resp = req.send().await.expect("platform answers");
            (resp.status, resp.json())
        })
    }

    fn post(&self, path: &str, token: &str, body: &Value, grant: Option<&str>) -> (u16, Value) {
        self.send(reqwest::Method::POST, path, token, Some(body), grant)
    }

    fn agent_id(&self) -> String {
        self.agent.clone()
    }

    fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.send(reqwest::Method::GET, path, token, None, None)
    }

    /// Starts a run with one `ledger.post` call, claims it as `executor_id`
    /// and confirms it with `accepted`: the call is `running` on the
    /// platform. Returns the assignment and the accepted receipt's body.
    fn running_call(&self, executor_id: &str) -> (Assignment, String) {
        let (s, conn) = self.post(
            "/executors/connect",
            EXEC,
            &json!({"executor_id": executor_id, "binding_id": self.binding_id,
                    "tools": [TOOL], "capacity": 4}),
            None,
        );
        assert_eq!(s, 200, "{conn}");
        let connection_id = conn["connection_id"].as_str().expect("connection_id");
        let (s, run) = self.post(
            "/runs",
            ADMIN,
            &json!({"agent_version": self.agent_version, "subject": "user_42",
                    "tool_calls": [{"tool_name": TOOL, "arguments": {"amount": 5}}]}),
            None,
        );
        assert_eq!(s, 200, "{run}");
        let run_id = run["run_id"].as_str().expect("run_id");
        let call_id = run["tool_calls"][0]["call_id"].as_str().expect("call_id");
        let (s, claimed) = self.post(
            &format!("/runs/{run_id}/tool-calls/{call_id}/claim"),
            EXEC,
            &json!({"executor_id": executor_id, "connection_id": connection_id,
                    "operation_key": format!("op_{call_id}")}),
            None,
        );
        assert_eq!(s, 200, "{claimed}");
        let asg: Assignment =
            serde_json::from_value(claimed["assignment"].clone()).expect("an assignment");
        let accepted = json!({"receipt_id": format!("rcp_{call_id}_0"), "executor_id": executor_id,
            "assignment_id": asg.assignment_id, "sequence": 0, "kind": "accepted"})
        .to_string();
        let (s, answer) = self.rt.block_on(async {
            let resp = self
                .http
                .request(
                    reqwest::Method::POST,
                    &format!("/runs/{run_id}/tool-calls/{call_id}/receipts"),
                )
                .token(Some(EXEC))
                .header("Tool-Grant", asg.grant.expose())
                .header("Content-Type", "application/json")
                .body(accepted.clone())
                .send()
                .await
                .expect("platform answers");
            (resp.status, resp.json())
        });
        assert_eq!(s, 200, "{answer}");
        assert_eq!(answer["accepted"], json!(true), "{answer}");
        (asg, accepted)
    }

    /// The platform's view of the run's only call.
    fn platform_call(&self, run_id: &str) -> Value {
        let (s, run) = self.get(&format!("/runs/{run_id}"), ADMIN);
        assert_eq!(s, 200, "{run}");
        run["tool_calls"][0].clone()
    }
}

/// The change that writes `call` over its stored row (one version on).
fn update(mut call: LocalCall) -> Change {
    let expect_version = call.version;
    call.version += 1;
    Change::UpdateCall {
        expect_version,
        call,
    }
}

/// Puts a call the platform knows (`running` there) into `f`'s store in
/// `state`, with its delivered `accepted` receipt. Returns `RUN/CALL`.
fn import_running_call(f: &Fixture, asg: &Assignment, accepted: &str, state: LocalState) -> String {
    let mut call = local_call(
        Some(asg.clone()),
        &asg.run_id,
        &asg.call_id,
        &asg.tool_name,
        state,
        1,
    );
    call.reason = Some("the handler's outcome is unknown".into());
    let mut acc = receipt(
        &call,
        ReceiptKind::Accepted,
        0,
        ReceiptStatus::Delivered,
        json!({}),
    );
    acc.body = accepted.to_owned();
    f.commit(vec![Change::InsertCall(call), Change::AddReceipt(acc)]);
    format!("{}/{}", asg.run_id, asg.call_id)
}

// ---------------------------------------------------------------- help

#[test]
fn help_of_the_binary_and_of_every_subcommand_exits_0() {
    let commands: &[&[&str]] = &[
        &[],
        &["calls"],
        &["calls", "list"],
        &["calls", "show"],
        &["reconcile"],
        &["reconcile", "resolve"],
        &["reconcile", "compensated"],
        &["reconcile", "close"],
        &["outbox"],
        &["outbox", "status"],
        &["outbox", "redeliver"],
        &["tools"],
        &["tools", "check"],
        &["tools", "dry-run"],
        &["tools", "publish"],
        &["budget"],
        &["devserver"],
    ];
    for c in commands {
        let mut args = c.to_vec();
        args.push("--help");
        let out = run(&args);
        out.code(0);
        assert!(out.stdout.contains("Usage:"), "{args:?}: {}", out.stdout);
    }
    let top = run(&["--help"]);
    for sub in [
        "calls",
        "reconcile",
        "outbox",
        "tools",
        "budget",
        "devserver",
    ] {
        assert!(
            top.stdout.contains(sub),
            "--help lists {sub}: {}",
            top.stdout
        );
    }
    let resolve = run(&["reconcile", "resolve", "--help"]);
    for flag in [
        "--completed",
        "--failed",
        "--cancelled",
        "--evidence",
        "--who",
        "--reference",
        "--db",
        "--base-url",
        "--token",
        "--json",
    ] {
        assert!(resolve.stdout.contains(flag), "resolve --help shows {flag}");
    }
    run(&["--version"]).code(0);
}

#[test]
fn no_or_unknown_subcommand_is_a_usage_error() {
    run(&[]).code(2);
    run(&["calls"]).code(2);
    run(&["frobnicate"]).code(2);
    run(&["calls", "list", "--no-such-flag"]).code(2);
}

// ---------------------------------------------------------------- calls list

#[test]
fn calls_list_json_has_every_summary_field_and_no_grant() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "list", "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["calls"]));
    let calls = v["calls"].as_array().expect("calls array");
    assert_eq!(calls.len(), 5, "{v}");
    let summary_keys = keys(&[
        "run_id",
        "call_id",
        "tool_name",
        "state",
        "operation_key",
        "assignment_id",
        "subject",
        "reason",
        "created_at",
        "updated_at",
    ]);
    for c in calls {
        assert_eq!(key_set(c), summary_keys, "{c}");
    }
    let by_id = |id: &str| {
        calls
            .iter()
            .find(|c| c["call_id"] == json!(id))
            .unwrap_or_else(|| panic!("{id} listed"))
            .clone()
    };
    let recon = by_id("call_recon");
    assert_eq!(recon["run_id"], json!("run_1"));
    assert_eq!(recon["tool_name"], json!(TOOL));
    assert_eq!(recon["state"], json!("reconciliation_required"));
    assert_eq!(recon["operation_key"], json!("op_call_recon"));
    assert_eq!(recon["assignment_id"], json!("asg_call_recon"));
    assert_eq!(recon["subject"], json!("user_42"));
    assert_eq!(recon["reason"], json!("handler failed after accepted"));
    for t in ["created_at", "updated_at"] {
        let s = recon[t].as_str().expect("a timestamp string");
        assert!(
            chrono::DateTime::parse_from_rfc3339(s).is_ok(),
            "{t} is RFC 3339: {s}"
        );
    }
    let states: BTreeSet<&str> = calls
        .iter()
        .map(|c| c["state"].as_str().expect("state"))
        .collect();
    assert_eq!(
        states,
        BTreeSet::from([
            "reconciliation_required",
            "rejected",
            "delivered",
            "settled",
            "claiming"
        ])
    );
    let claiming = by_id("call_claiming");
    assert_eq!(claiming["assignment_id"], Value::Null);
    assert_eq!(claiming["subject"], Value::Null);
    assert_eq!(claiming["reason"], Value::Null);
    assert_eq!(by_id("call_delivered")["tool_name"], json!("tasks.read"));
}

#[test]
fn calls_list_human_shows_a_table_and_a_count_without_the_grant() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "list"]);
    out.code(0).no_grant();
    for s in [
        "call",
        "tool",
        "state",
        "updated",
        "reason",
        RECON,
        REJECTED,
        DELIVERED,
        SETTLED,
        CLAIMING,
        "reconciliation_required",
        "handler failed after accepted",
        "5 calls",
    ] {
        assert!(out.stdout.contains(s), "{s:?} in\n{}", out.stdout);
    }
}

#[test]
fn calls_list_filters_by_state_and_refuses_an_unknown_state() {
    let f = Fixture::seeded();
    for (state, want) in [
        ("reconciliation_required", RECON),
        ("rejected", REJECTED),
        ("delivered", DELIVERED),
        ("settled", SETTLED),
        ("claiming", CLAIMING),
    ] {
        let out = f.run(&["calls", "list", "--state", state, "--json"]);
        out.code(0);
        let v = out.json();
        let calls = v["calls"].as_array().expect("calls");
        assert_eq!(calls.len(), 1, "--state {state}: {v}");
        let c = &calls[0];
        assert_eq!(
            format!(
                "{}/{}",
                c["run_id"].as_str().unwrap_or_default(),
                c["call_id"].as_str().unwrap_or_default()
            ),
            want
        );
        assert_eq!(c["state"], json!(state));
    }
    let none = f.run(&["calls", "list", "--state", "compensated", "--json"]);
    none.code(0);
    assert_eq!(none.json(), json!({"calls": []}));
    let human = f.run(&["calls", "list", "--state", "rejected"]);
    human.code(0);
    assert!(human.stdout.contains("1 calls"), "{}", human.stdout);

    let bad = f.run(&["calls", "list", "--state", "stuck"]);
    bad.code(2);
    assert!(bad.stdout.is_empty(), "{}", bad.stdout);
    assert!(bad.stderr.contains("stuck"), "{}", bad.stderr);
    assert!(
        bad.stderr.contains("reconciliation_required") && bad.stderr.contains("compensated"),
        "the error lists the states: {}",
        bad.stderr
    );
}

#[test]
fn calls_list_filters_by_tool() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "list", "--tool", "tasks.read", "--json"]);
    out.code(0);
    let v = out.json();
    let calls = v["calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!(calls[0]["call_id"], json!("call_delivered"));

    let out = f.run(&["calls", "list", "--tool", TOOL, "--json"]);
    out.code(0);
    assert_eq!(out.json()["calls"].as_array().expect("calls").len(), 4);

    let out = f.run(&[
        "calls", "list", "--tool", TOOL, "--state", "settled", "--json",
    ]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["calls"].as_array().expect("calls").len(), 1, "{v}");
    assert_eq!(v["calls"][0]["call_id"], json!("call_settled"));

    let out = f.run(&["calls", "list", "--tool", "no.such.tool", "--json"]);
    out.code(0);
    assert_eq!(out.json(), json!({"calls": []}));
}

#[test]
fn calls_list_older_than_compares_with_the_last_change() {
    let f = Fixture::seeded();
    std::thread::sleep(Duration::from_millis(20));
    let all = f.run(&["calls", "list", "--older-than", "0s", "--json"]);
    all.code(0);
    assert_eq!(all.json()["calls"].as_array().expect("calls").len(), 5);

    let fresh = f.run(&["calls", "list", "--older-than", "1h", "--json"]);
    fresh.code(0);
    assert_eq!(fresh.json(), json!({"calls": []}));

    let combined = f.run(&[
        "calls",
        "list",
        "--older-than",
        "0s",
        "--state",
        "rejected",
        "--json",
    ]);
    combined.code(0);
    assert_eq!(combined.json()["calls"].as_array().expect("calls").len(), 1);

    f.run(&["calls", "list", "--older-than", "soon"]).code(2);
}

#[test]
fn calls_list_is_ordered_oldest_change_first() {
    let f = Fixture::seeded();
    f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "withdrawn",
        "--evidence",
        "ticket 3",
    ])
    .code(0);
    let out = f.run(&["calls", "list", "--json"]);
    out.code(0);
    let v = out.json();
    let calls = v["calls"].as_array().expect("calls");
    let updated: Vec<&str> = calls
        .iter()
        .map(|c| c["updated_at"].as_str().expect("updated_at"))
        .collect();
    let mut sorted = updated.clone();
    sorted.sort_unstable();
    assert_eq!(updated, sorted, "oldest change first: {v}");
    assert_eq!(
        calls.last().expect("a call")["call_id"],
        json!("call_recon"),
        "the call just resolved changed last: {v}"
    );
}

#[test]
fn calls_list_older_than_a_huge_age_lists_nothing_and_does_not_crash() {
    // An age beyond the calendar cannot match any call: the answer is an
    // empty list (or a usage error), never a panic and never every call.
    let f = Fixture::seeded();
    let mut wrong = Vec::new();
    // 300000 years: `now - age` leaves chrono's calendar; 5e9 years: the age
    // does not fit a chrono duration at all.
    for age in ["300000years", "5000000000years"] {
        let out = f.run(&["calls", "list", "--older-than", age, "--json"]);
        match out.code {
            0 => {
                let listed = out.json()["calls"].as_array().map_or(0, Vec::len);
                if listed != 0 {
                    wrong.push(format!("--older-than {age}: exit 0 listing {listed} calls"));
                }
            }
            2 => {}
            code => wrong.push(format!(
                "--older-than {age}: exit {code}: {}",
                out.stderr.lines().take(2).collect::<Vec<_>>().join(" | ")
            )),
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}");
}

#[test]
fn a_not_a_store_file_is_a_setup_error_and_stays_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("notes.db");
    std::fs::write(&file, "hello, not a database").expect("write");
    let out = run(&["calls", "list", "--db", file.to_str().expect("utf-8")]);
    out.code(2);
    assert!(out.stdout.is_empty());
    assert_eq!(
        std::fs::read_to_string(&file).expect("read"),
        "hello, not a database"
    );
    run(&[
        "outbox",
        "status",
        "--db",
        dir.path().to_str().expect("utf-8"),
    ])
    .code(2);
}

#[test]
fn a_store_path_with_a_percent_sign_opens_that_very_file() {
    // `--db` takes a path; the CLI checks that this path exists and then
    // opens `sqlite://PATH`, whose path part sqlx percent-decodes. The
    // operator must see the store they named, not a new empty one.
    let f = Fixture::seeded();
    let odd = f.path("exec%41.db");
    std::fs::copy(&f.db, &odd).expect("copy the store");
    for suffix in ["-wal", "-shm"] {
        let side = PathBuf::from(format!("{}{suffix}", f.db.display()));
        if side.exists() {
            std::fs::copy(&side, format!("{}{suffix}", odd.display())).expect("copy");
        }
    }
    let out = run(&[
        "calls",
        "list",
        "--json",
        "--db",
        odd.to_str().expect("utf-8"),
    ]);
    out.code(0);
    assert_eq!(
        out.json()["calls"].as_array().expect("calls").len(),
        5,
        "the CLI read another store than {}",
        odd.display()
    );
    assert!(
        !f.path("execA.db").exists(),
        "the CLI created a new store at the percent-decoded path execA.db"
    );
}

#[test]
fn every_store_command_without_a_store_is_a_setup_error_and_creates_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.db");
    let missing = missing.to_str().expect("utf-8");
    let result = dir.path().join("r.json");
    std::fs::write(&result, r#"{"entry": 1}"#).expect("write");
    let result = result.to_str().expect("utf-8");
    let commands: Vec<Vec<&str>> = vec![
        vec!["calls", "list"],
        vec!["calls", "list", "--json"],
        vec!["calls", "show", RECON],
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            result,
            "--evidence",
            "checked",
        ],
        vec![
            "reconcile",
            "compensated",
            REJECTED,
            "--evidence",
            "checked",
        ],
        vec!["outbox", "status"],
        vec![
            "outbox",
            "redeliver",
            "--all",
            "--base-url",
            "http://127.0.0.1:9",
            "--token",
            "t",
        ],
    ];
    for c in commands {
        let out = run_cmd(toolrunner().args(&c).args(["--db", missing]));
        out.code(2);
        assert!(out.stdout.is_empty(), "{c:?}: {}", out.stdout);
        assert!(
            out.stderr.contains("no executor store at") && out.stderr.contains(missing),
            "{c:?}: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains("--db"),
            "the message says how to fix it: {}",
            out.stderr
        );
        assert!(
            !Path::new(missing).exists(),
            "{c:?} created a store at {missing}"
        );
    }
    // The default is ./toolrunner.db in the working directory.
    let out = run_cmd(toolrunner().current_dir(dir.path()).args(["calls", "list"]));
    out.code(2);
    assert!(out.stderr.contains("toolrunner.db"), "{}", out.stderr);
    assert!(!dir.path().join("toolrunner.db").exists());
}

#[test]
fn the_store_comes_from_toolrunner_db_or_a_sqlite_url() {
    let f = Fixture::seeded();
    let out = run_cmd(
        toolrunner()
            .env("TOOLRUNNER_DB", f.db())
            .args(["calls", "list", "--json"]),
    );
    out.code(0);
    assert_eq!(out.json()["calls"].as_array().expect("calls").len(), 5);
    let url = f.url();
    let out = run(&["calls", "list", "--json", "--db", &url]);
    out.code(0);
    assert_eq!(out.json()["calls"].as_array().expect("calls").len(), 5);
}

// ---------------------------------------------------------------- calls show

#[test]
fn calls_show_json_is_the_whole_timeline() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", RECON, "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(
        key_set(&v),
        keys(&["call", "receipts", "events", "attempts"])
    );

    let c = &v["call"];
    assert_eq!(
        key_set(c),
        keys(&[
            "run_id",
            "call_id",
            "tool_name",
            "state",
            "operation_key",
            "assignment_id",
            "subject",
            "reason",
            "created_at",
            "updated_at"
        ])
    );
    assert_eq!(c["run_id"], json!("run_1"));
    assert_eq!(c["call_id"], json!("call_recon"));
    assert_eq!(c["state"], json!("reconciliation_required"));
    assert_eq!(c["operation_key"], json!("op_call_recon"));
    assert_eq!(c["assignment_id"], json!("asg_call_recon"));
    assert_eq!(c["subject"], json!("user_42"));

    let receipts = v["receipts"].as_array().expect("receipts");
    assert_eq!(receipts.len(), 2, "{v}");
    let receipt_keys = keys(&[
        "receipt_id",
        "kind",
        "sequence",
        "assignment_id",
        "status",
        "attempts",
        "last_error",
        "created_at",
        "delivered_at",
        "body",
    ]);
    for r in receipts {
        assert_eq!(key_set(r), receipt_keys, "{r}");
        assert_eq!(r["assignment_id"], json!("asg_call_recon"));
        assert_eq!(r["status"], json!("delivered"));
        assert_eq!(r["attempts"], json!(1));
        assert_eq!(r["last_error"], Value::Null);
        assert!(r["delivered_at"].is_string(), "{r}");
        // The exact stored bytes, as a string.
        let body: Value =
            serde_json::from_str(r["body"].as_str().expect("body is a string")).expect("JSON");
        assert_eq!(body["executor_id"], json!(EXECUTOR));
        assert_eq!(body["receipt_id"], r["receipt_id"]);
        assert_eq!(body["sequence"], r["sequence"]);
    }
    assert_eq!(receipts[0]["receipt_id"], json!("rcp_call_recon_0"));
    assert_eq!(receipts[0]["kind"], json!("accepted"));
    assert_eq!(receipts[0]["sequence"], json!(0));
    assert_eq!(receipts[1]["kind"], json!("progress"));
    assert_eq!(receipts[1]["sequence"], json!(1));

    let events = v["events"].as_array().expect("events");
    assert!(!events.is_empty());
    for e in events {
        assert_eq!(key_set(e), keys(&["at", "what", "detail"]), "{e}");
        assert!(e["at"].is_string());
    }
    let state_event = events
        .iter()
        .find(|e| e["what"] == json!("reconciliation_required"))
        .expect("the state change is in the timeline");
    assert_eq!(
        state_event["detail"],
        json!("handler failed after accepted")
    );
    assert!(
        events
            .iter()
            .any(|e| e["what"] == json!("receipt accepted saved")
                && e["detail"] == json!("rcp_call_recon_0")),
        "{v}"
    );
}

#[test]
fn calls_show_pending_and_rejected_receipts_carry_attempts_and_errors() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", SETTLED, "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    let r = &v["receipts"][1];
    assert_eq!(r["kind"], json!("completed"));
    assert_eq!(r["status"], json!("pending"));
    assert_eq!(r["attempts"], json!(3));
    assert_eq!(
        r["last_error"],
        json!("POST /runs/run_2/...: could not connect")
    );
    assert_eq!(r["delivered_at"], Value::Null);

    let out = f.run(&["calls", "show", CLAIMING, "--json"]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["receipts"], json!([]));
    assert_eq!(v["call"]["assignment_id"], Value::Null);
    assert_eq!(v["call"]["subject"], Value::Null);
}

#[test]
fn calls_show_human_prints_the_call_its_receipts_and_its_timeline() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", REJECTED]);
    out.code(0).no_grant();
    let s = &out.stdout;
    for want in [
        REJECTED,
        TOOL,
        "rejected",
        "op_call_rejected",
        "asg_call_rejected",
        "user_42",
        "receipts",
        "timeline",
        "rcp_call_rejected_0",
        "rcp_call_rejected_1",
        "409 run_terminated: the run was cancelled",
        "receipt completed saved",
        "executor_id",
    ] {
        assert!(s.contains(want), "{want:?} in\n{s}");
    }
    let receipts_at = s.find("receipts").expect("receipts section");
    let timeline_at = s.find("timeline").expect("timeline section");
    assert!(receipts_at < timeline_at);
}

#[test]
fn calls_show_refuses_an_unknown_call_and_rejects_a_malformed_reference() {
    let f = Fixture::seeded();
    let out = f.run(&["calls", "show", "run_1/call_nope"]);
    out.code(1);
    assert!(out.stdout.is_empty());
    assert!(
        out.stderr.contains("run_1/call_nope"),
        "the message names the call: {}",
        out.stderr
    );
    f.run(&["calls", "show", "run_9/call_recon", "--json"])
        .code(1);
    for bad in ["call_recon", "run_1/", "/call_recon", ""] {
        let out = f.run(&["calls", "show", bad]);
        out.code(2);
        assert!(
            out.stderr.contains("RUN_ID/CALL_ID"),
            "{bad:?}: {}",
            out.stderr
        );
    }
    run(&["calls", "show"]).code(2);
}

// ---------------------------------------------------------------- reconcile resolve

/// Asserts the effects of a successful resolve of `run_1/call_recon` and
/// returns the new receipt's body.
#[track_caller]
fn assert_resolved(f: &Fixture, receipt_id: &str, kind: &str, who: &str, evidence: &str) -> Value {
    let call = f.call(RECON);
    assert_eq!(call.state, LocalState::Settled);
    assert_eq!(call.next_sequence, 3, "the sequence advanced");
    assert_eq!(call.report, None);
    let reason = call.reason.expect("a reason");
    assert!(
        reason.contains(who) && reason.contains(evidence),
        "{reason}"
    );
    let receipts = f.receipts(RECON);
    assert_eq!(receipts.len(), 3, "exactly one new receipt");
    let new = receipts
        .iter()
        .find(|r| r.receipt_id == receipt_id)
        .expect("the new receipt is stored");
    assert_eq!(new.kind.as_str(), kind);
    assert_eq!(new.sequence, 2, "sequence = the previous next_sequence");
    assert_eq!(new.status, ReceiptStatus::Pending);
    assert_eq!(new.attempts, 0);
    assert_eq!(new.assignment_id, "asg_call_recon");
    assert!(
        new.receipt_id.starts_with("rcp_"),
        "a new receipt id: {}",
        new.receipt_id
    );
    let body: Value = serde_json::from_str(&new.body).expect("JSON body");
    assert_eq!(body["receipt_id"], json!(receipt_id));
    assert_eq!(body["executor_id"], json!(EXECUTOR));
    assert_eq!(body["assignment_id"], json!("asg_call_recon"));
    assert_eq!(body["sequence"], json!(2));
    assert_eq!(body["kind"], json!(kind));
    assert!(!new.body.contains(GRANT));
    body
}

/// The "resolved by operator" event's detail (the evidence, as JSON).
fn resolution_note(f: &Fixture, call_ref: &str) -> Value {
    let events = f.events(call_ref);
    let notes: Vec<&Event> = events
        .iter()
        .filter(|e| e.what == "resolved by operator")
        .collect();
    assert_eq!(notes.len(), 1, "{events:?}");
    let detail = notes[0].detail.as_deref().expect("the note has a detail");
    serde_json::from_str(detail).expect("the detail is the evidence as JSON")
}

#[test]
fn resolve_completed_from_a_file_settles_the_call_with_a_new_receipt() {
    let f = Fixture::seeded();
    let result = f.write("result.json", "{\"entry\": 42}\n");
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "ledger shows entry 42 for op_call_recon",
        "--who",
        "alice",
        "--reference",
        "LEDGER-7",
        "--json",
    ]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["receipt_id", "state", "delivered"]));
    assert_eq!(v["state"], json!("settled"));
    assert_eq!(v["delivered"], json!(false), "no platform was given");
    let receipt_id = v["receipt_id"].as_str().expect("receipt_id");
    let body = assert_resolved(
        &f,
        receipt_id,
        "completed",
        "alice",
        "ledger shows entry 42 for op_call_recon",
    );
    assert_eq!(body["result"], json!({"entry": 42}));

    let note = resolution_note(&f, RECON);
    assert_eq!(note["who"], json!("alice"));
    assert_eq!(
        note["why"],
        json!("ledger shows entry 42 for op_call_recon")
    );
    assert_eq!(note["reference"], json!("LEDGER-7"));

    // `calls show` tells the same story.
    let show = f.run(&["calls", "show", RECON, "--json"]);
    show.code(0).no_grant();
    let t = show.json();
    assert_eq!(t["call"]["state"], json!("settled"));
    let last = t["receipts"].as_array().expect("receipts").last().cloned();
    let last = last.expect("a receipt");
    assert_eq!(last["receipt_id"], json!(receipt_id));
    assert_eq!(last["status"], json!("pending"));
    assert_eq!(last["sequence"], json!(2));
    let events = t["events"].as_array().expect("events");
    let note = events
        .iter()
        .find(|e| e["what"] == json!("resolved by operator"))
        .expect("resolved by operator in the timeline");
    let detail = note["detail"].as_str().expect("detail");
    assert!(
        detail.contains("ledger shows entry 42 for op_call_recon")
            && detail.contains("alice")
            && detail.contains("LEDGER-7"),
        "{detail}"
    );
    assert!(events.iter().any(|e| e["what"] == json!("settled")), "{t}");
    // The outbox now holds it.
    let status = f.run(&["outbox", "status", "--json"]);
    status.code(0);
    assert!(
        status.json()["pending"]
            .as_array()
            .expect("pending")
            .iter()
            .any(|r| r["receipt_id"] == json!(receipt_id))
    );
}

#[test]
fn resolve_completed_from_stdin_prints_a_human_line() {
    let f = Fixture::seeded();
    let out = f.run_stdin(
        &[
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            "-",
            "--evidence",
            "ledger entry 7 exists",
            "--who",
            "bob",
        ],
        "{\"entry\": 7}",
    );
    out.code(0).no_grant();
    assert!(
        out.stdout
            .starts_with("resolved run_1/call_recon: receipt rcp_"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("(state settled)"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains("the running executor's outbox delivers it"),
        "{}",
        out.stdout
    );
    let receipt_id = out
        .stdout
        .split_whitespace()
        .find(|w| w.starts_with("rcp_"))
        .expect("the receipt id is printed");
    let body = assert_resolved(&f, receipt_id, "completed", "bob", "ledger entry 7 exists");
    assert_eq!(body["result"], json!({"entry": 7}));
    let note = resolution_note(&f, RECON);
    assert_eq!(note["who"], json!("bob"));
    assert_eq!(note["reference"], Value::Null);
}

#[test]
fn resolve_failed_sends_the_code_and_message() {
    let f = Fixture::seeded();
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--failed",
        "not_performed",
        "--message",
        "the entry was not posted",
        "--evidence",
        "no entry for op_call_recon",
        "--who",
        "carol",
        "--reference",
        "TICKET-9",
        "--json",
    ]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["state"], json!("settled"));
    let body = assert_resolved(
        &f,
        v["receipt_id"].as_str().expect("id"),
        "failed",
        "carol",
        "no entry for op_call_recon",
    );
    assert_eq!(
        body["error"],
        json!({"code": "not_performed", "message": "the entry was not posted"})
    );
    assert!(body.get("result").is_none());
    let note = resolution_note(&f, RECON);
    assert_eq!(note["reference"], json!("TICKET-9"));
}

#[test]
fn resolve_cancelled_sends_the_reason() {
    let f = Fixture::seeded();
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "customer withdrew",
        "--evidence",
        "ticket 88",
        "--who",
        "dave",
        "--json",
    ]);
    out.code(0);
    let v = out.json();
    let body = assert_resolved(
        &f,
        v["receipt_id"].as_str().expect("id"),
        "cancelled",
        "dave",
        "ticket 88",
    );
    assert_eq!(body["reason"], json!("customer withdrew"));
}

#[test]
fn resolve_without_who_takes_user_then_operator() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 1}"#);
    let out = run_cmd(toolrunner().env("USER", "erin").args([
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "checked",
        "--db",
        f.db(),
    ]));
    out.code(0);
    assert_eq!(resolution_note(&f, RECON)["who"], json!("erin"));

    let g = Fixture::seeded();
    let out = run_cmd(toolrunner().env_remove("USER").args([
        "reconcile",
        "compensated",
        REJECTED,
        "--evidence",
        "refund re_1",
        "--db",
        g.db(),
    ]));
    out.code(0);
    let reason = g.call(REJECTED).reason.expect("reason");
    assert!(reason.contains("operator"), "{reason}");
}

#[test]
fn resolve_usage_errors_exit_2_and_change_nothing() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 1}"#);
    let before = f.snapshot(RECON);
    let missing_file = f.path("missing.json");
    let missing_file = missing_file.to_str().expect("utf-8");
    let cases: Vec<Vec<&str>> = vec![
        // --evidence is required
        vec!["reconcile", "resolve", RECON, "--completed", &result],
        // no outcome at all
        vec!["reconcile", "resolve", RECON, "--evidence", "x"],
        // two outcomes
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            &result,
            "--cancelled",
            "--reason",
            "r",
            "--evidence",
            "x",
        ],
        // --failed needs --message
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--failed",
            "not_performed",
            "--evidence",
            "x",
        ],
        // --cancelled needs --reason
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--cancelled",
            "--evidence",
            "x",
        ],
        // a malformed call reference
        vec![
            "reconcile",
            "resolve",
            "call_recon",
            "--completed",
            &result,
            "--evidence",
            "x",
        ],
        // an unreadable result file
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            missing_file,
            "--evidence",
            "x",
        ],
        // --base-url without --token
        vec![
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            &result,
            "--evidence",
            "x",
            "--base-url",
            "http://127.0.0.1:9",
        ],
        // no call at all
        vec![
            "reconcile",
            "resolve",
            "--completed",
            &result,
            "--evidence",
            "x",
        ],
    ];
    for c in cases {
        let out = f.run(&c);
        out.code(2);
        assert!(out.stdout.is_empty(), "{c:?}: {}", out.stdout);
        assert!(!out.stderr.is_empty(), "{c:?} says why");
        assert_eq!(f.snapshot(RECON), before, "{c:?} changed the store");
    }
    let out = f.run(&["reconcile", "resolve", RECON, "--completed", &result]);
    assert!(out.stderr.contains("--evidence"), "{}", out.stderr);
}

#[test]
fn resolve_refuses_a_result_that_breaks_the_output_schema_and_changes_nothing() {
    let f = Fixture::seeded();
    let before = f.snapshot(RECON);
    for (name, text) in [
        ("wrong_type.json", r#"{"entry": "forty-two"}"#),
        ("missing.json", r#"{"amount": 42}"#),
        ("not_object.json", "[1, 2]"),
    ] {
        let file = f.write(name, text);
        let out = f.run(&[
            "reconcile",
            "resolve",
            RECON,
            "--completed",
            &file,
            "--evidence",
            "checked",
            "--json",
        ]);
        out.code(1);
        assert!(out.stdout.is_empty(), "{name}: {}", out.stdout);
        assert!(
            out.stderr.starts_with("refused:") && out.stderr.contains("output_schema"),
            "{name}: {}",
            out.stderr
        );
        assert_eq!(f.snapshot(RECON), before, "{name} changed the store");
        let call = f.call(RECON);
        assert_eq!(call.state, LocalState::ReconciliationRequired);
        assert_eq!(
            call.reason.as_deref(),
            Some("handler failed after accepted")
        );
        assert!(
            !f.events(RECON)
                .iter()
                .any(|e| e.what == "resolved by operator")
        );
    }
    // Text that is not acceptable JSON is refused as well.
    let file = f.write("garbage.json", "{\"entry\": 1,");
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &file,
        "--evidence",
        "checked",
    ]);
    out.code(1);
    assert_eq!(f.snapshot(RECON), before);
    let file = f.write("dup.json", r#"{"entry": 1, "entry": 2}"#);
    f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &file,
        "--evidence",
        "checked",
    ])
    .code(1);
    assert_eq!(f.snapshot(RECON), before);
}

#[test]
fn resolve_refuses_blank_evidence() {
    let f = Fixture::seeded();
    let before = f.snapshot(RECON);
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "r",
        "--evidence",
        "   ",
    ]);
    out.code(1);
    assert!(out.stderr.contains("--evidence"), "{}", out.stderr);
    assert_eq!(f.snapshot(RECON), before);
}

#[test]
fn resolve_refuses_calls_in_other_states_and_unknown_calls() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 1}"#);
    for (call, state) in [
        (DELIVERED, "delivered"),
        (SETTLED, "settled"),
        (CLAIMING, "claiming"),
    ] {
        let before = f.snapshot(call);
        let out = f.run(&[
            "reconcile",
            "resolve",
            call,
            "--completed",
            &result,
            "--evidence",
            "checked",
        ]);
        out.code(1);
        assert!(out.stdout.is_empty());
        assert!(
            out.stderr.contains(&format!("is {state}"))
                && out.stderr.contains("reconciliation_required"),
            "{call}: the reason is given: {}",
            out.stderr
        );
        assert_eq!(f.snapshot(call), before, "{call} changed");
    }
    let out = f.run(&[
        "reconcile",
        "resolve",
        "run_1/call_nope",
        "--completed",
        &result,
        "--evidence",
        "checked",
    ]);
    out.code(1);
    assert!(out.stderr.contains("run_1/call_nope"), "{}", out.stderr);
}

#[test]
fn resolve_refuses_a_call_without_assignment_or_executor_id() {
    let f = Fixture::seeded();
    // reconciliation_required, but no receipt names the executor.
    let orphan = local_call(
        Some(assignment(
            "run_4",
            "call_quiet",
            TOOL,
            Some(entry_schema()),
        )),
        "run_4",
        "call_quiet",
        TOOL,
        LocalState::ReconciliationRequired,
        1,
    );
    // reconciliation_required without an assignment in this store.
    let bare = local_call(
        None,
        "run_4",
        "call_bare",
        TOOL,
        LocalState::ReconciliationRequired,
        0,
    );
    f.commit(vec![Change::InsertCall(orphan), Change::InsertCall(bare)]);
    let result = f.write("r.json", r#"{"entry": 1}"#);
    for (call, why) in [
        ("run_4/call_quiet", "executor id"),
        ("run_4/call_bare", "no assignment"),
    ] {
        let before = f.snapshot(call);
        let out = f.run(&[
            "reconcile",
            "resolve",
            call,
            "--completed",
            &result,
            "--evidence",
            "checked",
        ]);
        out.code(1);
        assert!(out.stderr.contains(why), "{call}: {}", out.stderr);
        assert_eq!(f.snapshot(call), before, "{call} changed");
    }
}

#[test]
fn a_second_resolve_of_the_same_call_is_refused() {
    let f = Fixture::seeded();
    let first = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--cancelled",
        "--reason",
        "withdrawn",
        "--evidence",
        "ticket 1",
        "--json",
    ]);
    first.code(0);
    let after_first = f.snapshot(RECON);
    let result = f.write("r.json", r#"{"entry": 1}"#);
    let second = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "ticket 2",
        "--json",
    ]);
    second.code(1);
    assert!(second.stdout.is_empty());
    assert!(second.stderr.contains("is settled"), "{}", second.stderr);
    assert_eq!(f.snapshot(RECON), after_first);
    assert_eq!(f.receipts(RECON).len(), 3);
    let note = resolution_note(&f, RECON);
    assert_eq!(note["why"], json!("ticket 1"));
}

#[test]
fn resolve_of_a_rejected_call_is_allowed() {
    // The reconciler settles `rejected` calls too (a new final receipt).
    let f = Fixture::seeded();
    let out = f.run(&[
        "reconcile",
        "resolve",
        REJECTED,
        "--failed",
        "not_performed",
        "--message",
        "nothing happened",
        "--evidence",
        "no entry",
        "--json",
    ]);
    out.code(0);
    let v = out.json();
    assert_eq!(v["state"], json!("settled"));
    let receipts = f.receipts(REJECTED);
    let new = receipts.last().expect("receipt");
    assert_eq!(new.receipt_id, v["receipt_id"].as_str().expect("id"));
    assert_eq!(new.sequence, 2);
}

#[test]
fn resolve_with_an_unreachable_platform_keeps_the_receipt_for_the_outbox() {
    let f = Fixture::seeded();
    let result = f.write("r.json", r#"{"entry": 5}"#);
    let out = f.run(&[
        "reconcile",
        "resolve",
        RECON,
        "--completed",
        &result,
        "--evidence",
        "checked",
        "--base-url",
        "http://127.0.0.1:9",
        "--token",
        EXEC,
        "--json",
    ]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(v["delivered"], json!(false));
    assert_eq!(v["state"], json!("settled"));
    let receipts = f.receipts(RECON);
    let new = receipts.last().expect("receipt");
    assert_eq!(new.status, ReceiptStatus::Pending);
    assert!(new.attempts >= 1, "the attempt is counted");
    assert!(new.last_error.is_some());
}

// ---------------------------------------------------------------- reconcile compensated

#[test]
fn compensated_records_a_rejected_call() {
    let f = Fixture::seeded();
    let receipts_before = f.receipts(REJECTED).len();
    let out = f.run(&[
        "reconcile",
        "compensated",
        REJECTED,
        "--evidence",
        "refund re_77 issued",
        "--reference",
        "re_77",
        "--who",
        "frank",
    ]);
    out.code(0).no_grant();
    assert_eq!(
        out.stdout.trim(),
        "recorded run_1/call_rejected as compensated"
    );
    let call = f.call(REJECTED);
    assert_eq!(call.state, LocalState::Compensated);
    let reason = call.reason.expect("reason");
    assert!(
        reason.contains("frank") && reason.contains("refund re_77 issued"),
        "{reason}"
    );
    assert_eq!(f.receipts(REJECTED).len(), receipts_before, "no receipt");
    let events = f.events(REJECTED);
    let note = events
        .iter()
        .find(|e| {
            e.what == "compensated" && e.detail.as_deref().is_some_and(|d| d.contains("re_77"))
        })
        .expect("the evidence is in the timeline");
    let detail: Value =
        serde_json::from_str(note.detail.as_deref().expect("detail")).expect("JSON");
    assert_eq!(
        detail,
        json!({"who": "frank", "why": "refund re_77 issued", "reference": "re_77"})
    );

    let list = f.run(&["calls", "list", "--state", "compensated", "--json"]);
    list.code(0);
    assert_eq!(list.json()["calls"][0]["call_id"], json!("call_rejected"));

    // Only once.
    let again = f.run(&["reconcile", "compensated", REJECTED, "--evidence", "again"]);
    again.code(1);
    assert!(again.stderr.contains("is compensated"), "{}", again.stderr);
}

#[test]
fn compensated_refuses_every_other_state() {
    let f = Fixture::seeded();
    for (call, state) in [
        (RECON, "reconciliation_required"),
        (DELIVERED, "delivered"),
        (SETTLED, "settled"),
        (CLAIMING, "claiming"),
    ] {
        let before = f.snapshot(call);
        let out = f.run(&["reconcile", "compensated", call, "--evidence", "refund"]);
        out.code(1);
        assert!(out.stdout.is_empty());
        assert!(
            out.stderr.contains(&format!("is {state}")) && out.stderr.contains("rejected"),
            "{call}: {}",
            out.stderr
        );
        assert_eq!(f.snapshot(call), before, "{call} changed");
    }
    f.run(&[
        "reconcile",
        "compensated",
        "run_1/call_nope",
        "--evidence",
        "refund",
    ])
    .code(1);
    let before = f.snapshot(REJECTED);
    f.run(&["reconcile", "compensated", REJECTED]).code(2);
    f.run(&["reconcile", "compensated", "nope", "--evidence", "refund"])
        .code(2);
    f.run(&["reconcile", "compensated", REJECTED, "--evidence", ""])
        .code(1);
    assert_eq!(f.snapshot(REJECTED), before);
}

// ---------------------------------------------------------------- outbox

#[test]
fn outbox_status_json_counts_every_status_and_lists_the_pending() {
    let f = Fixture::seeded();
    let out = f.run(&["outbox", "status", "--json"]);
    out.code(0).no_grant();
    let v = out.json();
    assert_eq!(
        key_set(&v),
        keys(&["by_status", "oldest_pending_at", "pending"])
    );
    assert_eq!(
        v["by_status"],
        json!({"pending": 1, "delivered": 6, "rejected": 1, "superseded": 0, "orphaned": 0})
    );
    let pending = v["pending"].as_array().expect("pending");
    assert_eq!(pending.len(), 1);
    let r = &pending[0];
    assert_eq!(
        key_set(r),
        keys(&[
            "receipt_id",
            "kind",
            "sequence",
            "assignment_id",
            "status",
            "attempts",
            "last_error",
            "created_at",
            "delivered_at",
            "body"
        ])
    );
    assert_eq!(r["receipt_id"], json!("rcp_call_settled_1"));
    assert_eq!(r["kind"], json!("completed"));
    assert_eq!(r["sequence"], json!(1));
    assert_eq!(r["assignment_id"], json!("asg_call_settled"));
    assert_eq!(r["status"], json!("pending"));
    assert_eq!(r["attempts"], json!(3));
    assert_eq!(
        r["last_error"],
        json!("POST /runs/run_2/...: could not connect")
    );
    assert_eq!(r["delivered_at"], Value::Null);
    assert_eq!(v["oldest_pending_at"], r["created_at"]);
    let body: Value = serde_json::from_str(r["body"].as_str().expect("body")).expect("JSON");
    assert_eq!(body["result"], json!({"entry": 3}));
}

#[test]
fn outbox_status_human_shows_counts_and_the_undelivered() {
    let f = Fixture::seeded();
    let out = f.run(&["outbox", "status"]);
    out.code(0).no_grant();
    for s in [
        "status",
        "receipts",
        "pending",
        "delivered",
        "rejected",
        "superseded",
        "orphaned",
        "oldest undelivered: 20",
        "rcp_call_settled_1",
        "completed",
        "could not connect",
    ] {
        assert!(out.stdout.contains(s), "{s:?} in\n{}", out.stdout);
    }
}

#[test]
fn outbox_status_of_an_empty_store() {
    let f = Fixture::empty();
    let out = f.run(&["outbox", "status", "--json"]);
    out.code(0);
    assert_eq!(
        out.json(),
        json!({"by_status": {"pending": 0, "delivered": 0, "rejected": 0, "superseded": 0,
                             "orphaned": 0},
               "oldest_pending_at": null, "pending": []})
    );
    let human = f.run(&["outbox", "status"]);
    human.code(0);
    assert!(
        human.stdout.contains("oldest undelivered: none"),
        "{}",
        human.stdout
    );
    let list = f.run(&["calls", "list", "--json"]);
    list.code(0);
    assert_eq!(list.json(), json!({"calls": []}));
}

#[test]
fn outbox_redeliver_usage_errors_and_refusals() {
    let f = Fixture::seeded();
    let before = f.snapshot(SETTLED);
    let out = f.run(&["outbox", "redeliver"]);
    out.code(2);
    assert!(out.stderr.contains("--all"), "{}", out.stderr);
    let out = f.run(&["outbox", "redeliver", "--all"]);
    out.code(2);
    assert!(out.stderr.contains("--base-url"), "{}", out.stderr);
    let out = f.run(&["outbox", "redeliver", "rcp_call_settled_1"]);
    out.code(2);
    assert!(out.stderr.contains("--base-url"), "{}", out.stderr);
    // --base-url without --token
    f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        "http://127.0.0.1:9",
    ])
    .code(2);
    // --all and an id
    f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "rcp_call_settled_1",
        "--base-url",
        "http://127.0.0.1:9",
        "--token",
        EXEC,
    ])
    .code(2);
    assert_eq!(f.snapshot(SETTLED), before);

    let platform = ["--base-url", "http://127.0.0.1:9", "--token", EXEC];
    let out = f.run(&[&["outbox", "redeliver", "rcp_nope"][..], &platform[..]].concat());
    out.code(1);
    assert!(out.stderr.contains("rcp_nope"), "{}", out.stderr);
    let out = f.run(
        &[
            &["outbox", "redeliver", "rcp_call_delivered_1"][..],
            &platform[..],
        ]
        .concat(),
    );
    out.code(1);
    assert!(out.stderr.contains("not pending"), "{}", out.stderr);
    assert_eq!(f.snapshot(SETTLED), before);
}

#[test]
fn outbox_redeliver_to_a_platform_that_does_not_know_the_run_orphans_it() {
    let p = Platform::start();
    let f = Fixture::seeded();
    let out = f.run(&[
        "outbox",
        "redeliver",
        "rcp_call_settled_1",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0).no_grant();
    assert_eq!(
        out.stdout, "rcp_call_settled_1: orphaned\n1 receipts sent\n",
        "{}",
        out.stderr
    );
    assert_eq!(f.call(SETTLED).state, LocalState::Orphaned);
}

// ---------------------------------------------------------------- against a platform

#[test]
fn resolve_with_a_platform_delivers_at_once() {
    let p = Platform::start();
    let f = Fixture::empty();
    let (asg, accepted) = p.running_call(EXECUTOR);
    let call = import_running_call(&f, &asg, &accepted, LocalState::ReconciliationRequired);
    assert_eq!(p.platform_call(&asg.run_id)["state"], json!("running"));

    let result = f.write("r.json", r#"{"entry": 1234}"#);
    let out = f.run(&[
        "reconcile",
        "resolve",
        &call,
        "--completed",
        &result,
        "--evidence",
        "ledger entry 1234",
        "--who",
        "gina",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
        "--json",
    ]);
    out.code(0);
    assert!(
        !out.stdout.contains(asg.grant.expose()) && !out.stderr.contains(asg.grant.expose()),
        "the grant was printed"
    );
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["receipt_id", "state", "delivered"]));
    assert_eq!(v["delivered"], json!(true), "{}", out.stderr);
    assert_eq!(v["state"], json!("delivered"));
    let receipt_id = v["receipt_id"].as_str().expect("id");

    let remote = p.platform_call(&asg.run_id);
    assert_eq!(remote["state"], json!("completed"), "{remote}");
    let remote_receipt = remote["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .find(|r| r["receipt_id"] == json!(receipt_id))
        .cloned()
        .expect("the platform stored the operator's receipt");
    assert_eq!(remote_receipt["kind"], json!("completed"));
    assert_eq!(remote_receipt["sequence"], json!(1));
    assert_eq!(remote_receipt["body"]["result"], json!({"entry": 1234}));

    let show = f.run(&["calls", "show", &call, "--json"]);
    show.code(0);
    let t = show.json();
    assert_eq!(t["call"]["state"], json!("delivered"));
    let r = t["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .find(|r| r["receipt_id"] == json!(receipt_id))
        .cloned()
        .expect("receipt");
    assert_eq!(r["status"], json!("delivered"));
    assert!(r["delivered_at"].is_string());

    let human = f.run(&["calls", "list", "--state", "delivered"]);
    human.code(0);
    assert!(human.stdout.contains(&call));
}

#[test]
fn resolve_human_output_says_delivered_when_the_platform_took_it() {
    let p = Platform::start();
    let f = Fixture::empty();
    let (asg, accepted) = p.running_call(EXECUTOR);
    let call = import_running_call(&f, &asg, &accepted, LocalState::ReconciliationRequired);
    let out = f.run(&[
        "reconcile",
        "resolve",
        &call,
        "--failed",
        "not_performed",
        "--message",
        "no entry was posted",
        "--evidence",
        "ledger has nothing for this key",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert!(
        out.stdout.contains(" delivered (state delivered)"),
        "{}",
        out.stdout
    );
    let remote = p.platform_call(&asg.run_id);
    assert_eq!(remote["state"], json!("failed"), "{remote}");
}

#[test]
fn outbox_redeliver_sends_pending_receipts_to_the_platform() {
    let p = Platform::start();
    let f = Fixture::empty();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (asg, accepted) = p.running_call(EXECUTOR);
        let call = import_running_call(&f, &asg, &accepted, LocalState::Settled);
        let mut local = f.call(&call);
        let completed = receipt(
            &local,
            ReceiptKind::Completed,
            1,
            ReceiptStatus::Pending,
            json!({"result": {"entry": 77}}),
        );
        local.next_sequence = 2;
        ids.push((asg.run_id.clone(), call, completed.receipt_id.clone()));
        f.commit(vec![update(local), Change::AddReceipt(completed)]);
    }
    let status = f.run(&["outbox", "status", "--json"]);
    status.code(0);
    assert_eq!(status.json()["by_status"]["pending"], json!(2));

    // One by id.
    let (run0, call0, rcp0) = &ids[0];
    let out = f.run(&[
        "outbox",
        "redeliver",
        rcp0,
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert_eq!(
        out.stdout,
        format!("{rcp0}: delivered\n1 receipts sent\n"),
        "{}",
        out.stderr
    );
    assert_eq!(f.call(call0).state, LocalState::Delivered);
    assert_eq!(p.platform_call(run0)["state"], json!("completed"));
    let status = f.run(&["outbox", "status", "--json"]);
    assert_eq!(status.json()["by_status"]["pending"], json!(1));

    // Then everything left.
    let (run1, call1, rcp1) = &ids[1];
    let out = f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert_eq!(out.stdout, format!("{rcp1}: delivered\n1 receipts sent\n"));
    assert_eq!(f.call(call1).state, LocalState::Delivered);
    assert_eq!(p.platform_call(run1)["state"], json!("completed"));

    let status = f.run(&["outbox", "status", "--json"]);
    status.code(0);
    let v = status.json();
    assert_eq!(v["by_status"]["pending"], json!(0));
    assert_eq!(v["by_status"]["delivered"], json!(4));
    assert_eq!(v["oldest_pending_at"], Value::Null);
    assert_eq!(v["pending"], json!([]));

    // Nothing left: --all sends nothing and succeeds.
    let out = f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert_eq!(out.stdout, "0 receipts sent\n");
    // A delivered receipt is not sent again.
    f.run(&[
        "outbox",
        "redeliver",
        rcp0,
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ])
    .code(1);
}

#[test]
fn outbox_redeliver_with_a_wrong_token_leaves_the_receipt_pending() {
    // A mistyped --token says nothing about the receipt: the platform never
    // judged it. The receipt must stay pending and the call settled, so
    // that a second try with the right token (or the executor) delivers it.
    let p = Platform::start();
    let f = Fixture::empty();
    let (asg, accepted) = p.running_call(EXECUTOR);
    let call = import_running_call(&f, &asg, &accepted, LocalState::Settled);
    let mut local = f.call(&call);
    let completed = receipt(
        &local,
        ReceiptKind::Completed,
        1,
        ReceiptStatus::Pending,
        json!({"result": {"entry": 5}}),
    );
    let rcp = completed.receipt_id.clone();
    local.next_sequence = 2;
    f.commit(vec![update(local), Change::AddReceipt(completed)]);

    let out = f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        &p.base,
        "--token",
        "not-a-token",
    ]);
    let after = f.call(&call);
    let stored = f
        .receipts(&call)
        .into_iter()
        .find(|r| r.receipt_id == rcp)
        .expect("the receipt");
    assert!(
        after.state == LocalState::Settled && stored.status == ReceiptStatus::Pending,
        "after a 401 the call is {} and its final receipt {} (exit {}, stdout {:?})",
        after.state.as_str(),
        stored.status.as_str(),
        out.code,
        out.stdout
    );
    assert_ne!(out.code, 0, "a refused token is not a success");

    // The right token still delivers it.
    f.run(&[
        "outbox",
        "redeliver",
        &rcp,
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ])
    .code(0);
    assert_eq!(f.call(&call).state, LocalState::Delivered);
}

/// `tools publish` checks a definitions file, publishes it as a new version
/// of the agent through the typed client, and prints its id; a file that
/// fails the checks publishes nothing and names the field.
#[test]
fn tools_publish_publishes_a_checked_version() {
    let p = Platform::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let agent_id = p.agent_id();
    let good = dir.path().join("tools.json");
    std::fs::write(
        &good,
        json!({"tools": [{"name": TOOL, "description": "Post a ledger entry",
                          "binding_id": p.binding_id, "input_schema": input_schema()}]})
        .to_string(),
    )
    .expect("write");
    let good = good.display().to_string();
    let base = [
        "tools",
        "publish",
        "--base-url",
        &p.base,
        "--token",
        ADMIN,
        "--agent",
        &agent_id,
    ];
    let out = run(&[&base[..], &[good.as_str(), "--json"]].concat());
    out.code(0);
    let v = out.json();
    let agv = v["agent_version"]
        .as_str()
        .expect("agent_version")
        .to_owned();
    assert!(agv.starts_with("agv_"), "{v}");
    assert_eq!(v["tools"][0]["name"], json!(TOOL));
    let (s, read) = p.get(&format!("/agents/{agent_id}/versions/{agv}"), ADMIN);
    assert_eq!(s, 200, "{read}");

    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        json!([{"name": TOOL, "description": "d", "binding_id": p.binding_id,
                "input_schema": {"type": "string"}}])
        .to_string(),
    )
    .expect("write");
    let bad = bad.display().to_string();
    let out = run(&[&base[..], &[bad.as_str()]].concat());
    out.code(1);
    assert!(
        out.stderr.contains("tools[0].input_schema"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("nothing was published"),
        "{}",
        out.stderr
    );
}

#[test]
fn tools_dry_run_checks_arguments_on_the_platform() {
    let p = Platform::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let base = ["tools", "dry-run", "--base-url", &p.base, "--token", EXEC];
    let version = ["--agent-version", &p.agent_version, "--tool", TOOL];

    let out = run(&[
        &base[..],
        &version[..],
        &["--arguments", r#"{"amount": 5}"#],
    ]
    .concat());
    out.code(0);
    let v = out.json();
    assert_eq!(v["arguments_valid"], json!(true), "{v}");
    assert_eq!(v["argument_errors"], json!([]));
    assert_eq!(v["context_preview"], Value::Null);
    assert_eq!(v["execution_verified"], json!(false));

    // With a mock result: the context preview.
    let mock = dir.path().join("mock.json");
    std::fs::write(&mock, r#"{"entry": 7}"#).expect("write");
    let mock_arg = format!("@{}", mock.display());
    let out = run(&[
        &base[..],
        &version[..],
        &[
            "--arguments",
            r#"{"amount": 5}"#,
            "--mock-result",
            &mock_arg,
        ],
    ]
    .concat());
    out.code(0);
    let v = out.json();
    assert_eq!(v["execution_verified"], json!(false));
    assert_eq!(
        v["context_preview"],
        json!({"max_result_context_bytes": 16384, "original_bytes": 11, "retained_bytes": 11,
               "truncated": false, "result": {"entry": 7}})
    );

    // Arguments from a file.
    let args = dir.path().join("args.json");
    std::fs::write(&args, r#"{"amount": 9}"#).expect("write");
    let args_arg = format!("@{}", args.display());
    run(&[&base[..], &version[..], &["--arguments", &args_arg]].concat()).code(0);

    // Invalid arguments: the answer is printed, the exit code is 1.
    let out = run(&[
        &base[..],
        &version[..],
        &["--arguments", r#"{"amount": "five"}"#],
    ]
    .concat());
    out.code(1);
    let v = out.json();
    assert_eq!(v["arguments_valid"], json!(false));
    assert_eq!(v["execution_verified"], json!(false));
    let errors = v["argument_errors"].as_array().expect("argument_errors");
    assert!(!errors.is_empty());
    assert_eq!(key_set(&errors[0]), keys(&["path", "message"]));
    assert_eq!(errors[0]["path"], json!("/amount"));
    assert!(out.stderr.contains("input_schema"), "{}", out.stderr);
    // The default arguments {} miss the required amount.
    run(&[&base[..], &version[..]].concat()).code(1);
    // An unknown field.
    run(&[
        &base[..],
        &version[..],
        &["--arguments", r#"{"amount": 1, "x": 1}"#],
    ]
    .concat())
    .code(1);

    // The platform refuses an unknown version or tool.
    let out = run(&[
        &base[..],
        &["--agent-version", "agv_nope", "--tool", TOOL],
        &["--arguments", r#"{"amount": 5}"#],
    ]
    .concat());
    out.code(1);
    assert!(out.json()["error"].is_object(), "{}", out.stdout);
    run(&[
        &base[..],
        &[
            "--agent-version",
            &p.agent_version,
            "--tool",
            "no.such.tool",
        ],
    ]
    .concat())
    .code(1);

    // Usage: arguments that are not JSON; a missing flag; an unreachable platform.
    let out = run(&[&base[..], &version[..], &["--arguments", "{amount"]].concat());
    out.code(2);
    assert!(out.stdout.is_empty());
    let missing = format!("@{}", dir.path().join("missing.json").display());
    run(&[&base[..], &version[..], &["--arguments", &missing]].concat()).code(2);
    run(&[&base[..], &["--tool", TOOL]].concat()).code(2);
    run(&[
        "tools",
        "dry-run",
        "--agent-version",
        "agv_1",
        "--tool",
        TOOL,
    ])
    .code(2);
    let out = run(&[
        "tools",
        "dry-run",
        "--base-url",
        "http://127.0.0.1:9",
        "--token",
        EXEC,
        "--agent-version",
        "agv_1",
        "--tool",
        TOOL,
    ]);
    out.code(2);
    assert!(out.stderr.contains("cannot reach"), "{}", out.stderr);
    // The platform and token may come from the environment.
    let out = run_cmd(
        toolrunner()
            .env("TOOLRUNNER_BASE_URL", &p.base)
            .env("TOOLRUNNER_TOKEN", EXEC)
            .args(["tools", "dry-run"])
            .args(version)
            .args(["--arguments", r#"{"amount": 5}"#]),
    );
    out.code(0);
    assert_eq!(out.json()["arguments_valid"], json!(true));
}

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

// ---------------------------------------------------------------- budget

#[test]
fn budget_within_the_budget_keeps_the_result() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.json");
    let result = json!({"entry": 1, "note": "short"});
    std::fs::write(&file, result.to_string()).expect("write");
    let file = file.to_str().expect("utf-8");
    let compact = serde_json::to_string(&result).expect("json").len();

    let out = run(&["budget", file, "--max", "1024", "--json"]);
    out.code(0);
    let v = out.json();
    assert_eq!(
        key_set(&v),
        keys(&[
            "max_result_context_bytes",
            "original_bytes",
            "retained_bytes",
            "truncated",
            "result"
        ])
    );
    assert_eq!(v["max_result_context_bytes"], json!(1024));
    assert_eq!(v["original_bytes"], json!(compact));
    assert_eq!(v["retained_bytes"], json!(compact));
    assert_eq!(v["truncated"], json!(false));
    assert_eq!(v["result"], result);

    // The default budget is 16384.
    let out = run(&["budget", file, "--json"]);
    out.code(0);
    assert_eq!(out.json()["max_result_context_bytes"], json!(16384));

    let human = run(&["budget", file, "--max", "2048"]);
    human.code(0);
    assert!(
        human.stdout.starts_with(&format!(
            "budget 2048 bytes: original {compact} bytes, retained {compact} bytes, truncated false"
        )),
        "{}",
        human.stdout
    );
    let printed: Value = serde_json::from_str(
        human
            .stdout
            .split_once('\n')
            .map(|(_, rest)| rest)
            .unwrap_or_default(),
    )
    .expect("the projection is printed as JSON");
    assert_eq!(printed, result);
}

#[test]
fn budget_over_the_budget_truncates_within_it() {
    let big = json!({"next_cursor": "page-2", "status": "ok",
                     "items": (0..400).map(|i| json!({"id": i, "text": "lorem ipsum dolor"})).collect::<Vec<_>>()});
    let text = big.to_string();
    let original = text.len();
    for max in [1024_u64, 4096, 32768] {
        let out = run_stdin(&["budget", "-", "--max", &max.to_string(), "--json"], &text);
        out.code(0);
        let v = out.json();
        assert_eq!(v["max_result_context_bytes"], json!(max));
        assert_eq!(v["original_bytes"], json!(original));
        let retained = v["retained_bytes"].as_u64().expect("retained_bytes");
        if original as u64 > max {
            assert_eq!(v["truncated"], json!(true), "--max {max}");
            assert!(retained <= max, "--max {max}: retained {retained}");
            assert_eq!(
                retained as usize,
                serde_json::to_string(&v["result"]).expect("json").len(),
                "retained_bytes is the projection's compact size"
            );
            assert_eq!(v["result"]["truncated"], json!(true));
            assert_eq!(v["result"]["original_bytes"], json!(original));
            assert_eq!(
                v["result"]["preserved_fields"]["next_cursor"],
                json!("page-2")
            );
        } else {
            assert_eq!(v["truncated"], json!(false));
        }
    }
}

#[test]
fn budget_refuses_an_out_of_range_budget_and_bad_input() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("r.json");
    std::fs::write(&file, r#"{"entry": 1}"#).expect("write");
    let file = file.to_str().expect("utf-8");
    for max in ["100", "1023", "32769", "-1", "lots"] {
        let out = run(&["budget", file, "--max", max]);
        out.code(2);
        assert!(out.stdout.is_empty(), "--max {max}: {}", out.stdout);
    }
    run(&["budget", file, "--max", "32768"]).code(0);
    let missing = dir.path().join("missing.json");
    let out = run(&["budget", missing.to_str().expect("utf-8")]);
    out.code(2);
    assert!(out.stderr.contains("cannot read"), "{}", out.stderr);
    run(&["budget"]).code(2);
    let out = run_stdin(&["budget", "-"], "{\"a\": ");
    out.code(1);
    assert!(out.stderr.contains("not acceptable JSON"), "{}", out.stderr);
}

#[test]
fn close_settles_an_unknown_outcome_orphaned_call_with_evidence_and_refuses_others() {
    let f = Fixture::seeded();
    let unknown = local_call(None, "run_9", "call_unknown", TOOL, LocalState::Orphaned, 0);
    let known = local_call(None, "run_9", "call_known", TOOL, LocalState::Orphaned, 0);
    f.commit(vec![
        Change::InsertCall(unknown),
        Change::Note {
            run_id: "run_9".into(),
            call_id: "call_unknown".into(),
            what: "orphaned_outcome_unknown".into(),
            detail: None,
        },
        Change::InsertCall(known),
    ]);
    let before = f.snapshot("run_9/call_known");
    let refused = f.run(&[
        "reconcile",
        "close",
        "run_9/call_known",
        "--evidence",
        "checked",
    ]);
    refused.code(1);
    assert!(
        refused
            .stderr
            .contains("only orphaned calls whose outcome was unknown"),
        "{}",
        refused.stderr
    );
    assert_eq!(
        f.snapshot("run_9/call_known"),
        before,
        "a refused close changed the call"
    );
    let out = f.run(&[
        "reconcile",
        "close",
        "run_9/call_unknown",
        "--evidence",
        "the provider has no charge for this key",
        "--who",
        "ops",
    ]);
    out.code(0);
    assert!(
        out.stdout.contains("closed run_9/call_unknown"),
        "{}",
        out.stdout
    );
    let shown = f.run(&["calls", "show", "run_9/call_unknown", "--json"]);
    shown.code(0);
    assert!(
        shown.stdout.contains("operator_closed")
            && shown
                .stdout
                .contains("the provider has no charge for this key"),
        "{}",
        shown.stdout
    );
    let again = f.run(&[
        "reconcile",
        "close",
        "run_9/call_unknown",
        "--evidence",
        "again",
    ]);
    again.code(1);
    assert!(again.stderr.contains("closed already"), "{}", again.stderr);
}
