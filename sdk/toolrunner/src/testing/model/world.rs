//! A small world: the platform model, one store model per database, and
//! executor processes whose every decision is the runner's own — the call
//! machine (`runner::machine`) and the lifecycle's pure plan
//! (`lifecycle::plan_with`). Each [`Input`] is one thing that can happen
//! next; [`World::apply`] does it and checks the promises on the way.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use serde_json::json;
use toolrunner_protocol::wire::{CallState, Claimed, ReceiptAnswer, ReceiptKind};

use super::platform::{PlatformModel, Refusal};
use super::store::StoreModel;
use crate::api::context::{confirms_before_connect, may_act};
use crate::api::handler::Effect;
use crate::lifecycle::{Event, FinalReceipt, Given, Snapshot, plan_with};
use crate::runner::machine::Reply;
use crate::runner::machine::accept::{self, OnAccepted, OnSaved, Saved};
use crate::runner::machine::claim::{self, OnClaim};
use crate::runner::machine::deliver::{self, Mark, OnDelivery};
use crate::runner::machine::resume::{self, Again, OnRunning, StillRuns};
use crate::runner::machine::step::{self, Step};
use crate::store::{LocalState, PendingReport, ReceiptStatus};

/// The run every call of a world belongs to.
pub(crate) const RUN: &str = "run_1";

/// How many of each fault a world may still inject.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Budget {
    /// Process crashes (at any point between two durable steps).
    pub crashes: u8,
    /// Answers lost after the platform acted on the request.
    pub lost: u8,
    /// Platform cancels of the run.
    pub cancels: u8,
    /// Lease expiries on the platform.
    pub expiries: u8,
    /// Pauses of a process past its lease (then another process of its
    /// identity takes it over).
    pub pauses: u8,
    /// Operators' resolves of a call whose outcome is unknown.
    pub resolves: u8,
    /// A person's decisions (approve, deny) of a `refund` call's approval
    /// request; its expiry passes whenever it may, unbudgeted.
    pub decisions: u8,
}

/// Where a `refund` call's approval request stands in one store's book.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asked {
    /// Nobody decided yet.
    Waiting,
    /// A person said yes: the call may be accepted and run, once.
    Approved,
    /// A person said no: the call is refused at sequence 0.
    Denied,
    /// Nobody decided in time: the call is refused at sequence 0.
    Expired,
}

/// One executor process.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Proc {
    identity: String,
    db: usize,
    token: u32,
    up: bool,
    paused: bool,
    conn: Option<String>,
    /// Calls whose `accepted` this process saw confirmed (not resumed).
    started: BTreeSet<String>,
    /// Write calls whose effect ran here and whose outcome is not saved.
    in_handler: BTreeMap<String, String>,
    /// Calls in `reconciliation_required` this process has checked.
    checked: BTreeSet<String>,
    /// Requests the platform acted on whose answers have not arrived yet.
    inflight: BTreeMap<String, Sent>,
    /// Calls recovery found no longer listed by the platform
    /// (`Core::remember_ended`): never run again.
    ended: BTreeSet<String>,
}

/// A request the platform acted on, and its answer on the way back.
#[derive(Debug, Clone, PartialEq)]
#[allow(clippy::large_enum_variant)] // a model's state, one per call in flight
enum Sent {
    /// A claim, sent from `claiming` with this operation key.
    Claim {
        operation_key: String,
        answer: Result<Claimed, Refusal>,
    },
    /// An `accepted`, sent from `assigned` under this assignment.
    Accept {
        assignment_id: String,
        receipt_id: String,
        answer: Result<ReceiptAnswer, Refusal>,
    },
    /// A final receipt of this assignment, sent from `settled`.
    Final {
        assignment_id: String,
        receipt_id: String,
        kind: ReceiptKind,
        sequence: u64,
        answer: Result<ReceiptAnswer, Refusal>,
    },
}

impl Input {
    /// Whether it is a fault the world injects (or an operator's act),
    /// rather than the system going on by itself.
    pub fn is_fault(&self) -> bool {
        matches!(
            self,
            Input::Crash(_)
                | Input::Pause(_)
                | Input::Expire(_)
                | Input::Cancel
                | Input::Resolve { .. }
                | Input::Decide {
                    to: Asked::Approved | Asked::Denied,
                    ..
                }
                | Input::Step { lost: true, .. }
        )
    }
}

/// Something that can happen next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Process `p` starts (a restart after a crash, or a takeover of its
    /// identity from a paused process): takes the identity, connects.
    Start(usize),
    /// Process `p` connects again (its lease lapsed or was superseded).
    Connect(usize),
    /// Process `p` dies: what it had not committed is lost.
    Crash(usize),
    /// Process `p` stops past its lease.
    Pause(usize),
    /// A paused process `p` goes on.
    Resume(usize),
    /// Process `p` takes the next step of `call`; `lost`: the platform
    /// acts on the request but its answer is lost.
    Step {
        /// Process.
        p: usize,
        /// Call.
        call: String,
        /// Whether the answer is lost.
        lost: bool,
    },
    /// Process `p` sends the report the call's row holds.
    Report {
        /// Process.
        p: usize,
        /// Call.
        call: String,
    },
    /// The platform's lease of identity `i` lapses.
    Expire(usize),
    /// A person decides the approval request of `call` waiting in store
    /// `db`'s book (`Asked::Expired`: its expiry passes).
    Decide {
        /// Database.
        db: usize,
        /// Call.
        call: String,
        /// The decision.
        to: Asked,
    },
    /// The platform cancels the run.
    Cancel,
    /// An operator resolves a call in `reconciliation_required` on
    /// database `db`, with what really happened.
    Resolve {
        /// Database.
        db: usize,
        /// Call.
        call: String,
    },
}

