//! What the executor tells a tracing backend and a metrics recorder, in
//! one place: the spans of a call (OpenTelemetry's GenAI conventions for a
//! tool execution, through `tracing`, so `tracing-opentelemetry` exports
//! them as they are) and the metrics (`toolrunner_*`, through the `metrics`
//! facade). `docs/operations.md` holds the table of both; the test
//! `telemetry` checks that the scrape and the table agree.
//!
//! Never on a span, an event or a label: arguments, results, the token, a
//! grant. Labels stay bounded: the executor id, the tool, an outcome, a
//! reason, a state; never a run or call id.

use tracing::Span;
use tracing::field::Empty;

use crate::api::handler::Effect;
use crate::store::{LocalCall, LocalState, OutboxReceipt};

/// The span of one call's work in this process: `execute_tool {tool}`,
/// with the GenAI attributes and ours. Its outcome is recorded by
/// [`finish`].
pub(crate) fn call_span(executor_id: &str, call: &LocalCall, effect: Option<Effect>) -> Span {
    let name = format!("execute_tool {}", call.tool_name);
    tracing::info_span!(
        "execute_tool",
        otel.name = name.as_str(),
        otel.status_code = Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = call.tool_name.as_str(),
        gen_ai.tool.call.id = call.call_id.as_str(),
        gen_ai.tool.type = "function",
        toolrunner.run_id = call.run_id.as_str(),
        toolrunner.executor_id = executor_id,
        toolrunner.effect = effect.map_or("unknown", effect_name),
        toolrunner.outcome = Empty,
        error.type = Empty,
    )
}

/// The effect's name on spans.
pub(crate) fn effect_name(effect: Effect) -> &'static str {
    match effect {
        Effect::Read => "read",
        Effect::Write => "write",
        Effect::Transactional => "transactional",
    }
}

/// A span of its own for work on a call outside its first pass (a
/// redelivery, a reconcile check, an operator's action), which may come
/// later or in another process: it carries the same call id.
macro_rules! call_work_span {
    ($name:literal, $executor_id:expr, $run_id:expr, $call_id:expr) => {
        tracing::info_span!(
            $name,
            gen_ai.tool.call.id = $call_id,
            toolrunner.run_id = $run_id,
            toolrunner.executor_id = $executor_id,
            toolrunner.outcome = tracing::field::Empty,
        )
    };
}
pub(crate) use call_work_span;

/// The outcomes that are not a success: a span that ends with one has
/// `error.type`. (`paused` and `waiting` are not: the call's work goes on
/// later; `released` gave a claim back with nothing run.)
const NOT_DONE: [&str; 7] = [
    "failed",
    "cancelled",
    "reconciliation_required",
    "rejected",
    "abandoned",
    "orphaned",
    "interrupted",
];

/// Records how the call's work in this process ended on its span:
/// `toolrunner.outcome`, and for an outcome that is not a success,
/// `error.type` (a failure's code, or the outcome) with an error status
/// for those a person or the model must know of.
pub(crate) fn finish(span: &Span, outcome: &str, error_type: Option<&str>) {
    span.record("toolrunner.outcome", outcome);
    if NOT_DONE.contains(&outcome) {
        span.record("error.type", error_type.unwrap_or(outcome));
        if matches!(
            outcome,
            "failed" | "reconciliation_required" | "rejected" | "interrupted"
        ) {
            span.record("otel.status_code", "ERROR");
        }
    }
}

/// The outcome of a call that reached `state`, with the final receipt
/// this process saved for it, if it did: the receipt's kind
/// (`completed`, `failed`, `cancelled`, …) and, for a failure, its code.
pub(crate) fn outcome_of(
    state: LocalState,
    receipt: Option<&OutboxReceipt>,
) -> (&'static str, Option<String>) {
    match receipt {
        Some(r) if r.kind.is_final() => {
            let code = serde_json::from_str::<serde_json::Value>(&r.body)
                .ok()
                .and_then(|b| b["error"]["code"].as_str().map(str::to_owned));
            (r.kind.as_str(), code)
        }
        _ => (state.as_str(), None),
    }
}

