//! The simulation's invariants, checked once a seed has settled (see
//! `docs/simulation.md`, "What each seed checks"): no write handler ran
//! twice, none before its `accepted` was confirmed, every receipt id kept
//! its bytes, no call has two live finals, every call ends settled or
//! waiting for a person, the stores and the platform agree, no
//! transactional row after the platform ended its call, the writer never
//! stalled, and nothing a person needs was pruned.

use super::*;

impl Seed {
    /// Every invariant, once settled.
    pub(super) async fn check(&mut self) -> Result<(), String> {
        let mut problems = self.world.with(|b| b.violations.clone());
        // Transactional calls whose closure committed the transaction
        // itself (their outcome is unknown), with their handler starts.
        let (own_commit, starts): (std::collections::HashSet<String>, HashMap<String, usize>) =
            self.world.with(|b| {
                let mut starts = HashMap::new();
                for (call, _) in &b.starts {
                    *starts.entry(call.clone()).or_insert(0) += 1;
                }
                (b.own_commit.clone(), starts)
            });
        // One body per receipt id, for everything that reached the platform.
        let mut bodies: HashMap<String, String> = HashMap::new();
        for r in self.server.received_receipts() {
            let Some(id) = r.receipt_id else { continue };
            let Ok(v) = parse_strict(&r.body) else {
                problems.push(format!("receipt {id} was sent as invalid JSON"));
                continue;
            };
            let text = canonical(&v);
            if let Some(before) = bodies.insert(id.clone(), text.clone())
                && before != text
            {
                problems.push(format!(
                    "receipt {id} was sent with two bodies:\n  {before}\n  {text}"
                ));
            }
        }
        // The stores.
        let forgotten_calls: std::collections::HashSet<String> =
            self.forgotten.values().flatten().cloned().collect();
        self.stats.calls = forgotten_calls.len() as u64;
        self.stats.reconciliation_required = 0;
        let mut local: HashMap<String, Vec<(usize, toolrunner::testing::store::LocalCall)>> =
            HashMap::new();
        let mut local_receipts: HashMap<String, (usize, String, ReceiptStatus)> = HashMap::new();
        for (i, s) in self.slots.iter().enumerate() {
            let store = self.reader(&s.store_url).await?;
            for c in store
                .calls(&CallFilter::default())
                .await
                .map_err(|e| e.to_string())?
            {
                let receipts = store
                    .receipts(&c.run_id, &c.call_id)
                    .await
                    .map_err(|e| e.to_string())?;
                let live_finals = receipts
                    .iter()
                    .filter(|r| {
                        r.kind.is_final()
                            && matches!(r.status, ReceiptStatus::Pending | ReceiptStatus::Delivered)
                    })
                    .count();
                if live_finals > 1 {
                    problems.push(format!(
                        "{} holds {live_finals} live finals for {}",
                        s.id, c.call_id
                    ));
                }
                for r in &receipts {
                    if r.kind.as_str() == "accepted"
                        && r.status == ReceiptStatus::Pending
                        && !matches!(c.state, LocalState::Assigned | LocalState::Claiming)
                    {
                        problems.push(format!(
                            "{} keeps a pending accepted for {} in {}",
                            s.id,
                            c.call_id,
                            c.state.as_str()
                        ));
                    }
                    let v = parse_strict(r.body.as_bytes()).map_err(|e| e.to_string())?;
                    local_receipts.insert(r.receipt_id.clone(), (i, canonical(&v), r.status));
                }
                if c.state == LocalState::Orphaned && !forgotten_calls.contains(&c.call_id) {
                    problems.push(format!(
                        "{} orphaned {} though the platform still knows its run",
                        s.id, c.call_id
                    ));
                }
                if c.tool_name == TRANSACT
                    && c.state == LocalState::ReconciliationRequired
                    && !own_commit.contains(&c.call_id)
                {
                    problems.push(format!(
                        "{} holds transactional call {} in reconciliation_required ({:?}): its outcome is never unknown",
                        s.id, c.call_id, c.reason
                    ));
                }
                local.entry(c.call_id.clone()).or_default().push((i, c));
            }
        }
        // The platform, call by call.
        let effects: BTreeMap<String, usize> = self.world.with(|b| {
            let mut m = BTreeMap::new();
            for (call, _) in &b.effects {
                *m.entry(call.clone()).or_insert(0) += 1;
            }
            m
        });
        for (call, n) in &effects {
            if *n > 1 {
                problems.push(format!("{call}: the effect happened {n} times"));
            }
        }
        // The transactional rows: at most one per call; none written by a
        // process started after the platform ended the call's run.
        let mut rows: BTreeMap<String, usize> = BTreeMap::new();
        for s in &self.slots {
            for (call_id, _key, late) in rows_in(&s.store_url).await? {
                *rows.entry(call_id.clone()).or_insert(0) += 1;
                if late != 0 {
                    problems.push(format!(
                        "{} holds a transactional row of {call_id} written after the platform ended the call",
                        s.id
                    ));
                }
            }
        }
        self.stats.rows = rows.values().map(|n| *n as u64).sum();
        for (call_id, n) in &rows {
            // A closure that committed the transaction itself, then a crash
            // before its unknown outcome was stored: the call runs again by
            // the crash table, and may commit again (docs/protocol.md,
            // choice 70); never more often than its handler started.
            let allowed = if own_commit.contains(call_id) {
                starts.get(call_id).copied().unwrap_or(1).max(1)
            } else {
                1
            };
            if *n > allowed {
                problems.push(format!("transactional call {call_id} has {n} rows"));
            }
        }
        // Retention left everything only an operator moves.
        for ((slot, call_id), state) in &self.retained.must_keep {
            let kept = local
                .get(call_id)
                .is_some_and(|h| h.iter().any(|(i, _)| i == slot));
            if !kept {
                problems.push(format!(
                    "retention pruned {call_id} from {}, which was {} and needed a person",
                    self.slots[*slot].id,
                    state.as_str()
                ));
            }
        }
        for run_id in &self.runs {
            if self.forgotten.contains_key(run_id) {
                continue;
            }
            let Some(run) = self.world.get(&format!("/runs/{run_id}")).await else {
                return Err(format!("run {run_id} cannot be read"));
            };
            for p in run["tool_calls"].as_array().cloned().unwrap_or_default() {
                let call_id = p["call_id"].as_str().unwrap_or_default().to_owned();
                let state = p["state"].as_str().unwrap_or("?").to_owned();
                let tool = p["tool_name"].as_str().unwrap_or_default();
                self.stats.calls += 1;
                if state == "reconciliation_required" {
                    self.stats.reconciliation_required += 1;
                }
                let n = effects.get(&call_id).copied().unwrap_or(0);
                if tool == TRANSACT {
                    let n = rows.get(&call_id).copied().unwrap_or(0);
                    // A row with a refused final (`rejected`, then perhaps
                    // compensated) is the compensation case: the platform
                    // ended the call while its handler ran.
                    let refused_state = |s: &LocalState| {
                        matches!(s, LocalState::Rejected | LocalState::Compensated)
                    };
                    let refused = local
                        .get(&call_id)
                        .is_some_and(|h| h.iter().any(|(_, c)| refused_state(&c.state)))
                        || self.retained.calls.get(&call_id).is_some_and(refused_state);
                    let own = own_commit.contains(&call_id);
                    match state.as_str() {
                        "completed" if own && n >= 1 => {}
                        "completed" if n != 1 => {
                            problems.push(format!("{tool} {call_id} is completed with {n} rows"))
                        }
                        "completed" => {}
                        // Its outcome unknown, or its run ended: a person
                        // looks.
                        "reconciliation_required" | "terminated" if own => {}
                        _ if n != 0 && !refused => problems.push(format!(
                            "{tool} {call_id} is {state} on the platform, yet its row was committed"
                        )),
                        _ => {}
                    }
                    if state == "reconciliation_required" && !own {
                        problems.push(format!(
                            "{tool} {call_id} is reconciliation_required on the platform: its outcome is never unknown"
                        ));
                    }
                } else if tool != "sim.read" {
                    match state.as_str() {
                        "completed" if n != 1 => {
                            problems.push(format!("{tool} {call_id} is completed with {n} effects"))
                        }
                        "failed" | "cancelled" if n != 0 => problems.push(format!(
                            "{tool} {call_id} is {state} though its effect happened"
                        )),
                        _ => {}
                    }
                }
                if let Some(problem) = person_outcome(&p, &state) {
                    problems.push(format!("{tool} {call_id}: {problem}"));
                }
                for r in p["receipts"].as_array().cloned().unwrap_or_default() {
                    let id = r["receipt_id"].as_str().unwrap_or_default();
                    match local_receipts.get(id) {
                        None if self.retained.receipts.get(id) == Some(&canonical(&r["body"])) => {}
                        None => problems
                            .push(format!("platform receipt {id} of {call_id} is in no store")),
                        Some((_, body, _)) if *body != canonical(&r["body"]) => problems
                            .push(format!("platform receipt {id} differs from the stored one")),
                        Some(_) => {}
                    }
                }
                let holders = local.get(&call_id).cloned().unwrap_or_default();
                for (i, c) in &holders {
                    let who = &self.slots[*i].id;
                    let same_asg = c.assignment.as_ref().map(|a| a.assignment_id.as_str())
                        == p["assignment_id"].as_str();
                    let bad = match c.state {
                        LocalState::Delivered => {
                            !matches!(state.as_str(), "completed" | "failed" | "cancelled")
                        }
                        LocalState::ReconciliationRequired => {
                            !(state == "terminated"
                                || (state == "reconciliation_required"
                                    && same_asg
                                    && p["executor_id"] == who.as_str()))
                        }
                        LocalState::Abandoned | LocalState::Released => {
                            same_asg
                                && p["executor_id"] == who.as_str()
                                && matches!(
                                    state.as_str(),
                                    "claimed" | "running" | "reconciliation_required"
                                )
                        }
                        LocalState::Rejected | LocalState::Compensated => !matches!(
                            state.as_str(),
                            "completed" | "failed" | "cancelled" | "terminated"
                        ),
                        _ => true,
                    };
                    if bad {
                        problems.push(format!(
                            "{who} holds {call_id} {} ({:?}) while the platform says {state}",
                            c.state.as_str(),
                            c.reason
                        ));
                    }
                }
                if matches!(state.as_str(), "reconciliation_required" | "running") {
                    let owner = p["executor_id"].as_str().unwrap_or_default();
                    let known = holders.iter().any(|(i, c)| {
                        self.slots[*i].id == owner && c.state == LocalState::ReconciliationRequired
                    });
                    if !known {
                        problems.push(format!(
                            "the platform holds {call_id} {state} for {owner}, whose store does not"
                        ));
                    }
                }
            }
        }
        // A fenced process sends nothing new: no process connected as an
        // identity taken over while it stood still, once it was thawed.
        let connects = self.server.received_connects();
        // A twin on the second database stops once the process of its id
        // on the first connects after it (superseded by an instance its
        // database never recorded): it never takes turns with it.
        // (A twin's connect after its own lapsed platform lease may come
        // after the other's, which then stops: a turn or two, not a flip
        // at every heartbeat.)
        for (twin, id) in &self.twins {
            let mut last: Option<&str> = None;
            let mut turns = 0;
            for c in connects
                .iter()
                .filter(|c| c.executor_id.as_deref() == Some(id))
            {
                let now = c.instance_id.as_deref().unwrap_or("");
                if last.is_some_and(|l| l != now) && (now == twin || last == Some(twin)) {
                    turns += 1;
                }
                last = Some(now);
            }
            if turns > 4 {
                problems.push(format!(
                    "the twin {twin} on the second database and the process of {id} on the first took {turns} turns connecting: twins of one executor id must not take turns"
                ));
            }
        }
        for f in self.fenced.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            for c in connects.iter().skip(f.from) {
                // One of the executors that held the identity before the
                // pause (a new adoption after the thaw connects with an
                // instance id of its own).
                let mine = c
                    .instance_id
                    .as_ref()
                    .is_some_and(|i| f.executors.contains(i));
                if mine
                    && c.executor_id
                        .as_ref()
                        .is_some_and(|e| f.identities.contains(e))
                {
                    problems.push(format!(
                        "process {} connected as {:?} (instance {:?}) after it was thawed, though {:?} had been taken over while it stood still",
                        f.instance, c.executor_id, c.instance_id, f.identities
                    ));
                }
            }
        }
        self.stats.effects = effects.values().map(|n| *n as u64).sum();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(format!("{}\n{}", problems.join("\n"), self.dump().await))
        }
    }
}

