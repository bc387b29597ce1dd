//! Differential test of the platform model
//! (`toolrunner::testing::model::PlatformModel`, protocol §4–5) against the
//! development platform (`toolrunner-devserver`, embedded on loopback, in
//! memory), on the same request sequences.
//!
//! Each step is played on both sides: connect, claim (new and replayed
//! operation keys, current and stale connections), receipts (accepted,
//! progress, completed, failed, cancelled, identical retries, conflicting
//! bodies, out-of-order sequences), reports, a platform cancel of the run
//! and a lease expiry. For every request the HTTP status and error code are
//! compared, and on success `replayed`, `call_state`, `accepted`, the
//! report `outcome` and the connect's `outstanding` calls; after every step
//! the state of every call (`PlatformModel::state` vs `GET /runs/{id}`).
//!
//! Ids differ between the sides: calls use the platform's ids on both
//! (the model takes any), connections and assignments are mapped by
//! position (the model's grant is `grt_` + its assignment id, the
//! platform's comes from its claim answer). Receipt bodies are the same
//! bytes on both sides except for `assignment_id`, which names each side's
//! own assignment.
//!
//! Lease expiry: the platform's clock is advanced (`DevServer::advance_clock`)
//! past the lease TTL while the other executors heartbeat, so exactly one
//! executor's lease lapses; the model hears `expire(executor)`.
//!
//! Every run holds a third call that no step touches, so that the random
//! walk's run never becomes `completed` (every call terminal), which would
//! end the walk early; `a_completed_run_has_ended` plays that case.
//!
//! The tests after "DISAGREEMENT" comments each play a case where the two
//! sides first answered differently, and assert the contract's answer
//! (`protocol.md`): four were the model's mistakes, fixed in the model;
//! one (C) is the development platform's documented choice 67, which the
//! model now follows. The random walk plays those cases too.

use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use toolrunner::testing::model::{PlatformModel, SplitMix};
use toolrunner_devserver::DevServer;
use toolrunner_protocol::wire::CallState;

const ADMIN: &str = "t-admin";
const EXEC: &str = "t-exec";
const TOOL: &str = "jobs.run";
const LEASE_TTL_MS: u64 = 15_000;

/// Requests compared over the whole test binary (printed by each test).
static COMPARED: AtomicU64 = AtomicU64::new(0);

// ------------------------------------------------------------ the platform

/// The development platform with one agent, binding and version.
struct Dev {
    server: DevServer,
    http: reqwest::Client,
    base: String,
    binding_id: String,
    agent_version: String,
}

impl Dev {
    async fn start() -> Dev {
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            let _ = rustls::crypto::ring::default_provider().install_default();
        });
        let server = DevServer::builder()
            .listen("127.0.0.1:0".parse().expect("address"))
            .lease_ttl_ms(LEASE_TTL_MS)
            .heartbeat_interval_ms(5_000)
            .run_ttl_ms(0)
            .token(ADMIN, "*")
            .token(EXEC, "executors:connect,tools:execute")
            .start()
            .await
            .expect("devserver starts");
        let base = server.base_url();
        let http = reqwest::Client::builder()
            .no_proxy()
            .build()
            .expect("http client");
        let mut dev = Dev {
            server,
            http,
            base,
            binding_id: String::new(),
            agent_version: String::new(),
        };
        let (s, agent) = dev.post(ADMIN, "/agents", &json!({"name": "model"})).await;
        assert_eq!(s, 200, "{agent}");
        let agent_id = agent["agent_id"].as_str().expect("agent_id").to_owned();
        let (s, binding) = dev
            .post(
                ADMIN,
                "/executor-bindings",
                &json!({"agent_id": agent_id, "name": "main", "tool_names": [TOOL]}),
            )
            .await;
        assert_eq!(s, 200, "{binding}");
        dev.binding_id = binding["binding_id"].as_str().expect("binding").to_owned();
        let (s, version) = dev
            .post(
                ADMIN,
                &format!("/agents/{agent_id}/versions"),
                &json!({"tools": [{"name": TOOL, "description": "Runs a job",
                        "binding_id": dev.binding_id,
                        "input_schema": {"type": "object"}}]}),
            )
            .await;
        assert_eq!(s, 200, "{version}");
        dev.agent_version = version["agent_version"]
            .as_str()
            .expect("agent_version")
            .to_owned();
        dev
    }

    async fn send(
        &self,
        token: &str,
        path: &str,
        body: Option<String>,
        grant: Option<&str>,
    ) -> (u16, Value) {
        let url = format!("{}/v1{path}", self.base);
        let mut rb = match &body {
            Some(_) => self.http.post(&url),
            None => self.http.get(&url),
        }
        .bearer_auth(token);
        if let Some(b) = body {
            rb = rb.header("content-type", "application/json").body(b);
        }
        if let Some(g) = grant {
            rb = rb.header("tool-grant", g);
        }
        let r = rb.send().await.unwrap_or_else(|e| panic!("{path}: {e}"));
        let status = r.status().as_u16();
        let bytes = r.bytes().await.expect("body");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    async fn post(&self, token: &str, path: &str, body: &Value) -> (u16, Value) {
        self.send(token, path, Some(body.to_string()), None).await
    }

    /// A new run with `n` calls of the tool; their ids.
    async fn run(&self, n: usize) -> (String, Vec<String>) {
        let calls: Vec<Value> = (0..n)
            .map(|_| json!({"tool_name": TOOL, "arguments": {}}))
            .collect();
        let (s, run) = self
            .post(
                ADMIN,
                "/runs",
                &json!({"agent_version": self.agent_version, "subject": "user_1",
                        "tool_calls": calls}),
            )
            .await;
        assert_eq!(s, 200, "{run}");
        let ids = run["tool_calls"]
            .as_array()
            .expect("tool_calls")
            .iter()
            .map(|c| c["call_id"].as_str().expect("call_id").to_owned())
            .collect();
        (run["run_id"].as_str().expect("run_id").to_owned(), ids)
    }
}

