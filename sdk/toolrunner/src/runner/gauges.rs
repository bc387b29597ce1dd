//! Metrics through the `metrics` facade (install any recorder, e.g. a
//! Prometheus exporter, to collect them):
//!
//! | name | kind | labels | meaning |
//! |---|---|---|---|
//! | `toolrunner_call_transitions_total` | counter | `state` | calls entering a local state |
//! | `toolrunner_receipt_deliveries_total` | counter | `kind`, `outcome` | delivery attempts and how they ended |
//! | `toolrunner_store_commit_seconds` | histogram | | latency of one store commit |
//! | `toolrunner_calls` | gauge | `state` | calls by local state |
//! | `toolrunner_oldest_reconciliation_seconds` | gauge | | age of the oldest `reconciliation_required` call |
//! | `toolrunner_undelivered_receipts` | gauge | | receipts saved and not yet acknowledged |
//! | `toolrunner_oldest_undelivered_seconds` | gauge | | age of the oldest of them |
use std::collections::BTreeMap;

use super::Core;
use crate::store::{CallFilter, LocalState, ReceiptStatus};

fn age_seconds(rfc3339: &str) -> f64 {
    chrono::DateTime::parse_from_rfc3339(rfc3339)
        .map(|t| {
            (chrono::Utc::now() - t.with_timezone(&chrono::Utc)).num_milliseconds() as f64 / 1000.0
        })
        .unwrap_or(0.0)
}

/// Publishes the gauges from the store.
pub(crate) async fn publish(core: &Core) {
    let Ok(calls) = core.store.calls(&CallFilter::default()).await else {
        return;
    };
    let mut by_state: BTreeMap<&'static str, f64> = crate::store::ALL_STATES
        .iter()
        .map(|s| (s.as_str(), 0.0))
        .collect();
    let mut oldest_reconciliation = 0.0f64;
    for c in &calls {
        *by_state.entry(c.state.as_str()).or_default() += 1.0;
        if c.state == LocalState::ReconciliationRequired {
            oldest_reconciliation = oldest_reconciliation.max(age_seconds(&c.updated_at));
        }
    }
    for (state, n) in by_state {
        metrics::gauge!("toolrunner_calls", "state" => state).set(n);
    }
    metrics::gauge!("toolrunner_oldest_reconciliation_seconds").set(oldest_reconciliation);
    if let Ok(pending) = core.store.receipts_with(ReceiptStatus::Pending).await {
        let oldest = pending
            .iter()
            .map(|r| age_seconds(&r.created_at))
            .fold(0.0, f64::max);
        metrics::gauge!("toolrunner_undelivered_receipts").set(pending.len() as f64);
        metrics::gauge!("toolrunner_oldest_undelivered_seconds").set(oldest);
    }
}