/// What a call whose behaviour needs a person ended as, against what its
/// person decided: denied, a `forbidden` failure "denied by an approver";
/// left to expire, "approval expired"; approved (once or twice), never
/// refused `forbidden`. A call its run ended first may end otherwise
/// (cancelled, terminated); none of them completes without approval.
fn person_outcome(call: &serde_json::Value, state: &str) -> Option<String> {
    let behaviour = call["arguments"]["behaviour"].as_str().unwrap_or_default();
    if !behaviour.starts_with("person_") {
        return None;
    }
    let failed = call["receipts"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["kind"] == "failed");
    let error = failed.map(|r| {
        (
            r["body"]["error"]["code"].as_str().unwrap_or_default(),
            r["body"]["error"]["message"].as_str().unwrap_or_default(),
        )
    });
    let refused = |message: &str| match (state, error) {
        ("completed", _) => Some(format!(
            "{behaviour} completed: its effect ran without a person's yes"
        )),
        ("failed", Some(("forbidden", m))) if m == message => None,
        ("failed", e) => Some(format!(
            "{behaviour} failed with {e:?}, expected forbidden {message:?}"
        )),
        _ => None,
    };
    match behaviour {
        "person_deny" => refused("denied by an approver"),
        "person_expire" => refused("approval expired"),
        _ => match error {
            Some(("forbidden", m)) => Some(format!(
                "{behaviour} was approved, yet refused forbidden ({m:?})"
            )),
            _ => None,
        },
    }
}