// ------------------------------------------------------------ answers

/// An answer reduced to what both sides can say.
#[derive(Debug, Clone, PartialEq)]
enum Answer {
    Refused(u16, String),
    Connected {
        outstanding: Vec<(String, String)>,
    },
    Claimed {
        replayed: bool,
        call_state: String,
    },
    Receipt {
        replayed: bool,
        call_state: String,
        accepted: Option<bool>,
    },
    Report {
        outcome: String,
    },
    Done,
}

fn refused(status: u16, code: &str) -> Answer {
    Answer::Refused(status, code.to_owned())
}

fn dev_refusal(status: u16, body: &Value) -> Answer {
    refused(
        status,
        body["error"]["code"].as_str().unwrap_or("(no code)"),
    )
}

fn s(state: CallState) -> String {
    state.as_str().to_owned()
}

/// Which connection of an executor a request names.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Con {
    /// Its newest.
    Latest,
    /// The `n`-th it got (0 = first).
    Nth(usize),
}

/// A receipt body, rendered per side with that side's assignment id.
#[derive(Debug, Clone, PartialEq)]
struct Body {
    receipt_id: String,
    sequence: u64,
    kind: &'static str,
    /// `failed`: the error code.
    code: &'static str,
    /// Changes `result` / `error.message` / `progress.data` / `reason`.
    variant: u64,
}

impl Body {
    fn render(&self, executor_id: &str, assignment_id: &str) -> String {
        let mut v = json!({"receipt_id": self.receipt_id, "executor_id": executor_id,
                           "assignment_id": assignment_id, "sequence": self.sequence,
                           "kind": self.kind});
        match self.kind {
            "completed" => v["result"] = json!({"n": self.variant}),
            "failed" => {
                v["error"] =
                    json!({"code": self.code, "message": format!("refused {}", self.variant)});
            }
            "progress" => {
                v["progress"] =
                    json!({"message": "working", "fraction": 0.5, "data": self.variant});
            }
            "cancelled" => v["reason"] = json!(format!("stopped {}", self.variant)),
            _ => {}
        }
        v.to_string()
    }
}

/// One request (or world event) played on both sides.
#[derive(Debug, Clone)]
enum Op {
    Connect {
        exec: usize,
    },
    Claim {
        exec: usize,
        con: Con,
        call: usize,
        key: usize,
    },
    /// A receipt under the `asg`-th assignment of call `call`.
    Receipt {
        call: usize,
        asg: usize,
        body: Body,
    },
    Report {
        exec: usize,
        con: Con,
        call: usize,
        state: &'static str,
    },
    /// A platform cancel of the run.
    Cancel,
    /// `exec`'s lease lapses.
    Expire {
        exec: usize,
    },
}

/// Both answers to one step.
#[derive(Debug)]
struct Both {
    model: Answer,
    dev: Answer,
}

struct ConPair {
    model: String,
    dev: String,
}

struct AsgPair {
    exec: usize,
    model_id: String,
    model_grant: String,
    dev_id: String,
    dev_grant: String,
}

/// A receipt body sent, for identical retries and conflicting variants.
#[derive(Clone)]
struct Sent {
    asg: usize,
    body: Body,
}

/// The model and the platform, fed the same steps.
struct World<'a> {
    dev: &'a Dev,
    model: PlatformModel,
    tag: String,
    run_id: String,
    /// Calls 0 and 1 are played; the last is never touched.
    calls: Vec<String>,
    execs: Vec<String>,
    cons: Vec<Vec<ConPair>>,
    asgs: Vec<Vec<AsgPair>>,
    sent: Vec<Vec<Sent>>,
    transcript: Vec<String>,
    compared: u64,
}

static WORLDS: AtomicU64 = AtomicU64::new(0);

