//! The transition table, written once: from which states each event is
//! allowed, and where it leads.

use super::*;

/// Where a transition leads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum To {
    /// The call stays in its state (only other columns change).
    Same,
    /// The call enters this state.
    State(LocalState),
}

/// One row of the transition table.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rule {
    /// The event's name.
    pub(crate) event: &'static str,
    /// The states it may happen in; empty: a call the store does not hold yet.
    pub(crate) from: &'static [LocalState],
    /// Where it leads.
    pub(crate) to: To,
    /// What it writes besides the row: receipts, reports, timeline.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))] // the docs' table (testing seam)
    pub(crate) writes: &'static str,
}

pub(super) const NEW: &[LocalState] = &[];
pub(super) const REPORTING: &[LocalState] = &[ReconciliationRequired, Settled, Abandoned, Released];

/// Every allowed transition. A transition not listed here is refused.
///
/// Besides what each row writes, every transition into a state other than
/// `assigned` or `claiming` marks a still `pending` `accepted` of the call
/// `superseded` (an `accepted` is sent only by the accept step, while its
/// call waits for the answer), and every change of state adds a timeline
/// entry named after the new state.
pub(crate) const TABLE: &[Rule] = &[
    Rule {
        event: "discovered",
        from: NEW,
        to: To::State(Claiming),
        writes: "attempt: a new random operation key, saved before the claim is sent",
    },
    Rule {
        event: "retried",
        from: &[Abandoned, Released],
        to: To::State(Claiming),
        writes: "attempt: a new operation key (the call is pending again); report cleared",
    },
    Rule {
        event: "claim_refused",
        from: &[Claiming],
        to: To::State(Abandoned),
        writes: "reason; nothing ran",
    },
    Rule {
        event: "claim_answered",
        from: &[Claiming],
        to: To::State(Assigned),
        writes: "assignment; attempt (key, assignment); a replaced assignment's pending receipts superseded and the sequence reset",
    },
    Rule {
        event: "claim_found_running",
        from: &[Claiming],
        to: To::State(ReconciliationRequired),
        writes: "assignment; next sequence at least 1 (the platform holds `accepted`); report `reconciliation_required` if the platform says running",
    },
    Rule {
        event: "claim_found_ended",
        from: &[Claiming],
        to: To::State(Abandoned),
        writes: "assignment; nothing ran here",
    },
    Rule {
        event: "claim_returned_refused",
        from: &[Claiming],
        to: To::State(Abandoned),
        writes: "report `released`: the platform kept an assignment whose `accepted` it refused; give it back",
    },
    Rule {
        event: "refused_before_start",
        from: &[Assigned],
        to: To::State(Settled),
        writes: "final `failed` at sequence 0 (`invalid_arguments`, `digest_mismatch`, `forbidden`)",
    },
    Rule {
        event: "rate_lapsed",
        from: &[Assigned],
        to: To::State(Released),
        writes: "report `released`: the tool's rate token lapsed before `accepted` was saved; nothing ran (claimed again, with a new key, once pending)",
    },
    Rule {
        event: "key_limited",
        from: &[Assigned],
        to: To::State(Released),
        writes: "report `released`: the call's concurrency key was at its limit; nothing ran (claimed again, with a new key, once pending and woken by a slot of its key coming back here, or once a back-off has passed and, on a store of one process, its key has a slot free)",
    },
    Rule {
        event: "approval_asked",
        from: &[Assigned],
        to: To::State(Released),
        writes: "report `released`: the product asked for a person's approval, stored first as a request of the run, the call and the arguments' digest; nothing ran (claimed again, with a new key, once a person decided or the request expired)",
    },
    Rule {
        event: "accepted_saved",
        from: &[Assigned],
        to: To::Same,
        writes: "receipt `accepted` at sequence 0",
    },
    Rule {
        event: "accept_confirmed",
        from: &[Assigned],
        to: To::State(Running),
        writes: "`accepted` delivered: side effects may start",
    },
    Rule {
        event: "accept_refused_pending",
        from: &[Assigned],
        to: To::State(Claiming),
        writes: "`accepted` rejected; claim again with the same key (the call may be pending again)",
    },
    Rule {
        event: "accept_refused",
        from: &[Assigned],
        to: To::State(Abandoned),
        writes: "`accepted` rejected; nothing ran",
    },
    Rule {
        event: "accept_found_reconciling",
        from: &[Assigned],
        to: To::State(Running),
        writes: "`accepted` delivered: a replay answered false with the call `reconciliation_required` (the platform confirmed it once, the answer was lost, and another store of this executor id reported the call since); resumed as after a crash, never started as confirmed",
    },
    Rule {
        event: "claim_lapsed",
        from: &[Assigned],
        to: To::State(Claiming),
        writes: "reason (the claim lapsed while away; the claim's answer decides about the saved `accepted`)",
    },
    Rule {
        event: "progress_saved",
        from: &[Running, ReconciliationRequired],
        to: To::Same,
        writes: "receipt `progress` at the next sequence",
    },
    Rule {
        event: "handler_finished",
        from: &[Running],
        to: To::State(Settled),
        writes: "final receipt (`completed`, `failed`, `cancelled`) at the next sequence",
    },
    Rule {
        event: "outcome_unknown",
        from: &[Running],
        to: To::State(ReconciliationRequired),
        writes: "report `reconciliation_required`; the evidence (a refused output) in the timeline",
    },
    Rule {
        event: "delivered",
        from: &[Settled],
        to: To::State(Delivered),
        writes: "final receipt delivered; report cleared",
    },
    Rule {
        event: "delivery_deferred",
        from: &[Settled],
        to: To::Same,
        writes: "report `pending_delivery`",
    },
    Rule {
        event: "final_refused_nothing_ran",
        from: &[Settled],
        to: To::State(Abandoned),
        writes: "the sequence-0 `failed` rejected: nothing ran",
    },
    Rule {
        event: "final_rejected",
        from: &[Settled],
        to: To::State(Rejected),
        writes: "final receipt rejected (`run_terminated`, `call_already_terminal`): compensation may be due",
    },
    Rule {
        event: "final_orphaned",
        from: &[Settled],
        to: To::State(Orphaned),
        writes: "final receipt orphaned (`404`)",
    },
    Rule {
        event: "final_refused",
        from: &[Settled],
        to: To::State(ReconciliationRequired),
        writes: "final receipt rejected (`400`, `413`, conflicts); report `reconciliation_required`",
    },
    Rule {
        event: "reported",
        from: REPORTING,
        to: To::Same,
        writes: "report cleared (the platform answered it)",
    },
    Rule {
        event: "unknown_to_platform",
        from: REPORTING,
        to: To::State(Orphaned),
        writes: "report cleared; pending receipts orphaned; from `reconciliation_required`, the outcome stays unknown (timeline `orphaned_outcome_unknown`: kept until an operator closes it)",
    },
    Rule {
        event: "give_back",
        from: &[Abandoned, Released],
        to: To::Same,
        writes: "report `released` (the platform still holds a claim that settled here)",
    },
    Rule {
        event: "outstanding_claimed",
        from: NEW,
        to: To::State(Released),
        writes: "report `released` (a claim this store never saw: never executed)",
    },
    Rule {
        event: "outstanding_running",
        from: NEW,
        to: To::State(Abandoned),
        writes: "report `reconciliation_required`, reason `unknown_to_executor` (nothing ran from this store, and nothing here can act on it: no assignment)",
    },
    Rule {
        event: "outstanding_reconciling",
        from: NEW,
        to: To::State(Abandoned),
        writes: "reason `unknown_to_executor` (nothing ran from this store, and nothing here can act on it: no assignment)",
    },
    Rule {
        event: "hook_happened",
        from: &[ReconciliationRequired],
        to: To::State(Settled),
        writes: "final `completed` with the hook's result",
    },
    Rule {
        event: "hook_did_not_happen",
        from: &[ReconciliationRequired],
        to: To::State(Settled),
        writes: "final `failed` with code `not_performed`",
    },
    Rule {
        event: "hook_rerun",
        from: &[ReconciliationRequired],
        to: To::State(Running),
        writes: "only if this assignment's `accepted` was confirmed here; report cleared",
    },
    Rule {
        event: "hook_run_cancelled",
        from: &[ReconciliationRequired],
        to: To::State(Abandoned),
        writes: "report cleared: it did not happen and the run was cancelled, nothing to send",
    },
    Rule {
        event: "hook_run_forgotten",
        from: &[ReconciliationRequired],
        to: To::State(Orphaned),
        writes: "report cleared; pending receipts orphaned: it did not happen, and the platform no longer knows the run (`400 unknown_call` before a re-run); the outcome is known (nothing ran), so no person is needed",
    },
    Rule {
        event: "transactional_ended",
        from: &[Running],
        to: To::State(Abandoned),
        writes: "report cleared: a transactional call whose writes never committed, ended by the platform while its handler was not running (no longer outstanding, or its run cancelled): nothing ran, nothing to send",
    },
    Rule {
        event: "transactional_forgotten",
        from: &[Running],
        to: To::State(Orphaned),
        writes: "report cleared; pending receipts orphaned: a transactional call whose writes never committed, whose run the platform no longer knows (`404`, `400 unknown_call` on its replayed claim); the outcome is known (nothing ran), so no person is needed",
    },
    Rule {
        event: "operator_closed",
        from: &[Orphaned],
        to: To::Same,
        writes: "only an orphaned call whose outcome was unknown: the operator's evidence in the timeline (`operator_closed`); nothing is sent (the platform no longer knows the call), and retention may prune it",
    },
    Rule {
        event: "operator_resolved",
        from: &[ReconciliationRequired, Rejected],
        to: To::State(Settled),
        writes: "final receipt with a new id; the operator's evidence in the timeline",
    },
    Rule {
        event: "operator_compensated",
        from: &[Rejected],
        to: To::State(Compensated),
        writes: "the operator's evidence in the timeline",
    },
];

