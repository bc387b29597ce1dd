//! The `ledger` example as a binary for the tests that run it as a real
//! process (`kill_loop`, the rolling restarts, the replicas' chaos).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

#[path = "examples.rs"]
mod examples;

/// `<target>/<profile>/examples/ledger`, built by cargo first
/// ([`examples::example_binaries`]).
pub(crate) fn ledger_binary() -> Result<PathBuf> {
    let mut bins = examples::example_binaries(&["ledger"])?;
    bins.pop().context("the ledger example")
}

/// An agent with a binding of the `ledger.append` tool and a version that
/// publishes it, as the ledger example defines it (its schemas written out:
/// the example runs as a process of its own).
pub(crate) struct Published {
    /// The agent.
    pub(crate) agent_id: String,
    /// The binding the ledger processes serve.
    pub(crate) binding_id: String,
    /// The version runs are created on.
    pub(crate) agent_version: String,
}

/// Creates the agent `name`, its `ledger` binding and a version with
/// `ledger.append`, through `admin` (the platform's admin token).
pub(crate) async fn publish_ledger(
    admin: &toolrunner::platform::Platform,
    name: &str,
) -> Result<Published> {
    let agent = admin.create_agent(name).await?;
    let binding = admin
        .create_binding(&agent.agent_id, "ledger", &["ledger.append"])
        .await?;
    let tool = serde_json::json!({
        "name": "ledger.append", "description": "Append one entry to the ledger",
        "binding_id": binding.binding_id,
        "input_schema": {"type": "object",
            "properties": {"amount": {"type": "integer", "minimum": 1},
                           "memo": {"type": "string"}},
            "required": ["amount", "memo"], "additionalProperties": false},
        "output_schema": {"type": "object",
            "properties": {"entry": {"type": "integer"}}, "required": ["entry"]}
    });
    let published = admin
        .request(
            toolrunner::platform::Method::POST,
            &format!("/agents/{}/versions", agent.agent_id),
        )
        .json(&serde_json::json!({ "tools": [tool] }))
        .send()
        .await?
        .json();
    let agent_version = published["agent_version"]
        .as_str()
        .with_context(|| format!("the version: {published}"))?
        .to_owned();
    Ok(Published {
        agent_id: agent.agent_id,
        binding_id: binding.binding_id,
        agent_version,
    })
}

/// Starts the ledger `bin` with `args` and the environment `env`, its
/// stderr appended to `log` (where a test reads what it said), its stdout
/// dropped.
pub(crate) fn spawn(
    bin: &Path,
    args: &[String],
    env: &[(&str, &str)],
    log: &Path,
) -> Result<std::process::Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .with_context(|| format!("the log {}", log.display()))?;
    let mut cmd = Command::new(bin);
    cmd.args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(log);
    for (name, value) in env {
        cmd.env(name, value);
    }
    Ok(cmd.spawn()?)
}

/// Where one ledger process serves and keeps its state: the arguments
/// every test passes (extra flags go after them).
pub(crate) struct Serving<'a> {
    /// The platform.
    pub(crate) base_url: &'a str,
    /// The executor token.
    pub(crate) token: &'a str,
    /// The executor id.
    pub(crate) executor_id: &'a str,
    /// The binding it serves.
    pub(crate) binding_id: &'a str,
    /// `--db`: a file or a `postgres://` URL.
    pub(crate) db: &'a str,
    /// The ledger file.
    pub(crate) ledger: &'a Path,
    /// Calls at once.
    pub(crate) capacity: u32,
    /// The handler's sleep after its write.
    pub(crate) effect_delay_ms: u64,
}

impl Serving<'_> {
    /// The command line, with `extra` flags after the common ones.
    pub(crate) fn args(&self, extra: &[&str]) -> Vec<String> {
        let common = [
            "--base-url",
            self.base_url,
            "--token",
            self.token,
            "--executor-id",
            self.executor_id,
            "--binding-id",
            self.binding_id,
            "--db",
            self.db,
        ];
        let mut args: Vec<String> = common.iter().map(|s| (*s).to_owned()).collect();
        args.extend([
            "--ledger".to_owned(),
            self.ledger.display().to_string(),
            "--capacity".to_owned(),
            self.capacity.to_string(),
            "--effect-delay-ms".to_owned(),
            self.effect_delay_ms.to_string(),
        ]);
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    }
}
