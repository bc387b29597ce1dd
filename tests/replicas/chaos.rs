//! Three `ledger` processes (the example built with the `postgres`
//! feature) share one PostgreSQL database and one ledger file, each with
//! its own executor id, a takeover grace, a short lease and a commit
//! window. At random, one is SIGKILLed and restarted at once, SIGKILLed
//! and kept down longer than the grace (a replica adopts its identity),
//! or paused (SIGSTOP past the grace and the lease, shorter than the lease
//! and the commit window, then SIGCONT). A replica that finds itself
//! fenced after a pause stops, and is restarted as an orchestrator would;
//! every restart takes its identity back and serves. At the end: no
//! effect twice, no effect reported `failed`, every call settled, every
//! store idle (the outbox empty), every replica serving; and a second live
//! process started with one of their ids fails fast while the first
//! serves on.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use toolrunner::platform::Platform;
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{CallFilter, LocalState, PgStore, ReceiptStatus, Store};
use toolrunner_devserver::{DevServer, Faults};

const CALLS: usize = 36;
const EVENTS: usize = 10;
const GRACE_MS: u64 = 1_500;
/// The identity lease: long enough that a live holder on a loaded 2-core
/// machine (the CI's release build beside the suite) renews within it, so
/// that the twin at the end meets a live holder. With 1 s, a holder that
/// went a whole second without renewing was (rightly) taken over by the
/// twin, and the test failed on its own premise.
const TTL_MS: u64 = 2_000;
const WINDOW_MS: u64 = 6_000;

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

