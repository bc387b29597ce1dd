//! One call, step by step: claim → checks → accepted → handler → final
//! receipt → delivery. Each step starts from the stored state, so the same
//! code resumes a call after a crash.
use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::sync::CancellationToken;
use toolrunner_protocol::wire::{Assignment, CallState, Claim, ReceiptKind};
use tracing::Instrument;

use super::{CallKey, Core, checks, connection, outbox};
use crate::client::ClientError;
use crate::context::{CallContext, ProgressError};
use crate::handler::{Effect, ErasedTool, ToolError};
use crate::store::{Change, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus};

/// Most handler attempts for "nothing happened, retry".
fn receipt_id() -> String {
    format!("rcp_{}", uuid::Uuid::now_v7().simple())
}

/// A new operation key: random, never derived from the call.
pub(crate) fn operation_key() -> String {
    format!("op_{}", uuid::Uuid::new_v4().simple())
}

/// Starts driving a call on its own task. (A plain function with a boxed
/// future: it breaks the async cycle drive → connect → resume → drive.)
pub(crate) fn spawn_drive(
    core: Arc<Core>,
    call: LocalCall,
    resumed: bool,
    permit: Option<OwnedSemaphorePermit>,
) {
    // Activated here, synchronously, so no other task can pick the call up
    // between this decision and the new task's start.
    let Some(cancel) = core.activate(&CallKey::of(&call)) else {
        return;
    };
    spawn_activated(core, call, resumed, permit, cancel);
}

/// [`spawn_drive`] for a call the caller has already activated.
pub(crate) fn spawn_activated(
    core: Arc<Core>,
    call: LocalCall,
    resumed: bool,
    permit: Option<OwnedSemaphorePermit>,
    cancel: CancellationToken,
) {
    let fut: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
        Box::pin(drive(core, call, resumed, permit, cancel));
    tokio::spawn(fut);
}

/// Drives one call until it is final or must wait (platform unreachable,
/// capacity); `resumed` means the process may have died inside a step.
async fn drive(
    core: Arc<Core>,
    call: LocalCall,
    resumed: bool,
    permit: Option<OwnedSemaphorePermit>,
    cancel: CancellationToken,
) {
    let key = CallKey::of(&call);
    // Start from the store, not from a snapshot taken before activation:
    // another task may have moved the call on meanwhile.
    let call = match core.store.call(&key.run_id, &key.call_id).await {
        Ok(Some(fresh)) => fresh,
        Ok(None) => call,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the call; it resumes later");
            core.deactivate(&key);
            return;
        }
    };
    let span = tracing::info_span!("call", run_id = %key.run_id, call_id = %key.call_id, tool = %call.tool_name);
    let result = tokio::select! {
        // The executor was dropped: stop where we are, as a lost process would.
        _ = core.done.cancelled() => return,
        r = steps(&core, call, resumed, cancel).instrument(span) => r,
    };
    if matches!(&result, Err(e) if e == super::CRASH) {
        // A fail point simulates the process dying here: nothing more
        // happens for this call until the executor is dropped.
        core.done.cancelled().await;
        return;
    }
    if let Err(e) = result {
        tracing::warn!(run_id = %key.run_id, call_id = %key.call_id, error = %e, "call paused; it resumes from the store");
    }
    core.deactivate(&key);
    drop(permit);
}

async fn steps(
    core: &Arc<Core>,
    mut call: LocalCall,
    mut resumed: bool,
    cancel: CancellationToken,
) -> Result<(), String> {
    let mut checked = false;
    loop {
        let next = match call.state {
            LocalState::Claiming => claim(core, call).await?,
            LocalState::Assigned => accept(core, call).await?,
            LocalState::Running => run(core, call, resumed, &cancel).await?,
            LocalState::Settled => {
                outbox::deliver_call(core, &CallKey::of(&call)).await;
                outbox::flush_reports(core).await;
                return Ok(());
            }
            LocalState::ReconciliationRequired if !checked => {
                checked = true;
                match super::reconcile::check(core, call.clone()).await? {
                    super::reconcile::Checked::Moved(next) => next,
                    super::reconcile::Checked::Stays => continue,
                }
            }
            _ => {
                outbox::flush_reports(core).await;
                return Ok(());
            }
        };
        resumed = false;
        call = next;
    }
}