/// A small world's state.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct World {
    pub(crate) platform: PlatformModel,
    pub(crate) dbs: Vec<StoreModel>,
    pub(crate) procs: Vec<Proc>,
    pub(crate) identities: Vec<String>,
    /// call → how many times its effect happened.
    pub(crate) effects: Vec<(String, u32)>,
    pub(crate) budget: Budget,
    ids: u32,
    /// Every event the machines decided, in order (not part of the state).
    pub(crate) journal: Journal,
    /// Calls seen terminal on the platform (none may come back).
    ended: BTreeSet<String>,
    /// A promise a commit broke, for `apply` to report.
    broken: Option<String>,
    /// The tools' concurrency limit in each store (`None`: none).
    limit: Option<u32>,
    /// Each store's approval requests, by call (the `refund` tool's
    /// calls need a person's yes before they are accepted).
    approvals: Vec<BTreeMap<String, Asked>>,
}

/// What the machines decided, for the trace; every journal is equal to
/// every other and prints nothing, so it is no part of a state.
#[derive(Clone, Default)]
pub(crate) struct Journal(pub(crate) Vec<String>);

impl std::fmt::Debug for Journal {
    fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        Ok(())
    }
}

impl PartialEq for Journal {
    fn eq(&self, _: &Journal) -> bool {
        true
    }
}

/// What a world is made of.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    /// `(call id, tool)`: as [`WorldSpec::calls`](super::WorldSpec::calls).
    pub(crate) calls: Vec<(&'static str, &'static str)>,
    /// `(identity, database)` of each process; the first process of each
    /// identity starts up.
    pub(crate) procs: Vec<(usize, usize)>,
    pub(crate) identities: usize,
    pub(crate) dbs: usize,
    pub(crate) budget: Budget,
    /// The tools' concurrency limit in each store (`None`: none).
    pub(crate) limit: Option<u32>,
}

fn effect_of(tool: &str) -> Option<Effect> {
    match tool {
        "pay" | "ship" | "refund" => Some(Effect::Write),
        "book" => Some(Effect::Transactional),
        _ => None,
    }
}

fn reply<T>(r: &Result<T, Refusal>, lost: bool) -> Reply<&T> {
    match r {
        _ if lost => Reply::Unreachable("the answer was lost".into()),
        Ok(t) => Reply::Answered(t),
        Err((status, code)) => Reply::Refused {
            status: *status,
            code: (*code).to_owned(),
            message: format!("{status} {code}"),
        },
    }
}

fn epoch() -> crate::store::Timestamp {
    chrono::DateTime::from_timestamp(1_800_000_000, 0).unwrap_or_default()
}

impl World {
    pub(crate) fn new(shape: &Shape) -> World {
        let mut platform = PlatformModel::new();
        for (call, tool) in &shape.calls {
            platform.add_call(RUN, call, tool);
        }
        let identities: Vec<String> = (0..shape.identities)
            .map(|i| format!("exe_{}", (b'a' + i as u8) as char))
            .collect();
        let procs = shape
            .procs
            .iter()
            .map(|&(i, db)| Proc {
                identity: identities[i].clone(),
                db,
                token: 0,
                up: false,
                paused: false,
                conn: None,
                started: BTreeSet::new(),
                in_handler: BTreeMap::new(),
                checked: BTreeSet::new(),
                inflight: BTreeMap::new(),
                ended: BTreeSet::new(),
            })
            .collect();
        let mut w = World {
            platform,
            dbs: vec![StoreModel::default(); shape.dbs],
            procs,
            identities,
            effects: shape
                .calls
                .iter()
                .map(|(c, _)| ((*c).to_owned(), 0))
                .collect(),
            budget: shape.budget.clone(),
            ids: 0,
            journal: Journal::default(),
            ended: BTreeSet::new(),
            broken: None,
            limit: shape.limit,
            approvals: vec![BTreeMap::new(); shape.dbs],
        };
        let mut first = BTreeSet::new();
        for p in 0..w.procs.len() {
            if first.insert(w.procs[p].identity.clone()) {
                w.start(p);
            }
        }
        w
    }

    /// A text that two worlds share exactly when they are the same state.
    pub(crate) fn fingerprint(&self) -> String {
        let mut s = String::new();
        let _ = write!(s, "{self:?}");
        s
    }

    /// The id the next successful commit takes (ids are counted, and
    /// only a commit that lands uses one up, so that a refused step does
    /// not make a new state).
    fn next_id(&self, prefix: &str) -> String {
        format!("{prefix}_{}", self.ids + 1)
    }

    fn calls(&self) -> Vec<String> {
        self.effects.iter().map(|(c, _)| c.clone()).collect()
    }

    fn holds(&self, p: usize) -> bool {
        let pr = &self.procs[p];
        self.dbs[pr.db].holds(&pr.identity, pr.token)
    }