impl<'a> World<'a> {
    async fn new(dev: &'a Dev) -> World<'a> {
        let n = WORLDS.fetch_add(1, Ordering::Relaxed);
        let tag = format!("w{n}");
        let (run_id, calls) = dev.run(3).await;
        let mut model = PlatformModel::new();
        for c in &calls {
            model.add_call(&run_id, c, TOOL);
        }
        World {
            dev,
            model,
            execs: vec![format!("exe_{tag}_a"), format!("exe_{tag}_b")],
            tag,
            run_id,
            cons: vec![Vec::new(), Vec::new()],
            asgs: vec![Vec::new(), Vec::new(), Vec::new()],
            sent: vec![Vec::new(), Vec::new(), Vec::new()],
            calls,
            transcript: Vec::new(),
            compared: 0,
        }
    }

    fn con(&self, exec: usize, con: Con) -> (String, String) {
        let list = &self.cons[exec];
        let pick = match con {
            Con::Latest => list.last(),
            Con::Nth(n) => list.get(n),
        };
        // Never connected: an id neither side issued (`lease_expired`).
        pick.map_or_else(
            || ("con_never".to_owned(), "con_never".to_owned()),
            |c| (c.model.clone(), c.dev.clone()),
        )
    }

    /// Plays `op` on both sides; nothing is asserted.
    async fn go(&mut self, op: Op) -> Both {
        let both = match op.clone() {
            Op::Connect { exec } => self.connect(exec).await,
            Op::Claim {
                exec,
                con,
                call,
                key,
            } => self.claim(exec, con, call, key).await,
            Op::Receipt { call, asg, body } => self.receipt(call, asg, body).await,
            Op::Report {
                exec,
                con,
                call,
                state,
            } => self.report(exec, con, call, state).await,
            Op::Cancel => {
                self.model.cancel(&self.run_id);
                let path = format!("/runs/{}/cancel", self.run_id);
                let (st, b) = self.dev.send(ADMIN, &path, Some("{}".into()), None).await;
                let dev = if st == 200 {
                    Answer::Done
                } else {
                    dev_refusal(st, &b)
                };
                Both {
                    model: Answer::Done,
                    dev,
                }
            }
            Op::Expire { exec } => self.expire(exec).await,
        };
        self.compared += 1;
        COMPARED.fetch_add(1, Ordering::Relaxed);
        self.transcript.push(format!(
            "{op:?}\n      model: {:?}\n      devsrv: {:?}",
            both.model, both.dev
        ));
        both
    }

    /// Plays `op`, asserts that both sides answer alike and then hold
    /// every call in the same state; returns the answer.
    async fn step(&mut self, op: Op) -> Answer {
        let both = self.go(op).await;
        if both.model != both.dev {
            self.fail("the answers differ");
        }
        self.same_states().await;
        both.model
    }

    /// Plays `op`, asserts both answers equal `want`.
    async fn expect(&mut self, op: Op, want: Answer) {
        let got = self.step(op).await;
        if got != want {
            self.fail(&format!("expected {want:?}"));
        }
    }

    fn fail(&self, why: &str) -> ! {
        let last: Vec<&String> = self.transcript.iter().rev().take(40).rev().collect();
        panic!(
            "{why} (world {}, {} steps); last steps:\n  {}",
            self.tag,
            self.transcript.len(),
            last.iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join("\n  ")
        );
    }

    /// The platform's call states, by call id.
    async fn dev_states(&self) -> Vec<(String, String)> {
        let (st, run) = self
            .dev
            .send(ADMIN, &format!("/runs/{}", self.run_id), None, None)
            .await;
        assert_eq!(st, 200, "{run}");
        run["tool_calls"]
            .as_array()
            .expect("tool_calls")
            .iter()
            .map(|c| {
                (
                    c["call_id"].as_str().unwrap_or_default().to_owned(),
                    c["state"].as_str().unwrap_or_default().to_owned(),
                )
            })
            .collect()
    }

    async fn same_states(&mut self) {
        let dev = self.dev_states().await;
        for (id, state) in &dev {
            let model = self.model.state(id).map(s);
            if model.as_deref() != Some(state.as_str()) {
                self.fail(&format!(
                    "call {id}: model state {model:?}, platform state {state}"
                ));
            }
        }
    }

    async fn connect(&mut self, exec: usize) -> Both {
        let id = self.execs[exec].clone();
        let (mcon, mout) = self.model.connect(&id);
        let mut outstanding: Vec<(String, String)> =
            mout.into_iter().map(|(c, st)| (c, s(st))).collect();
        outstanding.sort();
        let model = Answer::Connected { outstanding };
        let (st, b) = self
            .dev
            .post(
                EXEC,
                "/executors/connect",
                &json!({"executor_id": id, "instance_id": format!("ins_{}", self.cons[exec].len()),
                        "binding_id": self.dev.binding_id, "tools": [TOOL], "capacity": 8,
                        "sdk": {"name": "model_platform", "version": "0"}}),
            )
            .await;
        let dev = if st == 200 {
            let mut outstanding: Vec<(String, String)> = b["outstanding"]
                .as_array()
                .expect("outstanding")
                .iter()
                .map(|o| {
                    (
                        o["call_id"].as_str().unwrap_or_default().to_owned(),
                        o["state"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect();
            outstanding.sort();
            self.cons[exec].push(ConPair {
                model: mcon,
                dev: b["connection_id"]
                    .as_str()
                    .expect("connection_id")
                    .to_owned(),
            });
            Answer::Connected { outstanding }
        } else {
            dev_refusal(st, &b)
        };
        Both { model, dev }
    }

    async fn claim(&mut self, exec: usize, con: Con, call: usize, key: usize) -> Both {
        let id = self.execs[exec].clone();
        let call_id = self.calls[call].clone();
        let (mcon, dcon) = self.con(exec, con);
        // One key space per (executor, call): the platform refuses a key
        // reused for another call (`400 operation_key_reused`), which the
        // model does not know.
        let op_key = format!("op_{}_{exec}_{call}_{key}", self.tag);
        let m = self.model.claim(&id, &mcon, &call_id, &op_key);
        let (st, b) = self
            .dev
            .post(
                EXEC,
                &format!("/runs/{}/tool-calls/{call_id}/claim", self.run_id),
                &json!({"executor_id": id, "connection_id": dcon, "operation_key": op_key}),
            )
            .await;
        let model = match &m {
            Ok(c) => Answer::Claimed {
                replayed: c.replayed,
                call_state: s(c.call_state),
            },
            Err((st, code)) => refused(*st, code),
        };
        let dev = if st == 200 {
            Answer::Claimed {
                replayed: b["replayed"].as_bool().expect("replayed"),
                call_state: b["call_state"].as_str().expect("call_state").to_owned(),
            }
        } else {
            dev_refusal(st, &b)
        };
        // Map the assignments: a new one on both sides is a new pair; a
        // replay must name a pair already known on both sides.
        if let (Ok(c), 200) = (&m, st) {
            let mid = c.assignment.assignment_id.clone();
            let did = b["assignment"]["assignment_id"]
                .as_str()
                .expect("assignment_id")
                .to_owned();
            let known_m = self.asgs[call].iter().position(|a| a.model_id == mid);
            let known_d = self.asgs[call].iter().position(|a| a.dev_id == did);
            if known_m != known_d {
                self.fail(&format!(
                    "claim of call {call}: model assignment {mid} is pair {known_m:?}, platform's {did} is pair {known_d:?}"
                ));
            }
            if known_m.is_none() {
                self.asgs[call].push(AsgPair {
                    exec,
                    model_id: mid,
                    model_grant: c.assignment.grant.expose().to_owned(),
                    dev_id: did,
                    dev_grant: b["assignment"]["grant"].as_str().expect("grant").to_owned(),
                });
            }
        }
        Both { model, dev }
    }

    async fn receipt(&mut self, call: usize, asg: usize, body: Body) -> Both {
        let call_id = self.calls[call].clone();
        let a = &self.asgs[call][asg];
        let exec_id = self.execs[a.exec].clone();
        let (mbody, dbody) = (
            body.render(&exec_id, &a.model_id),
            body.render(&exec_id, &a.dev_id),
        );
        let (mgrant, dgrant) = (a.model_grant.clone(), a.dev_grant.clone());
        let model = match self.model.receipt(&call_id, &mgrant, &mbody) {
            Ok(r) => Answer::Receipt {
                replayed: r.replayed,
                call_state: s(r.call_state),
                accepted: r.accepted,
            },
            Err((st, code)) => refused(st, code),
        };
        let (st, b) = self
            .dev
            .send(
                EXEC,
                &format!("/runs/{}/tool-calls/{call_id}/receipts", self.run_id),
                Some(dbody),
                Some(&dgrant),
            )
            .await;
        let dev = if st == 200 {
            Answer::Receipt {
                replayed: b["replayed"].as_bool().expect("replayed"),
                call_state: b["call_state"].as_str().expect("call_state").to_owned(),
                accepted: b.get("accepted").and_then(Value::as_bool),
            }
        } else {
            dev_refusal(st, &b)
        };
        self.sent[call].push(Sent { asg, body });
        Both { model, dev }
    }

    async fn report(&mut self, exec: usize, con: Con, call: usize, state: &'static str) -> Both {
        let id = self.execs[exec].clone();
        let call_id = self.calls[call].clone();
        let (mcon, dcon) = self.con(exec, con);
        let model = match self.model.report(&id, &mcon, &call_id, state) {
            Ok(outcome) => Answer::Report {
                outcome: outcome.to_owned(),
            },
            Err((st, code)) => refused(st, code),
        };
        let (st, b) = self
            .dev
            .post(
                EXEC,
                &format!("/executors/{id}/calls/report"),
                &json!({"connection_id": dcon,
                        "calls": [{"run_id": self.run_id, "call_id": call_id, "state": state}]}),
            )
            .await;
        let dev = if st == 200 {
            Answer::Report {
                outcome: b["results"][0]["outcome"]
                    .as_str()
                    .expect("outcome")
                    .to_owned(),
            }
        } else {
            dev_refusal(st, &b)
        };
        Both { model, dev }
    }

    /// `exec`'s lease lapses: the platform's clock moves past the TTL in
    /// two halves while every other executor the model holds live
    /// heartbeats (so only `exec` lapses); each heartbeat must be `200`.
    async fn expire(&mut self, exec: usize) -> Both {
        let id = self.execs[exec].clone();
        self.model.expire(&id);
        let half = Duration::from_millis(LEASE_TTL_MS * 2 / 3 + 1);
        let mut dev = Answer::Done;
        for _ in 0..2 {
            self.dev.server.advance_clock(half);
            for other in (0..self.execs.len()).filter(|o| *o != exec) {
                let oid = self.execs[other].clone();
                let Some(c) = self.cons[other].last() else {
                    continue;
                };
                if !self.model.is_live(&oid, &c.model) {
                    continue;
                }
                let (st, b) = self
                    .dev
                    .post(
                        EXEC,
                        &format!("/executors/{oid}/heartbeat"),
                        &json!({"connection_id": c.dev, "in_flight": []}),
                    )
                    .await;
                if st != 200 {
                    dev = dev_refusal(st, &b);
                }
            }
        }
        Both {
            model: Answer::Done,
            dev,
        }
    }
}

// ------------------------------------------------------------ shorthands

fn claimed(replayed: bool, state: &str) -> Answer {
    Answer::Claimed {
        replayed,
        call_state: state.to_owned(),
    }
}

fn rcpt(replayed: bool, state: &str, accepted: Option<bool>) -> Answer {
    Answer::Receipt {
        replayed,
        call_state: state.to_owned(),
        accepted,
    }
}

fn outcome(o: &str) -> Answer {
    Answer::Report {
        outcome: o.to_owned(),
    }
}

fn body(receipt_id: &str, sequence: u64, kind: &'static str) -> Body {
    Body {
        receipt_id: receipt_id.to_owned(),
        sequence,
        kind,
        code: if kind == "failed" {
            "card_declined"
        } else {
            ""
        },
        variant: 0,
    }
}

fn forbidden0(receipt_id: &str) -> Body {
    Body {
        code: "forbidden",
        ..body(receipt_id, 0, "failed")
    }
}

fn claim(exec: usize, call: usize, key: usize) -> Op {
    Op::Claim {
        exec,
        con: Con::Latest,
        call,
        key,
    }
}

fn report(exec: usize, call: usize, state: &'static str) -> Op {
    Op::Report {
        exec,
        con: Con::Latest,
        call,
        state,
    }
}

fn rc(call: usize, asg: usize, body: Body) -> Op {
    Op::Receipt { call, asg, body }
}

fn connected(outstanding: &[(&str, &str)]) -> Answer {
    let mut v: Vec<(String, String)> = outstanding
        .iter()
        .map(|(c, s)| ((*c).to_owned(), (*s).to_owned()))
        .collect();
    v.sort();
    Answer::Connected { outstanding: v }
}

fn done(w: &World<'_>, name: &str) {
    println!("model_platform: {name}: {} requests compared", w.compared);
}

// ------------------------------------------------------------ scripted

/// Claims, replays, the receipt table's rows, and a second executor.
#[tokio::test]
async fn claims_and_receipts_agree() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    // A claim before any connect: lease_expired.
    w.expect(claim(0, 0, 0), refused(409, "lease_expired"))
        .await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(Op::Connect { exec: 1 }, connected(&[])).await;
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    // Same key again: replay; another key or executor: already_claimed.
    w.expect(claim(0, 0, 0), claimed(true, "claimed")).await;
    w.expect(claim(0, 0, 1), refused(409, "already_claimed"))
        .await;
    w.expect(claim(1, 0, 0), refused(409, "already_claimed"))
        .await;
    // A receipt before accepted.
    w.expect(
        rc(0, 0, body("rcp_p1", 1, "progress")),
        refused(409, "not_accepted"),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_c1", 1, "completed")),
        refused(409, "not_accepted"),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(false, "running", Some(true)),
    )
    .await;
    // Identical retry of accepted; a second accepted with another id.
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(true, "running", Some(true)),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_a2", 0, "accepted")),
        refused(409, "already_accepted"),
    )
    .await;
    // Sequence not greater than the last stored one.
    w.expect(
        rc(0, 0, body("rcp_p0", 0, "progress")),
        refused(409, "sequence_conflict"),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_p1", 1, "progress")),
        rcpt(false, "running", None),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_p1b", 1, "progress")),
        refused(409, "sequence_conflict"),
    )
    .await;
    // A claim of the running call; the owner's replay says running.
    w.expect(claim(1, 0, 0), refused(409, "already_claimed"))
        .await;
    w.expect(claim(0, 0, 0), claimed(true, "running")).await;
    w.expect(
        rc(0, 0, body("rcp_c", 2, "completed")),
        rcpt(false, "completed", None),
    )
    .await;
    // Identical retry after the end; same id, other body; new receipts.
    w.expect(
        rc(0, 0, body("rcp_c", 2, "completed")),
        rcpt(true, "completed", None),
    )
    .await;
    let other = Body {
        variant: 7,
        ..body("rcp_c", 2, "completed")
    };
    w.expect(rc(0, 0, other), refused(409, "receipt_conflict"))
        .await;
    w.expect(
        rc(0, 0, body("rcp_c3", 3, "completed")),
        refused(409, "call_already_terminal"),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(true, "completed", Some(false)),
    )
    .await;
    w.expect(claim(0, 0, 0), claimed(true, "completed")).await;
    w.expect(claim(1, 0, 3), refused(409, "call_not_claimable"))
        .await;
    // Call 1: the second executor settles it unstarted (sequence-0 failed,
    // forbidden); the first executor's grant is not this call's.
    w.expect(claim(1, 1, 0), claimed(false, "claimed")).await;
    w.expect(rc(1, 0, forbidden0("rcp_f0")), rcpt(false, "failed", None))
        .await;
    w.expect(rc(1, 0, forbidden0("rcp_f0")), rcpt(true, "failed", None))
        .await;
    w.expect(claim(0, 1, 0), refused(409, "call_not_claimable"))
        .await;
    done(&w, "claims_and_receipts_agree");
}

/// A business `failed` at sequence 0 before accepted is `not_accepted`;
/// a grant of a released claim is refused; a re-claim after release.
#[tokio::test]
async fn release_and_reclaim_agree() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(Op::Connect { exec: 1 }, connected(&[])).await;
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    w.expect(
        rc(0, 0, body("rcp_f", 0, "failed")),
        refused(409, "not_accepted"),
    )
    .await;
    // Report: released from claimed, then outcomes of a released call.
    w.expect(
        report(0, 0, "reconciliation_required"),
        outcome("not_applicable"),
    )
    .await;
    w.expect(report(1, 0, "released"), outcome("not_bound"))
        .await;
    w.expect(report(0, 0, "released"), outcome("updated")).await;
    w.expect(report(0, 0, "released"), outcome("not_bound"))
        .await;
    // The released grant stops working.
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        refused(403, "invalid_grant"),
    )
    .await;
    // The same key claims anew (a released assignment is never returned).
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        refused(403, "invalid_grant"),
    )
    .await;
    w.expect(
        rc(0, 1, body("rcp_a", 0, "accepted")),
        rcpt(false, "running", Some(true)),
    )
    .await;
    // Report reconciliation_required from running; again: unchanged;
    // released from it: not_applicable; the other executor: not_bound.
    w.expect(report(0, 0, "released"), outcome("not_applicable"))
        .await;
    w.expect(report(0, 0, "reconciliation_required"), outcome("updated"))
        .await;
    w.expect(
        report(0, 0, "reconciliation_required"),
        outcome("unchanged"),
    )
    .await;
    w.expect(
        report(1, 0, "reconciliation_required"),
        outcome("not_bound"),
    )
    .await;
    w.expect(claim(1, 0, 0), refused(409, "already_claimed"))
        .await;
    // A reconnect lists it; a stale connection is superseded.
    let c0 = w.calls[0].clone();
    w.expect(
        Op::Connect { exec: 0 },
        connected(&[(c0.as_str(), "reconciliation_required")]),
    )
    .await;
    w.expect(
        Op::Claim {
            exec: 0,
            con: Con::Nth(0),
            call: 1,
            key: 0,
        },
        refused(409, "connection_superseded"),
    )
    .await;
    w.expect(
        Op::Report {
            exec: 0,
            con: Con::Nth(0),
            call: 0,
            state: "released",
        },
        refused(409, "connection_superseded"),
    )
    .await;
    // A final receipt settles reconciliation; then report: terminal.
    w.expect(
        rc(0, 1, body("rcp_c", 5, "completed")),
        rcpt(false, "completed", None),
    )
    .await;
    w.expect(report(0, 0, "reconciliation_required"), outcome("terminal"))
        .await;
    w.expect(report(0, 0, "released"), outcome("terminal"))
        .await;
    done(&w, "release_and_reclaim_agree");
}

