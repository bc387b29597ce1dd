//! The outbox: receipts are stored before they are sent, sent again with
//! the same bytes until the platform answers, in sequence order per call;
//! and the states still to report go out with `calls/report`.
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use toolrunner_protocol::wire::{CallReport, ReceiptKind, Report, ReportState};

use super::{CallKey, Core, connection};
use crate::client::{Client, ClientError};
use crate::store::{
    CallFilter, Change, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus, Store,
};

/// What one delivery attempt found.
pub(crate) enum Delivery {
    Delivered,
    /// A progress receipt the platform refused: dropped, go on.
    Dropped,
    /// Stop: try again later.
    Later,
    /// The call changed state; stop delivering its receipts.
    Settled,
}

/// Delivers a call's pending receipts in sequence order.
pub(crate) async fn deliver_call(core: &Arc<Core>, key: &CallKey) {
    let Ok(Some(call)) = core.store.call(&key.run_id, &key.call_id).await else {
        return;
    };
    let Ok(receipts) = core.store.receipts(&key.run_id, &key.call_id).await else {
        return;
    };
    let unsent = receipts
        .iter()
        .filter(|r| r.status == ReceiptStatus::Pending && r.kind != ReceiptKind::Accepted);
    for r in unsent {
        match deliver_one(core, &call, r).await {
            Delivery::Delivered | Delivery::Dropped => {}
            Delivery::Later | Delivery::Settled => return,
        }
    }
}

fn status_change(r: &OutboxReceipt, status: ReceiptStatus, error: Option<String>) -> Change {
    Change::ReceiptStatus {
        receipt_id: r.receipt_id.clone(),
        status,
        error,
        attempt: true,
    }
}

/// Sends one stored receipt and applies the reaction table.
pub(crate) async fn deliver_one(core: &Arc<Core>, call: &LocalCall, r: &OutboxReceipt) -> Delivery {
    deliver(&core.client, core.store.as_ref(), call, r).await
}

/// Sends one stored receipt with `client` and records the outcome in
/// `store` (shared by the executor and the operator's [`crate::Reconciler`]).
pub(crate) async fn deliver(
    client: &Client,
    store: &dyn Store,
    call: &LocalCall,
    r: &OutboxReceipt,
) -> Delivery {
    let Some(asg) = call
        .assignment
        .as_ref()
        .filter(|a| a.assignment_id == r.assignment_id)
    else {
        let superseded = status_change(
            r,
            ReceiptStatus::Superseded,
            Some("assignment replaced".into()),
        );
        let _ = store.commit(vec![superseded]).await;
        return Delivery::Settled;
    };
    let answer = client
        .receipt(&r.run_id, &r.call_id, &asg.grant, &r.body)
        .await;
    let outcome = match &answer {
        Ok(_) => "delivered",
        Err(ClientError::Unreachable(_)) => "unreachable",
        Err(ClientError::Api(e)) => {
            if e.status == 404 {
                "not_found"
            } else {
                "refused"
            }
        }
    };
    metrics::counter!("toolrunner_receipt_deliveries_total", "kind" => r.kind.as_str(), "outcome" => outcome).increment(1);
    let final_kind = r.kind.is_final();
    let mut call = call.clone();
    let (status, error, state, report) = match answer {
        Ok(_) => (
            ReceiptStatus::Delivered,
            None,
            final_kind.then_some(LocalState::Delivered),
            None,
        ),
        // Not a verdict on the receipt: the credentials are wrong. Keep it
        // pending and say so; a configuration error is surfaced elsewhere.
        Err(ClientError::Api(e)) if e.status == 401 || e.code() == "missing_scope" => {
            let change = Change::ReceiptStatus {
                receipt_id: r.receipt_id.clone(),
                status: ReceiptStatus::Pending,
                error: Some(e.to_string()),
                attempt: true,
            };
            let _ = store.commit(vec![change]).await;
            return Delivery::Later;
        }
        Err(ClientError::Unreachable(m)) => {
            let pending = final_kind.then_some(PendingReport::PendingDelivery);
            let mut changes = vec![Change::ReceiptStatus {
                receipt_id: r.receipt_id.clone(),
                status: ReceiptStatus::Pending,
                error: Some(m),
                attempt: true,
            }];
            if pending.is_some() && call.report.is_none() {
                call.report = pending;
                changes.push(Change::Expect {
                    run_id: call.run_id.clone(),
                    call_id: call.call_id.clone(),
                    states: vec![call.state],
                });
                changes.push(Change::PutCall(call.clone()));
            }
            let _ = store.commit(changes).await;
            return Delivery::Later;
        }
        Err(e) if !final_kind && r.kind == ReceiptKind::Progress => {
            (ReceiptStatus::Rejected, Some(e.to_string()), None, None)
        }
        // A sequence-0 `failed` settles a call refused before start: nothing
        // ran, so a refusal of it leaves nothing unknown.
        Err(e) if r.kind == ReceiptKind::Failed && r.sequence == 0 => (
            ReceiptStatus::Rejected,
            Some(e.to_string()),
            Some(LocalState::Abandoned),
            None,
        ),
        Err(e) => match (e.status(), e.code()) {
            (_, Some("run_terminated" | "call_already_terminal")) => (
                ReceiptStatus::Rejected,
                Some(e.to_string()),
                Some(LocalState::Rejected),
                None,
            ),
            (Some(404), _) => (
                ReceiptStatus::Orphaned,
                Some(e.to_string()),
                Some(LocalState::Orphaned),
                None,
            ),
            _ => (
                ReceiptStatus::Rejected,
                Some(e.to_string()),
                Some(LocalState::ReconciliationRequired),
                Some(PendingReport::ReconciliationRequired),
            ),
        },
    };
    let mut changes = vec![status_change(r, status, error.clone())];
    if let Some(state) = state {
        // Only from the state the call had when the receipt went out.
        changes.push(Change::Expect {
            run_id: call.run_id.clone(),
            call_id: call.call_id.clone(),
            states: vec![call.state],
        });
        call.state = state;
        call.report = report;
        if error.is_some() {
            call.reason = error;
        }
        changes.push(Change::PutCall(call.clone()));
    }
    if let Err(e) = store.commit(changes).await {
        tracing::error!(error = %e, "could not record a delivery; it will be sent again");
        return Delivery::Later;
    }
    match (status, state) {
        (ReceiptStatus::Delivered, _) => Delivery::Delivered,
        (_, None) => Delivery::Dropped,
        _ => Delivery::Settled,
    }
}

