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
use toolrunner::testing::store::{
    Attempt, Change, Event, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus,
    SqliteStore, Store,
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

mod approvals;
mod budget;
mod calls;
mod canary;
mod console;
mod dev;
mod errors;
mod help;
mod outbox;
mod platform;
mod reconcile;
mod tools;

// ---------------------------------------------------------------- helpers

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn now() -> toolrunner::testing::store::Timestamp {
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
        "TOOLRUNNER_ADMIN_TOKEN",
        "TOOLRUNNER_AGENT_ID",
        "TOOLRUNNER_EXECUTOR_ID",
        "TOOLRUNNER_BINDING_ID",
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
        method: toolrunner::platform::Method,
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
        self.send(
            toolrunner::platform::Method::POST,
            path,
            token,
            Some(body),
            grant,
        )
    }

    fn agent_id(&self) -> String {
        self.agent.clone()
    }

    fn get(&self, path: &str, token: &str) -> (u16, Value) {
        self.send(toolrunner::platform::Method::GET, path, token, None, None)
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
                    toolrunner::platform::Method::POST,
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