/// A platform cancel: late receipts, claims, replays and reports.
#[tokio::test]
async fn cancel_agrees() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(Op::Connect { exec: 1 }, connected(&[])).await;
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(false, "running", Some(true)),
    )
    .await;
    w.expect(claim(1, 1, 0), claimed(false, "claimed")).await;
    w.expect(Op::Cancel, Answer::Done).await;
    // Late receipts; identical retry of a stored one still replays.
    w.expect(
        rc(0, 0, body("rcp_c", 1, "completed")),
        refused(409, "run_terminated"),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_c", 1, "completed")),
        refused(409, "run_terminated"),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(true, "terminated", Some(false)),
    )
    .await;
    w.expect(
        rc(1, 0, body("rcp_a1", 0, "accepted")),
        refused(409, "run_terminated"),
    )
    .await;
    w.expect(
        rc(1, 0, forbidden0("rcp_f1")),
        refused(409, "run_terminated"),
    )
    .await;
    // Claims: a replay answers terminated; a new claim run_terminated.
    w.expect(claim(0, 0, 0), claimed(true, "terminated")).await;
    w.expect(claim(1, 1, 0), claimed(true, "terminated")).await;
    w.expect(claim(1, 0, 1), refused(409, "run_terminated"))
        .await;
    w.expect(claim(0, 2, 0), refused(409, "run_terminated"))
        .await;
    // Reports: run_terminated for a bound call, not_bound otherwise.
    w.expect(
        report(0, 0, "reconciliation_required"),
        outcome("run_terminated"),
    )
    .await;
    w.expect(report(1, 1, "released"), outcome("run_terminated"))
        .await;
    w.expect(report(1, 0, "released"), outcome("not_bound"))
        .await;
    w.expect(report(0, 2, "released"), outcome("not_bound"))
        .await;
    // A reconnect lists nothing; a second cancel changes nothing.
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(Op::Cancel, Answer::Done).await;
    done(&w, "cancel_agrees");
}