    /// Everything that can happen next.
    pub(crate) fn inputs(&self) -> Vec<Input> {
        let mut out = Vec::new();
        for (p, pr) in self.procs.iter().enumerate() {
            // Nobody who holds the identity goes on: another process of it
            // (or this one, whose identity moved on) may take it.
            let holder_gone = self.procs.iter().all(|q| {
                q.identity != pr.identity
                    || q.db != pr.db
                    || !q.up
                    || q.paused
                    || !self.dbs[q.db].holds(&q.identity, q.token)
            });
            if !pr.up || (!pr.paused && !self.dbs[pr.db].holds(&pr.identity, pr.token)) {
                if holder_gone {
                    out.push(Input::Start(p));
                }
                if !pr.up {
                    continue;
                }
            }
            if pr.paused {
                out.push(Input::Resume(p));
                continue;
            }
            if self.budget.crashes > 0 {
                out.push(Input::Crash(p));
            }
            let twin = self
                .procs
                .iter()
                .filter(|q| q.identity == pr.identity && q.db == pr.db)
                .count()
                > 1;
            if self.budget.pauses > 0 && twin {
                out.push(Input::Pause(p));
            }
            let live = pr
                .conn
                .as_deref()
                .is_some_and(|c| self.platform.is_live(&pr.identity, c));
            if !live {
                out.push(Input::Connect(p));
                continue;
            }
            for call in self.calls() {
                out.push(Input::Step {
                    p,
                    call: call.clone(),
                    lost: false,
                });
                if self.budget.lost > 0 && pr.inflight.contains_key(&call) {
                    out.push(Input::Step {
                        p,
                        call: call.clone(),
                        lost: true,
                    });
                }
                let row = self.dbs[pr.db].calls.get(&call);
                if row.is_some_and(|r| r.report.is_some()) {
                    out.push(Input::Report { p, call });
                }
            }
        }
        if self.budget.expiries > 0 {
            out.extend((0..self.identities.len()).map(Input::Expire));
        }
        if self.budget.cancels > 0 {
            out.push(Input::Cancel);
        }
        // A person decides (within the budget), or the request's expiry
        // passes: time goes on by itself, so a request never waits for
        // ever.
        for (db, book) in self.approvals.iter().enumerate() {
            for (call, asked) in book {
                if *asked != Asked::Waiting {
                    continue;
                }
                let people = if self.budget.decisions > 0 {
                    &[Asked::Approved, Asked::Denied][..]
                } else {
                    &[]
                };
                for to in people.iter().chain([&Asked::Expired]) {
                    out.push(Input::Decide {
                        db,
                        call: call.clone(),
                        to: *to,
                    });
                }
            }
        }
        if self.budget.resolves > 0 {
            for (db, d) in self.dbs.iter().enumerate() {
                for (call, row) in &d.calls {
                    if row.state == LocalState::ReconciliationRequired {
                        out.push(Input::Resolve {
                            db,
                            call: call.clone(),
                        });
                    }
                }
            }
        }
        out
    }

    fn start(&mut self, p: usize) {
        let (identity, db) = (self.procs[p].identity.clone(), self.procs[p].db);
        let token = self.dbs[db].take(&identity);
        let pr = &mut self.procs[p];
        pr.token = token;
        pr.up = true;
        pr.paused = false;
        pr.conn = None;
        pr.started.clear();
        pr.in_handler.clear();
        pr.checked.clear();
        pr.inflight.clear();
        pr.ended.clear();
        self.connect(p);
    }

    fn connect(&mut self, p: usize) {
        if confirms_before_connect() && !self.holds(p) {
            return;
        }
        let (conn, outstanding) = self.platform.connect(&self.procs[p].identity);
        self.procs[p].conn = Some(conn);
        self.recover(p, &outstanding);
    }

    /// What recovery does with a connect's `outstanding` list
    /// (`runner::loops::recovery::resume`), the connect being the model's
    /// one instant: every row changed before it.
    fn recover(&mut self, p: usize, outstanding: &[(String, CallState)]) {
        let db = self.procs[p].db;
        for (call, platform) in outstanding {
            let row = self.dbs[db].calls.get(call).cloned();
            let event = match row {
                None => Some(match platform {
                    CallState::Claimed => Event::OutstandingClaimed,
                    CallState::Running => Event::OutstandingRunning,
                    _ => Event::OutstandingReconciling,
                }),
                Some(c)
                    if *platform == CallState::Claimed
                        && matches!(c.state, LocalState::Abandoned | LocalState::Released)
                        && c.report.is_none() =>
                {
                    Some(Event::GiveBack)
                }
                Some(_) => None,
            };
            if let Some(event) = event {
                self.commit(p, call, event);
            }
        }
        let bound = |c: &str| outstanding.iter().any(|(o, _)| o == c);
        let rows: Vec<crate::store::LocalCall> = self.dbs[db].calls.values().cloned().collect();
        for c in rows {
            // A call a task of this process still drives is left to it.
            let pr = &self.procs[p];
            if pr.inflight.contains_key(&c.call_id) || pr.in_handler.contains_key(&c.call_id) {
                continue;
            }
            let listed = bound(&c.call_id);
            if matches!(
                c.state,
                LocalState::Running | LocalState::ReconciliationRequired
            ) && !listed
                && !resume::PLANTED_RESUME
            {
                self.procs[p].ended.insert(c.call_id.clone());
            }
            if c.state == LocalState::Assigned && !listed {
                self.commit(p, &c.call_id, Event::ClaimLapsed);
            }
            if c.state == LocalState::Running
                && !listed
                && !resume::PLANTED_RESUME
                && effect_of(&c.tool_name) == Some(Effect::Transactional)
            {
                self.commit(p, &c.call_id, Event::TransactionalEnded);
            }
        }
    }

