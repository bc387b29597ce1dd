//! §5 Call states on the platform and run statuses, including run expiry.

use std::time::Instant;

use serde_json::json;

use crate::common::*;

/// Polls the run until its status is `want` or `ms` pass; answers the run.
async fn wait_status(fx: &Fixture, run_id: &str, want: &str, ms: u64) -> serde_json::Value {
    let end = deadline(ms);
    loop {
        let run = fx.get_run(run_id).await;
        if run["status"] == want {
            return run;
        }
        assert!(Instant::now() < end, "run never became {want}: {run}");
        sleep_ms(50).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_states_pending_claimed_running_completed() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    assert_eq!(fx.state(&run_id, &call_id).await, "pending");
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run_id, &call_id).await;
    assert_eq!(fx.state(&run_id, &call_id).await, "claimed");
    fx.receipt(&a, accepted(&a)).await.ok();
    assert_eq!(fx.state(&run_id, &call_id).await, "running");
    fx.receipt(&a, progress(&a, 1)).await.ok();
    assert_eq!(fx.state(&run_id, &call_id).await, "running");
    fx.receipt(&a, completed(&a, 2, json!({}))).await.ok();
    assert_eq!(fx.state(&run_id, &call_id).await, "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_state_claimed_returns_to_pending_when_its_assignment_is_released() {
    let fx = Fixture::new().await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    fx.claim_ok(&c, &run_id, &call_id).await;
    fx.report1(&c, &run_id, &call_id, "released").await;
    let run = fx.get_run(&run_id).await;
    assert_eq!(call_in(&run, &call_id)["state"], "pending");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn call_state_reconciliation_required_settled_by_a_later_final_receipt() {
    let fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    let b = fx.running(&c, &run.run_id, &run.calls[1]).await;
    for (x, call) in [(&a, &run.calls[0]), (&b, &run.calls[1])] {
        fx.report1(&c, &run.run_id, call, "reconciliation_required")
            .await;
        assert_eq!(fx.state(&run.run_id, call).await, "reconciliation_required");
        // progress is accepted meanwhile
        fx.receipt(x, progress(x, 1)).await.ok();
    }
    assert_eq!(
        fx.receipt(&a, completed(&a, 2, json!({}))).await.ok()["call_state"],
        "completed"
    );
    assert_eq!(
        fx.receipt(&b, failed(&b, 2, "declined")).await.ok()["call_state"],
        "failed"
    );
    assert_eq!(fx.get_run(&run.run_id).await["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_status_completed_when_every_call_is_terminal() {
    let fx = Fixture::new().await;
    let run = fx
        .run(&[(READ, json!({})), (READ, json!({})), (READ, json!({}))])
        .await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.complete(&a, json!({})).await.ok();
    assert_eq!(fx.get_run(&run.run_id).await["status"], "active");
    let b = fx.running(&c, &run.run_id, &run.calls[1]).await;
    fx.receipt(&b, cancelled(&b, 1)).await.ok();
    assert_eq!(fx.get_run(&run.run_id).await["status"], "active");
    let d = fx.claim_ok(&c, &run.run_id, &run.calls[2]).await;
    fx.receipt(&d, failed(&d, 0, "invalid_arguments"))
        .await
        .ok();
    assert_eq!(fx.get_run(&run.run_id).await["status"], "completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn platform_cancel_gives_terminated_business_cancel_gives_cancelled() {
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
    let biz = fx.running(&c, &run.run_id, &run.calls[0]).await;
    fx.receipt(&biz, cancelled(&biz, 1)).await.ok();
    fx.claim_ok(&c, &run.run_id, &run.calls[1]).await;
    fx.running(&c, &run.run_id, &run.calls[2]).await;
    let r = fx.cancel(&run.run_id).await;
    r.ok();
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(got["status"], "cancelled");
    assert_eq!(call_in(&got, &run.calls[0])["state"], "cancelled");
    for call in &run.calls[1..] {
        assert_eq!(call_in(&got, call)["state"], "terminated", "{got}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_expires_after_run_ttl_without_call_changes() {
    let fx = Fixture::with(Opts::run_ttl(300)).await;
    let run = fx.run(&[(READ, json!({})), (READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.running(&c, &run.run_id, &run.calls[0]).await;
    let got = wait_status(&fx, &run.run_id, "expired", 3000).await;
    for call in &run.calls {
        assert_eq!(call_in(&got, call)["state"], "terminated", "{got}");
    }
    // a late receipt to an expired run: 409 run_terminated, kept, not revived
    let late = completed(&a, 1, json!({}));
    fx.receipt(&a, late.clone())
        .await
        .err(409, "run_terminated");
    let got = fx.get_run(&run.run_id).await;
    assert_eq!(got["status"], "expired");
    assert!(
        call_in(&got, &run.calls[0])["late_receipts"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["body"] == late)
    );
    // and the executor is told
    let hb = fx
        .heartbeat(&c, json!([{"run_id": run.run_id, "call_id": run.calls[0]}]))
        .await;
    assert!(
        has_pair(&hb.ok()["cancel_requested"], &run.run_id, &run.calls[0]),
        "{hb:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_ttl_counts_from_the_last_call_change() {
    let fx = Fixture::with(Opts::run_ttl(900)).await;
    let (run_id, call_id) = fx.read_call().await;
    let c = fx.connect("exe_a").await;
    sleep_ms(600).await;
    let started = Instant::now();
    fx.claim_ok(&c, &run_id, &call_id).await; // a call change
    sleep_ms(600).await; // 1.2 s after creation, 0.6 s after the change
    if started.elapsed().as_millis() < 850 {
        assert_eq!(fx.get_run(&run_id).await["status"], "active");
    }
    wait_status(&fx, &run_id, "expired", 3000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_not_expired_while_a_live_executor_flagged_a_bound_call_pending_delivery() {
    let fx = Fixture::with(Opts::run_ttl(400)).await;
    let c = fx.connect("exe_a").await;
    let (run_id, call_id) = fx.read_call().await;
    fx.running(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "pending_delivery").await,
        "updated"
    );
    // a control run without the flag expires meanwhile
    let (control, _) = fx.read_call().await;
    let end = deadline(3000);
    loop {
        fx.heartbeat(&c, json!([{"run_id": run_id, "call_id": call_id}]))
            .await
            .ok();
        if fx.get_run(&control).await["status"] == "expired" {
            break;
        }
        assert!(Instant::now() < end, "control run never expired");
        sleep_ms(100).await;
    }
    for _ in 0..5 {
        fx.heartbeat(&c, json!([{"run_id": run_id, "call_id": call_id}]))
            .await
            .ok();
        sleep_ms(100).await;
    }
    let got = fx.get_run(&run_id).await;
    assert_eq!(got["status"], "active", "{got}");
    assert_eq!(call_in(&got, &call_id)["state"], "running");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_expires_once_the_flagging_executor_is_no_longer_live() {
    let fx = Fixture::with(Opts {
        run_ttl_ms: 300,
        lease_ttl_ms: 600,
        ..Opts::default()
    })
    .await;
    let c = fx.connect("exe_a").await;
    let (run_id, call_id) = fx.read_call().await;
    fx.running(&c, &run_id, &call_id).await;
    assert_eq!(
        fx.report1(&c, &run_id, &call_id, "pending_delivery").await,
        "updated"
    );
    // no more heartbeats: the lease runs out, then nothing holds the run
    wait_status(&fx, &run_id, "expired", 4000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_ttl_zero_never_expires() {
    let fx = Fixture::with(Opts::run_ttl(0)).await;
    let (run_id, _) = fx.read_call().await;
    sleep_ms(500).await;
    assert_eq!(fx.get_run(&run_id).await["status"], "active");
}
