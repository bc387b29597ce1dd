//! The secret canary's CLI part (the rest is the workspace's
//! `tests/secret_canary.rs`): unique strings planted in the platform token
//! (`TOOLRUNNER_TOKEN`), a grant, the arguments and the results of stored
//! calls, and every read and refusal of the operator CLI: neither the token
//! nor the grant ever show; the arguments show only in `calls show`'s
//! human output, which prints them to the operator on purpose (as the
//! console's call page does); a result shows only where the command prints
//! the stored receipts' bytes on purpose (`calls show`, `outbox status
//! --json`, `export`), which an operator needs to see.

use super::*;

const TOKEN: &str = "tok-CANARY-cli-3c9d1e";
const ARGUMENT: &str = "CANARY-cli-argument-51a0";
const RESULT: &str = "CANARY-cli-result-8f27";

/// A store with a `reconciliation_required` call and a settled one whose
/// arguments and results hold the canaries.
fn planted() -> Fixture {
    let f = Fixture::empty();
    let mut calls = Vec::new();
    for (call_id, state) in [
        ("call_unknown", LocalState::ReconciliationRequired),
        ("call_settled", LocalState::Settled),
    ] {
        let mut asg = assignment("run_c", call_id, TOOL, None);
        asg.arguments = json!({"amount": 5, "note": ARGUMENT});
        let mut call = local_call(Some(asg), "run_c", call_id, TOOL, state, 2);
        call.reason = Some("the downstream timed out".into());
        let receipts = vec![
            receipt(
                &call,
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
                json!({}),
            ),
            receipt(
                &call,
                if state == LocalState::Settled {
                    ReceiptKind::Completed
                } else {
                    ReceiptKind::Progress
                },
                1,
                ReceiptStatus::Pending,
                if state == LocalState::Settled {
                    json!({"result": {"reference": RESULT}})
                } else {
                    json!({"progress": {"message": RESULT, "fraction": 0.5, "data": null}})
                },
            ),
        ];
        calls.push((call, receipts));
    }
    for (call, receipts) in calls {
        let mut changes = vec![Change::InsertCall(call)];
        changes.extend(receipts.into_iter().map(Change::AddReceipt));
        f.commit(changes);
    }
    f
}

#[test]
fn no_token_grant_or_argument_in_any_output_and_results_only_in_receipt_bytes() {
    let f = planted();
    let unreachable = "http://127.0.0.1:9";
    let runs: Vec<(Vec<&str>, bool)> = vec![
        (vec!["calls", "list"], false),
        (vec!["calls", "list", "--json"], false),
        (
            vec!["calls", "list", "--state", "reconciliation_required"],
            false,
        ),
        (vec!["calls", "show", "run_c/call_unknown"], true),
        (vec!["calls", "show", "run_c/call_settled", "--json"], true),
        (vec!["outbox", "status"], false),
        (vec!["outbox", "status", "--json"], true),
        (vec!["export"], true),
        // Refused (the platform cannot be reached), with the token given.
        (
            vec!["outbox", "redeliver", "--all", "--base-url", unreachable],
            false,
        ),
        (
            vec![
                "reconcile",
                "resolve",
                "run_c/call_unknown",
                "--failed",
                "not_done",
                "--message",
                "nothing was done",
                "--evidence",
                "checked downstream",
                "--base-url",
                unreachable,
            ],
            false,
        ),
    ];
    let mut seen = Vec::new();
    for (args, shows_receipts) in runs {
        let out = run_cmd(
            toolrunner()
                .args(&args)
                .args(["--db", f.db()])
                .env("TOOLRUNNER_TOKEN", TOKEN),
        );
        out.no_grant();
        let text = format!("{}\n{}", out.stdout, out.stderr);
        assert!(!text.is_empty(), "{args:?} printed something");
        assert!(!text.contains(TOKEN), "the token in `{args:?}`:\n{text}");
        // `calls show` prints the arguments to the operator on purpose
        // (its human output only: not in the stable JSON).
        let shows_arguments = args.starts_with(&["calls", "show"]) && !args.contains(&"--json");
        if shows_arguments {
            assert!(
                text.contains(ARGUMENT),
                "`{args:?}` prints the call's arguments:\n{text}"
            );
        } else {
            assert!(
                !text.contains(ARGUMENT),
                "the arguments in `{args:?}`:\n{text}"
            );
        }
        if !shows_receipts {
            assert!(
                !text.contains(RESULT),
                "a result in `{args:?}`, which does not print receipts:\n{text}"
            );
        } else if text.contains(RESULT) {
            seen.push(args.join(" "));
        }
    }
    // The receipts' bytes are there where they are meant to be, so the
    // planted result did reach the outputs that show them.
    assert!(
        seen.iter().any(|a| a.starts_with("calls show")),
        "the receipts' bytes in calls show: {seen:?}"
    );
}
