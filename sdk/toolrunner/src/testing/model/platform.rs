//! The platform as the contract describes it (`protocol.md` §4–5): claims
//! and their answers, receipts and their conflict rules, leases and their
//! expiry, cancel, release and reports. Pure and small: no HTTP, no clock
//! (a lease lapses when the world says so), ids counted from 1, so the
//! same requests give the same answers. `tests/model_platform.rs` checks it against
//! the development platform's engine on the same request sequences.

use std::collections::BTreeMap;

use serde_json::{Value, json};
use toolrunner_protocol::wire::{Assignment, CallState, Claimed, Grant, ReceiptAnswer};

/// A refusal: the HTTP status and the contract's error code.
pub type Refusal = (u16, &'static str);

/// One assignment of a call.
#[derive(Debug, Clone, PartialEq)]
struct Asg {
    id: String,
    executor: String,
    operation_key: String,
    /// Released (the call went back to `pending`): its grant stops working.
    released: bool,
}

/// One call as the platform holds it.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    run_id: String,
    tool: String,
    state: CallState,
    asgs: Vec<Asg>,
    /// receipt id → body, byte for byte (compared as canonical JSON).
    receipts: BTreeMap<String, String>,
    accepted: bool,
    last_sequence: Option<u64>,
    /// Flagged `pending_delivery` by its executor.
    pending_delivery: bool,
    /// Receipts that arrived after the run ended: kept for audit, never
    /// processed (receipt id → body).
    late: BTreeMap<String, String>,
}

impl Call {
    /// The live (not released) assignment, while the call is bound.
    fn live(&self) -> Option<&Asg> {
        self.asgs.last().filter(|a| !a.released)
    }
}

/// The platform model.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PlatformModel {
    calls: BTreeMap<String, Call>,
    /// executor id → its current connection id, and whether its lease lives.
    conns: BTreeMap<String, (String, bool)>,
    /// Connections that were over (their lease lapsed) before a newer
    /// connect superseded them: they answer `lease_expired`, what happened
    /// first (`docs/protocol.md`, choice 67, as the development platform).
    ended: Vec<String>,
    cancelled: Vec<String>,
    next_id: u32,
}

impl PlatformModel {
    /// A platform with no call.
    pub fn new() -> PlatformModel {
        PlatformModel::default()
    }

    fn next(&mut self, prefix: &str) -> String {
        self.next_id += 1;
        format!("{prefix}_{}", self.next_id)
    }

    /// A run's new `pending` call of `tool`.
    pub fn add_call(&mut self, run_id: &str, call_id: &str, tool: &str) {
        self.calls.insert(
            call_id.to_owned(),
            Call {
                run_id: run_id.to_owned(),
                tool: tool.to_owned(),
                state: CallState::Pending,
                asgs: Vec::new(),
                receipts: BTreeMap::new(),
                accepted: false,
                last_sequence: None,
                pending_delivery: false,
                late: BTreeMap::new(),
            },
        );
    }

    /// The call's state, if the platform knows it.
    pub fn state(&self, call_id: &str) -> Option<CallState> {
        self.calls.get(call_id).map(|c| c.state)
    }

    /// Whether `executor` holds the call's live assignment and its
    /// `accepted` was confirmed (the call is `running` for it).
    pub fn running_for(&self, call_id: &str, executor: &str) -> bool {
        self.calls.get(call_id).is_some_and(|c| {
            c.state == CallState::Running
                && c.accepted
                && c.live().is_some_and(|a| a.executor == executor)
        })
    }

    /// Whether the call is still `executor`'s: `running` or
    /// `reconciliation_required` under its live assignment.
    pub fn bound_to(&self, call_id: &str, executor: &str) -> bool {
        self.calls.get(call_id).is_some_and(|c| {
            matches!(
                c.state,
                CallState::Running | CallState::ReconciliationRequired
            ) && c.live().is_some_and(|a| a.executor == executor)
        })
    }

    /// Whether `executor`'s live assignment of the call had its `accepted`
    /// confirmed (the call may have ended since).
    pub fn accepted_by(&self, call_id: &str, executor: &str) -> bool {
        self.calls
            .get(call_id)
            .is_some_and(|c| c.accepted && c.live().is_some_and(|a| a.executor == executor))
    }

    /// The body the platform holds under a receipt id.
    pub fn receipt_body(&self, call_id: &str, receipt_id: &str) -> Option<&str> {
        self.calls
            .get(call_id)?
            .receipts
            .get(receipt_id)
            .map(String::as_str)
    }

    /// Whether a connection is `executor`'s current one with a live lease.
    pub fn is_live(&self, executor: &str, connection_id: &str) -> bool {
        self.conns
            .get(executor)
            .is_some_and(|(c, live)| c == connection_id && *live)
    }

    /// `POST /executors/connect`: a new connection superseding the
    /// previous one, and the calls still bound to the identity.
    pub fn connect(&mut self, executor: &str) -> (String, Vec<(String, CallState)>) {
        let id = self.next("con");
        self.conns.insert(executor.to_owned(), (id.clone(), true));
        let outstanding = self
            .calls
            .iter()
            .filter(|(_, c)| {
                matches!(
                    c.state,
                    CallState::Claimed | CallState::Running | CallState::ReconciliationRequired
                ) && c.live().is_some_and(|a| a.executor == executor)
            })
            .map(|(id, c)| (id.clone(), c.state))
            .collect();
        (id, outstanding)
    }

