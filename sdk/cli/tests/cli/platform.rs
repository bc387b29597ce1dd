//! The subcommands that reach a platform: resolve and redeliver delivering, `tools publish`, `tools dry-run`.

use super::*;

// ---------------------------------------------------------------- against a platform

#[test]
fn resolve_with_a_platform_delivers_at_once() {
    let p = Platform::start();
    let f = Fixture::empty();
    let (asg, accepted) = p.running_call(EXECUTOR);
    let call = import_running_call(&f, &asg, &accepted, LocalState::ReconciliationRequired);
    assert_eq!(p.platform_call(&asg.run_id)["state"], json!("running"));

    let result = f.write("r.json", r#"{"entry": 1234}"#);
    let out = f.run(&[
        "reconcile",
        "resolve",
        &call,
        "--completed",
        &result,
        "--evidence",
        "ledger entry 1234",
        "--who",
        "gina",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
        "--json",
    ]);
    out.code(0);
    assert!(
        !out.stdout.contains(asg.grant.expose()) && !out.stderr.contains(asg.grant.expose()),
        "the grant was printed"
    );
    let v = out.json();
    assert_eq!(key_set(&v), keys(&["receipt_id", "state", "delivered"]));
    assert_eq!(v["delivered"], json!(true), "{}", out.stderr);
    assert_eq!(v["state"], json!("delivered"));
    let receipt_id = v["receipt_id"].as_str().expect("id");

    let remote = p.platform_call(&asg.run_id);
    assert_eq!(remote["state"], json!("completed"), "{remote}");
    let remote_receipt = remote["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .find(|r| r["receipt_id"] == json!(receipt_id))
        .cloned()
        .expect("the platform stored the operator's receipt");
    assert_eq!(remote_receipt["kind"], json!("completed"));
    assert_eq!(remote_receipt["sequence"], json!(1));
    assert_eq!(remote_receipt["body"]["result"], json!({"entry": 1234}));

    let show = f.run(&["calls", "show", &call, "--json"]);
    show.code(0);
    let t = show.json();
    assert_eq!(t["call"]["state"], json!("delivered"));
    let r = t["receipts"]
        .as_array()
        .expect("receipts")
        .iter()
        .find(|r| r["receipt_id"] == json!(receipt_id))
        .cloned()
        .expect("receipt");
    assert_eq!(r["status"], json!("delivered"));
    assert!(r["delivered_at"].is_string());

    let human = f.run(&["calls", "list", "--state", "delivered"]);
    human.code(0);
    assert!(human.stdout.contains(&call));
}

#[test]
fn resolve_human_output_says_delivered_when_the_platform_took_it() {
    let p = Platform::start();
    let f = Fixture::empty();
    let (asg, accepted) = p.running_call(EXECUTOR);
    let call = import_running_call(&f, &asg, &accepted, LocalState::ReconciliationRequired);
    let out = f.run(&[
        "reconcile",
        "resolve",
        &call,
        "--failed",
        "not_performed",
        "--message",
        "no entry was posted",
        "--evidence",
        "ledger has nothing for this key",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert!(
        out.stdout.contains(" delivered (state delivered)"),
        "{}",
        out.stdout
    );
    let remote = p.platform_call(&asg.run_id);
    assert_eq!(remote["state"], json!("failed"), "{remote}");
}

#[test]
fn outbox_redeliver_sends_pending_receipts_to_the_platform() {
    let p = Platform::start();
    let f = Fixture::empty();
    let mut ids = Vec::new();
    for _ in 0..2 {
        let (asg, accepted) = p.running_call(EXECUTOR);
        let call = import_running_call(&f, &asg, &accepted, LocalState::Settled);
        let mut local = f.call(&call);
        let completed = receipt(
            &local,
            ReceiptKind::Completed,
            1,
            ReceiptStatus::Pending,
            json!({"result": {"entry": 77}}),
        );
        local.next_sequence = 2;
        ids.push((asg.run_id.clone(), call, completed.receipt_id.clone()));
        f.commit(vec![update(local), Change::AddReceipt(completed)]);
    }
    let status = f.run(&["outbox", "status", "--json"]);
    status.code(0);
    assert_eq!(status.json()["by_status"]["pending"], json!(2));

    // One by id.
    let (run0, call0, rcp0) = &ids[0];
    let out = f.run(&[
        "outbox",
        "redeliver",
        rcp0,
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert_eq!(
        out.stdout,
        format!("{rcp0}: delivered\n1 receipts sent\n"),
        "{}",
        out.stderr
    );
    assert_eq!(f.call(call0).state, LocalState::Delivered);
    assert_eq!(p.platform_call(run0)["state"], json!("completed"));
    let status = f.run(&["outbox", "status", "--json"]);
    assert_eq!(status.json()["by_status"]["pending"], json!(1));

    // Then everything left.
    let (run1, call1, rcp1) = &ids[1];
    let out = f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert_eq!(out.stdout, format!("{rcp1}: delivered\n1 receipts sent\n"));
    assert_eq!(f.call(call1).state, LocalState::Delivered);
    assert_eq!(p.platform_call(run1)["state"], json!("completed"));

    let status = f.run(&["outbox", "status", "--json"]);
    status.code(0);
    let v = status.json();
    assert_eq!(v["by_status"]["pending"], json!(0));
    assert_eq!(v["by_status"]["delivered"], json!(4));
    assert_eq!(v["oldest_pending_at"], Value::Null);
    assert_eq!(v["pending"], json!([]));

    // Nothing left: --all sends nothing and succeeds.
    let out = f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ]);
    out.code(0);
    assert_eq!(out.stdout, "0 receipts sent\n");
    // A delivered receipt is not sent again.
    f.run(&[
        "outbox",
        "redeliver",
        rcp0,
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ])
    .code(1);
}

#[test]
fn outbox_redeliver_with_a_wrong_token_leaves_the_receipt_pending() {
    // A mistyped --token says nothing about the receipt: the platform never
    // judged it. The receipt must stay pending and the call settled, so
    // that a second try with the right token (or the executor) delivers it.
    let p = Platform::start();
    let f = Fixture::empty();
    let (asg, accepted) = p.running_call(EXECUTOR);
    let call = import_running_call(&f, &asg, &accepted, LocalState::Settled);
    let mut local = f.call(&call);
    let completed = receipt(
        &local,
        ReceiptKind::Completed,
        1,
        ReceiptStatus::Pending,
        json!({"result": {"entry": 5}}),
    );
    let rcp = completed.receipt_id.clone();
    local.next_sequence = 2;
    f.commit(vec![update(local), Change::AddReceipt(completed)]);

    let out = f.run(&[
        "outbox",
        "redeliver",
        "--all",
        "--base-url",
        &p.base,
        "--token",
        "not-a-token",
    ]);
    let after = f.call(&call);
    let stored = f
        .receipts(&call)
        .into_iter()
        .find(|r| r.receipt_id == rcp)
        .expect("the receipt");
    assert!(
        after.state == LocalState::Settled && stored.status == ReceiptStatus::Pending,
        "after a 401 the call is {} and its final receipt {} (exit {}, stdout {:?})",
        after.state.as_str(),
        stored.status.as_str(),
        out.code,
        out.stdout
    );
    assert_ne!(out.code, 0, "a refused token is not a success");

    // The right token still delivers it.
    f.run(&[
        "outbox",
        "redeliver",
        &rcp,
        "--base-url",
        &p.base,
        "--token",
        EXEC,
    ])
    .code(0);
    assert_eq!(f.call(&call).state, LocalState::Delivered);
}

/// `tools publish` checks a definitions file, publishes it as a new version
/// of the agent through the typed client, and prints its id; a file that
/// fails the checks publishes nothing and names the field.
#[test]
fn tools_publish_publishes_a_checked_version() {
    let p = Platform::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let agent_id = p.agent_id();
    let good = dir.path().join("tools.json");
    std::fs::write(
        &good,
        json!({"tools": [{"name": TOOL, "description": "Post a ledger entry",
                          "binding_id": p.binding_id, "input_schema": input_schema()}]})
        .to_string(),
    )
    .expect("write");
    let good = good.display().to_string();
    let base = [
        "tools",
        "publish",
        "--base-url",
        &p.base,
        "--token",
        ADMIN,
        "--agent",
        &agent_id,
    ];
    let out = run(&[&base[..], &[good.as_str(), "--json"]].concat());
    out.code(0);
    let v = out.json();
    let agv = v["agent_version"]
        .as_str()
        .expect("agent_version")
        .to_owned();
    assert!(agv.starts_with("agv_"), "{v}");
    assert_eq!(v["tools"][0]["name"], json!(TOOL));
    let (s, read) = p.get(&format!("/agents/{agent_id}/versions/{agv}"), ADMIN);
    assert_eq!(s, 200, "{read}");

    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        json!([{"name": TOOL, "description": "d", "binding_id": p.binding_id,
                "input_schema": {"type": "string"}}])
        .to_string(),
    )
    .expect("write");
    let bad = bad.display().to_string();
    let out = run(&[&base[..], &[bad.as_str()]].concat());
    out.code(1);
    assert!(
        out.stderr.contains("tools[0].input_schema"),
        "{}",
        out.stderr
    );
    assert!(
        out.stderr.contains("nothing was published"),
        "{}",
        out.stderr
    );
}

#[test]
fn tools_dry_run_checks_arguments_on_the_platform() {
    let p = Platform::start();
    let dir = tempfile::tempdir().expect("tempdir");
    let base = ["tools", "dry-run", "--base-url", &p.base, "--token", EXEC];
    let version = ["--agent-version", &p.agent_version, "--tool", TOOL];

    let out = run(&[
        &base[..],
        &version[..],
        &["--arguments", r#"{"amount": 5}"#],
    ]
    .concat());
    out.code(0);
    let v = out.json();
    assert_eq!(v["arguments_valid"], json!(true), "{v}");
    assert_eq!(v["argument_errors"], json!([]));
    assert_eq!(v["context_preview"], Value::Null);
    assert_eq!(v["execution_verified"], json!(false));

    // With a mock result: the context preview.
    let mock = dir.path().join("mock.json");
    std::fs::write(&mock, r#"{"entry": 7}"#).expect("write");
    let mock_arg = format!("@{}", mock.display());
    let out = run(&[
        &base[..],
        &version[..],
        &[
            "--arguments",
            r#"{"amount": 5}"#,
            "--mock-result",
            &mock_arg,
        ],
    ]
    .concat());
    out.code(0);
    let v = out.json();
    assert_eq!(v["execution_verified"], json!(false));
    assert_eq!(
        v["context_preview"],
        json!({"max_result_context_bytes": 16384, "original_bytes": 11, "retained_bytes": 11,
               "truncated": false, "result": {"entry": 7}})
    );

    // Arguments from a file.
    let args = dir.path().join("args.json");
    std::fs::write(&args, r#"{"amount": 9}"#).expect("write");
    let args_arg = format!("@{}", args.display());
    run(&[&base[..], &version[..], &["--arguments", &args_arg]].concat()).code(0);

    // Invalid arguments: the answer is printed, the exit code is 1.
    let out = run(&[
        &base[..],
        &version[..],
        &["--arguments", r#"{"amount": "five"}"#],
    ]
    .concat());
    out.code(1);
    let v = out.json();
    assert_eq!(v["arguments_valid"], json!(false));
    assert_eq!(v["execution_verified"], json!(false));
    let errors = v["argument_errors"].as_array().expect("argument_errors");
    assert!(!errors.is_empty());
    assert_eq!(key_set(&errors[0]), keys(&["path", "message"]));
    assert_eq!(errors[0]["path"], json!("/amount"));
    assert!(out.stderr.contains("input_schema"), "{}", out.stderr);
    // The default arguments {} miss the required amount.
    run(&[&base[..], &version[..]].concat()).code(1);
    // An unknown field.
    run(&[
        &base[..],
        &version[..],
        &["--arguments", r#"{"amount": 1, "x": 1}"#],
    ]
    .concat())
    .code(1);

    // The platform refuses an unknown version or tool.
    let out = run(&[
        &base[..],
        &["--agent-version", "agv_nope", "--tool", TOOL],
        &["--arguments", r#"{"amount": 5}"#],
    ]
    .concat());
    out.code(1);
    assert!(out.json()["error"].is_object(), "{}", out.stdout);
    run(&[
        &base[..],
        &[
            "--agent-version",
            &p.agent_version,
            "--tool",
            "no.such.tool",
        ],
    ]
    .concat())
    .code(1);

    // Usage: arguments that are not JSON; a missing flag; an unreachable platform.
    let out = run(&[&base[..], &version[..], &["--arguments", "{amount"]].concat());
    out.code(2);
    assert!(out.stdout.is_empty());
    let missing = format!("@{}", dir.path().join("missing.json").display());
    run(&[&base[..], &version[..], &["--arguments", &missing]].concat()).code(2);
    run(&[&base[..], &["--tool", TOOL]].concat()).code(2);
    run(&[
        "tools",
        "dry-run",
        "--agent-version",
        "agv_1",
        "--tool",
        TOOL,
    ])
    .code(2);
    let out = run(&[
        "tools",
        "dry-run",
        "--base-url",
        "http://127.0.0.1:9",
        "--token",
        EXEC,
        "--agent-version",
        "agv_1",
        "--tool",
        TOOL,
    ]);
    out.code(2);
    assert!(out.stderr.contains("cannot reach"), "{}", out.stderr);
    // The platform and token may come from the environment.
    let out = run_cmd(
        toolrunner()
            .env("TOOLRUNNER_BASE_URL", &p.base)
            .env("TOOLRUNNER_TOKEN", EXEC)
            .args(["tools", "dry-run"])
            .args(version)
            .args(["--arguments", r#"{"amount": 5}"#]),
    );
    out.code(0);
    assert_eq!(out.json()["arguments_valid"], json!(true));
}
