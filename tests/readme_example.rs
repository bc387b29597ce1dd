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

use std::future::Future;
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
            let bin = PathBuf::from(bin);
            let trial = |name: &str, f: fn(&Path) -> Result<()>| {
                let bin = bin.clone();
                Trial::test(name, move || {
                    f(&bin).map_err(|e| Failed::from(format!("{e:#}")))
                })
            };
            vec![
                trial(
                    "the_packaged_readme_example_posts_each_call_once_and_stops_on_sigterm",
                    |bin| in_runtime(bin, example),
                ),
                trial(
                    "the_readme_tool_keeps_whole_lines_and_fails_no_call_it_made_through_two_kill_9s",
                    |bin| in_runtime(bin, killed),
                ),
                trial(
                    "the_readme_hook_that_cannot_read_leaves_the_call_to_a_person",
                    |bin| in_runtime(bin, unreadable),
                ),
                trial(
                    "without_the_postgres_feature_a_postgres_store_is_a_missing_feature",
                    missing_feature,
                ),
                trial(
                    "the_readme_first_run_publishes_the_crates_tools_and_completes_a_run",
                    first_run,
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

/// Runs a trial on a runtime of its own, with the binary by its absolute
/// path.
fn in_runtime<F: Future<Output = Result<()>>>(bin: &Path, trial: fn(PathBuf) -> F) -> Result<()> {
    let bin = binary(bin)?;
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(trial(bin))
}

/// The user crate depends on `toolrunner` without the `postgres` feature:
/// given a `postgres://` store it stops at `build()`, before it connects
/// anywhere, with the error's own kind and what to turn on.
fn missing_feature(bin: &Path) -> Result<()> {
    let bin = binary(bin)?;
    let dir = tempfile::tempdir()?;
    let log = dir.path().join("output.log");
    let mut child = example_command(&bin, dir.path())
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
    // `main` returned the error: Rust prints its Debug, which reads as its
    // message.
    ensure!(
        stderr.starts_with("Error: ")
            && stderr.contains("needs the `postgres` feature of toolrunner")
            && !stderr.contains("Error {"),
        "it failed, but not with the missing feature's message: {stderr}"
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

/// The development platform of a trial, with the example's tool published
/// from the example's own `--print-definitions` (its binding filled in).
struct Platformed {
    server: DevServer,
    base: String,
    platform: Platform,
    binding_id: String,
    agent_version: String,
}

async fn platformed(bin: &Path) -> Result<Platformed> {
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
    // The definitions as the example prints them, with no platform
    // settings but the binding.
    let dir = tempfile::tempdir()?;
    let printed = example_command(bin, dir.path())
        .env("TOOLRUNNER_BINDING_ID", &binding.binding_id)
        // An argument that is not UTF-8 (a Latin-1 file name) beside it.
        .arg(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(b"caf\xe9"))
        .arg("--print-definitions")
        .output()
        .context("the example prints its definitions")?;
    ensure!(
        printed.status.success(),
        "--print-definitions exited {}: {}",
        printed.status,
        String::from_utf8_lossy(&printed.stderr)
    );
    let definitions: Value = serde_json::from_slice(&printed.stdout).with_context(|| {
        format!(
            "--print-definitions printed no JSON: {}",
            String::from_utf8_lossy(&printed.stdout)
        )
    })?;
    ensure!(
        std::fs::read_dir(dir.path())?.next().is_none(),
        "printing the definitions left files behind (a store?)"
    );
    ensure!(
        definitions["tools"][0]["name"] == "ledger.post"
            && definitions["tools"][0]["binding_id"] == binding.binding_id.as_str()
            && definitions["tools"][0]["input_schema"]["additionalProperties"] == false,
        "the printed definitions are not ledger.post's, strict and bound: {definitions:#}"
    );
    let published = platform
        .request(
            toolrunner::platform::Method::POST,
            &format!("/agents/{}/versions", agent.agent_id),
        )
        .json(&definitions)
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
        .context("the published version has an agent_version")?
        .to_owned();
    Ok(Platformed {
        server,
        base,
        platform,
        binding_id: binding.binding_id,
        agent_version,
    })
}

/// The example's command, in `dir`, with no `TOOLRUNNER_` variable of
/// this process.
fn example_command(bin: &Path, dir: &Path) -> Command {
    let mut command = Command::new(bin);
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TOOLRUNNER_") {
            command.env_remove(name);
        }
    }
    command.current_dir(dir).stdin(Stdio::null());
    command
}

impl Platformed {
    /// The product engineer's process, in `dir`: its store (the default
    /// sqlite://toolrunner.db) and ledger.txt land there; its output is
    /// appended to `dir/example.log`.
    fn spawn(&self, bin: &Path, dir: &Path) -> Result<Example> {
        let log = dir.join("example.log");
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let child = example_command(bin, dir)
            .env("TOOLRUNNER_BASE_URL", &self.base)
            .env("TOOLRUNNER_TOKEN", EXEC)
            .env("TOOLRUNNER_EXECUTOR_ID", EXECUTOR_ID)
            .env("TOOLRUNNER_BINDING_ID", &self.binding_id)
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("{} starts", bin.display()))?;
        Ok(Example { child, log })
    }

    async fn run_of(&self, entries: &[(u64, String)]) -> Result<Run> {
        let calls = entries
            .iter()
            .map(|(amount, memo)| {
                NewToolCall::new("ledger.post", json!({"amount": amount, "memo": memo}))
            })
            .collect();
        let run = self
            .platform
            .create_run(&self.agent_version, "readme-user", calls)
            .await?;
        ensure!(
            run.tool_calls.len() == entries.len(),
            "the run has {} calls, not {}",
            run.tool_calls.len(),
            entries.len()
        );
        Ok(run)
    }

    /// The run once every call is settled on the platform (bounded); the
    /// example must keep running meanwhile.
    async fn settled(&self, run_id: &str, example: &mut Example) -> Result<Run> {
        let end = Instant::now() + WITHIN;
        loop {
            example.still_running()?;
            let now = self.platform.run(run_id).await?;
            if now.tool_calls.iter().all(|c| settled(c.state)) {
                return Ok(now);
            }
            ensure!(
                Instant::now() < end,
                "the calls were not settled within {WITHIN:?}: {}; {}",
                states(&now),
                example.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// SIGTERM: the example drains and exits 0.
async fn stop(example: &mut Example) -> Result<()> {
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
    Ok(())
}

/// The call's final receipt's body on the platform (the one there is).
fn final_body(call: &toolrunner::platform::RunCall) -> Result<Value> {
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
    Ok(finals.into_iter().next().unwrap_or_default())
}

async fn example(bin: PathBuf) -> Result<()> {
    let bin = bin.as_path();
    let p = platformed(bin).await?;
    let dir = tempfile::tempdir()?;
    let mut example = p.spawn(bin, dir.path())?;

    let entries = [(42_u64, "coffee".to_owned()), (7, "two teas".to_owned())];
    let run = p.run_of(&entries).await?;
    let run = p.settled(&run.run_id, &mut example).await?;

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
        let body = final_body(call)?;
        let result = &body["result"];
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
    // Never silent: with no subscriber installed, it says that it serves.
    let serving = format!(
        "executor {EXECUTOR_ID} connected; serving ledger.post for binding {}",
        p.binding_id
    );
    ensure!(
        example.log().contains(&serving),
        "the example did not say {serving:?}; {}",
        example.log()
    );
    stop(&mut example).await?;

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
        let expected = format!("{key} {amount} {memo:?}");
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

    p.server.shutdown().await;
    Ok(())
}

/// How many calls the kill trial makes at once.
const CONCURRENT: usize = 40;

/// The README's tool as a product engineer copies it, under 40 calls at
/// once and two `kill -9`s: every ledger line is whole (one write per
/// entry), each completed call has exactly one line, and no call settled
/// `failed` has a line (its hook found none).
async fn killed(bin: PathBuf) -> Result<()> {
    let bin = bin.as_path();
    let p = platformed(bin).await?;
    let dir = tempfile::tempdir()?;
    // Long memos, with spaces and a newline, so that an entry written in
    // pieces would mix with another call's.
    let entries: Vec<(u64, String)> = (0..CONCURRENT)
        .map(|i| {
            let memo = format!("entry {i}\n{}", format!("{i:02} ").repeat(300));
            (i as u64 + 1, memo)
        })
        .collect();
    let mut example = p.spawn(bin, dir.path())?;
    let run = p.run_of(&entries).await?;
    let ledger_path = dir.path().join("ledger.txt");
    let lines = || {
        std::fs::read_to_string(&ledger_path)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    for (kill, at) in [(1, 4), (2, 16)] {
        let end = Instant::now() + WITHIN;
        while lines() < at && Instant::now() < end {
            example.still_running()?;
            std::thread::sleep(Duration::from_millis(1));
        }
        let pid = example.child.id().to_string();
        let status = Command::new("kill").args(["-KILL", &pid]).status()?;
        ensure!(status.success(), "kill -9 {pid} (kill {kill}) failed");
        println!("kill -9 {kill} at {} ledger lines", lines());
        example.child.wait()?;
        example = p.spawn(bin, dir.path())?;
    }
    let run = p.settled(&run.run_id, &mut example).await?;
    stop(&mut example).await?;

    let ledger = std::fs::read_to_string(&ledger_path).context("no ledger.txt")?;
    let store = toolrunner::Reconciler::open_path(&dir.path().join("toolrunner.db")).await?;
    // Every key each call was ever given, to its entry.
    let mut entry_of = std::collections::HashMap::new();
    for (call, entry) in run.tool_calls.iter().zip(&entries) {
        let timeline = store.show(&run.run_id, &call.call_id).await?;
        entry_of.insert(timeline.call().operation_key().to_owned(), (call, entry));
        for attempt in timeline.attempts() {
            entry_of.insert(attempt.operation_key().to_owned(), (call, entry));
        }
    }
    let mut lines_of: std::collections::HashMap<&str, usize> = Default::default();
    for line in ledger.lines() {
        let whole = line.split_once(' ').and_then(|(key, rest)| {
            let (amount, memo) = rest.split_once(' ')?;
            let (call, (want_amount, want_memo)) = entry_of.get(key)?;
            (amount.parse::<u64>().ok()? == *want_amount && memo == format!("{want_memo:?}"))
                .then_some(call.call_id.as_str())
        });
        let call_id = whole.with_context(|| {
            format!("ledger.txt has a line that is not one whole entry of a call: {line:?}")
        })?;
        *lines_of.entry(call_id).or_default() += 1;
    }
    let count = |state: CallState| run.tool_calls.iter().filter(|c| c.state == state).count();
    println!(
        "{} calls completed, {} failed; {} ledger lines",
        count(CallState::Completed),
        count(CallState::Failed),
        ledger.lines().count()
    );
    for call in &run.tool_calls {
        let n = lines_of.get(call.call_id.as_str()).copied().unwrap_or(0);
        match call.state {
            CallState::Completed => ensure!(
                n == 1,
                "call {} completed with {n} ledger lines; {}",
                call.call_id,
                example.log()
            ),
            CallState::Failed => ensure!(
                n == 0,
                "call {} settled failed ({}) while its line is in the ledger; {}",
                call.call_id,
                final_body(call)?,
                example.log()
            ),
            other => bail!(
                "call {} ended {}: the hook can read, so every call settles; {}",
                call.call_id,
                other.as_str(),
                example.log()
            ),
        }
    }
    p.server.shutdown().await;
    Ok(())
}

/// The hook made unable to read (`ledger.txt` a directory): the call it
/// cannot look up stays in `reconciliation_required`, and the example
/// says so on standard error; it is never settled `failed` by a guess.
async fn unreadable(bin: PathBuf) -> Result<()> {
    let bin = bin.as_path();
    let p = platformed(bin).await?;
    let dir = tempfile::tempdir()?;
    std::fs::create_dir(dir.path().join("ledger.txt"))?;
    let mut example = p.spawn(bin, dir.path())?;
    let run = p.run_of(&[(5, "lunch".to_owned())]).await?;
    let call_id = run.tool_calls[0].call_id.clone();
    // The store is read once the call is reported (the example made it
    // first: two processes must not migrate a new store at once); then
    // until the hook has been asked and said it cannot tell (bounded).
    let end = Instant::now() + WITHIN;
    loop {
        example.still_running()?;
        let now = p.platform.run(&run.run_id).await?;
        if now.tool_calls[0].state == CallState::ReconciliationRequired {
            break;
        }
        ensure!(
            Instant::now() < end && !settled(now.tool_calls[0].state),
            "the call the hook cannot look up is {}, not reconciliation_required; {}",
            now.tool_calls[0].state.as_str(),
            example.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let store = toolrunner::Reconciler::open_path(&dir.path().join("toolrunner.db")).await?;
    loop {
        example.still_running()?;
        let asked = match store.show(&run.run_id, &call_id).await {
            Ok(t) => t
                .events()
                .iter()
                .any(|e| e.what() == "automatic check: unknown"),
            Err(_) => false,
        };
        if asked {
            break;
        }
        ensure!(
            Instant::now() < end,
            "the hook was not asked within {WITHIN:?}; {}",
            example.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let now = p.platform.run(&run.run_id).await?;
    ensure!(
        now.tool_calls[0].state == CallState::ReconciliationRequired,
        "the call the hook could not look up is {}, not reconciliation_required; {}",
        now.tool_calls[0].state.as_str(),
        example.log()
    );
    let warned = format!(
        "call {call_id} of run {} (ledger.post) needs reconciliation",
        run.run_id
    );
    ensure!(
        example.log().contains(&warned),
        "the example did not say {warned:?}; {}",
        example.log()
    );
    stop(&mut example).await?;
    p.server.shutdown().await;
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

/// The development platform's default address, which the README's first
/// run uses.
const FIRST_RUN_PLATFORM: &str = "127.0.0.1:8700";

/// The README's "A first run" commands, taken from its text and run as
/// they are written (`bash -e`), in a copy of the user crate (the README's
/// tool as `src/main.rs`, built from the packaged crates), with the
/// workspace's `toolrunner` CLI on the `PATH`: the last one must print the
/// call `completed`.
fn first_run(_bin: &Path) -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md"))?;
    let section = readme
        .split("\n## A first run\n")
        .nth(1)
        .context("the README has no section \"A first run\"")?;
    let commands = section
        .split("```sh\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .find(|b| b.starts_with("toolrunner devserver"))
        .context("the first run has no block that starts the development platform")?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let cli = std::env::var_os("TOOLRUNNER_CLI_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target.join("debug/toolrunner"));
    let cli = std::fs::canonicalize(&cli).with_context(|| {
        format!(
            "no toolrunner CLI at {} (cargo build -p toolrunner-cli, or set TOOLRUNNER_CLI_BIN)",
            cli.display()
        )
    })?;
    ensure!(
        std::net::TcpListener::bind(FIRST_RUN_PLATFORM).is_ok(),
        "{FIRST_RUN_PLATFORM} is taken, so the README's first run cannot start its development platform there"
    );
    // The user's crate: the user crate's files, its patch to the packaged
    // crates made absolute.
    let dir = tempfile::tempdir()?;
    let user = root.join("tests/user-crate");
    // Its package and dependencies, and the patch; not the binaries of
    // CI's own checks.
    let manifest = std::fs::read_to_string(user.join("Cargo.toml"))?;
    let own = manifest
        .split("\n[features]")
        .next()
        .context("the user crate's manifest")?;
    let patch = manifest
        .split("\n[patch.crates-io]")
        .nth(1)
        .context("the user crate's manifest patches crates-io")?
        .replace(
            "../../target/packaged",
            &root.join("target/packaged").display().to_string(),
        );
    std::fs::write(
        dir.path().join("Cargo.toml"),
        format!("{own}\n[patch.crates-io]{patch}"),
    )?;
    std::fs::copy(user.join("Cargo.lock"), dir.path().join("Cargo.lock"))?;
    std::fs::create_dir(dir.path().join("src"))?;
    std::fs::copy(user.join("src/main.rs"), dir.path().join("src/main.rs"))?;

    let log = dir.path().join("first-run.log");
    let path = std::env::join_paths(
        std::iter::once(cli.parent().context("the CLI's directory")?.to_path_buf()).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ),
    )?;
    let mut command = Command::new("bash");
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("TOOLRUNNER_") {
            command.env_remove(name);
        }
    }
    use std::os::unix::process::CommandExt;
    let mut child = command
        .args(["-euo", "pipefail", "-c", commands])
        .current_dir(dir.path())
        .env("PATH", path)
        // The target directory the user crate was built in (cargo does not
        // hold it while tests run): only the copy itself is compiled.
        .env("CARGO_TARGET_DIR", &target)
        .process_group(0)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log)?)
        .stderr(std::fs::OpenOptions::new().append(true).open(&log)?)
        .spawn()
        .context("bash starts")?;
    // Cargo builds the crate first (its dependencies are built already
    // when .ci/run built the user crate; minutes otherwise).
    let within = Duration::from_secs(600);
    let end = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if Instant::now() > end {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // The platform and the executor it started in the background.
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
    std::thread::sleep(Duration::from_millis(500));
    let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
    let _ = child.wait();
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let status = status.with_context(|| {
        format!("the first run did not end within {within:?}; its output:\n{output}")
    })?;
    ensure!(
        status.success(),
        "the README's first run failed ({status}); its output:\n{output}"
    );
    ensure!(
        output
            .lines()
            .any(|l| l.starts_with("call ") && l.contains(" completed {\"key\":\"op_")),
        "the first run's last command did not print the call completed; its output:\n{output}"
    );
    ensure!(
        output.contains("connected; serving ledger.post for binding bnd_"),
        "the executor did not say that it serves; its output:\n{output}"
    );
    let ledger = std::fs::read_to_string(dir.path().join("ledger.txt"))
        .context("the first run wrote no ledger.txt")?;
    ensure!(
        ledger.lines().count() == 1 && ledger.contains(" 5 \"first\""),
        "ledger.txt should hold the one entry: {ledger}"
    );
    Ok(())
}
