//! Three executor processes (the `ledger` example built with the
//! `postgres` feature) share one PostgreSQL database and one ledger file,
//! each with its own executor id and `--takeover-grace-ms`. They are
//! SIGKILLed at random and restarted; one is killed for good while it has
//! calls in flight. A live replica must adopt its identity and finish its
//! calls, outbox and reconciliation under that identity; restarted after
//! the adoption, the zombie must refuse to start and write nothing. At the
//! end: no effect twice, no receipt lost, every call settled.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use sqlx::Connection;
use toolrunner::platform::Platform;
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::store::{CallFilter, LocalState, PgStore, ReceiptStatus, Store};
use toolrunner_devserver::{DevServer, Faults};

const CALLS: usize = 36;
const KILLS: usize = 12;
const GRACE_MS: u64 = 2_500;

/// xorshift64*: reproducible choices without another dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// `<target>/debug/examples/ledger` built with the `postgres` feature (cargo
/// decides whether anything is to be built).
fn ledger_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("<target>/<profile>/deps/<test>")?;
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args(["build", "--example", "ledger", "--features", "postgres"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    // As tests/kill_loop.rs: the nested cargo must not see this test's
    // package variables, or build scripts watching them rebuild.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy().into_owned();
        let from_cargo = [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || ["CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"].contains(&name.as_str());
        if from_cargo {
            cmd.env_remove(&name);
        }
    }
    if profile_dir.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    if let Some(target) = profile_dir.parent() {
        cmd.arg("--target-dir").arg(target);
    }
    ensure!(
        cmd.status()?.success(),
        "cargo build --example ledger --features postgres failed"
    );
    let bin = profile_dir.join("examples").join("ledger");
    ensure!(bin.exists(), "no ledger example at {}", bin.display());
    Ok(bin)
}

/// One replica: its executor id and how to start it.
struct Replica {
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Replica {
    fn spawn(&mut self, bin: &Path) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        self.child = Some(
            Command::new(bin)
                .args(&self.args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()?,
        );
        Ok(())
    }

    /// SIGKILL, as a lost machine.
    fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// An exit of its own, if it exited.
    fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => Ok(c.try_wait()?),
            None => Ok(None),
        }
    }

    fn tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }
}

/// The store of an executor identity, read without holding its lease.
async fn store_of(url: &str, id: &str) -> Result<PgStore> {
    Ok(PgStore::connect_in_schema(url, &PgStore::identity_schema(id)).await?)
}

/// Calls of an identity's store that may have had their effect and are not
/// delivered yet (`running`, `settled`).
async fn in_flight(store: &PgStore) -> Result<usize> {
    let filter = CallFilter {
        states: vec![LocalState::Running, LocalState::Settled],
        ..CallFilter::default()
    };
    Ok(store.calls(&filter).await?.len())
}

/// What an identity's store holds: calls not yet final and receipts not
/// yet delivered, and every row counted (to see that nothing was written).
async fn census(store: &PgStore) -> Result<(usize, usize, String)> {
    let calls = store.calls(&CallFilter::default()).await?;
    let open = calls.iter().filter(|c| !c.state.is_final()).count();
    let pending = store.receipts_with(ReceiptStatus::Pending).await?.len();
    let mut rows = Vec::new();
    for c in &calls {
        let receipts = store.receipts(&c.run_id, &c.call_id).await?;
        let events = store.events(&c.run_id, &c.call_id).await?.len();
        rows.push(format!(
            "{} {} v{} {} receipts {:?} {} events",
            c.call_id,
            c.state,
            c.version,
            receipts.len(),
            receipts.iter().map(|r| r.status).collect::<Vec<_>>(),
            events
        ));
    }
    Ok((open, pending, rows.join("\n")))
}

