//! Receipts (protocol §5, "Receipts"): the rows of the contract's table are
//! checked in order, the first that applies wins.
use serde_json::Value;
use toolrunner_protocol::ApiError;
use toolrunner_protocol::json::canonical;
use toolrunner_protocol::projection::project;
use toolrunner_protocol::wire::{CallState, Receipt, ReceiptAnswer, ReceiptKind, RunStatus};

use super::model::{AssignmentStatus, ReceiptRec, Table};
use super::{State, rfc3339};

/// Error codes a sequence-0 `failed` may carry to settle a `claimed` call.
const PRE_ACCEPT_CODES: [&str; 3] = ["invalid_arguments", "digest_mismatch", "forbidden"];

/// A receipt request as the HTTP layer hands it over.
pub(crate) struct ReceiptInput<'a> {
    pub(crate) grant: Option<&'a str>,
    /// The body exactly as received.
    pub(crate) raw: &'a str,
    /// The body parsed strictly, or why it is not JSON.
    pub(crate) parsed: Result<Value, ApiError>,
}

fn invalid_grant(msg: &str) -> ApiError {
    ApiError::forbidden("invalid_grant", msg.to_owned()).with_param("Tool-Grant")
}

impl State {
    pub(crate) fn receipt(
        &mut self,
        run_id: &str,
        call_id: &str,
        input: ReceiptInput<'_>,
        now: i64,
    ) -> Result<ReceiptAnswer, ApiError> {
        self.run_in_path(run_id)?;
        self.call_of_run(run_id, call_id)?;
        let asg = input
            .grant
            .and_then(|g| self.assignment_by_grant(g))
            .ok_or_else(|| invalid_grant("missing or unknown Tool-Grant"))?;
        if asg.call_id != call_id || asg.run_id != run_id {
            return Err(invalid_grant("this grant belongs to another call"));
        }
        if asg.status == AssignmentStatus::Released {
            return Err(invalid_grant(
                "this assignment was released; its grant no longer works",
            ));
        }
        let (asg_id, asg_executor) = (asg.assignment_id.clone(), asg.executor_id.clone());
        let value = input.parsed?;
        check_body_identity(&value, &asg_id, &asg_executor)?;
        let receipt = decode(value.clone())?;
        let rec = ReceiptRec {
            receipt_id: receipt.receipt_id.clone(),
            assignment_id: asg_id.clone(),
            kind: receipt.kind,
            sequence: receipt.sequence,
            received_at: rfc3339(now),
            raw: input.raw.to_owned(),
            canonical: canonical(&value),
        };
        let call = &self.calls[call_id];
        let current = call.assignment_id.as_deref() == Some(asg_id.as_str());
        let (receipt_id, kind) = (rec.receipt_id.clone(), rec.kind);
        let answer = |state: CallState, replayed: bool| ReceiptAnswer {
            receipt_id: receipt_id.clone(),
            replayed,
            call_state: state,
            accepted: (kind == ReceiptKind::Accepted)
                .then_some(state == CallState::Running && current),
        };
        if let Some(stored) = call
            .receipts
            .iter()
            .find(|r| r.receipt_id == rec.receipt_id)
        {
            if stored.canonical == rec.canonical {
                return Ok(answer(call.state, true));
            }
            return Err(ApiError::conflict(
                "receipt_conflict",
                format!(
                    "receipt {} was already stored with a different body",
                    rec.receipt_id
                ),
            )
            .with_param("receipt_id"));
        }
        if self.runs[run_id].status != RunStatus::Active {
            let msg = format!("run {run_id} has ended; the receipt is kept for audit only");
            let call = self.calls.get_mut(call_id).expect("checked above");
            let earlier = call
                .late_receipts
                .iter()
                .find(|r| r.receipt_id == rec.receipt_id);
            if earlier.is_some_and(|r| r.canonical != rec.canonical) {
                return Err(ApiError::conflict(
                    "receipt_conflict",
                    format!(
                        "receipt {} was already received with a different body",
                        rec.receipt_id
                    ),
                )
                .with_param("receipt_id"));
            }
            if earlier.is_none() {
                call.late_receipts.push(rec);
                self.touch(Table::Calls, call_id);
            }
            return Err(ApiError::conflict("run_terminated", msg));
        }
        check_transition(
            call.state,
            &receipt,
            call.receipts.last().map(|r| r.sequence),
        )?;
        if receipt.kind == ReceiptKind::Completed {
            let version = self.runs[run_id].agent_version.clone();
            let tool = call.tool_name.clone();
            if let Some(schema) = self.schema(&version, &tool, true) {
                let errors = schema.violations(receipt.result.as_ref().unwrap_or(&Value::Null));
                if let Some(first) = errors.first() {
                    return Err(ApiError::invalid(
                        "invalid_receipt",
                        format!(
                            "result does not match output_schema at '{}': {}",
                            first.path, first.message
                        ),
                    )
                    .with_param("result"));
                }
            }
        }
        let new_state = self.apply_receipt(call_id, &receipt, rec, now);
        Ok(answer(new_state, false))
    }