/// The metrics, by name. Their table is in `docs/operations.md`.
pub(crate) mod metric {
    /// Counter: calls whose handler ran, by tool and outcome.
    pub(crate) const TOOL_CALLS: &str = "toolrunner_tool_calls_total";
    /// Histogram (seconds): a handler's run, by tool and outcome.
    pub(crate) const TOOL_DURATION: &str = "toolrunner_tool_execution_duration_seconds";
    /// Histogram (seconds): a claim's round trip, by tool.
    pub(crate) const CLAIM_DURATION: &str = "toolrunner_claim_duration_seconds";
    /// Counter: claims that did not take the call, by reason.
    pub(crate) const CLAIMS_REFUSED: &str = "toolrunner_claims_refused_total";
    /// Gauge: capacity slots in use.
    pub(crate) const CAPACITY_IN_USE: &str = "toolrunner_capacity_in_use";
    /// Gauge: capacity slots free.
    pub(crate) const CAPACITY_AVAILABLE: &str = "toolrunner_capacity_available";
    /// Gauge: a limited tool's slots held in this process, by tool.
    pub(crate) const FLOW_SLOTS_IN_USE: &str = "toolrunner_flow_slots_in_use";
    /// Gauge: a limited tool's concurrency limit, by tool.
    pub(crate) const FLOW_SLOT_LIMIT: &str = "toolrunner_flow_slot_limit";
    /// Gauge: a rate-limited tool's tokens counting in the last second, by
    /// tool.
    pub(crate) const FLOW_TOKENS_IN_USE: &str = "toolrunner_flow_tokens_in_use";
    /// Gauge: a rate-limited tool's rate limit (first `accepted` a second),
    /// by tool.
    pub(crate) const FLOW_RATE_LIMIT: &str = "toolrunner_flow_rate_limit";
    /// Counter: candidates not claimed because their tool was at a limit,
    /// by tool.
    pub(crate) const FLOW_THROTTLED: &str = "toolrunner_flow_throttled_total";
    /// Counter: claims given back for a limit before anything ran (a rate
    /// token that lapsed, a key at its limit), by tool and reason.
    pub(crate) const FLOW_RELEASED: &str = "toolrunner_flow_released_total";
    /// Counter: slots found taken back when given back (another replica
    /// forgot them while this identity's lease looked lapsed: the limit
    /// may have been exceeded), by tool.
    pub(crate) const FLOW_SLOTS_LOST: &str = "toolrunner_flow_slots_lost_total";
    /// Counter: approval requests stored (a call given back to wait for a
    /// person), by tool.
    pub(crate) const APPROVALS_REQUESTED: &str = "toolrunner_approvals_requested_total";
    /// Counter: decisions the executor acted on, by tool and decision
    /// (`approved`, `denied`, `expired`).
    pub(crate) const APPROVALS_DECIDED: &str = "toolrunner_approvals_decided_total";
    /// Histogram (seconds): from a request to the claim that acted on its
    /// decision, by tool.
    pub(crate) const APPROVAL_WAIT: &str = "toolrunner_approval_wait_seconds";
    /// Gauge: receipts saved and not yet acknowledged.
    pub(crate) const UNDELIVERED: &str = "toolrunner_undelivered_receipts";
    /// Gauge (seconds): the oldest of them.
    pub(crate) const OLDEST_UNDELIVERED: &str = "toolrunner_oldest_undelivered_seconds";
    /// Gauge: calls in `reconciliation_required`, by tool.
    pub(crate) const RECONCILIATION: &str = "toolrunner_reconciliation_required";
    /// Gauge (seconds): the oldest of them, by tool.
    pub(crate) const OLDEST_RECONCILIATION: &str = "toolrunner_oldest_reconciliation_seconds";
    /// Counter: lease renewals that failed (a PostgreSQL store).
    pub(crate) const LEASE_RENEWALS_FAILED: &str = "toolrunner_lease_renewals_failed_total";
    /// Gauge (seconds): since the lease's last renewal (a PostgreSQL store).
    pub(crate) const LEASE_AGE: &str = "toolrunner_lease_age_seconds";
    /// Counter: connects after the first (the connection was lost or
    /// superseded).
    pub(crate) const RECONNECTS: &str = "toolrunner_reconnects_total";
    /// Gauge: calls by local state.
    pub(crate) const CALLS: &str = "toolrunner_calls";
    /// Histogram (seconds): a commit of a call's transition.
    pub(crate) const STORE_COMMIT: &str = "toolrunner_store_commit_seconds";
    /// Histogram: calls whose changes shared one transaction.
    pub(crate) const CALLS_PER_COMMIT: &str = "toolrunner_store_calls_per_commit";
    /// Counter: transitions, by event and the state they left the call in.
    pub(crate) const TRANSITIONS: &str = "toolrunner_call_transitions_total";
    /// Counter: delivery attempts of receipts, by kind and outcome.
    pub(crate) const DELIVERIES: &str = "toolrunner_receipt_deliveries_total";
}

