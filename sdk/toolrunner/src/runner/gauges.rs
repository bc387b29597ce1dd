//! A write probe of the store, then the gauges (through the
//! `metrics` facade) and the health facts ([`crate::health`]) from the
//! store and the runner. The metric names are in [`super::telemetry`];
//! their table is in `docs/operations.md`. Once a second, handed over by
//! `runner/loops/gauges.rs`.
use std::collections::BTreeMap;
use std::time::Duration;

use super::Core;
use super::telemetry::metric;
use crate::store::{CallFilter, LocalState, Timestamp};

/// How long the probe's write may take.
const PROBE_WITHIN: Duration = Duration::from_secs(2);

fn age(t: &Timestamp) -> Duration {
    (chrono::Utc::now() - *t).to_std().unwrap_or_default()
}

/// Whether this executor's gauges are still published: set for good by
/// [`clear`] when it stops (shut down, halted, dropped). The gauges are
/// set under its lock, so a publication that was under way when the
/// executor stopped cannot set them again after they were cleared.
#[derive(Debug, Default)]
pub(crate) struct Published {
    cleared: std::sync::Mutex<bool>,
}

impl Published {
    /// Runs `set` unless the gauges were cleared.
    fn set(&self, set: impl FnOnce()) {
        let cleared = self
            .cleared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !*cleared {
            set();
        }
    }
}

/// Sets this executor's gauges to zero, for good: it stopped (shut down,
/// or halted as a lost process: fenced, crashed at a fail point, dropped),
/// and holds nothing. Called from [`Core::halt`](super::Core::halt), which
/// every exit passes: an adopted identity let go or dropped by its adopter
/// included.
pub(crate) fn clear(core: &Core) {
    let mut cleared = core
        .gauges
        .cleared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *cleared = true;
    let id = core.cfg.executor_id.clone();
    for name in [
        metric::CAPACITY_IN_USE,
        metric::CAPACITY_AVAILABLE,
        metric::UNDELIVERED,
        metric::OLDEST_UNDELIVERED,
    ] {
        metrics::gauge!(name, "executor_id" => id.clone()).set(0.0);
    }
    if core.lease.is_shared() {
        metrics::gauge!(metric::LEASE_AGE, "executor_id" => id.clone()).set(0.0);
    }
    for state in crate::store::ALL_STATES {
        metrics::gauge!(metric::CALLS, "executor_id" => id.clone(), "state" => state.as_str())
            .set(0.0);
    }
    for tool in core.tools.keys() {
        let labels = [("executor_id", id.clone()), ("tool", tool.clone())];
        metrics::gauge!(metric::RECONCILIATION, &labels).set(0.0);
        metrics::gauge!(metric::OLDEST_RECONCILIATION, &labels).set(0.0);
    }
}

