//! §5 Receipts: the kinds table, every row of the case table (with
//! situations where two rows apply), accepted semantics, sequences, grants.

use serde_json::{Value, json};

use crate::common::*;

/// A fixture, an executor `exe_a`, and a claimed `payments.charge` call.
async fn claimed_charge() -> (Fixture, Conn, Asg) {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    (fx, c, a)
}

/// Like [`claimed_charge`], then `accepted`.
async fn running_charge() -> (Fixture, Conn, Asg) {
    let (fx, c, a) = claimed_charge().await;
    assert_eq!(fx.receipt(&a, accepted(&a)).await.ok()["accepted"], true);
    (fx, c, a)
}

/// A run with two calls; the first is running under `exe_a`, the second
/// pending (so the run stays active when the first ends).
async fn two_call_run() -> (Fixture, Conn, Asg, String) {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(CHARGE, charge_args()), (CHARGE, charge_args())])
        .await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    (fx, c, a, run.calls[1].clone())
}

async fn receipts_of(fx: &Fixture, a: &Asg) -> Value {
    let run = fx.get_run(&a.run_id).await;
    call_in(&run, &a.call_id)["receipts"].clone()
}

async fn late_of(fx: &Fixture, a: &Asg) -> Value {
    let run = fx.get_run(&a.run_id).await;
    call_in(&run, &a.call_id)["late_receipts"].clone()
}