/// A handler ran for `seconds` and its outcome is `outcome`.
pub(crate) fn tool_finished(executor_id: &str, tool: &str, outcome: &'static str, seconds: f64) {
    let labels = [
        ("executor_id", executor_id.to_owned()),
        ("tool", tool.to_owned()),
        ("outcome", outcome.to_owned()),
    ];
    metrics::counter!(metric::TOOL_CALLS, &labels).increment(1);
    metrics::histogram!(metric::TOOL_DURATION, &labels).record(seconds);
}

/// A claim was answered after `seconds`.
pub(crate) fn claim_answered(executor_id: &str, tool: &str, seconds: f64) {
    metrics::histogram!(metric::CLAIM_DURATION, "executor_id" => executor_id.to_owned(), "tool" => tool.to_owned())
        .record(seconds);
}

/// A claim did not take the call: `reason` is the platform's error code,
/// or `unreachable`.
pub(crate) fn claim_refused(executor_id: &str, reason: &str) {
    metrics::counter!(metric::CLAIMS_REFUSED, "executor_id" => executor_id.to_owned(), "reason" => reason.to_owned())
        .increment(1);
}

/// A candidate of `tool` was not claimed: the tool is at a limit.
pub(crate) fn flow_throttled(executor_id: &str, tool: &str) {
    metrics::counter!(metric::FLOW_THROTTLED, "executor_id" => executor_id.to_owned(), "tool" => tool.to_owned())
        .increment(1);
}

/// A claim of `tool` was given back for a limit (`reason`: `rate_lapsed`,
/// `key_limited`).
pub(crate) fn flow_released(executor_id: &str, tool: &str, reason: &'static str) {
    metrics::counter!(metric::FLOW_RELEASED, "executor_id" => executor_id.to_owned(), "tool" => tool.to_owned(), "reason" => reason)
        .increment(1);
}

/// An approval request of `tool` was stored.
pub(crate) fn approval_requested(executor_id: &str, tool: &str) {
    metrics::counter!(metric::APPROVALS_REQUESTED, "executor_id" => executor_id.to_owned(), "tool" => tool.to_owned())
        .increment(1);
}

/// The executor acted on a decision about a request of `tool`, asked
/// `waited` seconds before.
pub(crate) fn approval_decided(executor_id: &str, tool: &str, decision: &'static str, waited: f64) {
    metrics::counter!(metric::APPROVALS_DECIDED, "executor_id" => executor_id.to_owned(), "tool" => tool.to_owned(), "decision" => decision)
        .increment(1);
    metrics::histogram!(metric::APPROVAL_WAIT, "executor_id" => executor_id.to_owned(), "tool" => tool.to_owned())
        .record(waited);
}

/// The decisions [`approval_decided`] counts.
pub(crate) const APPROVAL_DECISIONS: [&str; 3] = ["approved", "denied", "expired"];

/// A slot of `tool` was found taken back when given back.
pub(crate) fn flow_slot_lost(tool: &str) {
    metrics::counter!(metric::FLOW_SLOTS_LOST, "tool" => tool.to_owned()).increment(1);
}

/// A lease renewal failed.
#[cfg_attr(not(feature = "postgres"), allow(dead_code))]
pub(crate) fn lease_renewal_failed(executor_id: &str) {
    metrics::counter!(metric::LEASE_RENEWALS_FAILED, "executor_id" => executor_id.to_owned())
        .increment(1);
}

