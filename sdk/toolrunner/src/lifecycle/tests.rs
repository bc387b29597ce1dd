use serde_json::json;
use toolrunner_protocol::wire::{Assignment, CallState, Grant, ReceiptKind};

use super::*;
use crate::store::ALL_STATES;

fn assignment(id: &str) -> Assignment {
    serde_json::from_value(json!({
        "assignment_id": id, "run_id": "run_1", "call_id": "call_1", "tool_name": "t",
        "arguments": {}, "arguments_digest": "sha256:x", "grant": "grt_secret",
        "subject": "s", "agent_id": "agt_1", "agent_version": "agv_1", "binding_id": "bnd_1",
        "max_result_context_bytes": 16384, "input_schema": {"type": "object"}
    }))
    .expect("an assignment")
}

fn one_of_each() -> Vec<Event> {
    let asg = assignment("asg_1");
    let f = FinalReceipt::failed("declined", "no");
    vec![
        Event::Discovered {
            tool_name: "t".into(),
            operation_key: "op_1".into(),
        },
        Event::Retried {
            tool_name: "t".into(),
            operation_key: "op_2".into(),
        },
        Event::ClaimRefused { why: "x".into() },
        Event::ClaimAnswered {
            assignment: asg.clone(),
        },
        Event::ClaimFoundRunning {
            assignment: asg.clone(),
            platform: CallState::Running,
        },
        Event::ClaimFoundEnded {
            assignment: asg.clone(),
            platform: CallState::Completed,
        },
        Event::ClaimReturnedRefused {
            assignment: asg.clone(),
        },
        Event::RefusedBeforeStart {
            code: "forbidden".into(),
            message: "no".into(),
        },
        Event::RateLapsed,
        Event::KeyLimited,
        Event::ApprovalAsked {
            reason: "over 1,000".into(),
        },
        Event::AcceptedSaved,
        Event::AcceptConfirmed {
            receipt_id: "rcp_1".into(),
        },
        Event::AcceptRefusedPending {
            receipt_id: "rcp_1".into(),
            why: "x".into(),
        },
        Event::AcceptRefused {
            receipt_id: "rcp_1".into(),
            why: "x".into(),
        },
        Event::AcceptFoundReconciling {
            receipt_id: "rcp_1".into(),
        },
        Event::ClaimLapsed,
        Event::ProgressSaved {
            progress: json!({}),
        },
        Event::HandlerFinished { outcome: f.clone() },
        Event::OutcomeUnknown {
            why: "x".into(),
            evidence: Some("{}".into()),
        },
        Event::Delivered {
            receipt_id: "rcp_1".into(),
        },
        Event::DeliveryDeferred,
        Event::FinalRefusedNothingRan {
            receipt_id: "rcp_1".into(),
            error: "x".into(),
        },
        Event::FinalRejected {
            receipt_id: "rcp_1".into(),
            error: "x".into(),
        },
        Event::FinalOrphaned {
            receipt_id: "rcp_1".into(),
            error: "x".into(),
        },
        Event::FinalRefused {
            receipt_id: "rcp_1".into(),
            error: "x".into(),
        },
        Event::Reported {
            outcome: "updated".into(),
        },
        Event::UnknownToPlatform { why: "x".into() },
        Event::GiveBack,
        Event::OutstandingClaimed,
        Event::OutstandingRunning,
        Event::OutstandingReconciling,
        Event::HookHappened { result: json!({}) },
        Event::HookDidNotHappen,
        Event::HookRerun,
        Event::HookRunCancelled,
        Event::HookRunForgotten { why: "x".into() },
        Event::TransactionalEnded,
        Event::TransactionalForgotten,
        Event::OperatorResolved {
            outcome: f,
            reason: "r".into(),
            evidence: "e".into(),
        },
        Event::OperatorCompensated {
            reason: "r".into(),
            evidence: "e".into(),
        },
        Event::OperatorClosed {
            reason: "r".into(),
            evidence: "e".into(),
        },
    ]
}

/// A stored call in `state` with an assignment, `accepted` confirmed.
fn stored(state: LocalState) -> Snapshot {
    let mut c = LocalCall::new(
        "run_1".into(),
        "call_1".into(),
        "t".into(),
        "op_1".into(),
        Claiming,
    );
    c.state = state;
    c.assignment = Some(assignment("asg_1"));
    c.version = 7;
    let accepted = OutboxReceipt {
        receipt_id: "rcp_1".into(),
        run_id: "run_1".into(),
        call_id: "call_1".into(),
        assignment_id: "asg_1".into(),
        kind: ReceiptKind::Accepted,
        sequence: 0,
        body: "{}".into(),
        status: ReceiptStatus::Delivered,
        attempts: 1,
        last_error: None,
        created_at: crate::store::now(),
        delivered_at: None,
    };
    Snapshot {
        call: Some(c),
        receipts: Some(vec![accepted]),
    }
}