/// A lease lapses: the claimed call returns to pending and its grant stops
/// working; the running call stays bound and listed at the next connect.
#[tokio::test]
async fn lease_expiry_agrees() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    let (c0, c1) = (w.calls[0].clone(), w.calls[1].clone());
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(Op::Connect { exec: 1 }, connected(&[])).await;
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(false, "running", Some(true)),
    )
    .await;
    w.expect(claim(0, 1, 0), claimed(false, "claimed")).await;
    w.expect(Op::Expire { exec: 0 }, Answer::Done).await;
    // The expired connection: lease_expired for claims and reports.
    w.expect(claim(0, 1, 0), refused(409, "lease_expired"))
        .await;
    w.expect(
        report(0, 0, "reconciliation_required"),
        refused(409, "lease_expired"),
    )
    .await;
    // The released claim's grant; the running call's grant still works.
    w.expect(
        rc(1, 0, body("rcp_a1", 0, "accepted")),
        refused(403, "invalid_grant"),
    )
    .await;
    w.expect(
        rc(0, 0, body("rcp_p", 1, "progress")),
        rcpt(false, "running", None),
    )
    .await;
    // The other executor (kept alive by heartbeats) claims the released call.
    w.expect(claim(1, 1, 0), claimed(false, "claimed")).await;
    w.expect(claim(1, 0, 0), refused(409, "already_claimed"))
        .await;
    w.expect(
        Op::Connect { exec: 0 },
        connected(&[(c0.as_str(), "running")]),
    )
    .await;
    w.expect(
        Op::Connect { exec: 1 },
        connected(&[(c1.as_str(), "claimed")]),
    )
    .await;
    // The old key of executor 0 on call 1: its assignment was released,
    // the call is claimed by executor 1.
    w.expect(claim(0, 1, 0), refused(409, "already_claimed"))
        .await;
    // Executor 1 lapses too: call 1 back to pending, 0 claims it with its old key.
    w.expect(Op::Expire { exec: 1 }, Answer::Done).await;
    w.expect(claim(0, 1, 0), claimed(false, "claimed")).await;
    w.expect(report(0, 0, "reconciliation_required"), outcome("updated"))
        .await;
    done(&w, "lease_expiry_agrees");
}