    /// Does `input`; `Err` names the promise it broke.
    pub(crate) fn apply(&mut self, input: &Input) -> Result<(), String> {
        match input {
            Input::Start(p) => self.start(*p),
            Input::Connect(p) => self.connect(*p),
            Input::Crash(p) => {
                self.budget.crashes -= 1;
                let pr = &mut self.procs[*p];
                pr.up = false;
                pr.conn = None;
                pr.inflight.clear();
            }
            Input::Pause(p) => {
                self.budget.pauses -= 1;
                self.procs[*p].paused = true;
                // Past its lease: the platform's lease lapses too.
                let id = self.procs[*p].identity.clone();
                self.platform.expire(&id);
            }
            Input::Resume(p) => self.procs[*p].paused = false,
            Input::Expire(i) => {
                self.budget.expiries -= 1;
                let id = self.identities[*i].clone();
                self.platform.expire(&id);
            }
            Input::Cancel => {
                self.budget.cancels -= 1;
                self.platform.cancel(RUN);
            }
            Input::Resolve { db, call } => {
                self.budget.resolves -= 1;
                self.resolve(*db, call)?;
            }
            Input::Decide { db, call, to } => {
                if *to != Asked::Expired {
                    self.budget.decisions -= 1;
                }
                // A compare-and-set on `waiting`: decided once.
                if let Some(asked) = self.approvals[*db].get_mut(call)
                    && *asked == Asked::Waiting
                {
                    *asked = *to;
                }
            }
            Input::Report { p, call } => self.report(*p, call),
            Input::Step { p, call, lost } => {
                if *lost {
                    self.budget.lost -= 1;
                }
                self.step(*p, call, *lost)?;
            }
        }
        self.check_limit()?;
        self.check()
    }

    /// Plans `event` on the row and commits it as process `p`; `false` when
    /// the plan or the commit was refused (a lost race, a fenced process).
    fn commit(&mut self, p: usize, call: &str, event: Event) -> bool {
        let pr = &self.procs[p];
        let (identity, token, db) = (pr.identity.clone(), pr.token, pr.db);
        let snapshot = Snapshot {
            call: self.dbs[db].calls.get(call).cloned(),
            receipts: Some(self.dbs[db].receipts_of(call).to_vec()),
        };
        let receipt_id = self.next_id("rcp");
        let given = Given {
            executor_id: &identity,
            now: epoch(),
            receipt_id,
        };
        let line = format!("{identity}#{token} {call} {}", brief(&format!("{event:?}")));
        let word = matches!(
            event,
            Event::HookHappened { .. }
                | Event::HookDidNotHappen
                | Event::HookRerun
                | Event::HookRunCancelled
                | Event::HookRunForgotten { .. }
                | Event::OperatorResolved { .. }
        );
        let unknown = snapshot
            .call
            .as_ref()
            .is_some_and(|c| c.state == LocalState::ReconciliationRequired);
        let Ok(plan) = plan_with(&snapshot, (RUN, call), event, &given) else {
            self.journal.0.push(format!("{line}: not allowed"));
            return false;
        };
        let done = self.dbs[db].commit(&identity, token, &plan.changes);
        if done.is_ok() {
            self.ids += 1;
        }
        self.journal.0.push(format!("{line}: {done:?}"));
        if done.is_ok() && unknown && plan.call.state != LocalState::ReconciliationRequired && !word
        {
            self.broken.get_or_insert(format!(
                "{call}'s unknown outcome left reconciliation_required without a hook's or an operator's word ({})",
                plan.call.state.as_str()
            ));
        }
        done.is_ok()
    }

    fn mark(&mut self, p: usize, receipt_id: &str, status: ReceiptStatus) {
        let pr = &self.procs[p];
        let change = crate::lifecycle::mark(receipt_id, status, None, true);
        let _ = self.dbs[pr.db].commit(&pr.identity.clone(), pr.token, &[change]);
    }

    fn effect(&mut self, p: usize, call: &str, resumed: bool) -> Result<(), String> {
        let identity = self.procs[p].identity.clone();
        let token = self.procs[p].token;
        self.journal
            .0
            .push(format!("{identity}#{token} {call} the effect happens"));
        if !self.holds(p) {
            return Err(format!(
                "the effect of {call} ran in a process whose identity {identity} moved on (a zombie)"
            ));
        }
        let db = self.procs[p].db;
        if self.platform.tool(call) == Some("refund")
            && self.approvals[db].get(call) != Some(&Asked::Approved)
        {
            return Err(format!(
                "the effect of {call} ran without a person's approval (its request in store {db}: {:?})",
                self.approvals[db].get(call)
            ));
        }
        if !self.platform.running_for(call, &identity)
            && (resumed || !self.platform.accepted_by(call, &identity))
        {
            return Err(format!(
                "the effect of {call} ran without the platform's call running for {identity} (a run revived, or no confirmed accepted)"
            ));
        }
        let n = self
            .effects
            .iter_mut()
            .find(|(c, _)| c == call)
            .map(|(_, n)| n)
            .ok_or("no such call")?;
        *n += 1;
        if *n > 1 {
            return Err(format!("the effect of {call} ran {} times", *n));
        }
        Ok(())
    }

    /// Whether `call` waits for a person's decision in store `db` (the
    /// claimer passes it over).
    fn waits(&self, db: usize, call: &str) -> bool {
        self.approvals[db].get(call) == Some(&Asked::Waiting)
    }