    /// The lease of `executor` lapses: its `claimed` calls return to
    /// `pending` and their assignments are released; `running` and
    /// `reconciliation_required` calls stay bound.
    pub fn expire(&mut self, executor: &str) {
        if let Some((conn, live)) = self.conns.get_mut(executor) {
            *live = false;
            if !self.ended.contains(conn) {
                self.ended.push(conn.clone());
            }
        }
        for c in self.calls.values_mut() {
            if c.state == CallState::Claimed && c.live().is_some_and(|a| a.executor == executor) {
                release(c);
            }
        }
    }

    fn connection(&self, executor: &str, connection_id: &str) -> Result<(), Refusal> {
        match self.conns.get(executor) {
            Some((c, true)) if c == connection_id => Ok(()),
            Some((c, false)) if c == connection_id => Err((409, "lease_expired")),
            _ if self.ended.iter().any(|c| c == connection_id) => Err((409, "lease_expired")),
            Some(_) if self.seen(connection_id) => Err((409, "connection_superseded")),
            _ => Err((409, "lease_expired")),
        }
    }

    fn seen(&self, connection_id: &str) -> bool {
        connection_id
            .strip_prefix("con_")
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| n <= self.next_id)
    }

    /// `POST /runs/{run}/tool-calls/{call}/claim`.
    ///
    /// # Errors
    /// The contract's refusal, first rule first.
    pub fn claim(
        &mut self,
        executor: &str,
        connection_id: &str,
        call_id: &str,
        operation_key: &str,
    ) -> Result<Claimed, Refusal> {
        if !self.calls.contains_key(call_id) {
            return Err((400, "unknown_call"));
        }
        self.connection(executor, connection_id)?;
        let cancelled = self.run_ended(call_id);
        let call = self.calls.get(call_id).expect("checked");
        if let Some(a) = call
            .asgs
            .iter()
            .rev()
            .find(|a| !a.released && a.executor == executor && a.operation_key == operation_key)
        {
            return Ok(claimed(call_id, call, a, true));
        }
        if cancelled {
            return Err((409, "run_terminated"));
        }
        if call.live().is_some() && !call.state.is_terminal() {
            return Err((409, "already_claimed"));
        }
        if call.state != CallState::Pending {
            return Err((409, "call_not_claimable"));
        }
        let id = self.next("asg");
        let call = self.calls.get_mut(call_id).expect("checked");
        call.asgs.push(Asg {
            id,
            executor: executor.to_owned(),
            operation_key: operation_key.to_owned(),
            released: false,
        });
        call.state = CallState::Claimed;
        let call = &self.calls[call_id];
        Ok(claimed(call_id, call, call.live().expect("pushed"), false))
    }

    /// Whether the call's run ended: cancelled, or `completed` (every one
    /// of its calls terminal).
    fn run_ended(&self, call_id: &str) -> bool {
        self.calls.get(call_id).is_some_and(|c| {
            self.cancelled.contains(&c.run_id)
                || self
                    .calls
                    .values()
                    .filter(|o| o.run_id == c.run_id)
                    .all(|o| o.state.is_terminal())
        })
    }

    /// `POST /runs/{run}/tool-calls/{call}/receipts` with `Tool-Grant`.
    ///
    /// # Errors
    /// The contract's refusal, first rule first.
    pub fn receipt(
        &mut self,
        call_id: &str,
        grant: &str,
        body: &str,
    ) -> Result<ReceiptAnswer, Refusal> {
        let Some(call) = self.calls.get(call_id) else {
            return Err((400, "unknown_call"));
        };
        let asg_id = grant.strip_prefix("grt_").unwrap_or_default();
        let Some(asg) = call.asgs.iter().find(|a| a.id == asg_id && !a.released) else {
            return Err((403, "invalid_grant"));
        };
        let parsed: Value = serde_json::from_str(body).map_err(|_| (400, "invalid_receipt"))?;
        if parsed["assignment_id"] != json!(asg.id) || parsed["executor_id"] != json!(asg.executor)
        {
            return Err((403, "invalid_grant"));
        }
        let id = parsed["receipt_id"].as_str().unwrap_or_default().to_owned();
        let kind = parsed["kind"].as_str().unwrap_or_default().to_owned();
        let sequence = parsed["sequence"].as_u64().unwrap_or(0);
        let current = call.live().is_some_and(|a| a.id == asg.id);
        if let Some(stored) = call.receipts.get(&id) {
            let same = serde_json::from_str::<Value>(stored).ok() == Some(parsed);
            if !same {
                return Err((409, "receipt_conflict"));
            }
            return Ok(ReceiptAnswer {
                receipt_id: id,
                replayed: true,
                call_state: call.state,
                accepted: (kind == "accepted")
                    .then_some(call.state == CallState::Running && current),
            });
        }
        if let Some(stored) = call.late.get(&id) {
            let same = serde_json::from_str::<Value>(stored).ok() == Some(parsed);
            return Err(if same {
                (409, "run_terminated")
            } else {
                (409, "receipt_conflict")
            });
        }
        if self.run_ended(call_id) {
            let call = self.calls.get_mut(call_id).expect("checked");
            call.late.insert(id, body.to_owned());
            return Err((409, "run_terminated"));
        }
        if call.state.is_terminal() {
            return Err((409, "call_already_terminal"));
        }
        let refusal_code = parsed["error"]["code"].as_str().unwrap_or_default();
        let settles_unstarted = kind == "failed"
            && sequence == 0
            && matches!(
                refusal_code,
                "invalid_arguments" | "digest_mismatch" | "forbidden"
            );
        if kind == "accepted" && call.accepted {
            return Err((409, "already_accepted"));
        }
        if kind != "accepted" && !call.accepted && !settles_unstarted {
            return Err((409, "not_accepted"));
        }
        if kind != "accepted" && call.last_sequence.is_some_and(|s| sequence <= s) {
            return Err((409, "sequence_conflict"));
        }
        let call = self.calls.get_mut(call_id).expect("checked");
        call.receipts.insert(id.clone(), body.to_owned());
        call.last_sequence = Some(sequence);
        match kind.as_str() {
            "accepted" => {
                call.accepted = true;
                call.state = CallState::Running;
            }
            "completed" => call.state = CallState::Completed,
            "failed" => call.state = CallState::Failed,
            "cancelled" => call.state = CallState::Cancelled,
            _ => {}
        }
        Ok(ReceiptAnswer {
            receipt_id: id,
            replayed: false,
            call_state: call.state,
            accepted: (kind == "accepted").then_some(true),
        })
    }

    /// `POST /executors/{id}/calls/report` for one call: its outcome.
    ///
    /// # Errors
    /// `409 lease_expired` or `409 connection_superseded` for a connection
    /// that is not live; `400 unknown_call`.
    pub fn report(
        &mut self,
        executor: &str,
        connection_id: &str,
        call_id: &str,
        state: &str,
    ) -> Result<&'static str, Refusal> {
        if !self.calls.contains_key(call_id) {
            return Err((400, "unknown_call"));
        }
        self.connection(executor, connection_id)?;
        let cancelled = self.run_ended(call_id);
        let call = self.calls.get_mut(call_id).expect("checked");
        let bound = call.live().is_some_and(|a| a.executor == executor);
        let outcome = if !bound {
            "not_bound"
        } else if cancelled {
            "run_terminated"
        } else if call.state.is_terminal() {
            "terminal"
        } else {
            match (state, call.state) {
                ("reconciliation_required", CallState::ReconciliationRequired) => "unchanged",
                ("reconciliation_required", CallState::Running) => {
                    call.state = CallState::ReconciliationRequired;
                    "updated"
                }
                ("released", CallState::Claimed) => {
                    release(call);
                    "updated"
                }
                ("pending_delivery", _) if call.pending_delivery => "unchanged",
                ("pending_delivery", _) => {
                    call.pending_delivery = true;
                    "updated"
                }
                _ => "not_applicable",
            }
        };
        Ok(outcome)
    }

    /// A platform cancel of the run: its calls not yet terminal become
    /// `terminated`; the run is never revived.
    pub fn cancel(&mut self, run_id: &str) {
        if !self.cancelled.iter().any(|r| r == run_id) {
            self.cancelled.push(run_id.to_owned());
        }
        for c in self.calls.values_mut().filter(|c| c.run_id == run_id) {
            if !c.state.is_terminal() {
                c.state = CallState::Terminated;
            }
        }
    }

    /// The calls of `tool`s that are `pending`, for a candidate list.
    pub fn pending(&self) -> Vec<String> {
        self.calls
            .iter()
            .filter(|(_, c)| c.state == CallState::Pending)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The tool of a call.
    pub fn tool(&self, call_id: &str) -> Option<&str> {
        self.calls.get(call_id).map(|c| c.tool.as_str())
    }
}

fn release(c: &mut Call) {
    if let Some(a) = c.asgs.last_mut() {
        a.released = true;
    }
    c.state = CallState::Pending;
    c.accepted = false;
    c.last_sequence = None;
}

fn claimed(call_id: &str, call: &Call, a: &Asg, replayed: bool) -> Claimed {
    Claimed {
        replayed,
        call_state: call.state,
        assignment: Assignment {
            assignment_id: a.id.clone(),
            run_id: call.run_id.clone(),
            call_id: call_id.to_owned(),
            tool_name: call.tool.clone(),
            arguments: json!({}),
            arguments_digest: toolrunner_protocol::json::arguments_digest(&json!({})),
            grant: Grant::new(format!("grt_{}", a.id)),
            subject: "user_1".into(),
            agent_id: "agt_1".into(),
            agent_version: "agv_1".into(),
            binding_id: "bnd_1".into(),
            max_result_context_bytes: 16384,
            input_schema: json!({"type": "object"}),
            output_schema: None,
        },
    }
}