const KEY: (&str, &str) = ("run_1", "call_1");

#[test]
fn every_event_has_exactly_one_row_and_every_row_an_event() {
    let events = one_of_each();
    for e in &events {
        assert_eq!(
            TABLE.iter().filter(|r| r.event == e.name()).count(),
            1,
            "{}",
            e.name()
        );
    }
    for r in TABLE {
        assert!(
            events.iter().any(|e| e.name() == r.event),
            "no event for row {}",
            r.event
        );
    }
}

/// Every event is allowed exactly from the states its row lists, and leads
/// exactly where its row says: the table is the whole truth.
#[test]
fn plan_follows_the_table_from_every_state() {
    for event in one_of_each() {
        let rule = rule(event.name()).expect("a row");
        let mut snapshots = vec![(None, Snapshot::default())];
        snapshots.extend(ALL_STATES.iter().map(|s| (Some(*s), stored(*s))));
        for (state, snapshot) in snapshots {
            let listed = match state {
                None => rule.from.is_empty(),
                Some(s) => rule.from.contains(&s),
            };
            let planned = plan(&snapshot, KEY, event.clone(), "exe_1");
            if !listed {
                assert!(
                    planned.is_err(),
                    "{} from {state:?} must be refused",
                    rule.event
                );
                continue;
            }
            let p = match planned {
                Ok(p) => p,
                // Events with a condition of their own (sequence 0).
                Err(e) => {
                    assert!(
                        matches!(rule.event, "refused_before_start" | "accepted_saved"),
                        "{} from {state:?} refused: {e}",
                        rule.event
                    );
                    continue;
                }
            };
            let expected = match (rule.to, state) {
                (To::State(s), _) => s,
                (To::Same, Some(s)) => s,
                (To::Same, None) => unreachable!("a new call always enters a state"),
            };
            assert_eq!(p.call.state, expected, "{} from {state:?}", rule.event);
            assert_eq!(
                p.call.version,
                state.map_or(0, |_| 8),
                "the version moves by one"
            );
            match (state, &p.changes[0]) {
                (None, Change::InsertCall(_)) => {}
                (
                    Some(_),
                    Change::UpdateCall {
                        expect_version: 7, ..
                    },
                ) => {}
                other => panic!(
                    "{}: the first change must be the guarded row write: {other:?}",
                    rule.event
                ),
            }
        }
    }
}

#[test]
fn receipts_take_increasing_sequences_from_the_row() {
    let mut s = stored(Assigned);
    s.call.as_mut().unwrap().next_sequence = 0;
    let p = plan(&s, KEY, Event::AcceptedSaved, "exe_1").expect("accepted");
    assert_eq!(p.receipt.as_ref().unwrap().sequence, 0);
    assert_eq!(p.call.next_sequence, 1);
    // A second `accepted` for the same assignment is refused.
    let again = Snapshot {
        call: Some(p.call.clone()),
        receipts: None,
    };
    assert!(plan(&again, KEY, Event::AcceptedSaved, "exe_1").is_err());
    let mut rr = stored(ReconciliationRequired);
    rr.call.as_mut().unwrap().next_sequence = 1;
    let progress = plan(
        &rr,
        KEY,
        Event::ProgressSaved {
            progress: json!({}),
        },
        "exe_1",
    )
    .unwrap();
    assert_eq!(progress.receipt.as_ref().unwrap().sequence, 1);
    let after = Snapshot {
        call: Some(progress.call),
        receipts: None,
    };
    let done = plan(
        &after,
        KEY,
        Event::HookHappened { result: json!({}) },
        "exe_1",
    )
    .unwrap();
    assert_eq!(
        done.receipt.as_ref().unwrap().sequence,
        2,
        "the final follows the hook's progress"
    );
    let body: serde_json::Value = serde_json::from_str(&done.receipt.unwrap().body).unwrap();
    assert_eq!(body["sequence"], 2);
    assert_eq!(body["executor_id"], "exe_1");
}

#[test]
fn a_call_orphaned_while_its_outcome_was_unknown_says_so_in_its_timeline() {
    let notes = |from: LocalState| -> Vec<String> {
        let why = Event::UnknownToPlatform { why: "gone".into() };
        plan(&stored(from), KEY, why, "exe_1")
            .expect("allowed")
            .changes
            .into_iter()
            .filter_map(|c| match c {
                Change::Note { what, .. } => Some(what),
                _ => None,
            })
            .collect()
    };
    assert!(notes(ReconciliationRequired).contains(&OUTCOME_UNKNOWN_NOTE.to_owned()));
    for known in [Settled, Abandoned, Released] {
        assert!(
            !notes(known).contains(&OUTCOME_UNKNOWN_NOTE.to_owned()),
            "{known}"
        );
    }
}