/// Saves `call` as it now is.
/// A passing store failure (a busy lock, a full disk being cleaned) must not
/// strand a call: the commit is tried again, with backoff, for a while.
async fn put(core: &Core, call: &LocalCall, extra: Vec<Change>) -> Result<(), String> {
    let mut changes = extra;
    changes.push(Change::PutCall(call.clone()));
    let mut attempt = 0;
    loop {
        match core.commit(changes.clone(), Some(call)).await {
            Ok(()) => return Ok(()),
            Err(e @ crate::store::StoreError::Conflict(..)) => return Err(e.to_string()),
            Err(e) if attempt >= 8 => return Err(e.to_string()),
            Err(e) => {
                tracing::warn!(error = %e, attempt, "store commit failed; trying again");
                tokio::time::sleep(super::pause(core, attempt.min(5))).await;
                attempt += 1;
            }
        }
    }
}

async fn settle_local(
    core: &Core,
    mut call: LocalCall,
    state: LocalState,
    reason: &str,
    report: Option<PendingReport>,
) -> Result<LocalCall, String> {
    call.state = state;
    call.reason = Some(reason.to_owned());
    call.report = report;
    put(core, &call, Vec::new()).await?;
    Ok(call)
}

/// Claim with the saved key. A refusal means nothing ran.
async fn claim(core: &Arc<Core>, mut call: LocalCall) -> Result<LocalCall, String> {
    if core.stop.is_cancelled() {
        // The key stays saved: the next start claims with it.
        return Err("shutting down: the claim waits for the next start".into());
    }
    let mut tries = 0;
    let claimed = loop {
        let connection_id = connection::connection_id(core)
            .await
            .map_err(|e| e.to_string())?;
        let body = Claim {
            executor_id: core.cfg.executor_id.clone(),
            connection_id: connection_id.clone(),
            operation_key: call.operation_key.clone(),
        };
        match core.client.claim(&call.run_id, &call.call_id, &body).await {
            Ok(c) => break c,
            Err(e) if tries < 3 && connection::handle_refusal(core, &connection_id, &e).await => {
                tries += 1
            }
            Err(ClientError::Unreachable(m)) => return Err(m),
            Err(e) => {
                if e.status() == Some(401) || e.code() == Some("missing_scope") {
                    core.fail(crate::Error::from(e.clone()));
                    return Err(e.to_string());
                }
                return match e.code() {
                    Some("capacity_exhausted" | "executor_draining") => {
                        Err(format!("claim deferred: {e}"))
                    }
                    Some("lease_expired" | "connection_superseded") => Err(e.to_string()),
                    _ => {
                        settle_local(
                            core,
                            call,
                            LocalState::Abandoned,
                            &format!("claim refused, nothing ran: {e}"),
                            None,
                        )
                        .await
                    }
                };
            }
        }
    };
    fail::fail_point!("after_claim_answer", |_| Err(super::CRASH.into()));
    let replaced = call
        .assignment
        .as_ref()
        .is_some_and(|a| a.assignment_id != claimed.assignment.assignment_id);
    let mut extra = Vec::new();
    if replaced {
        // A fresh assignment replaces a released one: the old one's unsent
        // receipts are never sent.
        for r in core
            .store
            .receipts(&call.run_id, &call.call_id)
            .await
            .map_err(|e| e.to_string())?
        {
            if r.status == ReceiptStatus::Pending {
                extra.push(Change::ReceiptStatus {
                    receipt_id: r.receipt_id,
                    status: ReceiptStatus::Superseded,
                    error: Some("assignment replaced".into()),
                    attempt: false,
                });
            }
        }
    }
    if replaced || call.assignment.is_none() {
        call.next_sequence = 0;
    }
    let state = claimed.call_state;
    call.assignment = Some(claimed.assignment);
    if state != CallState::Claimed {
        // Only an accepted receipt of ours moves a call on from `claimed`;
        // the store does not know of one, so nothing here is certain.
        let why = format!(
            "the claim came back {} but this store never saw it accepted",
            state.as_str()
        );
        let report =
            matches!(state, CallState::Running).then_some(PendingReport::ReconciliationRequired);
        let local = if state.is_terminal() {
            LocalState::Abandoned
        } else {
            LocalState::ReconciliationRequired
        };
        return settle_local(core, call, local, &why, report).await;
    }
    call.state = LocalState::Assigned;
    put(core, &call, extra).await?;
    fail::fail_point!("after_assignment_saved", |_| Err(super::CRASH.into()));
    Ok(call)
}

