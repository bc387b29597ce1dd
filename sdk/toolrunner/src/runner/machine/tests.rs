//! The machine's table tests: each states its inputs and the full
//! decision expected, one per row of the contract's "what the executor
//! does with each answer" (protocol §6) and of its crash table.
use serde_json::json;
use toolrunner_protocol::wire::{Assignment, CallState, Claimed, ReceiptAnswer, ReceiptKind};

use super::accept::{OnAccepted, OnSaved, Saved};
use super::claim::OnClaim;
use super::deliver::{Mark, OnDelivery};
use super::resume::{Again, OnRunning, StillRuns};
use super::step::Step;
use super::{Pause, Reply, accept, claim, deliver, resume, step};
use crate::api::handler::Effect;
use crate::lifecycle::Event;
use crate::store::LocalState;

fn assignment() -> Assignment {
    serde_json::from_value(json!({
        "assignment_id": "asg_1", "run_id": "run_1", "call_id": "call_1", "tool_name": "t",
        "arguments": {}, "arguments_digest": "sha256:x", "grant": "grt_secret",
        "subject": "s", "agent_id": "agt_1", "agent_version": "agv_1", "binding_id": "bnd_1",
        "max_result_context_bytes": 16384, "input_schema": {"type": "object"}
    }))
    .expect("an assignment")
}

fn claimed(replayed: bool, call_state: CallState) -> Claimed {
    Claimed {
        replayed,
        call_state,
        assignment: assignment(),
    }
}

fn receipt_answer(replayed: bool, call_state: CallState, accepted: Option<bool>) -> ReceiptAnswer {
    ReceiptAnswer {
        receipt_id: "rcp_1".into(),
        replayed,
        call_state,
        accepted,
    }
}

fn refused<'a, T>(status: u16, code: &str) -> Reply<&'a T> {
    Reply::refused(status, code)
}

fn unreachable<'a, T>() -> Reply<&'a T> {
    Reply::Unreachable("POST /v1/…: 503 after 5 attempts".into())
}

fn final_reply(reply: &Reply<&ReceiptAnswer>) -> OnDelivery {
    deliver::on_reply(reply, ReceiptKind::Completed, 1, "rcp_1")
}

fn progress_reply(reply: &Reply<&ReceiptAnswer>) -> OnDelivery {
    deliver::on_reply(reply, ReceiptKind::Progress, 1, "rcp_1")
}

// What the executor does with each answer.

/// any | `429`, `5xx`, timeout, connection lost | retried with backoff (by
/// the client, the same bytes); no verdict after the retries: the call
/// waits, its key, its `accepted`, its receipt kept.
#[test]
fn answer_any_unreachable_waits() {
    let m = "POST /v1/…: 503 after 5 attempts".to_owned();
    assert_eq!(
        claim::on_reply(&unreachable()),
        OnClaim::Wait(Pause::Waits(m.clone()))
    );
    assert_eq!(
        accept::on_reply(&unreachable(), "rcp_1"),
        OnAccepted::Wait(Pause::Waits(m))
    );
    assert_eq!(
        final_reply(&unreachable()),
        OnDelivery::Later { defer: true }
    );
    assert_eq!(
        progress_reply(&unreachable()),
        OnDelivery::Later { defer: false }
    );
    // Not sent at all (the lease is not live): the same, said so.
    assert_eq!(
        claim::on_reply(&Reply::NotSent),
        OnClaim::Wait(Pause::LeaseNotLive)
    );
    assert_eq!(
        accept::on_reply(&Reply::NotSent, "rcp_1"),
        OnAccepted::Wait(Pause::LeaseNotLive)
    );
}

/// any | `401`, `403 missing_scope` | keep everything, stop claiming,
/// surface a configuration error.
#[test]
fn answer_any_unauthorized_keeps_everything() {
    for (status, code) in [(401, "unauthorized"), (403, "missing_scope")] {
        assert_eq!(
            claim::on_reply(&refused(status, code)),
            OnClaim::Configuration(Pause::Waits(format!("{status} {code}")))
        );
        assert_eq!(
            accept::on_reply(&refused(status, code), "rcp_1"),
            OnAccepted::Configuration(Pause::Waits(format!("{status} {code}")))
        );
        assert_eq!(
            final_reply(&refused(status, code)),
            OnDelivery::Later { defer: false }
        );
        assert_eq!(
            progress_reply(&refused(status, code)),
            OnDelivery::Later { defer: false }
        );
    }
}

