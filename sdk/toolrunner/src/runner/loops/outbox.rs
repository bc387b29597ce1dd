//! Redelivery: now and then (sooner after a quiet outbox, backing off
//! while receipts wait), every call with receipts no running task is
//! delivering is handed to the dispatch queue, then the states still to
//! report.
use std::sync::Arc;
use std::time::Duration;

use super::super::dispatch::{self, Work};
use super::super::{CallKey, Core};

/// Redelivers what no running call is delivering: after a crash, after the
/// platform was unreachable. Waits until each handed-over delivery ended.
pub(crate) async fn flush(core: &Arc<Core>) {
    let Ok(summary) = core.store.outbox_summary().await else {
        return;
    };
    // `accepted` is sent only by the accept step, which acts on its answer
    // (the summary does not list a call for it).
    for (run_id, call_id) in summary.calls {
        let key = CallKey { run_id, call_id };
        if let Some(active) = core.activate(&key) {
            let delivered = dispatch::done(core, |done| Work::Redeliver {
                active,
                done: Some(done),
            })
            .await;
            if delivered.is_none() && core.life.is_halted() {
                // The executor halted: nothing more is sent.
                return;
            }
        }
    }
    reports(core).await;
}

/// Sends every state still to report, and waits until it went out (or
/// could not).
pub(crate) async fn reports(core: &Arc<Core>) {
    dispatch::done(core, |done| Work::Reports { done: Some(done) }).await;
}

pub(crate) async fn outbox_loop(core: Arc<Core>) {
    let mut attempt = 0u32;
    loop {
        let wait = if attempt == 0 {
            Duration::from_secs(1)
        } else {
            super::super::retry_delay(&core, attempt.min(6))
        };
        tokio::select! {
            _ = core.life.halted() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        flush(&core).await;
        let summary = core.store.outbox_summary().await.ok();
        let left = summary.map_or(0, |s| s.calls.len());
        attempt = if left == 0 { 0 } else { attempt + 1 };
    }
}