/// A new receipt for the call's current assignment at its next sequence.
pub(crate) fn new_receipt(
    executor_id: &str,
    call: &LocalCall,
    asg: &Assignment,
    kind: ReceiptKind,
    extra: Value,
) -> OutboxReceipt {
    let id = receipt_id();
    let mut body = json!({
        "receipt_id": id, "executor_id": executor_id, "assignment_id": asg.assignment_id,
        "sequence": call.next_sequence, "kind": kind.as_str(),
    });
    if let (Some(b), Value::Object(extra)) = (body.as_object_mut(), extra) {
        b.extend(extra);
    }
    OutboxReceipt {
        receipt_id: id,
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        assignment_id: asg.assignment_id.clone(),
        kind,
        sequence: call.next_sequence,
        body: body.to_string(),
        status: ReceiptStatus::Pending,
        attempts: 0,
        last_error: None,
        created_at: crate::store::now_rfc3339(),
        delivered_at: None,
    }
}

/// Saves a final receipt (the call becomes `settled`).
pub(crate) async fn save_final(
    core: &Core,
    call: LocalCall,
    kind: ReceiptKind,
    extra: Value,
) -> Result<LocalCall, String> {
    save_final_guarded(core, call, kind, extra, None).await
}

/// [`save_final`] that commits only if `guard` (a [`Change::Expect`]) holds.
pub(crate) async fn save_final_guarded(
    core: &Core,
    mut call: LocalCall,
    kind: ReceiptKind,
    extra: Value,
    guard: Option<Change>,
) -> Result<LocalCall, String> {
    let asg = call
        .assignment
        .clone()
        .ok_or("a final receipt needs an assignment")?;
    let r = new_receipt(&core.cfg.executor_id, &call, &asg, kind, extra);
    call.next_sequence += 1;
    call.state = LocalState::Settled;
    call.report = None;
    let mut changes: Vec<Change> = guard.into_iter().collect();
    changes.push(Change::AddReceipt(r));
    put(core, &call, changes).await?;
    fail::fail_point!("after_final_saved", |_| Err(super::CRASH.into()));
    Ok(call)
}

/// Checks, then `accepted`; the handler may start only on `accepted: true`.
async fn accept(core: &Arc<Core>, mut call: LocalCall) -> Result<LocalCall, String> {
    let asg = call
        .assignment
        .clone()
        .ok_or("an assigned call has its assignment")?;
    let stored = core
        .store
        .receipts(&call.run_id, &call.call_id)
        .await
        .map_err(|e| e.to_string())?;
    let accepted = stored
        .into_iter()
        .find(|r| r.assignment_id == asg.assignment_id && r.kind == ReceiptKind::Accepted);
    let accepted = match accepted {
        Some(r) => r,
        None => {
            let Some(tool) = core.tools.get(&call.tool_name).cloned() else {
                return save_final(core, call, ReceiptKind::Failed, json!({"error": {"code": "forbidden", "message": "this executor does not serve the tool"}})).await;
            };
            if let Err((code, message)) = checks::before_start(core, tool.as_ref(), &asg).await {
                tracing::info!(code, "refused before start; nothing ran");
                return save_final(
                    core,
                    call,
                    ReceiptKind::Failed,
                    json!({"error": {"code": code, "message": message}}),
                )
                .await;
            }
            let r = new_receipt(
                &core.cfg.executor_id,
                &call,
                &asg,
                ReceiptKind::Accepted,
                json!({}),
            );
            call.next_sequence = 1;
            put(core, &call, vec![Change::AddReceipt(r.clone())]).await?;
            fail::fail_point!("after_accepted_saved", |_| Err(super::CRASH.into()));
            r
        }
    };
    if accepted.status == ReceiptStatus::Superseded {
        return Err("the accepted receipt was superseded".into());
    }
    match core
        .client
        .receipt(&call.run_id, &call.call_id, &asg.grant, &accepted.body)
        .await
    {
        Ok(answer) if answer.accepted == Some(true) => {
            fail::fail_point!("after_accepted_confirmed", |_| Err(super::CRASH.into()));
            call.state = LocalState::Running;
            let done = Change::ReceiptStatus {
                receipt_id: accepted.receipt_id,
                status: ReceiptStatus::Delivered,
                error: None,
                attempt: true,
            };
            put(core, &call, vec![done]).await?;
            Ok(call)
        }
        Ok(answer) => {
            let why = format!(
                "accepted answered false (call {})",
                answer.call_state.as_str()
            );
            not_started(
                core,
                call,
                &accepted.receipt_id,
                answer.call_state == CallState::Pending,
                &why,
            )
            .await
        }
        Err(ClientError::Unreachable(m)) => Err(m),
        Err(e) if e.status() == Some(401) || e.code() == Some("missing_scope") => {
            // Not a verdict on the call: keep the assignment and the saved
            // `accepted`, stop claiming, surface the configuration error.
            core.fail(crate::Error::from(e.clone()));
            Err(e.to_string())
        }
        Err(e) => {
            let may_be_pending = e.code() == Some("invalid_grant");
            not_started(
                core,
                call,
                &accepted.receipt_id,
                may_be_pending,
                &format!("accepted refused: {e}"),
            )
            .await
        }
    }
}