#[test]
fn a_rerun_needs_a_confirmed_accepted() {
    let mut s = stored(ReconciliationRequired);
    assert!(plan(&s, KEY, Event::HookRerun, "exe_1").is_ok());
    s.receipts.as_mut().unwrap()[0].status = ReceiptStatus::Rejected;
    assert!(plan(&s, KEY, Event::HookRerun, "exe_1").is_err());
    s.receipts = None;
    assert!(
        plan(&s, KEY, Event::HookRerun, "exe_1").is_err(),
        "unknown receipts: no rerun"
    );
}

#[test]
fn leaving_the_claim_supersedes_a_pending_accepted() {
    let supersedes = |p: &Plan| {
        p.changes.iter().any(|c| {
            matches!(
                c,
                Change::SettlePending {
                    only_kind: Some(ReceiptKind::Accepted),
                    status: ReceiptStatus::Superseded,
                    ..
                }
            )
        })
    };
    let refused = plan(
        &stored(Claiming),
        KEY,
        Event::ClaimRefused { why: "x".into() },
        "e",
    )
    .unwrap();
    assert!(supersedes(&refused));
    let lapsed = plan(&stored(Assigned), KEY, Event::ClaimLapsed, "e").unwrap();
    assert!(!supersedes(&lapsed), "a lapsed claim's answer decides");
    let confirmed = plan(
        &stored(Assigned),
        KEY,
        Event::AcceptConfirmed {
            receipt_id: "rcp_1".into(),
        },
        "e",
    )
    .unwrap();
    let delivered_first = confirmed.changes.iter().position(|c| {
        matches!(
            c,
            Change::ReceiptStatus {
                status: ReceiptStatus::Delivered,
                ..
            }
        )
    });
    let swept = confirmed
        .changes
        .iter()
        .position(|c| matches!(c, Change::SettlePending { .. }));
    assert!(
        delivered_first < swept,
        "the confirmed accepted is marked before the sweep"
    );
}

#[test]
fn a_replay_answered_running_moves_the_sequence_past_accepted() {
    let mut s = stored(Claiming);
    s.call.as_mut().unwrap().assignment = None;
    let p = plan(
        &s,
        KEY,
        Event::ClaimFoundRunning {
            assignment: assignment("asg_2"),
            platform: CallState::Running,
        },
        "e",
    )
    .unwrap();
    assert_eq!(p.call.next_sequence, 1);
    assert_eq!(p.call.report, Some(PendingReport::ReconciliationRequired));
}

/// An `accepted` replay answered false with the call
/// `reconciliation_required` (another store of the identity reported it):
/// the platform holds the `accepted`, so it is marked delivered, before the
/// sweep of pending ones; the call is `running` here, resumed as after a
/// crash, with nothing to report yet (simulation seed 205).
#[test]
fn an_accepted_replay_answered_reconciling_keeps_the_call() {
    let mut s = stored(Assigned);
    s.call.as_mut().unwrap().next_sequence = 1;
    let p = plan(
        &s,
        KEY,
        Event::AcceptFoundReconciling {
            receipt_id: "rcp_1".into(),
        },
        "e",
    )
    .unwrap();
    assert_eq!(p.call.state, Running);
    assert_eq!(p.call.next_sequence, 1);
    assert_eq!(p.call.report, None);
    assert!(p.call.assignment.is_some());
    let delivered = p.changes.iter().position(|c| {
        matches!(
            c,
            Change::ReceiptStatus {
                status: ReceiptStatus::Delivered,
                ..
            }
        )
    });
    let swept = p
        .changes
        .iter()
        .position(|c| matches!(c, Change::SettlePending { .. }));
    assert!(delivered.is_some() && delivered < swept, "{:?}", p.changes);
}

#[test]
fn secrets_stay_out_of_planned_receipts() {
    let p = plan(
        &stored(Running),
        KEY,
        Event::ProgressSaved {
            progress: json!({}),
        },
        "e",
    )
    .unwrap();
    assert!(!p.receipt.unwrap().body.contains("grt_secret"));
    let _ = Grant::new("unused");
}

/// A fresh store file (its directory goes with the guard).
async fn store_file() -> (tempfile::TempDir, crate::store::SqliteStore) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let store = crate::store::SqliteStore::open_path(&dir.path().join("t.db"))
        .await
        .expect("a store");
    (dir, store)
}