    /// The product's checks of a call about to be accepted: a `refund`
    /// call needs a person's yes, its request stored in store `db`'s book
    /// (asked here if there is none yet) before the claim is given back;
    /// approved, it is accepted; denied or expired, refused at sequence 0.
    fn checked(&mut self, db: usize, call: &str, tool: &str) -> Event {
        if tool != "refund" {
            return Event::AcceptedSaved;
        }
        let refused = |message: &str| Event::RefusedBeforeStart {
            code: "forbidden".to_owned(),
            message: message.to_owned(),
        };
        match self.approvals[db].get(call).copied() {
            Some(Asked::Approved) => Event::AcceptedSaved,
            Some(Asked::Denied) => refused("denied by an approver"),
            Some(Asked::Expired) => refused("approval expired"),
            Some(Asked::Waiting) | None => {
                self.approvals[db].insert(call.to_owned(), Asked::Waiting);
                Event::ApprovalAsked {
                    reason: "a person decides".to_owned(),
                }
            }
        }
    }

    /// The calls of `tool` in store `db` holding a slot of it: from the
    /// claim to the end of their drive (`running` until its outcome is
    /// settled or left for reconciliation).
    fn held(&self, db: usize, tool: &str) -> usize {
        self.dbs[db]
            .calls
            .iter()
            .filter(|(_, row)| row.tool_name == tool)
            .filter(|(call, row)| match row.state {
                LocalState::Claiming | LocalState::Assigned => true,
                LocalState::Running => {
                    self.platform.state(call) != Some(CallState::ReconciliationRequired)
                }
                _ => false,
            })
            .count()
    }

    /// Whether store `db` may claim a call of `tool` now (below the
    /// limit).
    fn slot_free(&self, db: usize, tool: &str) -> bool {
        self.limit
            .is_none_or(|limit| self.held(db, tool) < usize::try_from(limit).unwrap_or(usize::MAX))
    }

    /// No store holds more calls between their claim and `accepted`
    /// (`claiming`, `assigned`) than the limit: none got there without a
    /// slot (a call picked up again by a check, its own work, may take
    /// one over the limit once `running`).
    fn check_limit(&self) -> Result<(), String> {
        let Some(limit) = self.limit else {
            return Ok(());
        };
        for (db, d) in self.dbs.iter().enumerate() {
            let mut claimed: BTreeMap<&str, usize> = BTreeMap::new();
            for row in d.calls.values() {
                if matches!(row.state, LocalState::Claiming | LocalState::Assigned) {
                    *claimed.entry(row.tool_name.as_str()).or_default() += 1;
                }
            }
            for (tool, n) in claimed {
                if n > usize::try_from(limit).unwrap_or(usize::MAX) {
                    return Err(format!(
                        "store {db} holds {n} calls of {tool} between their claim and accepted, over the tool's concurrency limit of {limit}"
                    ));
                }
            }
        }
        Ok(())
    }

    fn happened(&self, call: &str) -> bool {
        self.effects.iter().any(|(c, n)| c == call && *n > 0)
    }

    fn step(&mut self, p: usize, call: &str, lost: bool) -> Result<(), String> {
        if let Some(sent) = self.procs[p].inflight.remove(call) {
            self.receive(p, call, sent, lost);
            return Ok(());
        }
        let pr = self.procs[p].clone();
        let Some(conn) = pr.conn.clone() else {
            return Ok(());
        };
        let tool = self.platform.tool(call).unwrap_or_default().to_owned();
        let Some(row) = self.dbs[pr.db].calls.get(call).cloned() else {
            // The claimer claims a call only with a slot of its tool free,
            // and passes over a call that waits for a person.
            if self.platform.pending().iter().any(|c| c == call)
                && self.slot_free(pr.db, &tool)
                && !self.waits(pr.db, call)
            {
                let operation_key = self.next_id("op");
                self.commit(
                    p,
                    call,
                    Event::Discovered {
                        tool_name: tool,
                        operation_key,
                    },
                );
            }
            return Ok(());
        };
        match step::next(row.state, pr.checked.contains(call)) {
            Step::Done => {
                if matches!(row.state, LocalState::Abandoned | LocalState::Released)
                    && self.platform.pending().iter().any(|c| c == call)
                    && self.slot_free(pr.db, &tool)
                    && !self.waits(pr.db, call)
                {
                    let operation_key = self.next_id("op");
                    self.commit(
                        p,
                        call,
                        Event::Retried {
                            tool_name: tool,
                            operation_key,
                        },
                    );
                }
            }
            Step::Claim => {
                let answer = self
                    .platform
                    .claim(&pr.identity, &conn, call, &row.operation_key);
                self.send(
                    p,
                    call,
                    Sent::Claim {
                        operation_key: row.operation_key.clone(),
                        answer,
                    },
                );
            }
            Step::Accept => {
                let asg = row
                    .assignment
                    .clone()
                    .ok_or("assigned without assignment")?;
                let stored = self.dbs[pr.db]
                    .receipts_of(call)
                    .iter()
                    .find(|r| {
                        r.assignment_id == asg.assignment_id && r.kind == ReceiptKind::Accepted
                    })
                    .cloned();
                let saved = match &stored {
                    None => Saved::None,
                    Some(r)
                        if matches!(
                            r.status,
                            ReceiptStatus::Pending | ReceiptStatus::Delivered
                        ) =>
                    {
                        Saved::Sendable
                    }
                    Some(r) => Saved::Spent {
                        receipt_id: r.receipt_id.clone(),
                        status: r.status.as_str().to_owned(),
                    },
                };
                match (accept::on_saved(&saved), stored) {
                    (OnSaved::Reclaim(event), _) => {
                        self.commit(p, call, event);
                    }
                    (OnSaved::Send, Some(r)) => {
                        // No handler may start on a lease that lapsed.
                        if !self.holds(p) {
                            return Ok(());
                        }
                        let answer = self.platform.receipt(call, asg.grant.expose(), &r.body);
                        self.no_conflict(&answer)?;
                        self.send(
                            p,
                            call,
                            Sent::Accept {
                                assignment_id: asg.assignment_id.clone(),
                                receipt_id: r.receipt_id.clone(),
                                answer,
                            },
                        );
                    }
                    _ => {
                        let event = self.checked(pr.db, call, &tool);
                        self.commit(p, call, event);
                    }
                }
            }
            Step::Run => self.run(p, call, &tool)?,
            Step::Deliver => {
                let Some(asg) = row.assignment.clone() else {
                    return Ok(());
                };
                let Some(r) = self.dbs[pr.db]
                    .receipts_of(call)
                    .iter()
                    .find(|r| {
                        r.kind.is_final()
                            && r.status == ReceiptStatus::Pending
                            && r.assignment_id == asg.assignment_id
                    })
                    .cloned()
                else {
                    return Ok(());
                };
                let answer = self.platform.receipt(call, asg.grant.expose(), &r.body);
                self.no_conflict(&answer)?;
                self.send(
                    p,
                    call,
                    Sent::Final {
                        assignment_id: asg.assignment_id.clone(),
                        receipt_id: r.receipt_id.clone(),
                        kind: r.kind,
                        sequence: r.sequence,
                        answer,
                    },
                );
            }
            Step::Check => {
                if self.check_outcome(p, call, &tool, &row) {
                    self.procs[p].checked.insert(call.to_owned());
                }
            }
        }
        Ok(())
    }

