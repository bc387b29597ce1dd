//! The outbox: receipts are stored before they are sent, sent again with
//! the same bytes until the platform answers, in sequence order per call;
//! and the states still to report go out with `calls/report`.
//!
//! An `accepted` is never sent from here: only the accept step sends it,
//! and only the accept step acts on its answer.
use std::sync::Arc;

use toolrunner_protocol::wire::{CallReport, ReceiptKind, Report, ReportOutcome, ReportState};

use super::machine::deliver::{Mark, OnDelivery};
use super::{CallKey, Core, connection, machine};
use crate::lifecycle::{self, Event, Reads};
use crate::net::client::{Client, ClientError};
use crate::store::{
    CallFilter, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus, Store,
};

/// What one delivery attempt found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Delivery {
    Delivered,
    /// A progress receipt the platform refused: dropped, go on.
    Dropped,
    /// Stop: try again later.
    Later,
    /// The call changed state; stop delivering its receipts.
    Settled,
    /// Not the outbox's to send (an `accepted`).
    NotSent,
}

/// A delivery's outcome on a span.
pub(crate) fn delivery_name(d: Delivery) -> &'static str {
    match d {
        Delivery::Delivered => "delivered",
        Delivery::Dropped => "dropped",
        Delivery::Later => "later",
        Delivery::Settled => "settled",
        Delivery::NotSent => "not_sent",
    }
}

/// Delivers a call's pending receipts in sequence order; says how the last
/// attempt ended (`Delivered` when the last receipt went out, or there was
/// none to send). `known` is the call's row as the caller holds it, if it
/// has it (it saves a read; the compare-and-set still guards it).
pub(crate) async fn deliver_call(
    core: &Arc<Core>,
    key: &CallKey,
    mut known: Option<LocalCall>,
) -> Delivery {
    let Ok(receipts) = core.store.receipts(&key.run_id, &key.call_id).await else {
        return Delivery::Later;
    };
    let unsent = receipts
        .iter()
        .filter(|r| r.status == ReceiptStatus::Pending && r.kind != ReceiptKind::Accepted);
    let mut last = Delivery::Delivered;
    for r in unsent {
        last = deliver(
            &core.client,
            core.store.as_ref(),
            &core.cfg.executor_id,
            r,
            known.take(),
        )
        .await;
        match last {
            Delivery::Delivered | Delivery::Dropped | Delivery::NotSent => {}
            Delivery::Later | Delivery::Settled => return last,
        }
    }
    if last == Delivery::Delivered {
        // The platform holds what a person's deny or an expiry made of the
        // call (if one did): nothing consults the request again.
        core.calls.approvals.outcome_saved(key).await;
    }
    last
}

/// Sends one stored receipt and applies the reaction table (`known`: the
/// call's row as the caller holds it, if it does).
pub(crate) async fn deliver_one(
    core: &Arc<Core>,
    r: &OutboxReceipt,
    known: Option<LocalCall>,
) -> Delivery {
    let delivery = deliver(
        &core.client,
        core.store.as_ref(),
        &core.cfg.executor_id,
        r,
        known,
    )
    .await;
    if delivery == Delivery::Delivered {
        let key = CallKey {
            run_id: r.run_id.clone(),
            call_id: r.call_id.clone(),
        };
        core.calls.approvals.outcome_saved(&key).await;
    }
    delivery
}

/// Marks one receipt (its call row does not change).
async fn mark(store: &dyn Store, r: &OutboxReceipt, status: ReceiptStatus, error: Option<String>) {
    if let Err(e) = crate::lifecycle::mark_receipt(store, &r.receipt_id, status, error).await {
        tracing::warn!(error = %e, "could not record a delivery attempt");
    }
}

