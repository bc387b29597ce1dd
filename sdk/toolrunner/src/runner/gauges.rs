//! Metrics through the `metrics` facade (install any recorder, e.g. a
//! Prometheus exporter, to collect them):
//!
//! | name | kind | labels | meaning |
//! |---|---|---|---|
//! | `toolrunner_call_transitions_total` | counter | `event`, `state` | lifecycle transitions by event and the state they led to |
//! | `toolrunner_receipt_deliveries_total` | counter | `kind`, `outcome` | delivery attempts and how they ended |
//! | `toolrunner_store_commit_seconds` | histogram | | latency of one store commit |
//! | `toolrunner_calls` | gauge | `state` | calls by local state |
//! | `toolrunner_oldest_reconciliation_seconds` | gauge | | age of the oldest `reconciliation_required` call |
//! | `toolrunner_undelivered_receipts` | gauge | | receipts saved and not yet acknowledged |
//! | `toolrunner_oldest_undelivered_seconds` | gauge | | age of the oldest of them |
use super::Core;
use crate::store::{CallFilter, LocalState, OutboxSummary};

fn age_seconds(t: &crate::store::Timestamp) -> f64 {
    (chrono::Utc::now() - *t).num_milliseconds() as f64 / 1000.0
}

/// Publishes the gauges from the store.
pub(crate) async fn publish(core: &Core, outbox: Option<&OutboxSummary>) {
    if let Ok(counts) = core.store.count_by_state().await {
        for state in crate::store::ALL_STATES {
            let n = counts.get(&state).copied().unwrap_or(0) as f64;
            metrics::gauge!("toolrunner_calls", "state" => state.as_str()).set(n);
        }
    }
    let waiting = CallFilter {
        states: vec![LocalState::ReconciliationRequired],
        ..CallFilter::default()
    };
    if let Ok(calls) = core.store.calls(&waiting).await {
        let oldest = calls
            .iter()
            .map(|c| age_seconds(&c.updated_at))
            .fold(0.0, f64::max);
        metrics::gauge!("toolrunner_oldest_reconciliation_seconds").set(oldest);
    }
    if let Some(outbox) = outbox {
        let oldest = outbox.oldest.as_ref().map_or(0.0, age_seconds);
        metrics::gauge!("toolrunner_undelivered_receipts").set(outbox.pending as f64);
        metrics::gauge!("toolrunner_oldest_undelivered_seconds").set(oldest);
    }
}