/// A connect after the first.
pub(crate) fn reconnected(executor_id: &str) {
    metrics::counter!(metric::RECONNECTS, "executor_id" => executor_id.to_owned()).increment(1);
}

/// How a handler's run ends on the tool metrics (`outcome`): its final
/// receipt's kind, or the outcome unknown.
pub(crate) const TOOL_OUTCOMES: [&str; 4] = [
    "completed",
    "failed",
    "cancelled",
    "reconciliation_required",
];

/// The platform's error codes a refused claim is counted by (`reason`);
/// any other code is `other`.
pub(crate) const REFUSAL_CODES: [&str; 11] = [
    "unknown_call",
    "connection_superseded",
    "lease_expired",
    "tool_not_connected",
    "run_terminated",
    "executor_draining",
    "already_claimed",
    "call_not_claimable",
    "capacity_exhausted",
    "missing_scope",
    "invalid_request",
];

/// The other reasons of a refused claim: the call was pending again or
/// had ended, the request was not sent or not answered, a `404`, a `401`,
/// anything else.
const OTHER_REFUSALS: [&str; 7] = [
    "pending",
    "call_ended",
    "unreachable",
    "lease_not_live",
    "not_found",
    "unauthorized",
    "other",
];

/// The receipts the outbox sends (`kind`) and how a delivery ends
/// (`outcome`).
const DELIVERED_KINDS: [&str; 4] = ["progress", "completed", "failed", "cancelled"];
const DELIVERY_OUTCOMES: [&str; 4] = ["delivered", "unreachable", "not_found", "refused"];

/// Describes every metric family (its help text and unit) to the recorder.
fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        metric::TOOL_CALLS,
        "calls whose handler ran, by tool and outcome"
    );
    describe_histogram!(
        metric::TOOL_DURATION,
        Unit::Seconds,
        "a handler's run, by tool and outcome"
    );
    describe_histogram!(
        metric::CLAIM_DURATION,
        Unit::Seconds,
        "a claim's round trip, by tool"
    );
    describe_counter!(
        metric::CLAIMS_REFUSED,
        "claims that did not take the call, by reason"
    );
    describe_counter!(
        metric::APPROVALS_REQUESTED,
        "approval requests stored (calls given back to wait for a person), by tool"
    );
    describe_counter!(
        metric::APPROVALS_DECIDED,
        "decisions the executor acted on, by tool and decision"
    );
    describe_histogram!(
        metric::APPROVAL_WAIT,
        Unit::Seconds,
        "from an approval request to the claim that acted on its decision, by tool"
    );
    describe_gauge!(metric::CAPACITY_IN_USE, "capacity slots in use");
    describe_gauge!(metric::CAPACITY_AVAILABLE, "capacity slots free");
    describe_gauge!(
        metric::FLOW_SLOTS_IN_USE,
        "a limited tool's slots held in this process, by tool"
    );
    describe_gauge!(
        metric::FLOW_SLOT_LIMIT,
        "a limited tool's concurrency limit, by tool"
    );
    describe_gauge!(
        metric::FLOW_TOKENS_IN_USE,
        "a rate-limited tool's tokens counting now (reserved, sending, or sent in the last second), by tool"
    );
    describe_gauge!(
        metric::FLOW_RATE_LIMIT,
        "a rate-limited tool's limit of first accepted a second, by tool"
    );
    describe_counter!(
        metric::FLOW_THROTTLED,
        "candidates not claimed because their tool was at a concurrency or rate limit, by tool"
    );
    describe_counter!(
        metric::FLOW_RELEASED,
        "claims given back for a limit before anything ran, by tool and reason"
    );
    describe_counter!(
        metric::FLOW_SLOTS_LOST,
        "slots another replica took back while this identity's lease looked lapsed (the concurrency limit may have been exceeded), by tool"
    );
    describe_gauge!(
        metric::UNDELIVERED,
        "receipts saved and not yet acknowledged by the platform"
    );
    describe_gauge!(
        metric::OLDEST_UNDELIVERED,
        Unit::Seconds,
        "the age of the oldest receipt not yet acknowledged"
    );
    describe_gauge!(
        metric::RECONCILIATION,
        "calls in reconciliation_required, by tool"
    );
    describe_gauge!(
        metric::OLDEST_RECONCILIATION,
        Unit::Seconds,
        "the age of the oldest call in reconciliation_required, by tool"
    );
    describe_counter!(
        metric::LEASE_RENEWALS_FAILED,
        "lease renewals that failed (a PostgreSQL store)"
    );
    describe_gauge!(
        metric::LEASE_AGE,
        Unit::Seconds,
        "time since the lease's last renewal (a PostgreSQL store)"
    );
    describe_counter!(
        metric::RECONNECTS,
        "connects after the first (the connection was lost or superseded)"
    );
    describe_histogram!(
        metric::STORE_COMMIT,
        Unit::Seconds,
        "a commit of a call's transition to the store"
    );
    describe_histogram!(
        metric::CALLS_PER_COMMIT,
        "calls whose changes shared one store transaction (group commit)"
    );
    describe_gauge!(metric::CALLS, "calls by local state");
    describe_counter!(
        metric::TRANSITIONS,
        "transitions of calls, by event and the state they left the call in"
    );
    describe_counter!(
        metric::DELIVERIES,
        "delivery attempts of receipts, by kind and outcome"
    );
}