// ------------------------------------------------------------ random walk

/// The model's SplitMix64, drawn from as the walk needs.
struct Rng(SplitMix);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0.next_u64() % n
    }

    fn usize(&mut self, n: usize) -> usize {
        usize::try_from(self.below(n as u64)).expect("small")
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

impl World<'_> {
    /// A random step, from what the world holds now.
    fn random_op(&self, rng: &mut Rng, next_receipt: &mut u64) -> Op {
        let exec = rng.usize(2);
        let call = rng.usize(2);
        let con = |rng: &mut Rng| {
            let list = &self.cons[exec];
            if list.len() > 1 && rng.chance(15) {
                return Con::Nth(rng.usize(list.len() - 1));
            }
            Con::Latest
        };
        let roll = rng.below(100);
        if roll < 8 || (self.cons[exec].is_empty() && roll < 40) {
            return Op::Connect { exec };
        }
        if roll < 12 {
            return Op::Expire { exec };
        }
        if roll < 14 {
            return Op::Cancel;
        }
        if roll < 28 {
            let state = match rng.below(3) {
                0 => "released",
                1 => "pending_delivery",
                _ => "reconciliation_required",
            };
            return Op::Report {
                exec,
                con: con(rng),
                call,
                state,
            };
        }
        if roll < 52 || self.asgs[call].is_empty() {
            return Op::Claim {
                exec,
                con: con(rng),
                call,
                key: rng.usize(3),
            };
        }
        // A receipt.
        let sent = &self.sent[call];
        let r = rng.below(100);
        if r < 20 {
            let retries: Vec<&Sent> = sent.iter().collect();
            if !retries.is_empty() {
                let Sent { asg, body, .. } = retries[rng.usize(retries.len())].clone();
                return Op::Receipt { call, asg, body };
            }
        }
        if r < 30 {
            let stored: Vec<&Sent> = sent.iter().collect();
            if !stored.is_empty() {
                let Sent { asg, mut body, .. } = stored[rng.usize(stored.len())].clone();
                body.variant += 1 + rng.below(3);
                return Op::Receipt { call, asg, body };
            }
        }
        let asgs = self.asgs[call].len();
        let asg = if rng.chance(80) {
            asgs - 1
        } else {
            rng.usize(asgs)
        };
        *next_receipt += 1;
        let receipt_id = format!("rcp_{next_receipt}");
        let last = sent.iter().map(|s| s.body.sequence).max().unwrap_or(0);
        let sequence = match rng.below(10) {
            0 => 0,
            1 | 2 => last,
            _ => last + 1,
        };
        let k = rng.below(100);
        let mut body = match k {
            0..35 => body(&receipt_id, 0, "accepted"),
            35..50 => body(&receipt_id, sequence, "progress"),
            50..68 => body(&receipt_id, sequence, "completed"),
            68..78 => body(&receipt_id, sequence, "failed"),
            78..86 => body(&receipt_id, sequence, "cancelled"),
            _ => forbidden0(&receipt_id),
        };
        body.variant = rng.below(3);
        Op::Receipt { call, asg, body }
    }
}