/// any | `409 lease_expired` | connect again, then continue (the
/// connection reconnects and the request is asked again; a claim still
/// refused so waits with its key).
#[test]
fn answer_any_lease_expired_waits_for_a_new_connection() {
    assert_eq!(
        claim::on_reply(&refused(409, "lease_expired")),
        OnClaim::Wait(Pause::Waits("409 lease_expired".into()))
    );
}

/// any | `409 connection_superseded` | own instance: connect again;
/// another: stop claiming (the connection decides which); a claim waits.
#[test]
fn answer_any_connection_superseded_waits() {
    assert_eq!(
        claim::on_reply(&refused(409, "connection_superseded")),
        OnClaim::Wait(Pause::Waits("409 connection_superseded".into()))
    );
}

/// claim | `replayed: true` or a new assignment | save the assignment
/// (replacing a released one), continue.
#[test]
fn answer_claim_assignment_is_saved() {
    for replayed in [false, true] {
        let c = claimed(replayed, CallState::Claimed);
        assert_eq!(claim::on_reply(&Reply::Answered(&c)), OnClaim::Record);
        assert_eq!(
            claim::answered(&c, false),
            Event::ClaimAnswered {
                assignment: assignment()
            }
        );
    }
    // A claim that returns an assignment whose `accepted` was refused:
    // nothing may start on it.
    assert_eq!(
        claim::answered(&claimed(true, CallState::Claimed), true),
        Event::ClaimReturnedRefused {
            assignment: assignment()
        }
    );
    // Replayed while the call already runs, or after it ended.
    assert_eq!(
        claim::answered(&claimed(true, CallState::Running), false),
        Event::ClaimFoundRunning {
            assignment: assignment(),
            platform: CallState::Running
        }
    );
    assert_eq!(
        claim::answered(&claimed(true, CallState::Cancelled), false),
        Event::ClaimFoundEnded {
            assignment: assignment(),
            platform: CallState::Cancelled
        }
    );
}

/// claim | `409 already_claimed`, `call_not_claimable`, `run_terminated`,
/// `400`, `403`, `404` | settle locally `abandoned`; nothing ran.
#[test]
fn answer_claim_refused_abandons() {
    for (status, code) in [
        (409, "already_claimed"),
        (409, "call_not_claimable"),
        (409, "run_terminated"),
        (400, "invalid_request"),
        (403, "forbidden"),
        (404, "not_found"),
    ] {
        assert_eq!(
            claim::on_reply(&refused(status, code)),
            OnClaim::Refused(Event::ClaimRefused {
                why: format!("claim refused, nothing ran: {status} {code}")
            })
        );
    }
    // A claim answered `pending`: nothing ran either.
    assert_eq!(
        claim::answered(&claimed(false, CallState::Pending), false),
        Event::ClaimRefused {
            why: "the claim came back pending: nothing ran".into()
        }
    );
}

/// claim | `409 capacity_exhausted`, `executor_draining` | keep the key,
/// try later.
#[test]
fn answer_claim_capacity_defers() {
    for code in ["capacity_exhausted", "executor_draining"] {
        assert_eq!(
            claim::on_reply(&refused(409, code)),
            OnClaim::Wait(Pause::Deferred(format!("409 {code}")))
        );
    }
}

/// `accepted` | `accepted: true` (new or replayed) | run the handler.
#[test]
fn answer_accepted_true_runs_the_handler() {
    for replayed in [false, true] {
        let a = receipt_answer(replayed, CallState::Running, Some(true));
        assert_eq!(
            accept::on_reply(&Reply::Answered(&a), "rcp_1"),
            OnAccepted::Confirmed(Event::AcceptConfirmed {
                receipt_id: "rcp_1".into()
            })
        );
    }
}

