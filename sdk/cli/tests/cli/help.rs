//! The binary's help and usage errors.

use super::*;

// ---------------------------------------------------------------- help

#[test]
fn help_of_the_binary_and_of_every_subcommand_exits_0() {
    let commands: &[&[&str]] = &[
        &[],
        &["calls"],
        &["calls", "list"],
        &["calls", "show"],
        &["reconcile"],
        &["reconcile", "resolve"],
        &["reconcile", "compensated"],
        &["reconcile", "close"],
        &["outbox"],
        &["outbox", "status"],
        &["outbox", "redeliver"],
        &["tools"],
        &["tools", "check"],
        &["tools", "dry-run"],
        &["tools", "publish"],
        &["budget"],
        &["devserver"],
        &["dev"],
        &["dev", "up"],
        &["dev", "run"],
    ];
    for c in commands {
        let mut args = c.to_vec();
        args.push("--help");
        let out = run(&args);
        out.code(0);
        assert!(out.stdout.contains("Usage:"), "{args:?}: {}", out.stdout);
    }
    let top = run(&["--help"]);
    for sub in [
        "calls",
        "reconcile",
        "outbox",
        "tools",
        "budget",
        "devserver",
        "dev ",
    ] {
        assert!(
            top.stdout.contains(sub),
            "--help lists {sub}: {}",
            top.stdout
        );
    }
    let resolve = run(&["reconcile", "resolve", "--help"]);
    for flag in [
        "--completed",
        "--failed",
        "--cancelled",
        "--evidence",
        "--who",
        "--reference",
        "--db",
        "--base-url",
        "--token",
        "--json",
    ] {
        assert!(resolve.stdout.contains(flag), "resolve --help shows {flag}");
    }
    for (sub, flags) in [
        (
            "up",
            &[
                "--tools",
                "--base-url",
                "--token",
                "--agent",
                "--executor-id",
                "--executor-token",
                "TOOLRUNNER_BASE_URL",
                "TOOLRUNNER_ADMIN_TOKEN",
            ][..],
        ),
        (
            "run",
            &[
                "--tool",
                "--arguments",
                "--agent",
                "--base-url",
                "--token",
                "--wait",
                "TOOLRUNNER_AGENT_ID",
            ][..],
        ),
    ] {
        let help = run(&["dev", sub, "--help"]);
        for flag in flags {
            assert!(
                help.stdout.contains(flag),
                "dev {sub} --help shows {flag}: {}",
                help.stdout
            );
        }
    }
    run(&["--version"]).code(0);
}

#[test]
fn no_or_unknown_subcommand_is_a_usage_error() {
    run(&[]).code(2);
    run(&["calls"]).code(2);
    run(&["frobnicate"]).code(2);
    run(&["calls", "list", "--no-such-flag"]).code(2);
}