// ================================================================ kinds table

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_accepted_confirms_start_with_accepted_true() {
    let (fx, _c, a) = claimed_charge().await;
    let body = accepted(&a);
    let r = fx.receipt(&a, body.clone()).await;
    assert_eq!(
        r.ok(),
        &json!({"receipt_id": body["receipt_id"], "replayed": false, "call_state": "running", "accepted": true})
    );
    let run = fx.get_run(&a.run_id).await;
    let call = call_in(&run, &a.call_id);
    assert_eq!(call["state"], "running");
    assert_ts(&call["accepted_at"]);
    let rs = call["receipts"].as_array().unwrap();
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0]["receipt_id"], body["receipt_id"]);
    assert_eq!(rs[0]["kind"], "accepted");
    assert_eq!(rs[0]["sequence"], 0);
    assert_eq!(rs[0]["body"], body);
    assert_ts(&rs[0]["received_at"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_accepted_must_have_sequence_0() {
    let (fx, _c, a) = claimed_charge().await;
    let mut body = accepted(&a);
    body["sequence"] = json!(1);
    fx.receipt(&a, body).await.bad("invalid_receipt");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_accepted_true_on_replay_while_running() {
    let (fx, _c, a) = claimed_charge().await;
    let body = accepted(&a);
    fx.receipt(&a, body.clone()).await.ok();
    let v = fx.receipt(&a, body).await.ok().clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["accepted"], true);
    assert_eq!(v["call_state"], "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_accepted_false_on_replay_once_not_running_for_this_assignment() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    // reconciliation_required
    let a = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let acc = accepted(&a);
    fx.receipt(&a, acc.clone()).await.ok();
    fx.report1(&c, &run.run_id, &run.calls[0], "reconciliation_required")
        .await;
    let v = fx.receipt(&a, acc).await.ok().clone();
    assert_eq!(
        (v["replayed"].clone(), v["accepted"].clone()),
        (json!(true), json!(false)),
        "{v}"
    );
    // completed
    let b = fx.claim_ok(&c, &run.run_id, &run.calls[1]).await;
    let acc = accepted(&b);
    fx.receipt(&b, acc.clone()).await.ok();
    fx.complete(&b, json!({})).await.ok();
    let v = fx.receipt(&b, acc).await.ok().clone();
    assert_eq!(
        (v["replayed"].clone(), v["accepted"].clone()),
        (json!(true), json!(false)),
        "{v}"
    );
    assert_eq!(v["call_state"], "completed");
    // run cancelled (call terminated)
    let d = fx.claim_ok(&c, &run.run_id, &run.calls[2]).await;
    let acc = accepted(&d);
    fx.receipt(&d, acc.clone()).await.ok();
    fx.cancel(&run.run_id).await.ok();
    let v = fx.receipt(&d, acc).await.ok().clone();
    assert_eq!(
        (v["replayed"].clone(), v["accepted"].clone()),
        (json!(true), json!(false)),
        "{v}"
    );
    assert_eq!(v["call_state"], "terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_progress_any_number_with_increasing_sequence() {
    let (fx, _c, a) = running_charge().await;
    for (seq, fraction) in [
        (1, json!(0)),
        (2, json!(0.5)),
        (5, json!(null)),
        (6, json!(1)),
    ] {
        let mut p = progress(&a, seq);
        p["progress"]["fraction"] = fraction;
        p["progress"]["data"] = json!({"rows": seq});
        let v = fx.receipt(&a, p).await.ok().clone();
        assert_eq!(v["call_state"], "running");
        assert_eq!(v["replayed"], false);
        assert!(
            v.get("accepted").is_none(),
            "only kind accepted answers accepted: {v}"
        );
    }
    assert_eq!(receipts_of(&fx, &a).await.as_array().unwrap().len(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_progress_fraction_is_0_to_1_or_null() {
    let (fx, _c, a) = running_charge().await;
    for bad in [json!(1.5), json!(-0.1), json!("half")] {
        let mut p = progress(&a, 1);
        p["progress"]["fraction"] = bad.clone();
        let r = fx.receipt(&a, p).await;
        r.bad("invalid_receipt");
    }
    let mut p = progress(&a, 1);
    p.as_object_mut().unwrap().remove("progress");
    fx.receipt(&a, p).await.bad("invalid_receipt");
    assert_eq!(receipts_of(&fx, &a).await.as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_completed_is_terminal() {
    let (fx, _c, a) = running_charge().await;
    let body = completed(&a, 1, charge_result());
    let v = fx.receipt(&a, body.clone()).await.ok().clone();
    assert_eq!(
        v,
        json!({"receipt_id": body["receipt_id"], "replayed": false, "call_state": "completed"})
    );
    let run = fx.get_run(&a.run_id).await;
    assert_eq!(call_in(&run, &a.call_id)["state"], "completed");
    assert_eq!(run["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_failed_is_terminal_business_failure() {
    let (fx, _c, a) = running_charge().await;
    let v = fx
        .receipt(&a, failed(&a, 1, "card_declined"))
        .await
        .ok()
        .clone();
    assert_eq!(v["call_state"], "failed");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_failed_sequence_0_settles_a_claimed_call_without_starting() {
    for code in ["invalid_arguments", "digest_mismatch", "forbidden"] {
        let (fx, _c, a) = claimed_charge().await;
        let v = fx.receipt(&a, failed(&a, 0, code)).await.ok().clone();
        assert_eq!(v["call_state"], "failed", "{code}");
        let run = fx.get_run(&a.run_id).await;
        let call = call_in(&run, &a.call_id);
        assert_eq!(call["state"], "failed");
        assert!(
            call.get("accepted_at").is_none_or(Value::is_null),
            "nothing started: {call}"
        );
        assert_eq!(run["status"], "completed", "every call terminal");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_failed_sequence_0_with_another_code_is_409_not_accepted() {
    let (fx, _c, a) = claimed_charge().await;
    fx.receipt(&a, failed(&a, 0, "card_declined"))
        .await
        .err(409, "not_accepted");
    // and a sequence-1 failed with one of the three codes is no exception either
    fx.receipt(&a, failed(&a, 1, "forbidden"))
        .await
        .err(409, "not_accepted");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_failed_sequence_0_after_accepted_is_409_sequence_conflict() {
    let (fx, _c, a) = running_charge().await;
    fx.receipt(&a, failed(&a, 0, "forbidden"))
        .await
        .err(409, "sequence_conflict");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_kind_cancelled_is_terminal_business_cancellation() {
    let (fx, _c, a) = running_charge().await;
    let v = fx.receipt(&a, cancelled(&a, 1)).await.ok().clone();
    assert_eq!(v["call_state"], "cancelled");
    let run = fx.get_run(&a.run_id).await;
    assert_eq!(
        call_in(&run, &a.call_id)["state"],
        "cancelled",
        "a business cancellation is not terminated"
    );
    assert_eq!(
        run["status"], "completed",
        "the run was not cancelled, its call was"
    );
}

// ================================================================ case table, row by row

// ---- row 1: unknown or foreign run -> 404

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_unknown_run_is_404() {
    let (fx, _c, a) = claimed_charge().await;
    fx.receipt_with("run_missing", &a.call_id, Some(&a.grant), &accepted(&a))
        .await
        .is(404);
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_unknown_run_beats_unknown_call_grant_and_body() {
    let (fx, _c, _a) = claimed_charge().await;
    fx.receipt_with(
        "run_missing",
        "call_missing",
        None,
        &json!({"kind": "bogus"}),
    )
    .await
    .is(404);
}

// ---- row 2: unknown call in a known run, or a call of another run -> 400 unknown_call

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_unknown_call_in_known_run_is_400_unknown_call() {
    let (fx, _c, a) = claimed_charge().await;
    let before = fx.get_run(&a.run_id).await;
    fx.receipt_with(&a.run_id, "call_missing", Some(&a.grant), &accepted(&a))
        .await
        .bad("unknown_call");
    assert_eq!(fx.get_run(&a.run_id).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_call_of_another_run_is_400_unknown_call() {
    let (fx, _c, a) = claimed_charge().await;
    let (other_run, _) = fx.read_call().await;
    let before = fx.get_run(&a.run_id).await;
    fx.receipt_with(&other_run, &a.call_id, Some(&a.grant), &accepted(&a))
        .await
        .bad("unknown_call");
    assert_eq!(fx.get_run(&a.run_id).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_unknown_call_beats_invalid_grant_and_malformed_body() {
    let (fx, _c, a) = claimed_charge().await;
    fx.receipt_with(&a.run_id, "call_missing", None, &json!({"kind": "bogus"}))
        .await
        .bad("unknown_call");
}

// ---- row 3: invalid grant -> 403 invalid_grant

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_missing_grant_is_403_invalid_grant() {
    let (fx, _c, a) = claimed_charge().await;
    fx.receipt_with(&a.run_id, &a.call_id, None, &accepted(&a))
        .await
        .err(403, "invalid_grant");
    fx.receipt_with(&a.run_id, &a.call_id, Some(""), &accepted(&a))
        .await
        .err(403, "invalid_grant");
    fx.receipt_with(&a.run_id, &a.call_id, Some("grt_forged"), &accepted(&a))
        .await
        .err(403, "invalid_grant");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_grant_of_another_assignment_is_403_invalid_grant() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let b = fx.claim_ok(&c, &run.run_id, &run.calls[1]).await;
    // b's grant on a's call, with a's assignment id
    fx.receipt_with(&a.run_id, &a.call_id, Some(&b.grant), &accepted(&a))
        .await
        .err(403, "invalid_grant");
    // a's grant with b's assignment id in the body
    fx.receipt_with(&a.run_id, &a.call_id, Some(&a.grant), &accepted(&b))
        .await
        .err(403, "invalid_grant");
    assert_eq!(fx.state(&run.run_id, &run.calls[0]).await, "claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_grant_of_released_assignment_is_403_invalid_grant() {
    // released by report, by drain, by lease expiry
    let fx = Fixture::with(Opts::lease(400)).await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    let by_report = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    fx.report1(&c, &run.run_id, &run.calls[0], "released").await;
    fx.receipt(&by_report, accepted(&by_report))
        .await
        .err(403, "invalid_grant");
    fx.receipt(&by_report, failed(&by_report, 0, "forbidden"))
        .await
        .err(403, "invalid_grant");

    let c2 = fx.connect("exe_b").await;
    let by_drain = fx.claim_ok(&c2, &run.run_id, &run.calls[1]).await;
    fx.disconnect(&c2, "drain").await.ok();
    fx.receipt(&by_drain, accepted(&by_drain))
        .await
        .err(403, "invalid_grant");

    let c3 = fx.connect("exe_c").await;
    let by_lease = fx.claim_ok(&c3, &run.run_id, &run.calls[2]).await;
    sleep_ms(700).await;
    fx.receipt(&by_lease, accepted(&by_lease))
        .await
        .err(403, "invalid_grant");
    let got = fx.get_run(&run.run_id).await;
    for call in &run.calls {
        assert_eq!(call_in(&got, call)["state"], "pending");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_from_another_executor_is_403_invalid_grant() {
    let (fx, _c, a) = claimed_charge().await;
    let _b = fx.connect("exe_b").await;
    let mut body = accepted(&a);
    body["executor_id"] = json!("exe_b");
    fx.receipt(&a, body).await.err(403, "invalid_grant");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_invalid_grant_beats_malformed_receipt() {
    let (fx, _c, a) = claimed_charge().await;
    let mut body = accepted(&a);
    body["kind"] = json!("bogus");
    body["extra"] = json!(1);
    fx.receipt_with(&a.run_id, &a.call_id, None, &body)
        .await
        .err(403, "invalid_grant");
    fx.receipt_with(&a.run_id, &a.call_id, Some("grt_forged"), &body)
        .await
        .err(403, "invalid_grant");
}

// ---- row 4: malformed receipt -> 400; state unchanged

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_malformed_is_400_invalid_receipt_and_changes_nothing() {
    let (fx, _c, a) = running_charge().await;
    let before = fx.get_run(&a.run_id).await;
    let base = completed(&a, 1, charge_result());
    let mut cases: Vec<Value> = Vec::new();
    let mut unknown_kind = base.clone();
    unknown_kind["kind"] = json!("finished");
    cases.push(unknown_kind);
    for field in ["receipt_id", "sequence", "kind", "result"] {
        let mut m = base.clone();
        m.as_object_mut().unwrap().remove(field);
        cases.push(m);
    }
    for (field, wrong) in [
        ("receipt_id", json!(7)),
        ("sequence", json!("1")),
        ("sequence", json!(-1)),
        ("sequence", json!(1.5)),
        ("kind", json!(null)),
    ] {
        let mut m = base.clone();
        m[field] = wrong;
        cases.push(m);
    }
    let mut f = failed(&a, 1, "x");
    f.as_object_mut().unwrap().remove("error");
    cases.push(f);
    let mut f = failed(&a, 1, "x");
    f["error"] = json!({"code": "", "message": "m"});
    cases.push(f);
    let mut cxl = cancelled(&a, 1);
    cxl["reason"] = json!(5);
    cases.push(cxl);
    for body in cases {
        let r = fx.receipt(&a, body.clone()).await;
        r.envelope();
        assert_eq!(r.status, 400, "{body}: {r:?}");
        assert_eq!(r.code(), "invalid_receipt", "{body}: {r:?}");
    }
    assert_eq!(fx.get_run(&a.run_id).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_unlisted_field_is_400_unknown_field() {
    let (fx, _c, a) = running_charge().await;
    let mut body = completed(&a, 1, charge_result());
    body["note"] = json!("hi");
    fx.receipt(&a, body).await.bad("unknown_field");
    let mut body = progress(&a, 1);
    body["result"] = json!({});
    fx.receipt(&a, body).await.bad("unknown_field");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "running");
    assert_eq!(receipts_of(&fx, &a).await.as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_malformed_beats_receipt_conflict() {
    let (fx, _c, a) = running_charge().await;
    let body = progress(&a, 1);
    fx.receipt(&a, body.clone()).await.ok();
    let mut bad = body.clone();
    bad["kind"] = json!("bogus");
    fx.receipt(&a, bad).await.bad("invalid_receipt");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_malformed_beats_run_terminated_and_is_not_kept() {
    let (fx, _c, a) = running_charge().await;
    fx.cancel(&a.run_id).await.ok();
    let mut bad = completed(&a, 1, charge_result());
    bad["kind"] = json!("bogus");
    fx.receipt(&a, bad).await.bad("invalid_receipt");
    assert_eq!(late_of(&fx, &a).await, json!([]));
}

// ---- row 5: identical retry -> 200 replayed

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_identical_retry_is_replayed_and_not_processed_again() {
    let (fx, _c, a) = running_charge().await;
    let p = progress(&a, 1);
    fx.receipt(&a, p.clone()).await.ok();
    let v = fx.receipt(&a, p.clone()).await.ok().clone();
    assert_eq!(
        v,
        json!({"receipt_id": p["receipt_id"], "replayed": true, "call_state": "running"})
    );
    assert_eq!(
        receipts_of(&fx, &a).await.as_array().unwrap().len(),
        2,
        "stored once"
    );
    // "same body" is equal canonical JSON: key order and whitespace do not matter
    let raw = format!(
        "{{ \"kind\" : \"progress\", \"sequence\": 1, \"progress\": {{\"data\": null, \"fraction\": null, \"message\": \"step 1\"}},\n \"assignment_id\": \"{}\", \"executor_id\": \"{}\", \"receipt_id\": \"{}\" }}",
        a.assignment_id,
        a.executor_id,
        p["receipt_id"].as_str().unwrap()
    );
    let r = fx
        .srv
        .send(
            Req::post(&format!(
                "/runs/{}/tool-calls/{}/receipts",
                a.run_id, a.call_id
            ))
            .token(EXEC)
            .header("tool-grant", &a.grant)
            .raw(raw),
        )
        .await;
    assert_eq!(r.ok()["replayed"], true, "{r:?}");
    assert_eq!(receipts_of(&fx, &a).await.as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_identical_retry_after_call_ended_is_replayed() {
    let (fx, _c, a, _other) = two_call_run().await;
    let p = progress(&a, 1);
    fx.receipt(&a, p.clone()).await.ok();
    let done = completed(&a, 2, charge_result());
    fx.receipt(&a, done.clone()).await.ok();
    assert_eq!(fx.get_run(&a.run_id).await["status"], "active");
    for body in [p, done] {
        let v = fx.receipt(&a, body).await.ok().clone();
        assert_eq!(v["replayed"], true);
        assert_eq!(v["call_state"], "completed");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_identical_retry_after_run_ended_is_replayed() {
    // run cancelled
    let (fx, _c, a, _other) = two_call_run().await;
    let p = progress(&a, 1);
    fx.receipt(&a, p.clone()).await.ok();
    fx.cancel(&a.run_id).await.ok();
    let v = fx.receipt(&a, p).await.ok().clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "terminated");
    assert_eq!(
        late_of(&fx, &a).await,
        json!([]),
        "a replay is not a late receipt"
    );
    // run completed
    let (fx, _c, a) = running_charge().await;
    let done = completed(&a, 1, charge_result());
    fx.receipt(&a, done.clone()).await.ok();
    assert_eq!(fx.get_run(&a.run_id).await["status"], "completed");
    let v = fx.receipt(&a, done).await.ok().clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["call_state"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_identical_retry_beats_already_accepted() {
    let (fx, _c, a) = claimed_charge().await;
    let acc = accepted(&a);
    fx.receipt(&a, acc.clone()).await.ok();
    let v = fx.receipt(&a, acc).await.ok().clone();
    assert_eq!(v["replayed"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_identical_retry_beats_sequence_conflict() {
    let (fx, _c, a) = running_charge().await;
    let p1 = progress(&a, 1);
    fx.receipt(&a, p1.clone()).await.ok();
    fx.receipt(&a, progress(&a, 2)).await.ok();
    let v = fx.receipt(&a, p1).await.ok().clone();
    assert_eq!(v["replayed"], true);
}

// ---- row 6: same receipt_id, different body -> 409 receipt_conflict

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_same_id_different_body_is_409_receipt_conflict() {
    let (fx, _c, a) = running_charge().await;
    let p = progress(&a, 1);
    fx.receipt(&a, p.clone()).await.ok();
    let mut changed = p.clone();
    changed["progress"]["message"] = json!("something else");
    fx.receipt(&a, changed).await.err(409, "receipt_conflict");
    // a different kind under the same id, with a fresh sequence
    let mut other = completed(&a, 5, charge_result());
    other["receipt_id"] = p["receipt_id"].clone();
    fx.receipt(&a, other).await.err(409, "receipt_conflict");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "running");
    assert_eq!(receipts_of(&fx, &a).await.as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_receipt_conflict_beats_run_terminated() {
    let (fx, _c, a) = running_charge().await;
    let p = progress(&a, 1);
    fx.receipt(&a, p.clone()).await.ok();
    fx.cancel(&a.run_id).await.ok();
    let mut changed = p;
    changed["progress"]["message"] = json!("changed");
    fx.receipt(&a, changed).await.err(409, "receipt_conflict");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_receipt_conflict_beats_call_already_terminal() {
    let (fx, _c, a, _other) = two_call_run().await;
    let done = completed(&a, 1, charge_result());
    fx.receipt(&a, done.clone()).await.ok();
    let mut changed = done;
    changed["result"] = json!({"charge_id": "ch_other"});
    fx.receipt(&a, changed).await.err(409, "receipt_conflict");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_receipt_conflict_beats_sequence_conflict() {
    let (fx, _c, a) = running_charge().await;
    let p = progress(&a, 3);
    fx.receipt(&a, p.clone()).await.ok();
    let mut changed = p;
    changed["sequence"] = json!(2);
    fx.receipt(&a, changed).await.err(409, "receipt_conflict");
}

// ---- row 7: new receipt after the run ended -> 409 run_terminated, kept

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_late_after_run_cancelled_is_409_run_terminated_and_kept_in_late_receipts() {
    let (fx, _c, a) = running_charge().await;
    fx.cancel(&a.run_id).await.ok();
    let late = completed(&a, 1, charge_result());
    fx.receipt(&a, late.clone())
        .await
        .err(409, "run_terminated");
    let run = fx.get_run(&a.run_id).await;
    assert_eq!(run["status"], "cancelled", "never revived");
    let call = call_in(&run, &a.call_id);
    assert_eq!(call["state"], "terminated");
    let kept = call["late_receipts"].as_array().unwrap();
    assert!(
        kept.iter()
            .any(|r| r["receipt_id"] == late["receipt_id"] && r["body"] == late),
        "late receipt kept for audit: {call}"
    );
    assert!(
        call["receipts"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["receipt_id"] != late["receipt_id"]),
        "a late receipt is not part of the execution history: {call}"
    );
    assert!(
        call.get("context_projection").is_none_or(Value::is_null),
        "no projection of a late result: {call}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_late_after_run_completed_is_409_run_terminated() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.complete(&a, json!({})).await.ok();
    assert_eq!(fx.get_run(&run.run_id).await["status"], "completed");
    let late = progress(&a, 7);
    fx.receipt(&a, late.clone())
        .await
        .err(409, "run_terminated");
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(got["status"], "completed");
    assert!(
        call_in(&got, &run.calls[0])["late_receipts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["body"] == late),
        "{got}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_run_terminated_beats_call_already_terminal() {
    let (fx, _c, a, _other) = two_call_run().await;
    fx.complete(&a, charge_result()).await.ok();
    fx.cancel(&a.run_id).await.ok();
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "completed");
    fx.receipt(&a, progress(&a, 9))
        .await
        .err(409, "run_terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_run_terminated_beats_not_accepted() {
    let (fx, _c, a) = claimed_charge().await;
    fx.cancel(&a.run_id).await.ok();
    // a closed (not released) assignment: its grant still authenticates
    fx.receipt(&a, progress(&a, 1))
        .await
        .err(409, "run_terminated");
    fx.receipt(&a, accepted(&a))
        .await
        .err(409, "run_terminated");
    assert_eq!(late_of(&fx, &a).await.as_array().unwrap().len(), 2);
}

// ---- row 8: after the call's terminal receipt -> 409 call_already_terminal

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_after_call_terminal_is_409_call_already_terminal() {
    let (fx, _c, a, _other) = two_call_run().await;
    fx.complete(&a, charge_result()).await.ok();
    for body in [
        progress(&a, 5),
        completed(&a, 6, charge_result()),
        failed(&a, 7, "x"),
        cancelled(&a, 8),
    ] {
        fx.receipt(&a, body).await.err(409, "call_already_terminal");
    }
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "completed");
    assert_eq!(late_of(&fx, &a).await, json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_call_already_terminal_beats_already_accepted() {
    let (fx, _c, a, _other) = two_call_run().await;
    fx.complete(&a, charge_result()).await.ok();
    fx.receipt(&a, accepted(&a))
        .await
        .err(409, "call_already_terminal");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_call_already_terminal_beats_sequence_conflict() {
    let (fx, _c, a, _other) = two_call_run().await;
    fx.receipt(&a, completed(&a, 3, charge_result())).await.ok();
    fx.receipt(&a, progress(&a, 1))
        .await
        .err(409, "call_already_terminal");
}

// ---- row 9: a second accepted -> 409 already_accepted

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_second_accepted_is_409_already_accepted() {
    let (fx, _c, a) = running_charge().await;
    fx.receipt(&a, progress(&a, 1)).await.ok();
    fx.receipt(&a, accepted(&a))
        .await
        .err(409, "already_accepted");
    assert_eq!(receipts_of(&fx, &a).await.as_array().unwrap().len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_already_accepted_beats_sequence_conflict() {
    // sequence 0 is not greater than the stored 0: both rows apply
    let (fx, _c, a) = running_charge().await;
    fx.receipt(&a, accepted(&a))
        .await
        .err(409, "already_accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_second_accepted_on_reconciliation_required_is_409_already_accepted() {
    let (fx, c, a) = running_charge().await;
    fx.report1(&c, &a.run_id, &a.call_id, "reconciliation_required")
        .await;
    fx.receipt(&a, accepted(&a))
        .await
        .err(409, "already_accepted");
}

// ---- row 10: before accepted -> 409 not_accepted

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_before_accepted_is_409_not_accepted() {
    let (fx, _c, a) = claimed_charge().await;
    for body in [
        progress(&a, 1),
        completed(&a, 1, charge_result()),
        failed(&a, 1, "x"),
        cancelled(&a, 1),
    ] {
        fx.receipt(&a, body).await.err(409, "not_accepted");
    }
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "claimed");
    assert_eq!(receipts_of(&fx, &a).await, json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_not_accepted_beats_output_schema_check() {
    let (fx, _c, a) = claimed_charge().await;
    fx.receipt(&a, completed(&a, 1, json!({"no_charge_id": true})))
        .await
        .err(409, "not_accepted");
}

// ---- row 11: sequence not greater -> 409 sequence_conflict

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_sequence_not_greater_than_last_stored_is_409_sequence_conflict() {
    let (fx, _c, a) = running_charge().await;
    fx.receipt(&a, progress(&a, 2)).await.ok();
    fx.receipt(&a, progress(&a, 2))
        .await
        .err(409, "sequence_conflict");
    fx.receipt(&a, progress(&a, 1))
        .await
        .err(409, "sequence_conflict");
    fx.receipt(&a, completed(&a, 2, charge_result()))
        .await
        .err(409, "sequence_conflict");
    assert_eq!(fx.state(&a.run_id, &a.call_id).await, "running");
    // gaps are fine
    fx.receipt(&a, progress(&a, 10)).await.ok();
    assert_eq!(
        fx.receipt(&a, completed(&a, 11, charge_result()))
            .await
            .ok()["call_state"],
        "completed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_precedence_sequence_conflict_beats_output_schema_check() {
    let (fx, _c, a) = running_charge().await;
    fx.receipt(&a, progress(&a, 4)).await.ok();
    fx.receipt(&a, completed(&a, 3, json!("not an object")))
        .await
        .err(409, "sequence_conflict");
}

// ---- row 12: completed not matching output_schema -> 400 invalid_receipt

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_completed_not_matching_output_schema_is_400_invalid_receipt() {
    let (fx, _c, a) = running_charge().await;
    let before = fx.get_run(&a.run_id).await;
    for bad in [
        json!({"status": "ok"}),
        json!({"charge_id": 5}),
        json!("ch_9"),
        json!(null),
        json!([]),
    ] {
        fx.receipt(&a, completed(&a, 1, bad))
            .await
            .bad("invalid_receipt");
    }
    assert_eq!(fx.get_run(&a.run_id).await, before, "state unchanged");
    assert_eq!(
        fx.receipt(&a, completed(&a, 1, charge_result())).await.ok()["call_state"],
        "completed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipt_completed_without_output_schema_accepts_any_json() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(NOTE, json!({})), (NOTE, json!({})), (NOTE, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    for (call, result) in run
        .calls
        .iter()
        .zip([json!("text"), json!([1, 2]), json!(null)])
    {
        let a = fx.running(&c, &run.run_id, call).await;
        assert_eq!(
            fx.complete(&a, result).await.ok()["call_state"],
            "completed"
        );
    }
}

// ================================================================ grants

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grant_is_scoped_to_one_call_and_assignment() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    let b = fx.running(&c, &run.run_id, &run.calls[1]).await;
    // a's grant for b's call (b's body)
    fx.receipt_with(&b.run_id, &b.call_id, Some(&a.grant), &progress(&b, 1))
        .await
        .err(403, "invalid_grant");
    fx.receipt_with(&b.run_id, &b.call_id, Some(&b.grant), &progress(&b, 1))
        .await
        .ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grant_of_closed_assignment_still_authenticates_retries_and_late_receipts() {
    let (fx, _c, a, _other) = two_call_run().await;
    let done = completed(&a, 1, charge_result());
    fx.receipt(&a, done.clone()).await.ok();
    // closed by a terminal call: identical retry 200, new receipt 409 (not 403)
    assert_eq!(fx.receipt(&a, done.clone()).await.ok()["replayed"], true);
    fx.receipt(&a, progress(&a, 2))
        .await
        .err(409, "call_already_terminal");
    // closed by an ended run: retry 200, late receipt 409 run_terminated (kept)
    fx.cancel(&a.run_id).await.ok();
    assert_eq!(fx.receipt(&a, done).await.ok()["replayed"], true);
    fx.receipt(&a, progress(&a, 3))
        .await
        .err(409, "run_terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receipts_are_authorized_by_grant_not_by_connection() {
    let fx = Fixture::with(Opts::lease(400)).await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    let b = fx.running(&c, &run.run_id, &run.calls[1]).await;
    fx.disconnect(&c, "detach").await.ok();
    fx.receipt(&a, progress(&a, 1)).await.ok();
    assert_eq!(
        fx.receipt(&a, completed(&a, 2, json!({}))).await.ok()["call_state"],
        "completed"
    );
    // and with no live lease at all
    sleep_ms(600).await;
    assert_eq!(
        fx.receipt(&b, completed(&b, 1, json!({}))).await.ok()["call_state"],
        "completed"
    );
}