/// Sends one stored receipt with `client` and records the outcome in
/// `store` (shared by the executor and the operator's [`crate::Reconciler`]).
/// `known`: the call's row as the caller just read or wrote it, if it has
/// it (saves a read).
pub(crate) async fn deliver(
    client: &Client,
    store: &dyn Store,
    executor_id: &str,
    r: &OutboxReceipt,
    known: Option<LocalCall>,
) -> Delivery {
    if r.kind == ReceiptKind::Accepted {
        return Delivery::NotSent;
    }
    let key = (r.run_id.as_str(), r.call_id.as_str());
    let call = match known {
        Some(c) => c,
        None => match store.call(key.0, key.1).await {
            Ok(Some(c)) => c,
            _ => return Delivery::Later,
        },
    };
    let Some(asg) = call
        .assignment
        .as_ref()
        .filter(|a| a.assignment_id == r.assignment_id)
    else {
        mark(
            store,
            r,
            ReceiptStatus::Superseded,
            Some("assignment replaced".into()),
        )
        .await;
        return Delivery::Settled;
    };
    let answer = client
        .receipt(&r.run_id, &r.call_id, &asg.grant, &r.body)
        .await;
    let outcome = match &answer {
        Ok(_) => "delivered",
        Err(ClientError::Unreachable(_) | ClientError::NotReady(_)) => "unreachable",
        Err(ClientError::Api(e)) if e.status == 404 => "not_found",
        Err(ClientError::Api(_)) => "refused",
    };
    metrics::counter!(super::telemetry::metric::DELIVERIES, "executor_id" => executor_id.to_owned(), "kind" => r.kind.as_str(), "outcome" => outcome).increment(1);
    let error = answer.as_ref().err().map(ToString::to_string);
    let reply = super::answers::reply(&answer);
    let event = match machine::deliver::on_reply(&reply, r.kind, r.sequence, &r.receipt_id) {
        OnDelivery::Settle(event) => event,
        OnDelivery::Mark(Mark::Delivered) => {
            mark(store, r, ReceiptStatus::Delivered, None).await;
            return Delivery::Delivered;
        }
        OnDelivery::Mark(Mark::Rejected) => {
            mark(store, r, ReceiptStatus::Rejected, error).await;
            return Delivery::Dropped;
        }
        OnDelivery::Later { defer } => {
            mark(store, r, ReceiptStatus::Pending, error).await;
            if defer {
                let settled_without_report =
                    |c: &LocalCall| c.state == LocalState::Settled && c.report.is_none();
                let _ = lifecycle::advance(store, executor_id, key, Reads::Row, |s| {
                    s.call
                        .as_ref()
                        .filter(|c| settled_without_report(c))
                        .map(|_| Event::DeliveryDeferred)
                })
                .await;
            }
            return Delivery::Later;
        }
    };
    let delivered = matches!(event, Event::Delivered { .. });
    let known = Some(Some(call));
    let reads = Reads::ReceiptsUnlessKnown;
    let moved = lifecycle::advance_from(store, executor_id, key, known, reads, |s| {
        // Only while this very receipt is the settled call's live final:
        // a late answer to another sender's attempt changes no state. On
        // the row this sender holds, the receipt is as it read it (it was
        // pending; the compare-and-set on the row refuses the write if the
        // call moved on since).
        let call = s.call.as_ref().filter(|c| c.state == LocalState::Settled)?;
        let current = call.assignment.as_ref()?.assignment_id.as_str();
        let now = match &s.receipts {
            Some(list) => list.iter().find(|x| x.receipt_id == r.receipt_id)?,
            None => r,
        };
        (now.status == ReceiptStatus::Pending && now.assignment_id == current)
            .then(|| event.clone())
    })
    .await;
    match moved {
        Ok(lifecycle::Advanced::Moved { .. }) => {}
        Ok(lifecycle::Advanced::Stayed(_)) => {
            // The call moved on meanwhile: record the receipt's fate only.
            let status = match &event {
                Event::Delivered { .. } => ReceiptStatus::Delivered,
                Event::FinalOrphaned { .. } => ReceiptStatus::Orphaned,
                _ => ReceiptStatus::Rejected,
            };
            mark(store, r, status, (!delivered).then_some(outcome.to_owned())).await;
        }
        Err(e) => {
            tracing::error!(error = %e, "could not record a delivery; it will be sent again");
            return Delivery::Later;
        }
    }
    if delivered {
        Delivery::Delivered
    } else {
        Delivery::Settled
    }
}

/// One flush of the reports at a time, shared by the tasks that ask for
/// one meanwhile (a part of [`super::Calls`]): thirty calls given back at
/// once (their key at its limit) would otherwise each read and send every
/// report still pending, thirty times over, holding their capacity slots
/// while they did.
#[derive(Default)]
pub(crate) struct ReportFlush {
    /// Asks so far (each ask's ticket is its number).
    asked: std::sync::atomic::AtomicU64,
    /// Every ask up to this ticket had a pass over the store start after
    /// it.
    covered: std::sync::atomic::AtomicU64,
    /// Held by the one flush running.
    running: tokio::sync::Mutex<()>,
}