/// One replica: its executor id and how to start it.
struct Replica {
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Replica {
    fn spawn(&mut self, bin: &Path) -> Result<()> {
        // Errors as one line each, without a backtrace.
        let env = [("RUST_BACKTRACE", "0")];
        self.child = Some(super::rolling::spawn(bin, &self.args, &env, &self.log)?);
        Ok(())
    }

    /// SIGKILL, as a lost machine.
    fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            // A stopped process dies of SIGKILL too.
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    /// Sends a signal (`STOP`, `CONT`, `TERM`).
    fn signal(&self, name: &str) -> Result<()> {
        if let Some(c) = self.child.as_ref() {
            let sent = Command::new("kill")
                .args([&format!("-{name}"), &c.id().to_string()])
                .status()?;
            ensure!(sent.success(), "kill -{name} failed");
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
    let filter = CallFilter::new().states([LocalState::Running, LocalState::Settled]);
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

use super::lease;

/// The chaos loop, and its checks.
pub(crate) async fn three_replicas_killed_and_paused(url: &str) -> Result<()> {
    let bin = super::rolling::ledger_binary()?;
    let tag = format!("{:08x}", rand::random::<u32>());
    let ids: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("replica-{n}-{tag}"))
        .collect();
    let outcome = play(url, &bin, &ids).await;
    super::clean_up(url, &ids).await?;
    outcome
}

/// Restarts a replica that stopped by itself because a pause cost it its
/// identity (as an orchestrator restarts a container that exited); any
/// other exit fails the test.
fn restart_if_fenced(r: &mut Replica, id: &str, bin: &Path) -> Result<bool> {
    let Some(status) = r.exited()? else {
        return Ok(false);
    };
    let said = r.tail(40);
    ensure!(
        said.contains("lost its lease"),
        "{id} exited by itself ({status}), not for a lost lease:\n{said}"
    );
    r.child = None;
    r.spawn(bin)?;
    Ok(true)
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
        .lease_ttl_ms(2_000)
        .heartbeat_interval_ms(300)
        .start()
        .await?;
    let admin = Platform::new(&platform.base_url(), "dev-admin")?;
    let super::rolling::Published {
        binding_id,
        agent_version,
        ..
    } = super::rolling::publish_ledger(&admin, "replicas").await?;
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

    let (grace, ttl, window) = (
        GRACE_MS.to_string(),
        TTL_MS.to_string(),
        WINDOW_MS.to_string(),
    );
    let args = |id: &str| -> Vec<String> {
        super::rolling::Serving {
            base_url: &platform.base_url(),
            token: "dev-executor",
            executor_id: id,
            binding_id: &binding_id,
            db: url,
            ledger: &ledger,
            capacity: 3,
            effect_delay_ms: 300,
        }
        .args(&[
            "--takeover-grace-ms",
            &grace,
            "--lease-ttl-ms",
            &ttl,
            "--commit-window-ms",
            &window,
        ])
    };
    let mut replicas: Vec<Replica> = ids
        .iter()
        .map(|id| Replica {
            args: args(id),
            log: tmp.path().join(format!("{id}.log")),
            child: None,
        })
        .collect();
    for r in &mut replicas {
        r.spawn(bin)?;
    }
    // Work in flight everywhere before the chaos starts.
    let first = store_of(url, &ids[0]).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while in_flight(&first).await? == 0 {
        ensure!(
            Instant::now() < deadline,
            "{} never had calls in flight:\n{}",
            ids[0],
            replicas[0].tail(20)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let mut rng = Rng(0x5eed_0000_0000_0c0c ^ u64::from(rand::random::<u32>()));
    let (mut kills, mut long_kills, mut pauses, mut fenced) = (0, 0, 0, 0);
    for event in 0..EVENTS {
        for (r, id) in replicas.iter_mut().zip(ids) {
            fenced += usize::from(restart_if_fenced(r, id, bin)?);
        }
        let r = rng.below(3) as usize;
        // The first three events are one of each.
        let kind = if event < 3 {
            event as u64
        } else {
            rng.below(3)
        };
        match kind {
            0 => {
                replicas[r].kill()?;
                tokio::time::sleep(Duration::from_millis(rng.below(300))).await;
                replicas[r].spawn(bin)?;
                kills += 1;
            }
            1 => {
                // Down past the lease and the grace: adopted, then back.
                replicas[r].kill()?;
                tokio::time::sleep(Duration::from_millis(TTL_MS + GRACE_MS + 1_000)).await;
                replicas[r].spawn(bin)?;
                long_kills += 1;
            }
            _ => {
                // Past the lease and the grace, short of the lease and the
                // commit window.
                let ms = TTL_MS + GRACE_MS + 500 + rng.below(WINDOW_MS - GRACE_MS - 2_000);
                replicas[r].signal("STOP")?;
                tokio::time::sleep(Duration::from_millis(ms)).await;
                replicas[r].signal("CONT")?;
                pauses += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(200 + rng.below(600))).await;
    }

    // Calm: faults off; every replica serves until everything settled.
    let calm = toolrunner::platform::FaultSettings {
        error_rate: 0.0,
        drop_response_rate: 0.0,
        latency_ms: 0,
        seed: 11,
    };
    admin.set_faults(&calm).await?;
    let stores: Vec<PgStore> = {
        let mut v = Vec::new();
        for id in ids {
            v.push(store_of(url, id).await?);
        }
        v
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        for (r, id) in replicas.iter_mut().zip(ids) {
            fenced += usize::from(restart_if_fenced(r, id, bin)?);
        }
        let platform_calls = admin.run(&run.run_id).await?.tool_calls;
        let settled = platform_calls
            .iter()
            .all(|c| matches!(c.state.as_str(), "completed" | "failed"));
        let mut idle = true;
        for s in &stores {
            let (open, pending, _) = census(s).await?;
            idle &= open == 0 && pending == 0;
        }
        // Every replica holds its own identity again.
        let mut own = true;
        for id in ids {
            own &= lease(url, id)
                .await?
                .is_some_and(|(_, _, by, age)| by.is_none() && age < TTL_MS as i64);
        }
        if settled && idle && own {
            break;
        }
        if Instant::now() > deadline {
            let states: Vec<String> = platform_calls
                .iter()
                .map(|c| format!("{} {}", c.call_id, c.state.as_str()))
                .collect();
            let mut leases = Vec::new();
            for id in ids {
                leases.push(format!("{id}: {:?}", lease(url, id).await?));
            }
            let mut rows = String::new();
            for (s, id) in stores.iter().zip(ids) {
                rows.push_str(&format!("{id}:\n{}\n", census(s).await?.2));
            }
            bail!(
                "not settled within 120 s; leases {leases:?}; platform: {states:?}\n{rows}\n{}\n{}\n{}",
                replicas[0].tail(20),
                replicas[1].tail(20),
                replicas[2].tail(20)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A second live process with one of their ids fails fast; the first
    // serves on.
    let mut twin = Replica {
        args: replicas[0].args.clone(),
        log: tmp.path().join("twin.log"),
        child: None,
    };
    let lease_before = lease(url, &ids[0]).await?;
    twin.spawn(bin)?;
    let started = Instant::now();
    let status = loop {
        if let Some(status) = twin.exited()? {
            break status;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "a second process of {} did not stop",
            ids[0]
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(!status.success(), "the second process exited 0");
    let said = std::fs::read_to_string(&twin.log).unwrap_or_default();
    ensure!(
        said.contains("give every replica its own executor id"),
        "the second process does not say what to do:\n{}",
        twin.tail(10)
    );
    tokio::time::sleep(Duration::from_millis(TTL_MS)).await;
    ensure!(
        replicas[0].exited()?.is_none(),
        "the first process stopped when the second started:\n{}",
        replicas[0].tail(20)
    );
    let lease_after = lease(url, &ids[0]).await?;
    ensure!(
        lease_before.as_ref().map(|l| l.0) == lease_after.as_ref().map(|l| l.0),
        "the second process moved the first one's lease: {lease_before:?} -> {lease_after:?}"
    );

    // Drain them all: each exits 0.
    for r in &replicas {
        r.signal("TERM")?;
    }
    for (r, id) in replicas.iter_mut().zip(ids) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = r.exited()? {
                break status;
            }
            ensure!(Instant::now() < deadline, "{id} did not drain");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        ensure!(
            status.success(),
            "{id} did not drain cleanly ({status}):\n{}",
            r.tail(20)
        );
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
    for call in &run.tool_calls {
        let n = lines.get(&call.call_id).copied().unwrap_or(0);
        match call.state.as_str() {
            "completed" => ensure!(n == 1, "{} completed with {n} ledger lines", call.call_id),
            "failed" => {
                ensure!(
                    n == 0,
                    "{} is failed though its effect happened ({n} lines)",
                    call.call_id
                );
                // Declined by the ledger, or found not performed by a hook
                // (a process lost between `accepted` and the write, or
                // between `accepted` and the decline's commit: a "fail"
                // call lost there is found not performed too).
                let code = call
                    .receipts
                    .iter()
                    .rev()
                    .find(|r| r.kind == ReceiptKind::Failed)
                    .and_then(|r| serde_json::from_str::<Value>(r.body.get()).ok())
                    .map(|b| b["error"]["code"].clone())
                    .unwrap_or(Value::Null);
                let expected: &[&str] = if call.arguments["memo"] == "fail" {
                    &["declined", "not_performed"]
                } else {
                    &["not_performed"]
                };
                ensure!(
                    expected.iter().any(|e| code == *e),
                    "{} (memo {}) failed with code {code}",
                    call.call_id,
                    call.arguments["memo"]
                );
            }
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
    }
    for (s, id) in stores.iter().zip(ids) {
        let (open, pending, rows) = census(s).await?;
        ensure!(
            open == 0 && pending == 0,
            "{id}'s store still has {open} open calls and {pending} pending receipts:\n{rows}"
        );
        let stuck = s
            .calls(&CallFilter::new().states([LocalState::ReconciliationRequired]))
            .await?;
        ensure!(stuck.is_empty(), "{id} left calls to reconcile");
    }
    let by_executor: BTreeMap<String, usize> =
        run.tool_calls.iter().fold(BTreeMap::new(), |mut m, c| {
            *m.entry(c.executor_id.clone().unwrap_or_default())
                .or_default() += 1;
            m
        });
    println!(
        "replicas: {CALLS} calls, {kills} kills, {long_kills} kills past the grace, {pauses} pauses ({fenced} replicas fenced by a pause and restarted); {} lines; calls by executor {by_executor:?}",
        lines.values().sum::<usize>(),
    );
    platform.shutdown().await;
    Ok(())
}