/// Sends the states still to report on a task of their own (a plain
/// function with a boxed future: it breaks the cycle through `connect`).
pub(crate) fn spawn_flush_reports(core: Arc<Core>) {
    let fut: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
        Box::pin(async move { flush_reports(&core).await });
    tokio::spawn(fut);
}

/// Sends every state still to report.
pub(crate) async fn flush_reports(core: &Arc<Core>) {
    // Each round either delivers every report or drops one call the
    // platform does not know, so this ends.
    let mut size = 100;
    for _ in 0..1000 {
        match flush_reports_once(core, size).await {
            Pass::Done => return,
            Pass::Again => {}
            // The platform did not say which call: one call per report.
            Pass::OneByOne => size = 1,
        }
    }
}

/// How a pass over the pending reports ended.
enum Pass {
    Done,
    Again,
    OneByOne,
}

/// One pass, in reports of `size` calls.
async fn flush_reports_once(core: &Arc<Core>, size: usize) -> Pass {
    let filter = CallFilter {
        pending_report: true,
        ..CallFilter::default()
    };
    let Ok(calls) = core.store.calls(&filter).await else {
        return Pass::Done;
    };
    let pending: Vec<LocalCall> = calls.into_iter().filter(|c| c.report.is_some()).collect();
    for chunk in pending.chunks(size) {
        let Ok(connection_id) = connection::connection_id(core).await else {
            return Pass::Done;
        };
        let reports = chunk
            .iter()
            .map(|c| CallReport {
                run_id: c.run_id.clone(),
                call_id: c.call_id.clone(),
                state: match c.report {
                    Some(PendingReport::ReconciliationRequired) => {
                        ReportState::ReconciliationRequired
                    }
                    Some(PendingReport::PendingDelivery) => ReportState::PendingDelivery,
                    _ => ReportState::Released,
                },
                reason: (c.report == Some(PendingReport::ReconciliationRequired))
                    .then(|| public_reason(c)),
                receipt_id: None,
            })
            .collect();
        let body = Report {
            connection_id: connection_id.clone(),
            calls: reports,
        };
        match core.client.report(&core.cfg.executor_id, &body).await {
            Ok(answer) => {
                for (c, result) in chunk.iter().zip(answer.results) {
                    // The call may have moved on while the report was in
                    // flight: clear the flag only on the call as it is now.
                    let Ok(Some(mut now)) = core.store.call(&c.run_id, &c.call_id).await else {
                        continue;
                    };
                    let mut changes = vec![Change::Note {
                        run_id: c.run_id.clone(),
                        call_id: c.call_id.clone(),
                        what: "reported".into(),
                        detail: Some(format!("{:?}", result.outcome)),
                    }];
                    if now.state == c.state && now.report == c.report {
                        now.report = None;
                        changes.push(Change::Expect {
                            run_id: c.run_id.clone(),
                            call_id: c.call_id.clone(),
                            states: vec![c.state],
                        });
                        changes.push(Change::PutCall(now));
                    }
                    let _ = core.commit(changes, None).await;
                }
            }
            Err(ClientError::Api(e)) if e.code() == "unknown_call" => {
                // One call the platform no longer knows refuses the whole
                // report: set it aside as orphaned, send the rest again.
                let index = e
                    .body
                    .param
                    .as_deref()
                    .and_then(|p| p.strip_prefix("calls["))
                    .and_then(|p| p.strip_suffix(']'))
                    .and_then(|i| i.parse::<usize>().ok());
                let index = index.or((chunk.len() == 1).then_some(0));
                let Some(mut c) = index.and_then(|i| chunk.get(i)).cloned() else {
                    return Pass::OneByOne;
                };
                tracing::warn!(run_id = %c.run_id, call_id = %c.call_id, "the platform does not know this call: orphaned");
                c.state = LocalState::Orphaned;
                c.report = None;
                c.reason = Some(format!("the platform does not know the call ({e})"));
                let guard = Change::Expect {
                    run_id: c.run_id.clone(),
                    call_id: c.call_id.clone(),
                    states: vec![chunk[index.unwrap_or(0)].state],
                };
                let _ = core.commit(vec![guard, Change::PutCall(c)], None).await;
                return Pass::Again;
            }
            Err(e) => {
                connection::handle_refusal(core, &connection_id, &e).await;
                tracing::debug!(error = %e, "report not delivered; will retry");
                return Pass::Done;
            }
        }
    }
    Pass::Done
}

