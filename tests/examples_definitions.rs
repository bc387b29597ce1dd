//! Every example that serves tools prints its tool definitions with
//! `--print-definitions` (no platform, no store, nothing else started),
//! and what it prints passes the protocol's checks with no problem and no
//! warning (`toolrunner tools check`'s lints, `tooldef::lint_version`).

#[path = "support/examples.rs"]
mod examples;

use std::process::Command;

use serde_json::Value;
use toolrunner_protocol::tooldef::{check_version, lint_version};

/// The examples that serve tools (`bench_platform` drives the bare
/// protocol and serves none).
const SERVING: [&str; 8] = [
    "quickstart",
    "payments",
    "long_running",
    "ledger",
    "orders",
    "telemetry",
    "refunds",
    "bench",
];

#[test]
fn every_example_prints_definitions_that_check_clean() {
    let bins = examples::example_binaries(&SERVING).expect("the examples build");
    let mut failures = Vec::new();
    for (name, bin) in SERVING.iter().zip(bins) {
        let out = Command::new(&bin)
            .arg("--print-definitions")
            // No platform is reached: none is given, and none may be needed.
            .env_remove("TOOLRUNNER_BASE_URL")
            .output()
            .expect("the example runs");
        if !out.status.success() {
            failures.push(format!(
                "{name} --print-definitions: {}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
            continue;
        }
        let doc: Value = match serde_json::from_slice(&out.stdout) {
            Ok(doc) => doc,
            Err(e) => {
                failures.push(format!(
                    "{name} --print-definitions printed no JSON ({e}):\n{}",
                    String::from_utf8_lossy(&out.stdout)
                ));
                continue;
            }
        };
        let tools = &doc["tools"];
        if tools.as_array().is_none_or(Vec::is_empty) {
            failures.push(format!("{name}: no tools in {doc:#}"));
            continue;
        }
        if let Err(problems) = check_version(tools, None) {
            for p in problems {
                failures.push(format!("{name}: {}: {} ({})", p.param, p.message, p.code));
            }
        }
        for w in lint_version(tools) {
            failures.push(format!("{name}: warning {}: {}", w.param, w.message));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