/// Every family of the table from the start, before its first event, so
/// that an alert or a `rate()` has a series at once: described, the
/// counters at zero for each tool (and each outcome, reason, event and
/// kind), the histograms registered empty. (The gauges are published
/// before the executor's start returns.)
pub(crate) fn zero<'t>(executor_id: &str, tools: impl IntoIterator<Item = &'t str>, lease: bool) {
    describe();
    let id = || executor_id.to_owned();
    metrics::counter!(metric::RECONNECTS, "executor_id" => id()).increment(0);
    if lease {
        metrics::counter!(metric::LEASE_RENEWALS_FAILED, "executor_id" => id()).increment(0);
    }
    for tool in tools {
        for outcome in TOOL_OUTCOMES {
            let labels = [
                ("executor_id", id()),
                ("tool", tool.to_owned()),
                ("outcome", outcome.to_owned()),
            ];
            metrics::counter!(metric::TOOL_CALLS, &labels).increment(0);
            let _ = metrics::histogram!(metric::TOOL_DURATION, &labels);
        }
        let _ = metrics::histogram!(metric::CLAIM_DURATION, "executor_id" => id(), "tool" => tool.to_owned());
        metrics::counter!(metric::FLOW_THROTTLED, "executor_id" => id(), "tool" => tool.to_owned())
            .increment(0);
        for reason in ["rate_lapsed", "key_limited"] {
            metrics::counter!(metric::FLOW_RELEASED, "executor_id" => id(), "tool" => tool.to_owned(), "reason" => reason)
                .increment(0);
        }
        metrics::counter!(metric::FLOW_SLOTS_LOST, "tool" => tool.to_owned()).increment(0);
        metrics::counter!(metric::APPROVALS_REQUESTED, "executor_id" => id(), "tool" => tool.to_owned())
            .increment(0);
        for decision in APPROVAL_DECISIONS {
            metrics::counter!(metric::APPROVALS_DECIDED, "executor_id" => id(), "tool" => tool.to_owned(), "decision" => decision)
                .increment(0);
        }
        let _ = metrics::histogram!(metric::APPROVAL_WAIT, "executor_id" => id(), "tool" => tool.to_owned());
    }
    for reason in REFUSAL_CODES.iter().chain(&OTHER_REFUSALS) {
        metrics::counter!(metric::CLAIMS_REFUSED, "executor_id" => id(), "reason" => *reason)
            .increment(0);
    }
    for kind in DELIVERED_KINDS {
        for outcome in DELIVERY_OUTCOMES {
            metrics::counter!(metric::DELIVERIES, "executor_id" => id(), "kind" => kind, "outcome" => outcome)
                .increment(0);
        }
    }
    for (event, state) in crate::lifecycle::transitions() {
        metrics::counter!(metric::TRANSITIONS, "executor_id" => id(), "event" => event, "state" => state.as_str())
            .increment(0);
    }
    let _ = metrics::histogram!(metric::STORE_COMMIT, "executor_id" => id());
    let _ = metrics::histogram!(metric::CALLS_PER_COMMIT);
}