/// A call of `KEY` saved in `claiming`, as the claim loop leaves it.
async fn claiming(store: &crate::store::SqliteStore) -> LocalCall {
    let moved = advance_from(store, "exe", KEY, Some(None), Reads::Row, |_| {
        Some(Event::Discovered {
            tool_name: "t".into(),
            operation_key: operation_key(),
        })
    })
    .await
    .expect("saved");
    match moved {
        Advanced::Moved { call, .. } => call,
        Advanced::Stayed(_) => panic!("the call was not saved"),
    }
}

#[tokio::test]
async fn a_first_assignment_and_its_accepted_are_one_commit() {
    let (_dir, store) = store_file().await;
    let call = claiming(&store).await;
    let before = store.writer_stats().jobs;
    let moved = advance_then(
        &store,
        "exe",
        KEY,
        Some(Some(call)),
        Reads::Row,
        |_| {
            Some(Event::ClaimAnswered {
                assignment: assignment("asg_1"),
            })
        },
        Some(Event::AcceptedSaved),
    )
    .await
    .expect("saved");
    assert_eq!(store.writer_stats().jobs - before, 1, "one commit");
    let Advanced::Moved { call, receipt } = moved else {
        panic!("nothing moved");
    };
    assert_eq!(call.state, Assigned);
    let receipt = receipt.expect("the accepted saved with the assignment");
    assert_eq!(
        (
            receipt.kind,
            receipt.sequence,
            receipt.assignment_id.as_str()
        ),
        (ReceiptKind::Accepted, 0, "asg_1")
    );
    let stored = store.call(KEY.0, KEY.1).await.expect("read").expect("row");
    assert_eq!(stored.version, call.version);
    let receipts = store.receipts(KEY.0, KEY.1).await.expect("read");
    assert_eq!(receipts.len(), 1, "{receipts:?}");
}

#[tokio::test]
async fn a_second_event_the_table_refuses_is_left_out() {
    let (_dir, store) = store_file().await;
    let call = claiming(&store).await;
    // `accept_confirmed` is not allowed from `abandoned`, where a refused
    // claim leads: only the first event is written.
    let moved = advance_then(
        &store,
        "exe",
        KEY,
        Some(Some(call)),
        Reads::Row,
        |_| Some(Event::ClaimRefused { why: "no".into() }),
        Some(Event::AcceptConfirmed {
            receipt_id: "rcp_1".into(),
        }),
    )
    .await
    .expect("saved");
    let Advanced::Moved { call, receipt } = moved else {
        panic!("nothing moved");
    };
    assert_eq!((call.state, receipt), (Abandoned, None));
    let stored = store.call(KEY.0, KEY.1).await.expect("read").expect("row");
    assert_eq!((stored.state, stored.version), (Abandoned, call.version));
}

/// A fixed time and receipt id for `plan_with`.
fn given() -> Given<'static> {
    Given {
        executor_id: "exe_1",
        now: chrono::DateTime::parse_from_rfc3339("2026-01-02T03:04:05Z")
            .expect("a time")
            .with_timezone(&chrono::Utc),
        receipt_id: "rcp_given".into(),
    }
}

/// `plan_with` is pure: the clock and the receipt id are passed in, so the
/// same arguments give the same plan, and the plan's times and ids are the
/// ones given.
#[test]
fn a_plan_with_its_clock_and_ids_passed_in_is_pure() {
    let s = stored(Running);
    let given = given();
    let event = || Event::HandlerFinished {
        outcome: FinalReceipt::failed("declined", "no"),
    };
    let first = plan_with(&s, KEY, event(), &given).expect("allowed");
    let second = plan_with(&s, KEY, event(), &given).expect("allowed");
    assert_eq!(format!("{first:?}"), format!("{second:?}"));
    assert_eq!(first.call.updated_at, given.now);
    let r = first.receipt.as_ref().expect("a final receipt");
    assert_eq!(r.receipt_id, "rcp_given");
    assert_eq!(r.created_at, given.now);
    assert!(
        r.body.contains("\"receipt_id\":\"rcp_given\""),
        "{}",
        r.body
    );
}

/// And for a call the store does not hold yet: the new row's creation
/// time is the one given, not the clock's (the model's states and the
/// deterministic simulation's traces depend on it).
#[test]
fn a_plan_of_a_new_call_takes_its_creation_time_from_what_is_given() {
    let given = given();
    let event = || Event::Discovered {
        tool_name: "t".into(),
        operation_key: "op_1".into(),
    };
    let first = plan_with(&Snapshot::default(), KEY, event(), &given).expect("allowed");
    std::thread::sleep(std::time::Duration::from_millis(2));
    let second = plan_with(&Snapshot::default(), KEY, event(), &given).expect("allowed");
    assert_eq!(first.call.created_at, given.now);
    assert_eq!(format!("{first:?}"), format!("{second:?}"));
}
