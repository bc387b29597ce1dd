//! The README's example as a product engineer gets it: `tests/user-crate`
//! (the README's code, byte for byte) built from the crates as `cargo
//! package` packs them, run as a process of its own against the development
//! platform. Two `ledger.post` calls must complete with their operation
//! keys, `ledger.txt` must hold exactly one line per call, and `SIGTERM`
//! must stop it with exit code 0.
//!
//! ```text
//! cargo package --workspace --locked          # then unpack target/package/*.crate
//!                                             # into target/packaged/ (see .ci/run)
//! cargo build --manifest-path tests/user-crate/Cargo.toml --target-dir target --locked
//! TOOLRUNNER_README_EXAMPLE_BIN=target/debug/user-crate cargo test --test readme_example
//! ```
//!
//! Without `TOOLRUNNER_README_EXAMPLE_BIN` it runs nothing and says so
//! (`.ci/run` always sets it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use libtest_mimic::{Arguments, Failed, Trial};
use serde_json::{Value, json};
use toolrunner::platform::{CallState, NewToolCall, Platform, Run, settled};
use toolrunner_devserver::DevServer;

const BIN_VAR: &str = "TOOLRUNNER_README_EXAMPLE_BIN";
const ADMIN: &str = "readme-admin";
const EXEC: &str = "readme-executor";
const EXECUTOR_ID: &str = "readme-example-01";
/// How long the calls may take to complete, and the process to drain.
const WITHIN: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    let args = Arguments::from_args();
    let trials = match std::env::var_os(BIN_VAR).filter(|v| !v.is_empty()) {
        Some(bin) => {
            let bin2 = bin.clone();
            vec![
                Trial::test(
                    "the_packaged_readme_example_posts_each_call_once_and_stops_on_sigterm",
                    move || run(Path::new(&bin)).map_err(|e| Failed::from(format!("{e:#}"))),
                ),
                Trial::test(
                    "without_the_postgres_feature_a_postgres_store_is_a_missing_feature",
                    move || {
                        missing_feature(Path::new(&bin2))
                            .map_err(|e| Failed::from(format!("{e:#}")))
                    },
                ),
            ]
        }
        None => {
            println!(
                "the README example from the packaged crates was not run: set {BIN_VAR} to the user crate's binary (see tests/readme_example.rs, or .ci/run)"
            );
            Vec::new()
        }
    };
    libtest_mimic::run(&args, trials).exit_code()
}

/// The binary `TOOLRUNNER_README_EXAMPLE_BIN` names, by its absolute path
/// (the example runs in a directory of its own).
fn binary(bin: &Path) -> Result<PathBuf> {
    std::fs::canonicalize(bin).with_context(|| {
        format!(
            "{BIN_VAR}={}: no such binary (build tests/user-crate first)",
            bin.display()
        )
    })
}

fn run(bin: &Path) -> Result<()> {
    let bin = binary(bin)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(example(&bin))
}

/// The user crate depends on `toolrunner` without the `postgres` feature:
/// given a `postgres://` store it stops at `build()`, before it connects
/// anywhere, with the error's own kind and what to turn on.
fn missing_feature(bin: &Path) -> Result<()> {
    let bin = binary(bin)?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("output.log");
    let mut command = Command::new(&bin);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TOOLRUNNER_") {
            command.env_remove(name);
        }
    }
    let mut child = command
        .current_dir(dir.path())
        .env("TOOLRUNNER_BASE_URL", "http://127.0.0.1:9")
        .env("TOOLRUNNER_TOKEN", "unused")
        .env("TOOLRUNNER_EXECUTOR_ID", EXECUTOR_ID)
        .env("TOOLRUNNER_BINDING_ID", "bnd_unused")
        .env(
            "TOOLRUNNER_STORE_URL",
            "postgres://postgres@127.0.0.1:9/none",
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("running {}", bin.display()))?;
    // It must stop at build(): a process still running after the bound
    // started serving, and is killed.
    let deadline = Instant::now() + WITHIN;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "it still ran {WITHIN:?} after it was started with a postgres:// store and no postgres feature"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stderr = std::fs::read_to_string(&log)?;
    let out = std::process::Output {
        status,
        stdout: Vec::new(),
        stderr: stderr.into_bytes(),
    };
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success(),
        "it ran with a postgres:// store and no postgres feature: {stderr}"
    );
    ensure!(
        stderr.contains("MissingFeature")
            && stderr.contains("needs the `postgres` feature of toolrunner"),
        "it failed, but not as a missing feature: {stderr}"
    );
    ensure!(
        !dir.path().join("ledger.txt").exists(),
        "nothing ran, so no ledger was written"
    );
    Ok(())
}