/// The reason sent with `reconciliation_required`: fixed words, never a
/// handler's raw error text (which may carry internals).
fn public_reason(c: &LocalCall) -> String {
    if c.reason.as_deref() == Some("unknown_to_executor") {
        "unknown_to_executor".to_owned()
    } else {
        "outcome unknown after accepted".to_owned()
    }
}

/// Redelivers what no running call is delivering: after a crash, after the
/// platform was unreachable.
pub(crate) async fn flush(core: &Arc<Core>) {
    let Ok(pending) = core.store.receipts_with(ReceiptStatus::Pending).await else {
        return;
    };
    let mut by_call: BTreeMap<CallKey, ()> = BTreeMap::new();
    // `accepted` is sent only by the accept step, which acts on its answer.
    for r in pending
        .into_iter()
        .filter(|r| r.kind != ReceiptKind::Accepted)
    {
        by_call.insert(
            CallKey {
                run_id: r.run_id,
                call_id: r.call_id,
            },
            (),
        );
    }
    for key in by_call.into_keys() {
        if core.activate(&key).is_some() {
            deliver_call(core, &key).await;
            core.deactivate(&key);
        }
    }
    flush_reports(core).await;
}

pub(crate) async fn outbox_loop(core: Arc<Core>) {
    let mut attempt = 0u32;
    loop {
        let wait = if attempt == 0 {
            Duration::from_secs(1)
        } else {
            super::pause(&core, attempt.min(6))
        };
        tokio::select! {
            _ = core.done.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        flush(&core).await;
        super::gauges::publish(&core).await;
        let left = core
            .store
            .receipts_with(ReceiptStatus::Pending)
            .await
            .map(|v| v.len())
            .unwrap_or(0);
        attempt = if left == 0 { 0 } else { attempt + 1 };
    }
}