/// `accepted` | `accepted: false`, `403 invalid_grant`, `409` | nothing
/// may start: re-claim with the same key if the call may be `pending`
/// again, else `abandoned`.
#[test]
fn answer_accepted_refused_starts_nothing() {
    let pending = receipt_answer(false, CallState::Pending, Some(false));
    assert_eq!(
        accept::on_reply(&Reply::Answered(&pending), "rcp_1"),
        OnAccepted::Record(Event::AcceptRefusedPending {
            receipt_id: "rcp_1".into(),
            why: "accepted answered false (call pending)".into()
        })
    );
    let ended = receipt_answer(false, CallState::Cancelled, Some(false));
    assert_eq!(
        accept::on_reply(&Reply::Answered(&ended), "rcp_1"),
        OnAccepted::Record(Event::AcceptRefused {
            receipt_id: "rcp_1".into(),
            why: "accepted answered false (call cancelled)".into()
        })
    );
    assert_eq!(
        accept::on_reply(&refused(403, "invalid_grant"), "rcp_1"),
        OnAccepted::Record(Event::AcceptRefusedPending {
            receipt_id: "rcp_1".into(),
            why: "accepted refused: 403 invalid_grant".into()
        })
    );
    assert_eq!(
        accept::on_reply(&refused(409, "run_terminated"), "rcp_1"),
        OnAccepted::Record(Event::AcceptRefused {
            receipt_id: "rcp_1".into(),
            why: "accepted refused: 409 run_terminated".into()
        })
    );
    // A replay answered false while the platform holds the call
    // `reconciliation_required`: confirmed once, its answer lost; resumed
    // as after a crash (docs/protocol.md, choice 76), never `abandoned`.
    let reconciling = receipt_answer(true, CallState::ReconciliationRequired, Some(false));
    assert_eq!(
        accept::on_reply(&Reply::Answered(&reconciling), "rcp_1"),
        OnAccepted::Record(Event::AcceptFoundReconciling {
            receipt_id: "rcp_1".into()
        })
    );
}

/// final | `200` (new or replayed) | delivered.
#[test]
fn answer_final_200_is_delivered() {
    for replayed in [false, true] {
        let a = receipt_answer(replayed, CallState::Completed, None);
        assert_eq!(
            final_reply(&Reply::Answered(&a)),
            OnDelivery::Settle(Event::Delivered {
                receipt_id: "rcp_1".into()
            })
        );
        assert_eq!(
            progress_reply(&Reply::Answered(&a)),
            OnDelivery::Mark(Mark::Delivered)
        );
    }
}

/// final | `409 run_terminated`, `call_already_terminal` | `rejected`
/// (compensation may be due); a progress receipt answered so is dropped.
#[test]
fn answer_final_terminal_is_rejected() {
    for code in ["run_terminated", "call_already_terminal"] {
        assert_eq!(
            final_reply(&refused(409, code)),
            OnDelivery::Settle(Event::FinalRejected {
                receipt_id: "rcp_1".into(),
                error: format!("409 {code}")
            })
        );
        assert_eq!(
            progress_reply(&refused(409, code)),
            OnDelivery::Mark(Mark::Rejected)
        );
    }
}

/// final | `400`, `413`, `409 receipt_conflict`, `sequence_conflict` |
/// `rejected`, report `reconciliation_required`.
#[test]
fn answer_final_conflict_is_refused_and_reported() {
    for (status, code) in [
        (400, "invalid_request"),
        (413, "payload_too_large"),
        (409, "receipt_conflict"),
        (409, "sequence_conflict"),
    ] {
        assert_eq!(
            final_reply(&refused(status, code)),
            OnDelivery::Settle(Event::FinalRefused {
                receipt_id: "rcp_1".into(),
                error: format!("{status} {code}")
            })
        );
    }
    // A sequence-0 `failed` (refused before start) leaves nothing unknown.
    assert_eq!(
        deliver::on_reply(
            &refused(400, "invalid_request"),
            ReceiptKind::Failed,
            0,
            "rcp_1"
        ),
        OnDelivery::Settle(Event::FinalRefusedNothingRan {
            receipt_id: "rcp_1".into(),
            error: "400 invalid_request".into()
        })
    );
}

/// final | `404` | `orphaned` (the platform no longer knows the run); no
/// retry.
#[test]
fn answer_final_404_is_orphaned() {
    assert_eq!(
        final_reply(&refused(404, "not_found")),
        OnDelivery::Settle(Event::FinalOrphaned {
            receipt_id: "rcp_1".into(),
            error: "404 not_found".into()
        })
    );
}

// The crash table: the process lost after each point, restarted.

/// operation key saved, claim not answered | claim again with the same
/// key: `replayed: true` resumes, a new assignment replaces nothing;
/// `409` means nothing ran: settle as `abandoned`.
#[test]
fn crash_after_the_key_claims_again() {
    assert_eq!(step::next(LocalState::Claiming, false), Step::Claim);
    let replayed = claimed(true, CallState::Claimed);
    assert_eq!(
        claim::on_reply(&Reply::Answered(&replayed)),
        OnClaim::Record
    );
    assert_eq!(
        claim::answered(&replayed, false),
        Event::ClaimAnswered {
            assignment: assignment()
        }
    );
    assert_eq!(
        claim::on_reply(&refused(409, "already_claimed")),
        OnClaim::Refused(Event::ClaimRefused {
            why: "claim refused, nothing ran: 409 already_claimed".into()
        })
    );
}