/// Sends every state still to report: when it returns, a pass over the
/// store that began after it was called has ended (this task's own, or
/// the one it waited for).
pub(crate) async fn flush_reports(core: &Arc<Core>) {
    use std::sync::atomic::Ordering::SeqCst;
    let shared = &core.calls.reports;
    let ticket = shared.asked.fetch_add(1, SeqCst) + 1;
    let _running = shared.running.lock().await;
    if shared.covered.load(SeqCst) >= ticket {
        return;
    }
    // Every ask made so far is covered by the pass that starts now.
    let upto = shared.asked.load(SeqCst);
    flush_reports_now(core).await;
    shared.covered.fetch_max(upto, SeqCst);
}

/// Sends every state still to report, in passes of its own.
async fn flush_reports_now(core: &Arc<Core>) {
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

/// Decides `event` if the call still is as it was reported.
fn still_as_sent(
    sent: &LocalCall,
    event: Event,
) -> impl FnMut(&lifecycle::Snapshot) -> Option<Event> {
    let (state, report) = (sent.state, sent.report);
    move |s| {
        s.call
            .as_ref()
            .filter(|c| c.state == state && c.report == report)
            .map(|_| event.clone())
    }
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
                    // flight: clear the flag only on the call as it was sent.
                    let event = Event::Reported {
                        outcome: format!("{:?}", result.outcome),
                    };
                    let _ = core
                        .advance(&CallKey::of(c), Reads::Row, still_as_sent(c, event))
                        .await;
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
                let Some(c) = index.and_then(|i| chunk.get(i)) else {
                    return Pass::OneByOne;
                };
                tracing::warn!(run_id = %c.run_id, call_id = %c.call_id, "the platform does not know this call: orphaned");
                let event = Event::UnknownToPlatform {
                    why: format!("the platform does not know the call ({e})"),
                };
                let _ = core
                    .advance(&CallKey::of(c), Reads::Row, still_as_sent(c, event))
                    .await;
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

/// What the platform says of a call asked about before it runs again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Bound {
    /// Still this executor's, bound and not ended (`updated`, `unchanged`).
    Yes,
    /// Ended, or no longer this executor's (`terminal`, `run_terminated`,
    /// `not_bound`).
    Ended,
    /// The platform no longer knows the run (`400 unknown_call`), with its
    /// answer: the call is orphaned, as after a `404` on a final receipt.
    Forgotten(String),
}

/// Whether the platform still holds `c` for this executor, bound and not
/// ended, asked right now with an idempotent report of
/// `reconciliation_required` (see [`Bound`]). `None` when it cannot tell
/// now (no connection, no answer, `not_applicable`, an outcome this
/// version does not know): logged, asked again at the next check. Asked
/// before anything runs again: a cancel notice comes only once, in a
/// heartbeat answer that may be lost.
pub(crate) async fn still_bound(core: &Arc<Core>, c: &LocalCall) -> Option<Bound> {
    // Once more after a reconnect (a lapsed lease, a superseded connection).
    for _ in 0..2 {
        let connection_id = connection::connection_id(core).await.ok()?;
        let body = Report {
            connection_id: connection_id.clone(),
            calls: vec![CallReport {
                run_id: c.run_id.clone(),
                call_id: c.call_id.clone(),
                state: ReportState::ReconciliationRequired,
                reason: Some(public_reason(c)),
                receipt_id: None,
            }],
        };
        match core.client.report(&core.cfg.executor_id, &body).await {
            Ok(answer) => {
                return match answer.results.first().map(|r| r.outcome) {
                    Some(ReportOutcome::Updated | ReportOutcome::Unchanged) => Some(Bound::Yes),
                    Some(
                        ReportOutcome::RunTerminated
                        | ReportOutcome::Terminal
                        | ReportOutcome::NotBound,
                    ) => Some(Bound::Ended),
                    // Still bound, live, yet not as this executor holds it
                    // (`not_applicable`), or an outcome this version does
                    // not know: not a leave to run, nor an end.
                    other => {
                        tracing::warn!(run_id = %c.run_id, call_id = %c.call_id, outcome = ?other, "the platform's answer does not say whether the call may run again; it waits for the next check");
                        None
                    }
                };
            }
            Err(ClientError::Api(e)) if e.code() == "unknown_call" => {
                return Some(Bound::Forgotten(format!(
                    "the platform does not know the call ({e})"
                )));
            }
            Err(e) => {
                if !connection::handle_refusal(core, &connection_id, &e).await {
                    tracing::warn!(run_id = %c.run_id, call_id = %c.call_id, error = %e, "cannot ask the platform whether the call may run again; it waits for the next check");
                    return None;
                }
            }
        }
    }
    None
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