    fn send(&mut self, p: usize, call: &str, sent: Sent) {
        self.journal.0.push(format!(
            "{}#{} {call} sent, answered {}",
            self.procs[p].identity,
            self.procs[p].token,
            brief(&format!("{sent:?}"))
        ));
        self.procs[p].inflight.insert(call.to_owned(), sent);
    }

    /// The answer to a request arrives (or is lost): the machine decides
    /// on it, and the decision is committed only while the row is still
    /// where the request left it (the runner's `while_in` and
    /// `advance_from`: a row that moved on meanwhile is not overwritten).
    fn receive(&mut self, p: usize, call: &str, sent: Sent, lost: bool) {
        let db = self.procs[p].db;
        let row = self.dbs[db].calls.get(call).cloned();
        let state = row.as_ref().map(|r| r.state);
        let asg = row
            .as_ref()
            .and_then(|r| r.assignment.as_ref())
            .map(|a| a.assignment_id.clone());
        match sent {
            Sent::Claim {
                operation_key,
                answer,
            } => {
                let event = match claim::on_reply(&reply(&answer, lost)) {
                    OnClaim::Record => match &answer {
                        Ok(claimed) => {
                            let snapshot = Snapshot {
                                call: row.clone(),
                                receipts: Some(self.dbs[db].receipts_of(call).to_vec()),
                            };
                            let refused =
                                snapshot.accepted_refused(&claimed.assignment.assignment_id);
                            claim::answered(claimed, refused)
                        }
                        Err(_) => return,
                    },
                    OnClaim::Refused(event) => event,
                    OnClaim::Configuration(_) | OnClaim::Wait(_) => return,
                };
                let same = row
                    .as_ref()
                    .is_some_and(|r| r.operation_key == operation_key);
                if state == Some(LocalState::Claiming) && same {
                    self.commit(p, call, event);
                }
            }
            Sent::Accept {
                assignment_id,
                receipt_id,
                answer,
            } => {
                let event = match accept::on_reply(&reply(&answer, lost), &receipt_id) {
                    OnAccepted::Confirmed(e) | OnAccepted::Record(e) => e,
                    OnAccepted::Wait(_) | OnAccepted::Configuration(_) => return,
                };
                let confirmed = matches!(event, Event::AcceptConfirmed { .. });
                if state == Some(LocalState::Assigned)
                    && asg.as_deref() == Some(assignment_id.as_str())
                    && self.commit(p, call, event)
                    && confirmed
                {
                    self.procs[p].started.insert(call.to_owned());
                }
            }
            Sent::Final {
                assignment_id,
                receipt_id,
                kind,
                sequence,
                answer,
            } => {
                let still = |w: &World| {
                    w.dbs[db]
                        .receipts_of(call)
                        .iter()
                        .any(|r| r.receipt_id == receipt_id && r.status == ReceiptStatus::Pending)
                };
                match deliver::on_reply(&reply(&answer, lost), kind, sequence, &receipt_id) {
                    OnDelivery::Settle(event) => {
                        // The receipt's fate, where the call moved on (or
                        // the table refuses the event): `outbox::deliver`.
                        let fate = match &event {
                            Event::Delivered { .. } => ReceiptStatus::Delivered,
                            Event::FinalOrphaned { .. } => ReceiptStatus::Orphaned,
                            _ => ReceiptStatus::Rejected,
                        };
                        let delivered = fate == ReceiptStatus::Delivered;
                        let live = state == Some(LocalState::Settled)
                            && asg.as_deref() == Some(assignment_id.as_str())
                            && still(self);
                        if live && self.commit(p, call, event) {
                            if delivered {
                                self.mark(p, &receipt_id, ReceiptStatus::Delivered);
                            }
                        } else if still(self) {
                            self.mark(p, &receipt_id, fate);
                        }
                    }
                    OnDelivery::Mark(Mark::Delivered) => {
                        self.mark(p, &receipt_id, ReceiptStatus::Delivered);
                    }
                    OnDelivery::Mark(Mark::Rejected) => {
                        self.mark(p, &receipt_id, ReceiptStatus::Rejected);
                    }
                    OnDelivery::Later { defer } => {
                        // A final receipt that got no answer: the run must
                        // not expire meanwhile (`pending_delivery`).
                        let unreported = self.dbs[db]
                            .calls
                            .get(call)
                            .is_some_and(|c| c.state == LocalState::Settled && c.report.is_none());
                        if defer && unreported {
                            self.commit(p, call, Event::DeliveryDeferred);
                        }
                    }
                }
            }
        }
    }

