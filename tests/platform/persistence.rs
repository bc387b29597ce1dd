//! `--db` / `.db_path(..)`: all state survives a restart; identifiers are
//! never reused, with or without a database.

use serde_json::{Value, json};

use crate::common::*;

/// Every id-looking string (`xxx_` + 32 hex) anywhere in `v`.
fn ids_in(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => {
            if let Some((prefix, rest)) = s.split_once('_') {
                let known = ["agt", "agv", "bnd", "run", "call", "con", "asg", "grt"];
                if known.contains(&prefix) && rest.len() == 32 {
                    out.push(s.clone());
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|x| ids_in(x, out)),
        Value::Object(m) => m.values().for_each(|x| ids_in(x, out)),
        _ => {}
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_survives_a_restart_with_db_path() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Opts {
        db_path: Some(dir.path().join("platform.db")),
        ..Opts::default()
    };
    let mut fx = Fixture::with(opts.clone()).await;
    let run = fx
        .run(&[
            (CHARGE, charge_args()),
            (READ, json!({})),
            (READ, json!({})),
            (NOTE, json!({})),
        ])
        .await;
    let c = fx.connect("exe_a").await;
    let done = fx.running(&c, &run.run_id, &run.calls[0]).await;
    let prog = progress(&done, 1);
    fx.receipt(&done, prog.clone()).await.ok();
    let fin = completed(&done, 2, charge_result());
    fx.receipt(&done, fin.clone()).await.ok();
    let running = fx.running(&c, &run.run_id, &run.calls[1]).await;
    assert_eq!(
        fx.report1(&c, &run.run_id, &run.calls[1], "pending_delivery")
            .await,
        "updated"
    );
    let claimed = fx.claim_ok(&c, &run.run_id, &run.calls[2]).await;
    // a cancelled run with a late receipt
    let (run2, call2) = fx.run1(NOTE, json!({})).await;
    let late_asg = fx.running(&c, &run2, &call2).await;
    fx.cancel(&run2).await.ok();
    let late = completed(&late_asg, 1, json!({"big": "x".repeat(3000)}));
    fx.receipt(&late_asg, late.clone())
        .await
        .err(409, "run_terminated");

    let before_run = fx.get_run(&run.run_id).await;
    let before_run2 = fx.get_run(&run2).await;
    let version_path = format!("/agents/{}/versions/{}", fx.agent_id, fx.agent_version);
    let before_version = fx.srv.get(ADMIN, &version_path).await.ok().clone();
    let before_bindings = fx
        .srv
        .get(
            ADMIN,
            &format!("/executor-bindings?agent_id={}", fx.agent_id),
        )
        .await
        .ok()
        .clone();
    let before_diag = fx.diagnostics().await;
    let mut old_ids = Vec::new();
    for v in [
        &before_run,
        &before_run2,
        &before_version,
        &before_bindings,
        &before_diag,
        &c.answer,
    ] {
        ids_in(v, &mut old_ids);
    }
    old_ids.extend([
        fx.agent_id.clone(),
        fx.binding_id.clone(),
        fx.side_binding_id.clone(),
        fx.agent_version.clone(),
        run.run_id.clone(),
        run2.clone(),
        call2.clone(),
        c.connection_id.clone(),
    ]);
    old_ids.extend(run.calls.iter().cloned());
    for a in [&done, &running, &claimed, &late_asg] {
        old_ids.push(a.assignment_id.clone());
        old_ids.push(a.grant.clone());
    }

    fx.srv.stop().await;
    fx.srv = Srv::start_with(opts).await;

    // runs, calls, receipts (bodies), late receipts, projections
    assert_eq!(fx.get_run(&run.run_id).await, before_run);
    assert_eq!(fx.get_run(&run2).await, before_run2);
    assert_eq!(fx.srv.get(ADMIN, &version_path).await.ok(), &before_version);
    assert_eq!(
        fx.srv
            .get(
                ADMIN,
                &format!("/executor-bindings?agent_id={}", fx.agent_id)
            )
            .await
            .ok(),
        &before_bindings
    );
    let diag = fx.diagnostics().await;
    assert_eq!(
        diag["calls"], before_diag["calls"],
        "pending_delivery flag and states kept"
    );
    assert!(
        diag["executors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["executor_id"] == "exe_a"),
        "{diag}"
    );
    // stored receipts still replay; grants still work
    assert_eq!(fx.receipt(&done, fin).await.ok()["replayed"], true);
    assert_eq!(fx.receipt(&done, prog).await.ok()["replayed"], true);
    fx.receipt(&late_asg, late).await.err(409, "run_terminated");
    // executor identity: outstanding on reconnect with the same executor_id
    let c2 = fx.connect("exe_a").await;
    let out = c2.answer["outstanding"].as_array().unwrap().clone();
    assert_eq!(out.len(), 2, "{out:?}");
    assert!(out.iter().any(|o| o["call_id"] == running.call_id.as_str()
        && o["state"] == "running"
        && o["assignment_id"] == running.assignment_id.as_str()));
    assert!(out.iter().any(|o| o["call_id"] == claimed.call_id.as_str()
        && o["state"] == "claimed"
        && o["assignment_id"] == claimed.assignment_id.as_str()));
    // the claim's operation key still replays
    let v = fx
        .claim(&c2, &run.run_id, &run.calls[2], &claimed.operation_key)
        .await
        .ok()
        .clone();
    assert_eq!(v["replayed"], true);
    assert_eq!(v["assignment"]["grant"], claimed.grant.as_str());
    assert_eq!(
        fx.complete(&running, json!({})).await.ok()["call_state"],
        "completed"
    );

    // ids are never reused
    let agent = fx
        .srv
        .post(ADMIN, "/agents", json!({"name": "after"}))
        .await
        .ok()
        .clone();
    let b = fx
        .srv
        .post(
            ADMIN,
            "/executor-bindings",
            json!({"agent_id": agent["agent_id"], "name": "b", "tool_names": [READ]}),
        )
        .await
        .ok()
        .clone();
    let v = fx
        .srv
        .post(
            ADMIN,
            &format!("/agents/{}/versions", agent["agent_id"].as_str().unwrap()),
            json!({"tools": [read_tool(b["binding_id"].as_str().unwrap())]}),
        )
        .await
        .ok()
        .clone();
    let new_run = fx.run(&[(READ, json!({}))]).await;
    let a = fx.claim_ok(&c2, &new_run.run_id, &new_run.calls[0]).await;
    let fresh = [
        agent["agent_id"].clone(),
        b["binding_id"].clone(),
        v["agent_version"].clone(),
        json!(new_run.run_id),
        json!(new_run.calls[0]),
        json!(c2.connection_id),
        json!(a.assignment_id),
        json!(a.grant),
    ];
    for id in fresh {
        let id = id.as_str().unwrap().to_string();
        assert!(!old_ids.contains(&id), "id {id} reused after restart");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_memory_restart_loses_state_but_never_reuses_ids() {
    let mut fx = Fixture::new().await;
    let run = fx.run(&[(READ, json!({}))]).await;
    let c = fx.connect("exe_a").await;
    let a = fx.claim_ok(&c, &run.run_id, &run.calls[0]).await;
    let old = vec![
        fx.agent_id.clone(),
        fx.binding_id.clone(),
        fx.side_binding_id.clone(),
        fx.agent_version.clone(),
        run.run_id.clone(),
        run.calls[0].clone(),
        c.connection_id.clone(),
        a.assignment_id.clone(),
        a.grant.clone(),
    ];
    fx.srv.stop().await;
    let srv = Srv::start().await;
    // the platform lost its state
    srv.get(ADMIN, &format!("/runs/{}", run.run_id))
        .await
        .is(404);
    let ghost = srv
        .post(
            EXEC,
            "/executors/exe_a/heartbeat",
            json!({"connection_id": c.connection_id, "in_flight": []}),
        )
        .await;
    ghost.err(409, "lease_expired");
    // the same steps again give new ids
    let fx2 = Fixture::on(srv).await;
    let run2 = fx2.run(&[(READ, json!({}))]).await;
    let c2 = fx2.connect("exe_a").await;
    let a2 = fx2.claim_ok(&c2, &run2.run_id, &run2.calls[0]).await;
    for id in [
        &fx2.agent_id,
        &fx2.binding_id,
        &fx2.side_binding_id,
        &fx2.agent_version,
        &run2.run_id,
        &run2.calls[0],
        &c2.connection_id,
        &a2.assignment_id,
        &a2.grant,
    ] {
        assert!(!old.contains(id), "id {id} reused by a fresh platform");
    }
}

/// A forgotten run (`DevServer::forget_run`, a platform's own retention)
/// answers `404` wherever a path names it, a final receipt for it included
/// (the executor's call then goes `orphaned`), it leaves the heartbeat's
/// bound calls, and it stays forgotten after a restart; other runs are
/// untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgotten_run_is_gone_for_good() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Opts {
        db_path: Some(dir.path().join("platform.db")),
        ..Opts::default()
    };
    let mut fx = Fixture::with(opts.clone()).await;
    let (kept, kept_call) = fx.run1(READ, json!({})).await;
    let (gone, gone_call) = fx.run1(CHARGE, charge_args()).await;
    let c = fx.connect("exe_forget").await;
    let asg = fx.running(&c, &gone, &gone_call).await;
    fx.srv.forget_run(&gone).await.expect("forgotten");
    fx.get_run_resp(&gone).await.err(404, "unknown_run");
    fx.receipt(&asg, completed(&asg, 1, charge_result()))
        .await
        .err(404, "unknown_run");
    let beat = fx.heartbeat(&c, json!([])).await;
    assert!(
        !beat.ok().to_string().contains(&gone_call),
        "the heartbeat still names a call of the forgotten run: {beat:?}"
    );
    let again = fx.srv.forget_run(&gone).await;
    assert!(again.is_err(), "forgetting an unknown run succeeded");
    assert_eq!(fx.state(&kept, &kept_call).await, "pending");

    fx.srv.stop().await;
    let fx = Fixture::on(Srv::start_with(opts).await).await;
    fx.get_run_resp(&gone).await.err(404, "unknown_run");
    assert_eq!(
        fx.get_run(&kept).await["tool_calls"][0]["call_id"],
        kept_call.as_str()
    );
}