    /// Stores a checked receipt and moves the call on; returns its new state.
    fn apply_receipt(
        &mut self,
        call_id: &str,
        receipt: &Receipt,
        rec: ReceiptRec,
        now: i64,
    ) -> CallState {
        let asg_id = rec.assignment_id.clone();
        let call = self.calls.get_mut(call_id).expect("checked by caller");
        call.receipts.push(rec);
        let run_id = call.run_id.clone();
        let target = match receipt.kind {
            ReceiptKind::Accepted => {
                call.accepted_at = Some(rfc3339(now));
                Some(CallState::Running)
            }
            ReceiptKind::Progress => None,
            ReceiptKind::Completed => {
                let budget = self.versions_budget(call_id);
                let result = receipt.result.as_ref().unwrap_or(&Value::Null);
                let call = self.calls.get_mut(call_id).expect("checked by caller");
                call.projection = Some(project(result, budget));
                Some(CallState::Completed)
            }
            ReceiptKind::Failed => Some(CallState::Failed),
            ReceiptKind::Cancelled => Some(CallState::Cancelled),
        };
        self.touch(Table::Calls, call_id);
        self.note_activity(&run_id, now);
        match target {
            Some(state) => {
                self.set_call_state(call_id, state, now);
                if state.is_terminal() {
                    self.set_assignment(&asg_id, AssignmentStatus::Closed);
                    self.complete_run_if_done(&run_id);
                }
                state
            }
            None => self.calls[call_id].state,
        }
    }

    fn versions_budget(&self, call_id: &str) -> usize {
        let call = &self.calls[call_id];
        let run = &self.runs[&call.run_id];
        let budget = self.versions[&run.agent_version]
            .tools
            .iter()
            .find(|t| t.name == call.tool_name)
            .map_or(16384, |t| t.max_result_context_bytes);
        usize::try_from(budget).unwrap_or(usize::MAX)
    }
}

/// The body's `assignment_id` and `executor_id`, where present, must be the
/// grant's: otherwise `403 invalid_grant`.
fn check_body_identity(value: &Value, asg_id: &str, executor_id: &str) -> Result<(), ApiError> {
    let field = |name: &str| value.get(name).and_then(Value::as_str);
    if field("assignment_id").is_some_and(|a| a != asg_id) {
        return Err(invalid_grant(
            "this grant is not the assignment's named in the body",
        ));
    }
    if field("executor_id").is_some_and(|e| e != executor_id) {
        return Err(invalid_grant("this grant belongs to another executor"));
    }
    Ok(())
}

/// Decodes and checks the shape of a receipt: `400 unknown_field` for an
/// unlisted field, `400 invalid_receipt` for anything else.
fn decode(value: Value) -> Result<Receipt, ApiError> {
    // A member written as `null` is present: only `completed` may carry
    // `result` (even a null one), and no kind lists a null `error`.
    let written = |name: &str| value.get(name).is_some();
    let named: Vec<(&'static str, bool)> = ["progress", "result", "error", "reason"]
        .iter()
        .map(|n| (*n, written(n)))
        .collect();
    let receipt: Receipt = super::json::decode(value).map_err(|e| {
        if e.code() == "unknown_field" {
            e
        } else {
            ApiError::invalid("invalid_receipt", e.body.message).with_param_opt(e.body.param)
        }
    })?;
    let wanted = Receipt::required_field(receipt.kind);
    for ((name, written), (_, present)) in named.into_iter().zip(receipt.extra_fields()) {
        if written && Some(name) != wanted {
            return Err(ApiError::invalid(
                "unknown_field",
                format!("a {} receipt has no field {name}", receipt.kind.as_str()),
            )
            .with_param(name));
        }
        if !present && Some(name) == wanted {
            return Err(ApiError::invalid(
                "invalid_receipt",
                format!("a {} receipt needs the field {name}", receipt.kind.as_str()),
            )
            .with_param(name));
        }
    }
    let bad = |msg: &str, param: &str| {
        Err(ApiError::invalid("invalid_receipt", msg.to_owned()).with_param(param))
    };
    if !super::is_token_id(&receipt.receipt_id) {
        return bad(
            "receipt_id must be 1-128 characters of [A-Za-z0-9_.:-]",
            "receipt_id",
        );
    }
    if receipt.kind == ReceiptKind::Accepted && receipt.sequence != 0 {
        return bad("an accepted receipt has sequence 0", "sequence");
    }
    if let Some(p) = &receipt.progress
        && p.fraction.is_some_and(|f| !(0.0..=1.0).contains(&f))
    {
        return bad(
            "progress.fraction must be between 0 and 1, or null",
            "progress.fraction",
        );
    }
    if let Some(e) = &receipt.error
        && (e.code.trim().is_empty() || e.message.trim().is_empty())
    {
        return bad("error.code and error.message must not be blank", "error");
    }
    Ok(receipt)
}

/// The state rows of the receipt table, after identity and replay checks.
fn check_transition(state: CallState, r: &Receipt, last_seq: Option<u64>) -> Result<(), ApiError> {
    if state.is_terminal() {
        return Err(ApiError::conflict(
            "call_already_terminal",
            format!("the call already ended ({})", state.as_str()),
        ));
    }
    let accepted = state != CallState::Claimed;
    if r.kind == ReceiptKind::Accepted && accepted {
        return Err(ApiError::conflict(
            "already_accepted",
            "the call was already accepted",
        ));
    }
    let pre_accept_failure = r.kind == ReceiptKind::Failed
        && r.sequence == 0
        && r.error
            .as_ref()
            .is_some_and(|e| PRE_ACCEPT_CODES.contains(&e.code.as_str()));
    if r.kind != ReceiptKind::Accepted && !accepted && !pre_accept_failure {
        return Err(ApiError::conflict(
            "not_accepted",
            "only accepted, or a sequence-0 failed with invalid_arguments, digest_mismatch or forbidden, may come before accepted",
        ));
    }
    if last_seq.is_some_and(|last| r.sequence <= last) {
        return Err(ApiError::conflict(
            "sequence_conflict",
            format!(
                "sequence {} is not greater than the last stored one",
                r.sequence
            ),
        )
        .with_param("sequence"));
    }
    Ok(())
}