    /// The tool's reconcile hook looks at what really happened (`true`:
    /// it decided, or there is nothing to check); `ship`'s
    /// runs the call again when it did not happen, as `tool.rerun_when_not_performed()`
    /// and `runner::call::reconcile` do: only under an `accepted` this
    /// store saw confirmed, only while the platform says the call is still
    /// this executor's.
    fn check_outcome(
        &mut self,
        p: usize,
        call: &str,
        tool: &str,
        row: &crate::store::LocalCall,
    ) -> bool {
        if tool == "book" {
            return true;
        }
        let event = if self.happened(call) {
            Event::HookHappened { result: json!({}) }
        } else if tool == "ship" {
            let snapshot = Snapshot {
                call: Some(row.clone()),
                receipts: Some(self.dbs[self.procs[p].db].receipts_of(call).to_vec()),
            };
            let identity = self.procs[p].identity.clone();
            if snapshot.accepted_confirmed() != Some(true) {
                Event::HookDidNotHappen
            } else if !self.holds(p) {
                return false;
            } else if self.procs[p].ended.contains(call) {
                Event::HookRunCancelled
            } else {
                // `outbox::still_bound`: an idempotent report of
                // `reconciliation_required` says whether the call is still
                // this executor's to run.
                let Some(conn) = self.procs[p].conn.clone() else {
                    return false;
                };
                match self
                    .platform
                    .report(&identity, &conn, call, "reconciliation_required")
                {
                    Ok("updated" | "unchanged") => Event::HookRerun,
                    Ok("run_terminated" | "terminal" | "not_bound") => Event::HookRunCancelled,
                    Ok(_) => return false,
                    Err((400 | 404, _)) => Event::HookRunForgotten {
                        why: "the platform does not know the call".into(),
                    },
                    Err(_) => return false,
                }
            }
        } else {
            Event::HookDidNotHappen
        };
        let rerun = matches!(event, Event::HookRerun);
        let done = self.commit(p, call, event);
        if done && rerun {
            self.procs[p].started.insert(call.to_owned());
        }
        done
    }

    fn run(&mut self, p: usize, call: &str, tool: &str) -> Result<(), String> {
        let pr = self.procs[p].clone();
        if let Some(asg) = self.procs[p].in_handler.remove(call) {
            // The handler returned: its outcome is saved while the row is
            // still `running` under its assignment (`while_in`), or, fenced
            // or moved on, not.
            if self.running_under(p, call, &asg) {
                self.commit(p, call, finished());
            }
            return Ok(());
        }
        // One confirmation starts one handler: found `running` again, the
        // call is resumed as after a crash.
        let resumed = !self.procs[p].started.remove(call);
        match resume::on_running(effect_of(tool), resumed) {
            OnRunning::Settle(event) => {
                self.commit(p, call, event);
            }
            OnRunning::Run => self.handler(p, call, tool, resumed)?,
            OnRunning::CheckLease => {
                let identity = pr.identity.clone();
                // The replayed claim's answer (`runner::outbox::still_runs`):
                // still this executor's, ended (or another's), forgotten,
                // or no answer yet (pending or claimed: it waits).
                let platform = match self.platform.state(call) {
                    None => Some(StillRuns::Forgotten),
                    Some(_) if self.platform.bound_to(call, &identity) => Some(StillRuns::Yes),
                    Some(CallState::Pending | CallState::Claimed) => None,
                    Some(_) => Some(StillRuns::Ended),
                };
                if matches!(platform, Some(StillRuns::Ended | StillRuns::Forgotten)) {
                    self.procs[p].ended.insert(call.to_owned());
                }
                let cancelled = pr.ended.contains(call);
                match resume::transactional_again(cancelled, Some(platform)) {
                    Ok(Again::Run) => self.handler(p, call, tool, resumed)?,
                    Ok(Again::Settle(event)) => {
                        self.commit(p, call, event);
                    }
                    Ok(Again::AskPlatform) | Err(_) => {}
                }
            }
        }
        Ok(())
    }

    fn handler(&mut self, p: usize, call: &str, tool: &str, resumed: bool) -> Result<(), String> {
        if effect_of(tool) == Some(Effect::Transactional) {
            // Its writes commit with its outcome, or not at all.
            if self.commit(p, call, finished()) {
                self.effect(p, call, resumed)?;
            }
            return Ok(());
        }
        // `ctx.commit_point()` right before the irreversible step.
        if !may_act(self.holds(p)) {
            return Ok(());
        }
        self.effect(p, call, resumed)?;
        let asg = self.assignment_of(p, call).unwrap_or_default();
        self.procs[p].in_handler.insert(call.to_owned(), asg);
        Ok(())
    }