/// assignment saved, `accepted` not confirmed | resend the saved
/// `accepted` (same `receipt_id`); no side effect has run.
#[test]
fn crash_after_the_assignment_resends_the_accepted() {
    assert_eq!(step::next(LocalState::Assigned, false), Step::Accept);
    assert_eq!(accept::on_saved(&Saved::Sendable), OnSaved::Send);
    assert_eq!(accept::on_saved(&Saved::None), OnSaved::CheckThenSave);
    // One refused before is never sent again: the claim decides.
    assert_eq!(
        accept::on_saved(&Saved::Spent {
            receipt_id: "rcp_1".into(),
            status: "rejected".into()
        }),
        OnSaved::Reclaim(Event::AcceptRefusedPending {
            receipt_id: "rcp_1".into(),
            why: "the saved accepted is rejected".into()
        })
    );
}

/// `accepted` confirmed, no final receipt saved | write tool:
/// `reconciliation_required` (report it); read tool: run again.
#[test]
fn crash_after_accepted_write_is_unknown_read_runs_again() {
    assert_eq!(step::next(LocalState::Running, false), Step::Run);
    let unknown = OnRunning::Settle(Event::OutcomeUnknown {
        why: "the process stopped after accepted: the outcome is unknown".into(),
        evidence: None,
    });
    if !resume::PLANTED_RERUN {
        assert_eq!(resume::on_running(Some(Effect::Write), true), unknown);
    }
    assert_eq!(resume::on_running(Some(Effect::Read), true), OnRunning::Run);
    // Started by this task's own confirmation: it runs.
    assert_eq!(
        resume::on_running(Some(Effect::Write), false),
        OnRunning::Run
    );
    // A tool this executor does not serve: unknown, never run.
    assert_eq!(
        resume::on_running(None, false),
        OnRunning::Settle(Event::OutcomeUnknown {
            why: "running call of a tool this executor does not serve".into(),
            evidence: None,
        })
    );
    // A transactional tool (none of its writes committed): again only on a
    // live lease, not cancelled, and while the platform says it runs.
    assert_eq!(
        resume::on_running(Some(Effect::Transactional), true),
        OnRunning::CheckLease
    );
    if !resume::PLANTED_RESUME {
        assert_eq!(
            resume::transactional_again(false, None),
            Ok(Again::AskPlatform)
        );
        assert_eq!(
            resume::transactional_again(true, None),
            Ok(Again::Settle(Event::TransactionalEnded))
        );
        assert_eq!(
            resume::transactional_again(false, Some(Some(StillRuns::Yes))),
            Ok(Again::Run)
        );
        assert_eq!(
            resume::transactional_again(false, Some(Some(StillRuns::Ended))),
            Ok(Again::Settle(Event::TransactionalEnded))
        );
        assert_eq!(
            resume::transactional_again(false, Some(Some(StillRuns::Forgotten))),
            Ok(Again::Settle(Event::TransactionalForgotten))
        );
        assert!(matches!(
            resume::transactional_again(false, Some(None)),
            Err(Pause::Waits(_))
        ));
    }
}

/// final receipt saved, not delivered | deliver the saved receipt again,
/// same id and body.
#[test]
fn crash_after_the_final_delivers_it_again() {
    assert_eq!(step::next(LocalState::Settled, false), Step::Deliver);
    let replayed = receipt_answer(true, CallState::Completed, None);
    assert_eq!(
        final_reply(&Reply::Answered(&replayed)),
        OnDelivery::Settle(Event::Delivered {
            receipt_id: "rcp_1".into()
        })
    );
}

/// final receipt delivered | nothing.
#[test]
fn crash_after_delivery_does_nothing() {
    for state in [
        LocalState::Delivered,
        LocalState::Abandoned,
        LocalState::Released,
        LocalState::Rejected,
        LocalState::Orphaned,
        LocalState::Compensated,
    ] {
        assert_eq!(step::next(state, false), Step::Done, "{state:?}");
    }
    // A call whose outcome is unknown is checked once per drive.
    assert_eq!(
        step::next(LocalState::ReconciliationRequired, false),
        Step::Check
    );
    assert_eq!(
        step::next(LocalState::ReconciliationRequired, true),
        Step::Done
    );
}