/// A few hundred random sequences from a fixed seed, every answer and
/// every call state compared.
#[tokio::test]
async fn random_sequences_agree() {
    const SEQUENCES: u64 = 300;
    const STEPS: usize = 30;
    let dev = Dev::start().await;
    let mut rng = Rng(SplitMix(0x5EED_F00D_2024_0001));
    let mut total = 0;
    let mut answers: std::collections::BTreeMap<String, u64> = Default::default();
    for _ in 0..SEQUENCES {
        let mut w = World::new(&dev).await;
        let mut next_receipt = 0;
        for _ in 0..STEPS {
            let op = w.random_op(&mut rng, &mut next_receipt);
            let a = w.step(op).await;
            let key = match a {
                Answer::Refused(st, code) => format!("{st} {code}"),
                Answer::Connected { .. } => "connected".into(),
                Answer::Claimed {
                    replayed,
                    call_state,
                } => format!("claim replayed={replayed} {call_state}"),
                Answer::Receipt {
                    replayed,
                    call_state,
                    accepted,
                } => format!("receipt replayed={replayed} {call_state} accepted={accepted:?}"),
                Answer::Report { outcome } => format!("report {outcome}"),
                Answer::Done => "done".into(),
            };
            *answers.entry(key).or_default() += 1;
        }
        total += w.compared;
    }
    for (k, n) in &answers {
        println!("model_platform: random: {n:6} × {k}");
    }
    println!(
        "model_platform: random_sequences_agree: {SEQUENCES} sequences, {total} requests compared"
    );
    // The walk must reach the interesting answers, or it proves little.
    for want in [
        "409 receipt_conflict",
        "409 sequence_conflict",
        "409 not_accepted",
        "409 run_terminated",
        "409 already_accepted",
        "403 invalid_grant",
        "report updated",
        "report not_bound",
    ] {
        assert!(answers.contains_key(want), "the walk never answered {want}");
    }
}