    fn assignment_of(&self, p: usize, call: &str) -> Option<String> {
        let row = self.dbs[self.procs[p].db].calls.get(call)?;
        Some(row.assignment.as_ref()?.assignment_id.clone())
    }

    fn running_under(&self, p: usize, call: &str, asg: &str) -> bool {
        self.dbs[self.procs[p].db].calls.get(call).is_some_and(|c| {
            c.state == LocalState::Running
                && c.assignment
                    .as_ref()
                    .is_some_and(|a| a.assignment_id == asg)
        })
    }

    fn report(&mut self, p: usize, call: &str) {
        let pr = self.procs[p].clone();
        let Some(conn) = pr.conn.clone() else { return };
        let Some(report) = self.dbs[pr.db].calls.get(call).and_then(|r| r.report) else {
            return;
        };
        let state = match report {
            PendingReport::ReconciliationRequired => "reconciliation_required",
            PendingReport::PendingDelivery => "pending_delivery",
            PendingReport::Released => "released",
        };
        if let Ok(outcome) = self.platform.report(&pr.identity, &conn, call, state) {
            self.commit(
                p,
                call,
                Event::Reported {
                    outcome: outcome.to_owned(),
                },
            );
        }
    }

    fn resolve(&mut self, db: usize, call: &str) -> Result<(), String> {
        let outcome = if self.happened(call) {
            finished_outcome()
        } else {
            FinalReceipt::failed("not_performed", "the operator found it not done")
        };
        // The operator's console writes as the identity's current holder.
        let p = self
            .procs
            .iter()
            .position(|q| q.db == db && self.dbs[db].holds(&q.identity, q.token))
            .ok_or("no holder")?;
        self.commit(
            p,
            call,
            Event::OperatorResolved {
                outcome,
                reason: "checked the provider".into(),
                evidence: "the provider's record".into(),
            },
        );
        Ok(())
    }

    fn no_conflict<T>(&self, answer: &Result<T, Refusal>) -> Result<(), String> {
        match answer {
            Err((409, "receipt_conflict")) => {
                Err("a stored receipt was sent again with other bytes".into())
            }
            _ => Ok(()),
        }
    }

    /// The promises that hold in every state.
    fn check(&mut self) -> Result<(), String> {
        if let Some(broken) = self.broken.take() {
            return Err(broken);
        }
        for (call, _) in &self.effects {
            let terminal = self
                .platform
                .state(call)
                .is_some_and(CallState::is_terminal);
            if terminal {
                self.ended.insert(call.clone());
            } else if self.ended.contains(call) {
                return Err(format!(
                    "{call} ended on the platform, then came back (a run revived)"
                ));
            }
        }
        for (call, n) in &self.effects {
            match self.platform.state(call) {
                Some(CallState::Completed) if *n == 0 => {
                    return Err(format!(
                        "{call} completed on the platform, its effect never ran"
                    ));
                }
                Some(CallState::Failed) if *n > 0 => {
                    return Err(format!(
                        "{call} failed on the platform, yet its effect ran (an unknown outcome settled by a guess)"
                    ));
                }
                _ => {}
            }
        }
        for d in &self.dbs {
            for r in d.receipts.values().flatten() {
                if let Some(body) = self.platform.receipt_body(&r.call_id, &r.receipt_id)
                    && body != r.body
                {
                    return Err(format!(
                        "receipt {} holds other bytes on the platform",
                        r.receipt_id
                    ));
                }
            }
        }
        Ok(())
    }

    /// The promises of a world where nothing more can happen.
    pub(crate) fn check_quiet(&self) -> Result<(), String> {
        for (call, _) in &self.effects {
            match self.platform.state(call) {
                Some(s) if s.is_terminal() => {}
                s => return Err(format!("{call} is stuck, {s:?} on the platform")),
            }
        }
        for d in &self.dbs {
            for (call, row) in &d.calls {
                let live = row.assignment.as_ref().map(|a| a.assignment_id.as_str());
                for r in d.receipts_of(call) {
                    if r.kind.is_final()
                        && r.status == ReceiptStatus::Pending
                        && Some(r.assignment_id.as_str()) == live
                        && row.state == LocalState::Settled
                    {
                        return Err(format!("receipt {} was never delivered", r.receipt_id));
                    }
                }
            }
        }
        Ok(())
    }
}

/// `Debug` text with each `Assignment { assignment_id: "asg_2", … }`
/// written `Assignment(asg_2)`: the rest of an assignment is the same in
/// every world.
fn brief(debug: &str) -> String {
    const OPEN: &str = "Assignment { assignment_id: \"";
    let mut out = String::new();
    let mut rest = debug;
    while let Some(at) = rest.find(OPEN) {
        out.push_str(&rest[..at]);
        let after = &rest[at + OPEN.len()..];
        let id = after.split('"').next().unwrap_or_default();
        let mut depth = 0usize;
        let mut end = rest.len();
        for (i, ch) in rest[at..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = at + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push_str(&format!("Assignment({id})"));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

fn finished_outcome() -> FinalReceipt {
    FinalReceipt {
        kind: ReceiptKind::Completed,
        extra: json!({"result": {"done": true}}),
    }
}

fn finished() -> Event {
    Event::HandlerFinished {
        outcome: finished_outcome(),
    }
}