/// Every `(event, state the call is left in)` the table allows: the
/// series of the transitions counter, registered at start.
pub(crate) fn transitions() -> impl Iterator<Item = (&'static str, LocalState)> {
    TABLE.iter().flat_map(|r| {
        let states: &'static [LocalState] = match &r.to {
            To::State(s) => std::slice::from_ref(s),
            To::Same => r.from,
        };
        states.iter().map(move |s| (r.event, *s))
    })
}

/// The table's row for an event.
pub(crate) fn rule(event: &str) -> Option<&'static Rule> {
    TABLE.iter().find(|r| r.event == event)
}

/// The table as Markdown, followed by a Mermaid state diagram: the text
/// `docs/architecture.md` carries between its lifecycle markers.
#[cfg(feature = "testing")]
pub(crate) fn table_markdown() -> String {
    let mut out = String::from("| event | from | to | also writes |\n|---|---|---|---|\n");
    for r in TABLE {
        let from = if r.from.is_empty() {
            "(not stored yet)".to_owned()
        } else {
            r.from
                .iter()
                .map(|s| format!("`{}`", s.as_str()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let to = match r.to {
            To::Same => "(same)".to_owned(),
            To::State(s) => format!("`{}`", s.as_str()),
        };
        out.push_str(&format!(
            "| `{}` | {from} | {to} | {} |\n",
            r.event, r.writes
        ));
    }
    out.push_str("\n```mermaid\nstateDiagram-v2\n");
    for r in TABLE {
        let to = match r.to {
            To::Same => continue,
            To::State(s) => s.as_str(),
        };
        if r.from.is_empty() {
            out.push_str(&format!("    [*] --> {to}: {}\n", r.event));
        }
        for f in r.from {
            out.push_str(&format!("    {} --> {to}: {}\n", f.as_str(), r.event));
        }
    }
    out.push_str("```\n");
    out
}