/// The user crate's process; killed if a check fails before it stopped.
struct Example {
    child: Child,
    log: PathBuf,
}

impl Example {
    fn log(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        if text.trim().is_empty() {
            "(its output was empty)".to_owned()
        } else {
            format!("its output:\n{text}")
        }
    }

    /// Fails if the process has stopped.
    fn still_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("the example stopped by itself ({status}); {}", self.log());
        }
        Ok(())
    }
}

impl Drop for Example {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

async fn example(bin: &Path) -> Result<()> {
    let server = DevServer::builder()
        .listen(([127, 0, 0, 1], 0).into())
        .token(ADMIN, "*")
        .token(EXEC, "executors:connect,tools:execute")
        .start()
        .await
        .context("the development platform starts")?;
    let base = server.base_url();
    let platform = Platform::new(&base, ADMIN)?;

    // The platform's side of the example: an agent whose published version
    // has `ledger.post`, served by one executor binding.
    let agent = platform.create_agent("readme-example").await?;
    let binding = platform
        .create_binding(&agent.agent_id, "ledger", &["ledger.post"])
        .await?;
    let tool = json!({
        "name": "ledger.post",
        "description": "Appends an entry to the ledger, once.",
        "binding_id": binding.binding_id,
        "input_schema": {"type": "object",
            "properties": {"amount": {"type": "integer", "minimum": 0},
                           "memo": {"type": "string"}},
            "required": ["amount", "memo"], "additionalProperties": false},
        "output_schema": {"type": "object",
            "properties": {"key": {"type": "string"}},
            "required": ["key"]}
    });
    let published = platform
        .request(
            toolrunner::platform::Method::POST,
            &format!("/agents/{}/versions", agent.agent_id),
        )
        .json(&json!({"tools": [tool]}))
        .send()
        .await?;
    let version = published.json();
    ensure!(
        published.status == 201 || published.status == 200,
        "publishing ledger.post answered {}: {version}",
        published.status
    );
    let agent_version = version["agent_version"]
        .as_str()
        .context("the published version has an agent_version")?;

    // The product engineer's process, in a directory of its own: its store
    // (the default sqlite://toolrunner.db) and ledger.txt land there.
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("example.log");
    let out = std::fs::File::create(&log)?;
    let mut command = Command::new(bin);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TOOLRUNNER_") {
            command.env_remove(name);
        }
    }
    let child = command
        .current_dir(dir.path())
        .env("TOOLRUNNER_BASE_URL", &base)
        .env("TOOLRUNNER_TOKEN", EXEC)
        .env("TOOLRUNNER_EXECUTOR_ID", EXECUTOR_ID)
        .env("TOOLRUNNER_BINDING_ID", &binding.binding_id)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("{} starts", bin.display()))?;
    let mut example = Example { child, log };

    let entries = [(42_u64, "coffee"), (7, "two teas")];
    let calls = entries
        .iter()
        .map(|(amount, memo)| {
            NewToolCall::new("ledger.post", json!({"amount": amount, "memo": memo}))
        })
        .collect();
    let run = platform
        .create_run(agent_version, "readme-user", calls)
        .await?;
    ensure!(
        run.tool_calls.len() == entries.len(),
        "the run has {} calls, not {}",
        run.tool_calls.len(),
        entries.len()
    );

    // Until the platform has every call settled (bounded).
    let end = Instant::now() + WITHIN;
    let run: Run = loop {
        example.still_running()?;
        let now = platform.run(&run.run_id).await?;
        if now.tool_calls.iter().all(|c| settled(c.state)) {
            break now;
        }
        ensure!(
            Instant::now() < end,
            "the calls were not settled within {WITHIN:?}: {}; {}",
            states(&now),
            example.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // Each call completed, with the operation key as its output.
    let mut keys = Vec::new();
    for ((amount, memo), call) in entries.iter().zip(&run.tool_calls) {
        ensure!(
            call.state == CallState::Completed,
            "call {} ({amount} {memo}) ended {}, not completed: {}; {}",
            call.call_id,
            call.state.as_str(),
            states(&run),
            example.log()
        );
        let finals: Vec<Value> = call
            .receipts
            .iter()
            .filter(|r| r.kind.is_final())
            .map(|r| serde_json::from_str(r.body.get()))
            .collect::<Result<_, _>>()?;
        ensure!(
            finals.len() == 1,
            "call {} has {} final receipts on the platform, not 1",
            call.call_id,
            finals.len()
        );
        let result = &finals[0]["result"];
        let key = result["key"]
            .as_str()
            .filter(|k| !k.is_empty())
            .with_context(|| {
                format!(
                    "call {}'s result {result} has no operation key",
                    call.call_id
                )
            })?;
        ensure!(
            *result == json!({"key": key}),
            "call {}'s result is {result}, not just its key",
            call.call_id
        );
        keys.push(key.to_owned());
    }
    ensure!(
        keys[0] != keys[1],
        "both calls had the operation key {}",
        keys[0]
    );

    // SIGTERM: the example drains and exits 0.
    example.still_running()?;
    let pid = example.child.id().to_string();
    let kill = Command::new("kill").args(["-TERM", &pid]).status()?;
    ensure!(kill.success(), "kill -TERM {pid} failed ({kill})");
    let status = exit_within(&mut example.child, WITHIN).await?;
    ensure!(
        status.code() == Some(0),
        "after SIGTERM the example exited with {status}, not 0; {}",
        example.log()
    );

    // The ledger: exactly one line per call, each with its operation key
    // and its entry.
    let ledger = std::fs::read_to_string(dir.path().join("ledger.txt"))
        .context("the example wrote no ledger.txt")?;
    let lines: Vec<&str> = ledger.lines().collect();
    ensure!(
        lines.len() == entries.len(),
        "ledger.txt has {} lines for {} calls:\n{ledger}",
        lines.len(),
        entries.len()
    );
    for ((amount, memo), key) in entries.iter().zip(&keys) {
        let expected = format!("{key} {amount} {memo}");
        let with_key: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.contains(key.as_str()))
            .collect();
        ensure!(
            with_key == [expected.as_str()],
            "ledger.txt should have the one line {expected:?} with operation key {key}:\n{ledger}"
        );
    }

    // The executor's own store agrees: each call's operation key is the one
    // the handler was given.
    let store = toolrunner::Reconciler::open_path(&dir.path().join("toolrunner.db")).await?;
    for (call, key) in run.tool_calls.iter().zip(&keys) {
        let timeline = store.show(&run.run_id, &call.call_id).await?;
        ensure!(
            timeline.call().operation_key() == *key,
            "the store has operation key {} for call {}, the result {key}",
            timeline.call().operation_key(),
            call.call_id
        );
    }

    server.shutdown().await;
    Ok(())
}

/// The calls' states, for messages.
fn states(run: &Run) -> String {
    run.tool_calls
        .iter()
        .map(|c| format!("{} {}", c.call_id, c.state.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Waits (bounded) for the process to exit.
async fn exit_within(child: &mut Child, within: Duration) -> Result<ExitStatus> {
    let end = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        ensure!(
            Instant::now() < end,
            "the example did not exit within {within:?} of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