/// One round: the probe, the gauges, the health facts.
pub(crate) async fn publish(core: &Core) {
    let id = core.cfg.executor_id.clone();
    // A real write of the probe's row (on PostgreSQL, in a transaction
    // that checks the identity's fencing token): its outcome is the
    // store's health, as every commit's is (the fenced store records it).
    // A write that does not come back in time (a half-open connection, a
    // writer stuck behind one) is a store that does not take writes.
    let probe = core.store.commit(vec![crate::store::Change::Probe {
        at: crate::store::now(),
    }]);
    if tokio::time::timeout(PROBE_WITHIN, probe).await.is_err() {
        core.health.store(Err(format!(
            "a write did not come back within {PROBE_WITHIN:?}"
        )));
    }
    let free = u32::try_from(core.calls.slots.available_permits()).unwrap_or(u32::MAX);
    let in_use = core.cfg.capacity.saturating_sub(free);
    core.gauges.set(|| {
        metrics::gauge!(metric::CAPACITY_IN_USE, "executor_id" => id.clone())
            .set(f64::from(in_use));
        metrics::gauge!(metric::CAPACITY_AVAILABLE, "executor_id" => id.clone())
            .set(f64::from(free));
        for used in core.calls.flow.in_use() {
            let tool = used.tool;
            if let Some((limit, held)) = used.slots {
                metrics::gauge!(metric::FLOW_SLOTS_IN_USE, "executor_id" => id.clone(), "tool" => tool.clone())
                    .set(f64::from(held));
                metrics::gauge!(metric::FLOW_SLOT_LIMIT, "executor_id" => id.clone(), "tool" => tool.clone())
                    .set(f64::from(limit));
            }
            if let Some((limit, counting)) = used.tokens {
                metrics::gauge!(metric::FLOW_TOKENS_IN_USE, "executor_id" => id.clone(), "tool" => tool.clone())
                    .set(f64::from(counting));
                metrics::gauge!(metric::FLOW_RATE_LIMIT, "executor_id" => id.clone(), "tool" => tool)
                    .set(f64::from(limit));
            }
        }
    });
    if let Some(renewed) = lease_health(core) {
        core.gauges.set(|| {
            metrics::gauge!(metric::LEASE_AGE, "executor_id" => id.clone())
                .set(renewed.elapsed().as_secs_f64());
        });
    }
    // Each read is bounded too: a read that hangs (a half-open connection,
    // a frozen process) must not hold the round, or no probe would run
    // again and the store would stay "ready" while it answers nothing.
    if let Some(Ok(counts)) = within(core.store.count_by_state()).await {
        core.gauges.set(|| {
            for state in crate::store::ALL_STATES {
                let n = counts.get(&state).copied().unwrap_or(0) as f64;
                metrics::gauge!(metric::CALLS, "executor_id" => id.clone(), "state" => state.as_str())
                    .set(n);
            }
        });
    }
    let waiting = CallFilter {
        states: vec![LocalState::ReconciliationRequired],
        ..CallFilter::default()
    };
    if let Some(Ok(calls)) = within(core.store.calls(&waiting)).await {
        // Every served tool, so that a tool whose last call was settled
        // goes back to zero.
        let mut by_tool: BTreeMap<&str, (u64, Duration)> = core
            .tools
            .keys()
            .map(|t| (t.as_str(), (0, Duration::ZERO)))
            .collect();
        for c in &calls {
            let entry = by_tool.entry(c.tool_name.as_str()).or_default();
            entry.0 += 1;
            entry.1 = entry.1.max(age(&c.updated_at));
        }
        core.gauges.set(|| {
            for (tool, (n, oldest)) in by_tool {
                let labels = [("executor_id", id.clone()), ("tool", tool.to_owned())];
                metrics::gauge!(metric::RECONCILIATION, &labels).set(n as f64);
                metrics::gauge!(metric::OLDEST_RECONCILIATION, &labels).set(oldest.as_secs_f64());
            }
        });
        core.health.reconciliation_required(calls.len() as u64);
    }
    if let Some(Ok(outbox)) = within(core.store.outbox_summary()).await {
        let oldest = outbox.oldest.as_ref().map(age);
        core.gauges.set(|| {
            metrics::gauge!(metric::UNDELIVERED, "executor_id" => id.clone())
                .set(outbox.pending as f64);
            metrics::gauge!(metric::OLDEST_UNDELIVERED, "executor_id" => id)
                .set(oldest.unwrap_or_default().as_secs_f64());
        });
        core.health.outbox(outbox.pending, oldest);
    }
}

/// `read`'s answer, if it comes back within [`PROBE_WITHIN`]; else `None`
/// (the next round's probe tells whether the store answers).
async fn within<T>(read: impl std::future::Future<Output = T>) -> Option<T> {
    tokio::time::timeout(PROBE_WITHIN, read).await.ok()
}

/// Tells the health handle how the identity's lease stands, on a database
/// shared by replicas; returns when it was last renewed (`None`: no lease).
pub(crate) fn lease_health(core: &Core) -> Option<std::time::Instant> {
    let renewed = core.lease.renewed_at()?;
    core.health
        .lease(renewed, core.lease.live(), core.cfg.lease_ttl);
    Some(renewed)
}