/// `accepted` was not confirmed: nothing may start. Claim again with the
/// same key if the call may be `pending` again, else give up.
async fn not_started(
    core: &Core,
    mut call: LocalCall,
    accepted_id: &str,
    may_be_pending: bool,
    why: &str,
) -> Result<LocalCall, String> {
    let status = if may_be_pending {
        ReceiptStatus::Superseded
    } else {
        ReceiptStatus::Rejected
    };
    let mark = Change::ReceiptStatus {
        receipt_id: accepted_id.to_owned(),
        status,
        error: Some(why.to_owned()),
        attempt: true,
    };
    call.state = if may_be_pending {
        LocalState::Claiming
    } else {
        LocalState::Abandoned
    };
    call.reason = Some(why.to_owned());
    put(core, &call, vec![mark]).await?;
    Ok(call)
}

/// Runs the handler (after `accepted: true`) and saves the final receipt.
async fn run(
    core: &Arc<Core>,
    call: LocalCall,
    resumed: bool,
    cancel: &CancellationToken,
) -> Result<LocalCall, String> {
    let Some(tool) = core.tools.get(&call.tool_name).cloned() else {
        return settle_local(
            core,
            call,
            LocalState::ReconciliationRequired,
            "running call of a tool this executor does not serve",
            Some(PendingReport::ReconciliationRequired),
        )
        .await;
    };
    if resumed && tool.effect() == Effect::Write {
        return settle_local(
            core,
            call,
            LocalState::ReconciliationRequired,
            "the process stopped after accepted: the outcome is unknown",
            Some(PendingReport::ReconciliationRequired),
        )
        .await;
    }
    let asg = call
        .assignment
        .clone()
        .ok_or("a running call has its assignment")?;
    let ctx = CallContext::new(core, &call, &asg, cancel.clone());
    let outcome = attempt_handler(core, tool.as_ref(), &ctx, &asg).await;
    fail::fail_point!("after_handler", |_| Err(super::CRASH.into()));
    // Progress receipts may have moved the sequence on: start from the
    // store, once every queued write (a progress commit of a handler that
    // timed out, say) has gone through the single writer.
    core.commit(Vec::new(), None)
        .await
        .map_err(|e| e.to_string())?;
    let _serial = core.progress_lock.lock().await;
    let call = core
        .store
        .call(&call.run_id, &call.call_id)
        .await
        .map_err(|e| e.to_string())?
        .unwrap_or(call);
    finish(core, call, tool.effect(), outcome, &asg).await
}