/// The lease row of an identity: (token, adopted_by).
async fn lease(url: &str, id: &str) -> Result<Option<(i64, Option<String>)>> {
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let row = sqlx::query_as(
        "SELECT token, adopted_by FROM toolrunner_leases.executor_leases WHERE executor_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut conn)
    .await?;
    conn.close().await?;
    Ok(row)
}

/// Whether an identity's lease was renewed within the last second.
async fn held(url: &str, id: &str) -> Result<bool> {
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let held: Option<bool> = sqlx::query_scalar(
        "SELECT renewed_at > now() - interval '1 second' FROM toolrunner_leases.executor_leases WHERE executor_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut conn)
    .await?;
    conn.close().await?;
    Ok(held == Some(true))
}

/// Drops what the test left in the shared database.
async fn clean_up(url: &str, ids: &[String]) -> Result<()> {
    let mut conn = sqlx::PgConnection::connect(url).await?;
    for id in ids {
        let schema = PgStore::identity_schema(id);
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&mut conn)
        .await?;
        sqlx::query("DELETE FROM toolrunner_leases.executor_leases WHERE executor_id = $1")
            .bind(id)
            .execute(&mut conn)
            .await?;
    }
    conn.close().await?;
    Ok(())
}

/// The kill loop.
pub(crate) async fn three_replicas_one_killed_for_good(url: &str) -> Result<()> {
    let bin = ledger_binary()?;
    let tag = format!("{:08x}", rand::random::<u32>());
    let ids: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("replica-{n}-{tag}"))
        .collect();
    let outcome = play(url, &bin, &ids).await;
    clean_up(url, &ids).await?;
    outcome
}

