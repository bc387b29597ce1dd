//! §4 Executor connection: connect, supersede, heartbeat and lease expiry,
//! capacity, pending candidates, stream, report, disconnect.

use serde_json::{Value, json};

use crate::common::*;

// ---------------------------------------------------------------- connect

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_answers_connection_lease_interval_stream_path_and_outstanding() {
    let fx = Fixture::with(Opts {
        lease_ttl_ms: 12_345,
        heartbeat_interval_ms: 2_345,
        ..Opts::default()
    })
    .await;
    let c = fx.connect("exe_payments_01").await;
    let v = &c.answer;
    assert_eq!(v["executor_id"], "exe_payments_01");
    assert_id(&v["connection_id"], "con_");
    assert_eq!(v["heartbeat_interval_ms"], 2345);
    assert_eq!(v["lease_ttl_ms"], 12345);
    assert_eq!(v["stream_path"], "/v1/executors/exe_payments_01/stream");
    assert_eq!(v["outstanding"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_tools_must_be_a_subset_of_the_bindings_tool_names() {
    let fx = Fixture::new().await;
    let r = fx
        .connect_raw(fx.connect_body("exe_a", &[READ, SIDE], 2))
        .await;
    r.bad("unknown_tool");
    let param = r.param().as_str().unwrap_or("");
    assert!(
        param == "tools" || param.starts_with("tools["),
        "param names the field: {r:?}"
    );
    fx.connect_raw(fx.connect_body("exe_a", &[READ, "no.such"], 2))
        .await
        .bad("unknown_tool");
    fx.connect_raw(fx.connect_body("exe_a", &[], 2))
        .await
        .is(400);
    fx.connect_raw(fx.connect_body("exe_a", &[READ, READ], 2))
        .await
        .is(400);
    fx.connect_raw(fx.connect_body("exe_a", &[READ], 2))
        .await
        .ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_executor_id_is_1_to_128_of_the_allowed_characters() {
    let fx = Fixture::new().await;
    for bad in [
        String::new(),
        "x".repeat(129),
        "exe a".into(),
        "exe/a".into(),
        "exé".into(),
    ] {
        let r = fx.connect_raw(fx.connect_body(&bad, &[READ], 1)).await;
        r.envelope();
        assert_eq!(r.status, 400, "{bad:?}: {r:?}");
    }
    for good in ["x".repeat(128), "Az09_.:-".into()] {
        fx.connect_raw(fx.connect_body(&good, &[READ], 1))
            .await
            .ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_capacity_is_an_integer_1_to_1024() {
    let fx = Fixture::new().await;
    for bad in [
        json!(0),
        json!(1025),
        json!(-1),
        json!(1.5),
        json!("4"),
        json!(null),
    ] {
        let mut body = fx.connect_body("exe_a", &[READ], 1);
        body["capacity"] = bad.clone();
        let r = fx.connect_raw(body).await;
        r.envelope();
        assert_eq!(r.status, 400, "{bad}: {r:?}");
    }
    for good in [1, 1024] {
        fx.connect_raw(fx.connect_body("exe_a", &[READ], good))
            .await
            .ok();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_outstanding_lists_calls_still_bound_to_the_executor_identity() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[
            (READ, json!({})),
            (READ, json!({})),
            (READ, json!({})),
            (READ, json!({})),
            (READ, json!({})),
        ])
        .await;
    let c = fx.connect("exe_a").await;
    let claimed = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let running = fx.running(&c, &run.run_id, &run.calls[1]).await;
    let recon = fx.running(&c, &run.run_id, &run.calls[2]).await;
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[2], "reconciliation_required")
            .await,
        "updated"
    );
    let done = fx.running(&c, &run.run_id, &run.calls[3]).await;
    fx.complete(&done, json!({})).await.ok();
    // a restarted process connects again
    let c2 = fx.connect("exe_a").await;
    let out = c2.answer["outstanding"].as_array().unwrap().clone();
    assert_eq!(out.len(), 3, "{out:?}");
    for (a, state) in [
        (&claimed, "claimed"),
        (&running, "running"),
        (&recon, "reconciliation_required"),
    ] {
        let item = out
            .iter()
            .find(|o| o["call_id"] == a.call_id.as_str())
            .unwrap_or_else(|| panic!("{state} missing: {out:?}"));
        assert_eq!(item["run_id"], a.run_id.as_str());
        assert_eq!(item["assignment_id"], a.assignment_id.as_str());
        assert_eq!(item["state"], state);
    }
    // another executor identity sees none of them
    let other = fx.connect("exe_b").await;
    assert_eq!(other.answer["outstanding"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_supersedes_previous_connection_with_409_naming_new_instance_id() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let old = fx.connect("exe_a").await;
    let mut body = fx.connect_body("exe_a", &[READ, CHARGE, NOTE], 8);
    body["instance_id"] = json!("ins_second_process_7f3a");
    let r = fx.connect_raw(body).await;
    let new_con = r.ok()["connection_id"].as_str().unwrap().to_string();
    assert_ne!(new_con, old.connection_id);
    let checks = vec![
        fx.heartbeat(&old, json!([])).await,
        fx.pending(&old, "").await,
        fx.claim(&old, &run.run_id, &run.calls[0], "k_old").await,
        fx.report(
            &old,
            json!([{"run_id": run.run_id, "call_id": run.calls[0], "state": "released"}]),
        )
        .await,
        fx.disconnect(&old, "drain").await,
    ];
    for r in checks {
        r.err(409, "connection_superseded");
        let msg = r.json["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("ins_second_process_7f3a"),
            "message must name the new instance_id: {msg}"
        );
    }
    // the new connection works, the old one changed nothing
    let new = Conn {
        connection_id: new_con,
        ..old.clone()
    };
    fx.heartbeat(&new, json!([])).await.ok();
    assert_eq!(fx.state(&run.run_id, &run.calls[0]).await, "pending");
    fx.claim_ok(&new, &run.run_id, &run.calls[1]).await;
    assert_eq!(fx.exec_diag("exe_a").await["status"], "online");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_supersede_keeps_the_executors_calls_bound() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let claimed = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let running = fx.running(&c, &run.run_id, &run.calls[1]).await;
    let c2 = fx.connect("exe_a").await;
    assert_eq!(c2.answer["outstanding"].as_array().unwrap().len(), 2);
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(call_in(&got, &run.calls[0])["state"], "claimed");
    assert_eq!(call_in(&got, &run.calls[1])["state"], "running");
    // the grants keep working: receipts are authorized by grant, not connection
    assert_eq!(
        fx.receipt(&claimed, accepted(&claimed)).await.ok()["accepted"],
        true
    );
    assert_eq!(
        fx.complete(&running, json!({})).await.ok()["call_state"],
        "completed"
    );
}

// ---------------------------------------------------------------- heartbeat and lease

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_answers_lease_expiry_interval_and_cancel_requested() {
    let fx = Fixture::with(Opts {
        heartbeat_interval_ms: 1_234,
        ..Opts::default()
    })
    .await;
    let c = fx.connect("exe_a").await;
    let r = fx.heartbeat(&c, json!([])).await;
    let v = r.ok();
    assert_ts(&v["lease_expires_at"]);
    assert_eq!(v["heartbeat_interval_ms"], 1234);
    assert_eq!(v["cancel_requested"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_cancel_requested_lists_cancelled_in_flight_calls_and_unannounced_ones_once() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.running(&c, &run.run_id, &run.calls[1]).await;
    let before = fx
        .heartbeat(&c, json!([{"run_id": run.run_id, "call_id": run.calls[0]}]))
        .await;
    assert_eq!(before.ok()["cancel_requested"], json!([]));
    fx.cancel(&run.run_id).await.ok();
    // choices 18: listed while in in_flight, plus not yet announced ones
    let listed = json!([{"run_id": run.run_id, "call_id": run.calls[1]}]);
    let first = fx.heartbeat(&c, listed.clone()).await;
    let cr = first.ok()["cancel_requested"].clone();
    assert!(
        has_pair(&cr, &run.run_id, &run.calls[0]) && has_pair(&cr, &run.run_id, &run.calls[1]),
        "{cr}"
    );
    // calls[0] was announced and is not in flight: not again
    let second = fx.heartbeat(&c, listed.clone()).await;
    assert_eq!(second.ok()["cancel_requested"], listed);
    assert_eq!(
        fx.heartbeat(&c, json!([])).await.ok()["cancel_requested"],
        json!([])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_renews_the_lease() {
    let fx = Fixture::with(Opts::lease(600)).await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    for _ in 0..6 {
        sleep_ms(200).await;
        fx.heartbeat(&c, json!([{"run_id": run_id, "call_id": call_id}]))
            .await
            .ok();
    }
    // 1.2 s > lease: still online, the claim still held
    assert_eq!(fx.exec_diag("exe_a").await["status"], "online");
    assert_eq!(fx.state(&run_id, &call_id).await, "claimed");
    assert_eq!(fx.receipt(&a, accepted(&a)).await.ok()["accepted"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_on_expired_lease_is_409_lease_expired() {
    let fx = Fixture::with(Opts::lease(300)).await;
    let c = fx.connect("exe_a").await;
    sleep_ms(600).await;
    fx.heartbeat(&c, json!([])).await.err(409, "lease_expired");
    // connect again, then continue
    let c2 = fx.connect("exe_a").await;
    fx.heartbeat(&c2, json!([])).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_returns_claimed_calls_to_pending_and_releases_their_grants() {
    let fx = Fixture::with(Opts::lease(500)).await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let claimed = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let running = fx.running(&c, &run.run_id, &run.calls[1]).await;
    sleep_ms(800).await;
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(
        call_in(&got, &run.calls[0])["state"],
        "pending",
        "claimed call back to pending: {got}"
    );
    // its grant stops working
    fx.receipt(&claimed, accepted(&claimed))
        .await
        .err(403, "invalid_grant");
    // the running call stays bound to the identity
    let r = call_in(&got, &run.calls[1]);
    assert_eq!(r["state"], "running");
    assert_eq!(r["executor_id"], "exe_a");
    assert_eq!(r["assignment_id"], running.assignment_id.as_str());
    // the executor shows offline; a reconnect gets the running call back
    assert_eq!(fx.exec_diag("exe_a").await["status"], "offline");
    let c2 = fx.connect("exe_a").await;
    let out = c2.answer["outstanding"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(out[0]["call_id"], running.call_id.as_str());
    assert_eq!(out[0]["state"], "running");
    // and the released call can be claimed again by anyone
    let other = fx.connect("exe_b").await;
    let again = fx.claim_ok(&other, &run.run_id, &run.calls[0]).await;
    assert_ne!(again.assignment_id, claimed.assignment_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expiry_keeps_reconciliation_required_calls_bound() {
    let fx = Fixture::with(Opts::lease(500)).await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "reconciliation_required")
            .await,
        "updated"
    );
    sleep_ms(800).await;
    let got = fx.get_run(&run_id).await;
    assert_eq!(call_in(&got, &call_id)["state"], "reconciliation_required");
    assert_eq!(call_in(&got, &call_id)["executor_id"], "exe_a");
    // grant still works: a final receipt settles it
    assert_eq!(
        fx.complete(&a, json!({})).await.ok()["call_state"],
        "completed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_expired_executor_shows_offline_without_waiting_for_a_sweep() {
    let fx = Fixture::with(Opts::lease(300)).await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.claim_ok(&c, &run_id, &call_id).await;
    let hb = fx.heartbeat(&c, json!([])).await;
    let _ = hb.ok();
    // poll from just after the lease ends: at most 150 ms of slack
    sleep_ms(450).await;
    assert_eq!(fx.exec_diag("exe_a").await["status"], "offline");
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
}

// ---------------------------------------------------------------- capacity

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claim_beyond_capacity_is_409_capacity_exhausted() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect_with("exe_a", &[READ], 2).await;
    let a = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    fx.running(&c, &run.run_id, &run.calls[1]).await;
    fx.claim(&c, &run.run_id, &run.calls[2], &uid("op"))
        .await
        .err(409, "capacity_exhausted");
    assert_eq!(fx.state(&run.run_id, &run.calls[2]).await, "pending");
    // a slot frees when a call ends
    fx.receipt(&a, accepted(&a)).await.ok();
    fx.complete(&a, json!({})).await.ok();
    fx.claim_ok(&c, &run.run_id, &run.calls[2]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_does_not_count_reconciliation_required_calls() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect_with("exe_a", &[READ], 1).await;
    fx.running(&c, &run.run_id, &run.calls[0]).await;
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[0], "reconciliation_required")
            .await,
        "updated"
    );
    fx.claim_ok(&c, &run.run_id, &run.calls[1]).await;
}

// ---------------------------------------------------------------- pending

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_lists_only_pending_calls() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[
            (READ, json!({})),
            (READ, json!({})),
            (READ, json!({})),
            (READ, json!({})),
        ])
        .await;
    let c = fx.connect("exe_a").await;
    fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let done = fx.running(&c, &run.run_id, &run.calls[1]).await;
    fx.complete(&done, json!({})).await.ok();
    fx.running(&c, &run.run_id, &run.calls[2]).await;
    let p = fx.pending(&c, "").await;
    let ids: Vec<&str> = p.ok()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["call_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![run.calls[3].as_str()]);
    // a cancelled run's calls are not pending
    fx.cancel(&run.run_id).await.ok();
    assert_eq!(fx.pending(&c, "").await.ok()["data"], json!([]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_lists_only_this_executors_tools() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[
            (READ, json!({})),
            (CHARGE, charge_args()),
            (SIDE, json!({})),
            (NOTE, json!({})),
        ])
        .await;
    let c = fx.connect_with("exe_a", &[READ, NOTE], 4).await;
    let p = fx.pending(&c, "").await;
    let data = p.ok()["data"].as_array().unwrap().clone();
    let tools: Vec<&str> = data
        .iter()
        .map(|x| x["tool_name"].as_str().unwrap())
        .collect();
    assert_eq!(tools, vec![READ, NOTE], "{data:?}");
    assert_eq!(data[0]["run_id"], run.run_id.as_str());
    assert_eq!(data[0]["call_id"], run.calls[0].as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_lists_oldest_first() {
    let fx = Fixture::new().await;
    let mut want = Vec::new();
    for _ in 0..3 {
        let (_, call_id) = fx.read_call().await;
        want.push(call_id);
        sleep_ms(15).await;
    }
    let r2 = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    want.extend(r2.calls.clone());
    let c = fx.connect("exe_a").await;
    let p = fx.pending(&c, "").await;
    let got: Vec<String> = p.ok()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["call_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_limit_is_1_to_100_default_50() {
    let fx = Fixture::new().await;
    let calls: Vec<(&str, Value)> = (0..55).map(|_| (READ, json!({}))).collect();
    fx.run(&calls).await;
    let c = fx.connect("exe_a").await;
    let p = fx.pending(&c, "").await;
    let v = p.ok();
    assert_eq!(v["data"].as_array().unwrap().len(), 50, "default limit 50");
    assert!(v["next_cursor"].is_string(), "more remain: {v}");
    let p = fx.pending(&c, "&limit=100").await;
    assert_eq!(p.ok()["data"].as_array().unwrap().len(), 55);
    assert!(p.json["next_cursor"].is_null());
    let p = fx.pending(&c, "&limit=1").await;
    assert_eq!(p.ok()["data"].as_array().unwrap().len(), 1);
    for bad in ["0", "101", "-1", "abc", "1.5", "99999999999999999999999"] {
        let r = fx.pending(&c, &format!("&limit={bad}")).await;
        r.bad(r.code());
        r.param_is("limit");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_cursor_pages_through_every_call_once() {
    let fx = Fixture::new().await;
    let calls: Vec<(&str, Value)> = (0..7).map(|_| (READ, json!({}))).collect();
    let run = fx.run(&calls).await;
    let c = fx.connect("exe_a").await;
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..10 {
        let q = match &cursor {
            Some(cur) => format!("&limit=3&cursor={cur}"),
            None => "&limit=3".to_string(),
        };
        let p = fx.pending(&c, &q).await;
        let v = p.ok().clone();
        let page = v["data"].as_array().unwrap();
        assert!(page.len() <= 3);
        seen.extend(
            page.iter()
                .map(|x| x["call_id"].as_str().unwrap().to_string()),
        );
        match v["next_cursor"].as_str() {
            Some(n) => cursor = Some(n.to_string()),
            None => break,
        }
    }
    assert_eq!(seen, run.calls);
    fx.pending(&c, "&cursor=%%%not-a-cursor")
        .await
        .bad("invalid_cursor");
    fx.pending(&c, "&cursor=garbage")
        .await
        .bad("invalid_cursor");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_candidates_carry_no_arguments_and_no_grant() {
    let fx = Fixture::new().await;
    fx.run1(CHARGE, charge_args()).await;
    let c = fx.connect("exe_a").await;
    let p = fx.pending(&c, "").await;
    let item = p.ok()["data"][0].as_object().unwrap().clone();
    for k in item.keys() {
        assert!(
            ["run_id", "call_id", "tool_name", "created_at"].contains(&k.as_str()),
            "unexpected member {k} in {item:?}"
        );
    }
    for k in ["run_id", "call_id", "tool_name", "created_at"] {
        assert!(item.contains_key(k), "missing {k}");
    }
    assert!(!item.contains_key("arguments") && !item.contains_key("grant"));
    // being listed gives no right: a receipt without a claim is refused
    let run_id = item["run_id"].as_str().unwrap();
    let call_id = item["call_id"].as_str().unwrap();
    let r = fx
        .receipt_with(run_id, call_id, None, &json!({"receipt_id": "r1", "executor_id": "exe_a",
                                                     "assignment_id": "asg_x", "sequence": 0, "kind": "accepted"}))
        .await;
    r.err(403, "invalid_grant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_listing_still_works_while_draining() {
    let fx = Fixture::new().await;
    let (_, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.disconnect(&c, "drain").await.ok();
    let p = fx.pending(&c, "").await;
    assert_eq!(p.ok()["data"][0]["call_id"], call_id.as_str());
}

// ---------------------------------------------------------------- stream

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_sends_call_pending_frames() {
    let fx = Fixture::new().await;
    let c = fx.connect("exe_a").await;
    let mut ws = fx.open_stream(&c).await.expect("stream opens");
    let (run_id, call_id) = fx.run1(CHARGE, charge_args()).await;
    let f = frame_for(&mut ws, "call.pending", &call_id, 3000)
        .await
        .expect("call.pending frame");
    assert_eq!(
        f,
        json!({"type": "call.pending", "run_id": run_id, "call_id": call_id, "tool_name": CHARGE})
    );
    // added calls are announced too, and can be claimed straight from the frame
    let added = fx.add_calls(&run_id, &[(READ, json!({}))]).await;
    let f = frame_for(&mut ws, "call.pending", &added[0], 3000)
        .await
        .expect("frame for added call");
    let a = fx
        .claim_ok(
            &c,
            f["run_id"].as_str().unwrap(),
            f["call_id"].as_str().unwrap(),
        )
        .await;
    assert_eq!(a.call_id, added[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_sends_call_cancel_requested_frames() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run_id, &call_id).await;
    let mut ws = fx.open_stream(&c).await.expect("stream opens");
    fx.cancel(&run_id).await.ok();
    let f = frame_for(&mut ws, "call.cancel_requested", &call_id, 3000)
        .await
        .expect("cancel frame");
    assert_eq!(
        f,
        json!({"type": "call.cancel_requested", "run_id": run_id, "call_id": call_id})
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_is_live_only_and_never_replays() {
    let fx = Fixture::new().await;
    let (_, old_call) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let mut ws = fx.open_stream(&c).await.expect("stream opens");
    let (_, new_call) = fx.read_call().await;
    let mut frames = Vec::new();
    let end = deadline(3000);
    loop {
        let f = next_frame(&mut ws, 500).await;
        if let Some(f) = f {
            let is_new = f["call_id"] == new_call.as_str();
            frames.push(f);
            if is_new {
                break;
            }
        }
        assert!(
            std::time::Instant::now() < end,
            "no frame for the new call: {frames:?}"
        );
    }
    // a little longer, in case a replay comes late
    while let Some(f) = next_frame(&mut ws, 300).await {
        frames.push(f);
    }
    assert!(
        frames.iter().all(|f| f["call_id"] != old_call.as_str()),
        "a call pending before the stream opened was replayed: {frames:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_needs_a_live_connection_and_a_token() {
    let fx = Fixture::new().await;
    let c = fx.connect("exe_a").await;
    let http_status = |r: Result<Ws, tokio_tungstenite::tungstenite::Error>| match r {
        Err(tokio_tungstenite::tungstenite::Error::Http(resp)) => resp.status().as_u16(),
        Err(other) => panic!("expected an HTTP refusal, got {other:?}"),
        Ok(_) => panic!("the stream opened"),
    };
    let e = fx
        .open_stream_raw("exe_a", "connection_id=con_never_issued", Some(EXEC))
        .await;
    assert_eq!(http_status(e), 409);
    let e = fx
        .open_stream_raw("exe_a", &format!("connection_id={}", c.connection_id), None)
        .await;
    assert_eq!(http_status(e), 401);
    let e = fx
        .open_stream_raw(
            "exe_a",
            &format!("connection_id={}", c.connection_id),
            Some(EXECUTE_ONLY),
        )
        .await;
    assert_eq!(http_status(e), 403);
    fx.open_stream(&c).await.expect("the right request opens");
}

// ---------------------------------------------------------------- report

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_answers_updated_count_and_one_result_per_call() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.running(&c, &run.run_id, &run.calls[1]).await;
    fx.claim_ok(&c, &run.run_id, &run.calls[2]).await;
    let r = fx
        .report(
            &c,
            json!([
                {"run_id": run.run_id, "call_id": run.calls[0], "state": "reconciliation_required",
                 "reason": "handler returned an error after accepted"},
                {"run_id": run.run_id, "call_id": run.calls[1], "state": "pending_delivery", "receipt_id": "rcp_5"},
                {"run_id": run.run_id, "call_id": run.calls[2], "state": "reconciliation_required"}
            ]),
        )
        .await;
    let v = r.ok();
    assert_eq!(v["updated"], 2, "{v}");
    let res = v["results"].as_array().unwrap();
    assert_eq!(res.len(), 3);
    for (i, outcome) in ["updated", "updated", "not_applicable"].iter().enumerate() {
        assert_eq!(res[i]["run_id"], run.run_id.as_str());
        assert_eq!(res[i]["call_id"], run.calls[i].as_str());
        assert_eq!(res[i]["outcome"], *outcome, "{v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_updated_reconciliation_required_from_running() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "reconciliation_required")
            .await,
        "updated"
    );
    let run = fx.get_run(&run_id).await;
    assert_eq!(call_in(&run, &call_id)["state"], "reconciliation_required");
    assert_eq!(run["status"], "active", "the run waits");
    assert_eq!(
        fx.diagnostics().await["calls"]["reconciliation_required"],
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_updated_released_returns_call_to_pending_and_releases_assignment() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "released").await,
        "updated"
    );
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
    fx.receipt(&a, accepted(&a)).await.err(403, "invalid_grant");
    let p = fx.pending(&c, "").await;
    assert_eq!(p.ok()["data"][0]["call_id"], call_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_updated_pending_delivery_flags_a_bound_call() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    fx.running(&c, &run.run_id, &run.calls[1]).await;
    fx.running(&c, &run.run_id, &run.calls[2]).await;
    fx.report1(&c, &run.run_id, &run.calls[2], "reconciliation_required")
        .await;
    for call in &run.calls {
        assert_eq!(
            fx.report1(&c, &run.run_id, call, "pending_delivery").await,
            "updated",
            "{call}"
        );
    }
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(
        call_in(&got, &run.calls[0])["state"],
        "claimed",
        "a flag, not a state"
    );
    assert_eq!(call_in(&got, &run.calls[1])["state"], "running");
    assert_eq!(fx.diagnostics().await["calls"]["pending_delivery"], 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_unchanged_when_already_so() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.running(&c, &run.run_id, &run.calls[1]).await;
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[0], "reconciliation_required")
            .await,
        "updated"
    );
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[0], "reconciliation_required")
            .await,
        "unchanged"
    );
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[1], "pending_delivery")
            .await,
        "updated"
    );
    let r = fx
        .report(
            &c,
            json!([{"run_id": run.run_id, "call_id": run.calls[1], "state": "pending_delivery"}]),
        )
        .await;
    assert_eq!(r.ok()["results"][0]["outcome"], "unchanged");
    assert_eq!(r.json["updated"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_terminal_when_the_call_already_ended() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.complete(&a, json!({})).await.ok();
    for state in ["reconciliation_required", "pending_delivery", "released"] {
        assert_eq!(
            fx.report1(&c, &run.run_id, &run.calls[0], state).await,
            "terminal",
            "{state}"
        );
    }
    assert_eq!(fx.state(&run.run_id, &run.calls[0]).await, "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_run_terminated_when_the_run_was_cancelled() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run_id, &call_id).await;
    fx.cancel(&run_id).await.ok();
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "reconciliation_required")
            .await,
        "run_terminated"
    );
    assert_eq!(fx.state(&run_id, &call_id).await, "terminated");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_not_applicable_when_transition_not_allowed() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    fx.running(&c, &run.run_id, &run.calls[1]).await;
    // reconciliation_required only from running; released only from claimed
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[0], "reconciliation_required")
            .await,
        "not_applicable"
    );
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[1], "released").await,
        "not_applicable"
    );
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(call_in(&got, &run.calls[0])["state"], "claimed");
    assert_eq!(call_in(&got, &run.calls[1])["state"], "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_outcome_not_bound_when_the_call_is_not_this_executors() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    fx.running(&a, &run.run_id, &run.calls[0]).await;
    assert_eq!(
        fx.report1(&b, &run.run_id, &run.calls[0], "reconciliation_required")
            .await,
        "not_bound"
    );
    assert_eq!(
        fx.report1(&b, &run.run_id, &run.calls[1], "released").await,
        "not_bound",
        "a pending call is bound to no one"
    );
    assert_eq!(fx.state(&run.run_id, &run.calls[0]).await, "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_precedence_not_bound_beats_unchanged_after_release() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.claim_ok(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "released").await,
        "updated"
    );
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "released").await,
        "not_bound"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_precedence_not_bound_beats_run_terminated() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    fx.running(&a, &run_id, &call_id).await;
    fx.cancel(&run_id).await.ok();
    assert_eq!(
        fx.report1(&b, &run_id, &call_id, "reconciliation_required")
            .await,
        "not_bound"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_precedence_not_bound_beats_terminal() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    let asg = fx.running(&a, &run.run_id, &run.calls[0]).await;
    fx.complete(&asg, json!({})).await.ok();
    assert_eq!(
        fx.report1(&b, &run.run_id, &run.calls[0], "reconciliation_required")
            .await,
        "not_bound"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_precedence_run_terminated_beats_terminal() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let asg = fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.complete(&asg, json!({})).await.ok();
    fx.cancel(&run.run_id).await.ok();
    assert_eq!(fx.state(&run.run_id, &run.calls[0]).await, "completed");
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[0], "reconciliation_required")
            .await,
        "run_terminated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_precedence_run_terminated_beats_terminal_on_a_terminated_call() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "pending_delivery").await,
        "updated"
    );
    fx.cancel(&run_id).await.ok();
    assert_eq!(fx.state(&run_id, &call_id).await, "terminated");
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "pending_delivery").await,
        "run_terminated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_precedence_unchanged_beats_not_applicable() {
    // reconciliation_required is allowed only from running; the call is
    // already so: unchanged, not not_applicable.
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run_id, &call_id).await;
    fx.report1(&c, &run_id, &call_id, "reconciliation_required")
        .await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "reconciliation_required")
            .await,
        "unchanged"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_precedence_terminal_beats_not_applicable() {
    // released is allowed only from claimed: on a completed call both
    // terminal and not_applicable apply.
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.complete(&a, json!({})).await.ok();
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[0], "released").await,
        "terminal"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_nothing_changes_for_a_call_whose_outcome_is_not_updated() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let a = fx.connect("exe_a").await;
    let b = fx.connect("exe_b").await;
    fx.claim_ok(&a, &run.run_id, &run.calls[0]).await;
    fx.running(&a, &run.run_id, &run.calls[1]).await;
    let before = fx.get_run(&run.run_id).await;
    let r = fx
        .report(
            &b,
            json!([{"run_id": run.run_id, "call_id": run.calls[0], "state": "released"},
                   {"run_id": run.run_id, "call_id": run.calls[1], "state": "pending_delivery"}]),
        )
        .await;
    assert_eq!(r.ok()["updated"], 0);
    assert_eq!(fx.get_run(&run.run_id).await, before);
    assert_eq!(fx.diagnostics().await["calls"]["pending_delivery"], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_unknown_call_makes_whole_request_400_and_changes_nothing() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.running(&c, &run_id, &call_id).await;
    let before = fx.get_run(&run_id).await;
    for (bad_run, bad_call) in [
        (run_id.as_str(), "call_missing"),
        ("run_missing", "call_missing"),
        ("run_missing", call_id.as_str()),
    ] {
        let r = fx
            .report(
                &c,
                json!([{"run_id": run_id, "call_id": call_id, "state": "reconciliation_required"},
                       {"run_id": bad_run, "call_id": bad_call, "state": "pending_delivery"}]),
            )
            .await;
        r.bad("unknown_call");
    }
    assert_eq!(fx.get_run(&run_id).await, before);
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "reconciliation_required")
            .await,
        "updated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_validates_state_and_list_size() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.claim_ok(&c, &run_id, &call_id).await;
    fx.report(
        &c,
        json!([{"run_id": run_id, "call_id": call_id, "state": "completed"}]),
    )
    .await
    .bad("invalid_state");
    fx.report(&c, json!([])).await.is(400);
    let many: Vec<Value> = (0..101)
        .map(|_| json!({"run_id": run_id, "call_id": call_id, "state": "pending_delivery"}))
        .collect();
    fx.report(&c, Value::Array(many)).await.is(400);
    assert_eq!(fx.state(&run_id, &call_id).await, "claimed");
}

// ---------------------------------------------------------------- disconnect

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_new_claims_get_409_executor_draining() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.disconnect(&c, "drain").await.ok();
    fx.claim(&c, &run_id, &call_id, &uid("op"))
        .await
        .err(409, "executor_draining");
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_releases_unaccepted_claims_at_once_and_keeps_running_calls() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let claimed = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let running = fx.running(&c, &run.run_id, &run.calls[1]).await;
    let r = fx.disconnect(&c, "drain").await;
    let v = r.ok();
    assert_eq!(
        v["released"],
        json!([{"run_id": run.run_id, "call_id": run.calls[0]}]),
        "{v}"
    );
    assert!(has_pair(&v["retained"], &run.run_id, &run.calls[1]), "{v}");
    assert!(!has_pair(&v["retained"], &run.run_id, &run.calls[0]), "{v}");
    assert_eq!(fx.state(&run.run_id, &run.calls[0]).await, "pending");
    fx.receipt(&claimed, accepted(&claimed))
        .await
        .err(403, "invalid_grant");
    assert_eq!(fx.state(&run.run_id, &run.calls[1]).await, "running");
    assert_eq!(running.call_id, run.calls[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_receipts_and_heartbeats_keep_working() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run_id, &call_id).await;
    fx.disconnect(&c, "drain").await.ok();
    fx.heartbeat(&c, json!([{"run_id": run_id, "call_id": call_id}]))
        .await
        .ok();
    fx.receipt(&a, progress(&a, 1)).await.ok();
    assert_eq!(
        fx.receipt(&a, completed(&a, 2, json!({}))).await.ok()["call_state"],
        "completed"
    );
    fx.heartbeat(&c, json!([])).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn detach_releases_unaccepted_claims_and_retains_running_calls() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let claimed = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let running = fx.running(&c, &run.run_id, &run.calls[1]).await;
    let r = fx.disconnect(&c, "detach").await;
    let v = r.ok();
    assert_eq!(
        v["released"],
        json!([{"run_id": run.run_id, "call_id": run.calls[0]}]),
        "{v}"
    );
    assert_eq!(
        v["retained"],
        json!([{"run_id": run.run_id, "call_id": run.calls[1]}]),
        "{v}"
    );
    assert_eq!(fx.state(&run.run_id, &run.calls[0]).await, "pending");
    fx.receipt(&claimed, accepted(&claimed))
        .await
        .err(403, "invalid_grant");
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(call_in(&got, &run.calls[1])["state"], "running");
    assert_eq!(call_in(&got, &run.calls[1])["executor_id"], "exe_a");
    assert_eq!(fx.exec_diag("exe_a").await["status"], "detached");
    // a later connect gets it back
    let c2 = fx.connect("exe_a").await;
    let out = c2.answer["outstanding"].as_array().unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(out[0]["assignment_id"], running.assignment_id.as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_mode_must_be_drain_or_detach() {
    let fx = Fixture::new().await;
    let c = fx.connect("exe_a").await;
    fx.disconnect(&c, "vanish").await.is(400);
    fx.heartbeat(&c, json!([])).await.ok();
    assert_eq!(fx.exec_diag("exe_a").await["status"], "online");
}