// ------------------------------------------------------------ disagreements

/// DISAGREEMENT A. A sequence-0 `failed` (`forbidden`) after `accepted`
/// (sequence 0 stored): the contract's receipt table gives the pre-accept
/// exception only to the `not_accepted` row ("any receipt but accepted
/// before accepted, except …"); the next row, "sequence not greater than
/// the last stored one", still applies: `409 sequence_conflict`. The
/// platform answers that; the model stores it and fails the call.
#[tokio::test]
async fn a_sequence0_failed_after_accepted_is_sequence_conflict() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(false, "running", Some(true)),
    )
    .await;
    w.expect(
        rc(0, 0, forbidden0("rcp_f0")),
        refused(409, "sequence_conflict"),
    )
    .await;
}

/// DISAGREEMENT B. A second `pending_delivery` report of the same bound
/// call: the contract's report outcomes say `unchanged` ("already so —
/// reports are idempotent"). The platform answers `unchanged`; the model
/// answers `updated` every time (it keeps no flag).
#[tokio::test]
async fn pending_delivery_twice_is_unchanged() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(false, "running", Some(true)),
    )
    .await;
    w.expect(report(0, 0, "pending_delivery"), outcome("updated"))
        .await;
    w.expect(report(0, 0, "pending_delivery"), outcome("unchanged"))
        .await;
}

/// DISAGREEMENT C (found by this test; the model now follows the
/// development platform). A connection whose lease lapsed, after the
/// executor connected again: the claim rules' order names `409
/// connection_superseded` before `409 lease_expired`, and §4 says a new
/// connect supersedes the previous connection; the development platform
/// answers `lease_expired`, what happened first (its documented choice 67
/// in `docs/protocol.md`). An executor handles both alike (it connects
/// again); the model answers as the development platform, and
/// `docs/simulation.md` records the question.
#[tokio::test]
async fn an_expired_then_superseded_connection_claims_lease_expired() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(Op::Expire { exec: 0 }, Answer::Done).await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(
        Op::Claim {
            exec: 0,
            con: Con::Nth(0),
            call: 0,
            key: 0,
        },
        refused(409, "lease_expired"),
    )
    .await;
}

/// DISAGREEMENT D. A late receipt (after a cancel) sent again under the
/// same `receipt_id` with another body. The platform kept the first for
/// audit and answers `409 receipt_conflict`; the model keeps nothing and
/// answers `409 run_terminated`. The contract's table puts "same
/// receipt_id, different body → receipt_conflict" above the late-receipt
/// row, and says late receipts are "kept for audit": the platform's answer.
/// (The contract is loose here: an identical retry of a late receipt is
/// `run_terminated` on both sides, not `200 replayed`.)
#[tokio::test]
async fn a_late_receipt_with_another_body_is_receipt_conflict() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    w.expect(claim(0, 0, 0), claimed(false, "claimed")).await;
    w.expect(
        rc(0, 0, body("rcp_a", 0, "accepted")),
        rcpt(false, "running", Some(true)),
    )
    .await;
    w.expect(Op::Cancel, Answer::Done).await;
    w.expect(
        rc(0, 0, body("rcp_c", 1, "completed")),
        refused(409, "run_terminated"),
    )
    .await;
    let other = Body {
        variant: 9,
        ..body("rcp_c", 1, "completed")
    };
    w.expect(rc(0, 0, other), refused(409, "receipt_conflict"))
        .await;
}

/// DISAGREEMENT E. A run whose every call is terminal is `completed`
/// (§5 run status), and "any new receipt after the run was cancelled or
/// ended" is `409 run_terminated` (that row comes before
/// `call_already_terminal`); the platform answers so (docs choice 14).
/// The model knows only cancelled runs and answers
/// `409 call_already_terminal`.
#[tokio::test]
async fn a_completed_run_has_ended() {
    let dev = Dev::start().await;
    let mut w = World::new(&dev).await;
    // Settle every call of the run, the untouched third one included.
    w.expect(Op::Connect { exec: 0 }, connected(&[])).await;
    for call in 0..3 {
        w.expect(claim(0, call, 0), claimed(false, "claimed")).await;
        w.expect(
            rc(call, 0, forbidden0("rcp_f")),
            rcpt(false, "failed", None),
        )
        .await;
    }
    w.expect(
        rc(2, 0, body("rcp_x", 1, "completed")),
        refused(409, "run_terminated"),
    )
    .await;
}