async fn play(url: &str, bin: &Path, ids: &[String]) -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let ledger = tmp.path().join("ledger.jsonl");
    let platform = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .db_path(tmp.path().join("platform.db"))
        .faults(Faults {
            error_rate: 0.05,
            drop_response_rate: 0.05,
            latency_ms: 0,
            seed: 11,
        })
        .lease_ttl_ms(1_000)
        .heartbeat_interval_ms(200)
        .start()
        .await?;
    let admin = Platform::new(&platform.base_url(), "dev-admin")?;
    let agent = admin.create_agent("replicas").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "ledger", &["ledger.append"])
        .await?;
    let tool = json!({
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
            reqwest::Method::POST,
            &format!("/agents/{}/versions", agent.agent_id),
        )
        .json(&json!({ "tools": [tool] }))
        .send()
        .await?
        .json();
    let agent_version = published["agent_version"]
        .as_str()
        .with_context(|| format!("the version: {published}"))?
        .to_owned();
    let calls = (0..CALLS)
        .map(|i| {
            let memo = if i % 13 == 5 { "fail" } else { "coffee" };
            toolrunner::platform::NewToolCall::new(
                "ledger.append",
                json!({"amount": 100 + i, "memo": memo}),
            )
        })
        .collect();
    let run = admin.create_run(&agent_version, "user_42", calls).await?;

    let mut replicas: Vec<Replica> = ids
        .iter()
        .map(|id| Replica {
            args: [
                "--base-url",
                &platform.base_url(),
                "--token",
                "dev-executor",
                "--executor-id",
                id,
                "--binding-id",
                &binding.binding_id,
                "--db",
                url,
                "--ledger",
                &ledger.display().to_string(),
                "--capacity",
                "3",
                "--effect-delay-ms",
                "300",
                "--takeover-grace-ms",
                &GRACE_MS.to_string(),
            ]
            .iter()
            .map(|s| (*s).to_owned())
            .collect(),
            log: tmp.path().join(format!("{id}.log")),
            child: None,
        })
        .collect();
    for r in &mut replicas {
        r.spawn(bin)?;
    }
    let (gone, live) = (2, [0usize, 1]);

    // The one killed for good: once its store holds calls whose effect may
    // have happened (after `accepted`), which only its identity can settle.
    let gone_store = store_of(url, &ids[gone]).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut waiting = 0;
    while waiting == 0 {
        ensure!(
            Instant::now() < deadline,
            "{} never had calls in flight:\n{}",
            ids[gone],
            replicas[gone].tail(20)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        waiting = in_flight(&gone_store).await?;
    }
    replicas[gone].kill()?;

    // The others, killed at random and restarted.
    let mut rng = Rng(0x5eed_0000_0000_0c0c);
    for _ in 0..KILLS {
        let r = live[rng.below(2) as usize];
        tokio::time::sleep(Duration::from_millis(100 + rng.below(500))).await;
        if let Some(status) = replicas[r].exited()? {
            bail!(
                "{} exited by itself ({status}):\n{}",
                ids[r],
                replicas[r].tail(30)
            );
        }
        replicas[r].kill()?;
        tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
        replicas[r].spawn(bin)?;
    }

    // Calm: faults off, the two live replicas run until everything settled.
    let calm = toolrunner::platform::FaultSettings {
        error_rate: 0.0,
        drop_response_rate: 0.0,
        latency_ms: 0,
        seed: 11,
    };
    admin.set_faults(&calm).await?;
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let settled = admin
            .run(&run.run_id)
            .await?
            .tool_calls
            .iter()
            .all(|c| matches!(c.state.as_str(), "completed" | "failed"));
        let (open, pending, _) = census(&gone_store).await?;
        let adopted = lease(url, &ids[gone]).await?.and_then(|(_, by)| by);
        if settled && open == 0 && pending == 0 && adopted.is_some() {
            break;
        }
        for r in live {
            if let Some(status) = replicas[r].exited()? {
                bail!(
                    "{} exited by itself ({status}):\n{}",
                    ids[r],
                    replicas[r].tail(30)
                );
            }
        }
        if Instant::now() > deadline {
            let states: Vec<String> = admin
                .run(&run.run_id)
                .await?
                .tool_calls
                .iter()
                .map(|c| format!("{} {}", c.call_id, c.state.as_str()))
                .collect();
            bail!(
                "not settled within 90 s: adopted by {adopted:?}, {open} calls open and {pending} receipts pending in {}'s store; platform: {states:?}\n{}\n{}",
                ids[gone],
                replicas[live[0]].tail(30),
                replicas[live[1]].tail(30)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The zombie comes back after the adoption: it refuses, writes nothing.
    // (First, its identity held by a live adopter: an adopter killed in the
    // loop lost it, and it is adopted again after the grace.)
    let deadline = Instant::now() + Duration::from_secs(20);
    while !held(url, &ids[gone]).await? {
        ensure!(
            Instant::now() < deadline,
            "no live replica holds the adopted identity {}",
            ids[gone]
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before = census(&gone_store).await?;
    let lease_before = lease(url, &ids[gone]).await?;
    let connection = |d: &toolrunner::protocol::wire::Diagnostics| {
        serde_json::to_value(d).ok().and_then(|v| {
            v["executors"].as_array().and_then(|e| {
                e.iter()
                    .find(|e| e["executor_id"] == ids[gone].as_str())
                    .map(|e| e["connection_id"].clone())
            })
        })
    };
    let connected_before = connection(
        &admin
            .diagnostics(&agent.agent_id, &binding.binding_id)
            .await?,
    );
    replicas[gone].log = tmp.path().join("zombie.log");
    replicas[gone].spawn(bin)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = replicas[gone].exited()? {
            break status;
        }
        ensure!(
            Instant::now() < deadline,
            "the zombie {} did not stop",
            ids[gone]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(!status.success(), "the zombie exited 0");
    let said = std::fs::read_to_string(&replicas[gone].log).unwrap_or_default();
    ensure!(
        said.contains("was adopted by replica"),
        "the zombie does not say that its identity was adopted:\n{}",
        replicas[gone].tail(10)
    );
    let after = census(&gone_store).await?;
    ensure!(
        before.2 == after.2,
        "the zombie wrote to its store:\nbefore\n{}\nafter\n{}",
        before.2,
        after.2
    );
    let lease_after = lease(url, &ids[gone]).await?;
    ensure!(
        lease_after == lease_before,
        "the zombie changed its lease: {lease_before:?} -> {lease_after:?}"
    );
    let connected_after = connection(
        &admin
            .diagnostics(&agent.agent_id, &binding.binding_id)
            .await?,
    );
    ensure!(
        connected_before == connected_after,
        "the zombie connected to the platform: {connected_before:?} -> {connected_after:?}"
    );

    // Drain the live ones.
    for r in live {
        if let Some(c) = replicas[r].child.as_ref() {
            Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status()?;
        }
    }
    for r in live {
        let deadline = Instant::now() + Duration::from_secs(30);
        while replicas[r].exited()?.is_none() {
            ensure!(Instant::now() < deadline, "{} did not drain", ids[r]);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // The checks.
    let run = admin.run(&run.run_id).await?;
    let text = std::fs::read_to_string(&ledger).unwrap_or_default();
    let mut lines: BTreeMap<String, usize> = BTreeMap::new();
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).context("a ledger line")?;
        *lines
            .entry(v["call_id"].as_str().unwrap_or_default().to_owned())
            .or_default() += 1;
    }
    let mut adopted_calls = 0;
    for call in &run.tool_calls {
        let n = lines.get(&call.call_id).copied().unwrap_or(0);
        match call.state.as_str() {
            "completed" => ensure!(n == 1, "{} completed with {n} ledger lines", call.call_id),
            "failed" => ensure!(n == 0, "{} failed with {n} ledger lines", call.call_id),
            other => bail!("{} ended {other}", call.call_id),
        }
        let finals = call
            .receipts
            .iter()
            .filter(|r| matches!(r.kind, ReceiptKind::Completed | ReceiptKind::Failed))
            .count();
        ensure!(
            finals == 1,
            "{} has {finals} final receipts on the platform",
            call.call_id
        );
        if call.executor_id.as_deref() == Some(ids[gone].as_str()) {
            adopted_calls += 1;
        }
    }
    let by_executor: BTreeMap<String, usize> =
        run.tool_calls.iter().fold(BTreeMap::new(), |mut m, c| {
            *m.entry(format!("{:?}", c.executor_id)).or_default() += 1;
            m
        });
    ensure!(
        adopted_calls > 0,
        "no call was settled under the identity killed for good ({}); calls by executor: {by_executor:?}",
        ids[gone]
    );
    for id in ids {
        let store = store_of(url, id).await?;
        let (open, pending, rows) = census(&store).await?;
        ensure!(
            open == 0 && pending == 0,
            "{id}'s store still has {open} open calls and {pending} pending receipts:\n{rows}"
        );
        let stuck = store
            .calls(&CallFilter {
                states: vec![LocalState::ReconciliationRequired],
                ..CallFilter::default()
            })
            .await?;
        ensure!(stuck.is_empty(), "{id} left calls to reconcile");
    }
    println!(
        "replicas: {CALLS} calls, {KILLS} kills and one for good; {} lines; {adopted_calls} calls settled under the adopted identity {}",
        lines.values().sum::<usize>(),
        ids[gone]
    );
    platform.shutdown().await;
    Ok(())
}

/// Every write checks the identity's fencing token: once a newer process
/// (or an adopter) took the lease, the older one's writes are refused, and
/// nothing of them is stored; the newer one writes.
pub(crate) async fn a_write_with_an_older_token_is_refused(url: &str) -> Result<()> {
    use toolrunner::store::{Change, StoreError};
    let id = format!("fence-{:08x}", rand::random::<u32>());
    let binding = format!("bnd_{:08x}", rand::random::<u32>());
    let old = PgStore::connect_as(url, &id, &binding, "ins_old").await?;
    let call = |n: &str| {
        Change::InsertCall(super::store_contract::rows::call(
            n,
            LocalState::Claiming,
            0,
        ))
    };
    old.commit(vec![call("call_before")]).await?;
    let new = PgStore::connect_as(url, &id, &binding, "ins_new").await?;
    let refused = old.commit(vec![call("call_zombie")]).await;
    ensure!(
        matches!(refused, Err(StoreError::Fenced(_))),
        "the older process's write was not refused: {refused:?}"
    );
    ensure!(
        new.call("run_1", "call_zombie").await?.is_none(),
        "the refused write is stored"
    );
    new.commit(vec![call("call_after")]).await?;
    let mut calls: Vec<String> = new
        .calls(&CallFilter::default())
        .await?
        .into_iter()
        .map(|c| c.call_id)
        .collect();
    calls.sort();
    ensure!(
        calls == ["call_after", "call_before"],
        "the calls stored: {calls:?}"
    );
    clean_up(url, &[id]).await
}

/// A running executor whose identity moves on (here a newer process of the
/// same id takes the lease, as an adoption does) stops by itself, saying
/// why, and its store refuses its writes from then on.
pub(crate) async fn a_running_executor_whose_lease_moved_on_stops(url: &str) -> Result<()> {
    let id = format!("moved-{:08x}", rand::random::<u32>());
    let server = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let admin = Platform::new(&server.base_url(), "dev-admin")?;
    let agent = admin.create_agent("moved").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "moved", &["moved.echo"])
        .await?;
    let running = toolrunner::Executor::builder()
        .base_url(server.base_url())
        .token("dev-executor")
        .executor_id(&id)
        .binding_id(&binding.binding_id)
        .store_url(url)
        .allow_all()
        .tool(toolrunner::tool::read("moved.echo", echo).describe("Echoes."))
        .build()?
        .start()
        .await?;
    // The identity moves on.
    let _newer = PgStore::connect_as(url, &id, &binding.binding_id, "ins_newer").await?;
    let stopped = tokio::time::timeout(Duration::from_secs(10), running.wait())
        .await
        .context("the executor did not stop within 10 s of losing its lease")?;
    let why = stopped.err().context("it stopped without an error")?;
    ensure!(
        why.to_string().contains("lost its lease"),
        "it stopped for another reason: {why}"
    );
    drop(running);
    server.shutdown().await;
    clean_up(url, &[id]).await
}

/// `moved.echo` arguments and result.
#[toolrunner::schema]
#[derive(serde::Deserialize, serde::Serialize)]
struct Echo {
    /// Anything.
    text: String,
}

async fn echo(_ctx: toolrunner::CallContext, input: Echo) -> Result<Echo, toolrunner::ToolError> {
    Ok(input)
}