async fn attempt_handler(
    core: &Arc<Core>,
    tool: &dyn ErasedTool,
    ctx: &CallContext,
    asg: &Assignment,
) -> Result<Value, ToolError> {
    let mut attempt = 0;
    loop {
        let result = tokio::time::timeout(
            core.cfg.handler_timeout,
            guarded(tool, ctx, asg.arguments.clone()),
        )
        .await;
        let result = match result {
            Ok(r) => r,
            Err(_) => Err(ToolError::unknown(format!(
                "the handler timed out after {:?}",
                core.cfg.handler_timeout
            ))),
        };
        match result {
            Err(ToolError::Retry { reason }) if attempt + 1 < core.cfg.retry_attempts => {
                tracing::info!(attempt, %reason, "handler asked to retry; nothing happened");
                tokio::time::sleep(super::pause(core, attempt)).await;
                attempt += 1;
            }
            Err(ToolError::Retry { reason }) => {
                return Err(ToolError::failed(
                    "retries_exhausted",
                    format!("the tool could not complete after {} attempts", attempt + 1),
                )
                .with_log(reason));
            }
            other => return other,
        }
    }
}

/// Runs the handler so that a panic is an unknown outcome, not a crash.
async fn guarded(
    tool: &dyn ErasedTool,
    ctx: &CallContext,
    arguments: Value,
) -> Result<Value, ToolError> {
    use futures_util::FutureExt;
    match std::panic::AssertUnwindSafe(tool.call(ctx, arguments))
        .catch_unwind()
        .await
    {
        Ok(r) => r,
        Err(_) => Err(ToolError::unknown("the handler panicked")),
    }
}

impl ToolError {
    fn with_log(self, reason: String) -> ToolError {
        tracing::warn!(%reason, "retries exhausted");
        self
    }
}

async fn finish(
    core: &Arc<Core>,
    call: LocalCall,
    effect: Effect,
    outcome: Result<Value, ToolError>,
    asg: &Assignment,
) -> Result<LocalCall, String> {
    let unknown = |why: String| (LocalState::ReconciliationRequired, why);
    let (kind, extra) = match outcome {
        Ok(result) => match checks::check_output(asg, &result) {
            Ok(()) => (ReceiptKind::Completed, json!({"result": result})),
            Err(why) => {
                let (state, why) = unknown(why);
                return settle_local(
                    core,
                    call,
                    state,
                    &why,
                    Some(PendingReport::ReconciliationRequired),
                )
                .await;
            }
        },
        Err(ToolError::Failed { code, message }) => (
            ReceiptKind::Failed,
            json!({"error": {"code": code, "message": message}}),
        ),
        Err(ToolError::Cancelled { reason }) => (ReceiptKind::Cancelled, json!({"reason": reason})),
        Err(ToolError::Retry { reason } | ToolError::Unknown { error: reason }) => {
            tracing::warn!(error = %reason, ?effect, "the outcome is unknown: reconciliation required");
            return settle_local(
                core,
                call,
                LocalState::ReconciliationRequired,
                &reason,
                Some(PendingReport::ReconciliationRequired),
            )
            .await;
        }
    };
    save_final(core, call, kind, extra).await
}

/// Stores, then sends, a progress receipt (`CallContext::progress`).
pub(crate) async fn progress(
    core: &Arc<Core>,
    key: &CallKey,
    message: &str,
    fraction: Option<f64>,
    data: Value,
) -> Result<(), ProgressError> {
    let err = |e: String| ProgressError(e);
    // One progress receipt at a time: each takes the next sequence.
    let _serial = core.progress_lock.lock().await;
    let mut call = core
        .store
        .call(&key.run_id, &key.call_id)
        .await
        .map_err(|e| err(e.to_string()))?
        .ok_or_else(|| err("unknown call".into()))?;
    let asg = call
        .assignment
        .clone()
        .ok_or_else(|| err("no assignment".into()))?;
    let r = new_receipt(
        &core.cfg.executor_id,
        &call,
        &asg,
        ReceiptKind::Progress,
        json!({"progress": {"message": message, "fraction": fraction, "data": data}}),
    );
    call.next_sequence += 1;
    put(core, &call, vec![Change::AddReceipt(r.clone())])
        .await
        .map_err(err)?;
    drop(_serial);
    outbox::deliver_one(core, &call, &r).await;
    Ok(())
}
