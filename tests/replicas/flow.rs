//! Flow control across replicas: three `ledger` processes on one
//! PostgreSQL database with `--concurrency 4 --rate 50`. The platform's
//! receipt times (what the downstream saw) show never more than 4 calls
//! between their first `accepted` and their final receipt at once, never
//! more than 50 first `accepted` in any second; every call completes once
//! (the ledger file, what the downstream received, has one line a call);
//! and the executors' own timelines show that no claim waited for a slot:
//! claim to `accepted`, p99, within 10 ms of the same run without limits.
//! Then the same with a replica killed (`kill -9`) and another paused past
//! its lease: their slots come back (the others go on at the limit), and
//! nothing is duplicated or lost.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant, UNIX_EPOCH};

use anyhow::{Context, Result, ensure};
use serde_json::json;
use toolrunner::platform::Platform;
use toolrunner::testing::store::{CallFilter, PgStore, Store};
use toolrunner_devserver::DevServer;

const CONCURRENCY: usize = 4;
const RATE: usize = 50;

#[path = "../support/limits.rs"]
mod limits;

use limits::most;

/// One play: its replicas' ids, and what the platform and the ledger saw.
struct Played {
    /// Each call's first `accepted` and final receipt, as the platform
    /// received them (milliseconds).
    spans: Vec<(i128, i128)>,
    /// Claim (the key saved) to `running` (the `accepted` confirmed), for
    /// each call, in milliseconds, from the executors' timelines.
    claim_to_accepted: Vec<i64>,
    /// Ledger lines by call id.
    lines: BTreeMap<String, usize>,
    /// When each ledger line was written (Unix milliseconds).
    writes: Vec<i128>,
}

struct Setup<'a> {
    url: &'a str,
    bin: &'a Path,
    platform: &'a DevServer,
    admin: &'a Platform,
    tmp: &'a Path,
}

/// Runs `calls` calls through three replicas started with `extra` flags;
/// `disturb` runs while they serve (given the replicas and their args).
async fn play<F, Fut>(
    s: &Setup<'_>,
    tag: &str,
    calls: usize,
    effect_delay_ms: u64,
    extra: &[&str],
    disturb: F,
) -> Result<Played>
where
    F: FnOnce(Vec<(Child, Vec<String>)>) -> Fut,
    Fut: std::future::Future<Output = Result<Vec<(Child, Vec<String>)>>>,
{
    let published = super::rolling::publish_ledger(s.admin, tag).await?;
    let ledger = s.tmp.join(format!("{tag}.jsonl"));
    let ids: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("flow-{n}-{tag}"))
        .collect();
    let new_calls = (0..calls)
        .map(|i| {
            toolrunner::platform::NewToolCall::new(
                "ledger.append",
                json!({"amount": 1 + i, "memo": "coffee"}),
            )
        })
        .collect();
    let run = s
        .admin
        .create_run(&published.agent_version, "user_42", new_calls)
        .await?;
    let mut replicas = Vec::new();
    for id in &ids {
        let args = super::rolling::Serving {
            base_url: &s.platform.base_url(),
            token: "dev-executor",
            executor_id: id,
            binding_id: &published.binding_id,
            db: s.url,
            ledger: &ledger,
            capacity: 8,
            effect_delay_ms,
        }
        .args(extra);
        let log = s.tmp.join(format!("{id}.log"));
        let child = super::rolling::spawn(s.bin, &args, &[("RUST_BACKTRACE", "0")], &log)?;
        replicas.push((child, args));
    }
    let mut replicas = disturb(replicas).await?;
    let deadline = Instant::now() + Duration::from_secs(180);
    let done = loop {
        let now = s.admin.run(&run.run_id).await?;
        if now
            .tool_calls
            .iter()
            .all(|c| c.state.as_str() == "completed")
        {
            break now;
        }
        if Instant::now() > deadline {
            let mut said = String::new();
            for id in &ids {
                said +=
                    &std::fs::read_to_string(s.tmp.join(format!("{id}.log"))).unwrap_or_default();
            }
            let states: BTreeMap<&str, usize> =
                now.tool_calls.iter().fold(BTreeMap::new(), |mut m, c| {
                    *m.entry(c.state.as_str()).or_default() += 1;
                    m
                });
            anyhow::bail!("not every call completed in time ({states:?}):\n{said}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for (child, _) in &mut replicas {
        let _ = child.kill();
        let _ = child.wait();
    }

    let spans = limits::spans(&done)?;
    let mut claim_to_accepted = Vec::new();
    for id in &ids {
        let store = PgStore::connect_in_schema(s.url, &PgStore::identity_schema(id)).await?;
        for c in store.calls(&CallFilter::default()).await? {
            let events = store.events(&c.run_id, &c.call_id).await?;
            let at = |what: &str| {
                events
                    .iter()
                    .find(|e| e.what() == what)
                    .map(|e| e.at().timestamp_millis())
            };
            if let (Some(claimed), Some(running)) = (at("claiming"), at("running")) {
                claim_to_accepted.push(running - claimed);
            }
        }
    }
    let mut lines = BTreeMap::new();
    let mut writes = Vec::new();
    for line in std::fs::read_to_string(&ledger)?.lines() {
        let v: serde_json::Value = serde_json::from_str(line)?;
        let call = v["call_id"].as_str().context("a ledger line's call")?;
        *lines.entry(call.to_owned()).or_default() += 1;
        writes.push(i128::from(
            v["at_ms"].as_u64().context("a ledger line's time")?,
        ));
    }
    super::clean_up(s.url, &ids).await?;
    Ok(Played {
        spans,
        claim_to_accepted,
        lines,
        writes,
    })
}

fn p99(mut v: Vec<i64>) -> i64 {
    v.sort_unstable();
    v.get((v.len() * 99).div_ceil(100).saturating_sub(1))
        .copied()
        .unwrap_or(0)
}

fn once_each(played: &Played, calls: usize) -> Result<()> {
    ensure!(
        played.lines.len() == calls && played.lines.values().all(|n| *n == 1),
        "the ledger holds {} calls, some more than once: {:?}",
        played.lines.len(),
        played
            .lines
            .iter()
            .filter(|(_, n)| **n > 1)
            .collect::<Vec<_>>()
    );
    Ok(())
}

async fn setup_platform(tmp: &Path) -> Result<(DevServer, Platform)> {
    let platform = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .db_path(tmp.join("platform.db"))
        .lease_ttl_ms(2_000)
        .heartbeat_interval_ms(300)
        .start()
        .await?;
    let admin = Platform::new(&platform.base_url(), "dev-admin")?;
    Ok((platform, admin))
}

/// 600 calls through three replicas, with limits and without.
pub(crate) async fn three_replicas_hold_one_limit(url: &str) -> Result<()> {
    const CALLS: usize = 600;
    let bin = super::rolling::ledger_binary()?;
    let tmp = tempfile::tempdir()?;
    let (platform, admin) = setup_platform(tmp.path()).await?;
    let s = Setup {
        url,
        bin: &bin,
        platform: &platform,
        admin: &admin,
        tmp: tmp.path(),
    };
    let tag = format!("{:08x}", rand::random::<u32>());
    let free = play(&s, &format!("free{tag}"), CALLS, 30, &[], |r| async {
        Ok(r)
    })
    .await?;
    let (c, r) = (CONCURRENCY.to_string(), RATE.to_string());
    let limited = play(
        &s,
        &format!("lim{tag}"),
        CALLS,
        30,
        &["--concurrency", &c, "--rate", &r],
        |r| async { Ok(r) },
    )
    .await?;
    platform.shutdown().await;

    once_each(&free, CALLS)?;
    once_each(&limited, CALLS)?;
    let (at_once, a_second) = most(&limited.spans);
    let (free_at_once, free_a_second) = most(&free.spans);
    ensure!(
        at_once <= CONCURRENCY,
        "{at_once} calls between accepted and their final receipt at once"
    );
    ensure!(
        a_second <= RATE,
        "{a_second} first accepted within a second"
    );
    // Without limits the load goes over the concurrency limit (over the
    // rate too on a quiet machine: 53 to 72 a second here; under load it
    // may not, so only the concurrency is asked for).
    ensure!(
        free_at_once > CONCURRENCY,
        "without limits the load stays under them ({free_at_once} at once, {free_a_second} a second): the test shows nothing"
    );
    ensure!(
        limited.claim_to_accepted.len() == CALLS && free.claim_to_accepted.len() == CALLS,
        "a timeline without its claim or its start: {} and {} of {CALLS}",
        limited.claim_to_accepted.len(),
        free.claim_to_accepted.len()
    );
    let (lim99, free99) = (
        p99(limited.claim_to_accepted.clone()),
        p99(free.claim_to_accepted.clone()),
    );
    eprintln!(
        "flow: 3 replicas, {CALLS} calls: limited {at_once} at once (limit {CONCURRENCY}), {a_second} a second (limit {RATE}); claim to accepted p99 {lim99} ms limited, {free99} ms without limits ({free_at_once} at once, {free_a_second} a second)"
    );
    ensure!(
        lim99 <= free99 + 10,
        "claim to accepted p99 {lim99} ms with limits against {free99} ms without: a claim waited"
    );
    Ok(())
}

fn now_ms() -> i128 {
    i128::try_from(
        std::time::SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis()),
    )
    .unwrap_or(0)
}

/// The most effects at once among `writes` (each lasting `effect_ms` from
/// its write) at the instants in `from..to`.
fn effects_at_once(writes: &[i128], effect_ms: i128, from: i128, to: i128) -> usize {
    writes
        .iter()
        .filter(|w| (from..to).contains(*w))
        .map(|at| {
            writes
                .iter()
                .filter(|w| **w <= *at && *at < **w + effect_ms)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// 200 calls through three limited replicas (4 at once, 50 a second,
/// effects of a second: the concurrency binds, so calls still wait when
/// the second replica goes away); one is killed (`kill -9`) and kept down
/// 7 s, well past its lease, then restarted; then another is paused
/// (SIGSTOP) as long, then let go on. The ledger's writes show never more
/// than 4 effects at once; the calls the others took while each was away
/// were 4 at once again (its slots came back within a lease); the
/// platform saw never more than 50 first `accepted` a second; every call
/// completes once.
pub(crate) async fn killed_and_paused_replicas_give_their_slots_back(url: &str) -> Result<()> {
    const CALLS: usize = 200;
    const TTL_MS: i128 = 1_500;
    // Away this long: the windows looked at start a lease and a second and
    // a half after (the platform's lease of the claims, 2 s, has lapsed by
    // then too) and last four seconds (one at 1.5 s was missed once, the
    // PostgreSQL suite's other tests loading the machine).
    const AWAY_MS: u64 = 7_000;
    const AFTER_MS: i128 = TTL_MS + 1_500;
    // A second each: four overlap even when a loaded machine claims a few
    // calls a second (with 200 ms a CI run saw 3 at once in a window of 18
    // writes, the PostgreSQL suite's other tests beside it); 200 calls so
    // that calls still wait when the second replica thaws.
    const EFFECT_MS: u64 = 1_000;
    let bin = super::rolling::ledger_binary()?;
    let tmp = tempfile::tempdir()?;
    let (platform, admin) = setup_platform(tmp.path()).await?;
    let s = Setup {
        url,
        bin: &bin,
        platform: &platform,
        admin: &admin,
        tmp: tmp.path(),
    };
    let tag = format!("{:08x}", rand::random::<u32>());
    let (c, r, ttl) = (
        CONCURRENCY.to_string(),
        RATE.to_string(),
        TTL_MS.to_string(),
    );
    let marks = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let noted = marks.clone();
    let bin_for = bin.clone();
    let log_dir = tmp.path().to_owned();
    let played = play(
        &s,
        &format!("kp{tag}"),
        CALLS,
        EFFECT_MS,
        &["--concurrency", &c, "--rate", &r, "--lease-ttl-ms", &ttl],
        move |mut replicas| async move {
            let note = |what: &'static str| noted.lock().unwrap().push((what, now_ms()));
            tokio::time::sleep(Duration::from_secs(3)).await;
            // Killed, down past its lease, started again with its id.
            note("kill");
            replicas[0].0.kill()?;
            replicas[0].0.wait()?;
            tokio::time::sleep(Duration::from_millis(AWAY_MS)).await;
            note("restart");
            let log = log_dir.join("restarted.log");
            replicas[0].0 = super::rolling::spawn(&bin_for, &replicas[0].1, &[], &log)?;
            tokio::time::sleep(Duration::from_secs(3)).await;
            // Paused past its lease, then let go on.
            note("stop");
            let pid = replicas[1].0.id().to_string();
            std::process::Command::new("kill")
                .args(["-STOP", &pid])
                .status()?;
            tokio::time::sleep(Duration::from_millis(AWAY_MS)).await;
            note("cont");
            std::process::Command::new("kill")
                .args(["-CONT", &pid])
                .status()?;
            Ok(replicas)
        },
    )
    .await?;
    platform.shutdown().await;
    once_each(&played, CALLS)?;
    let (_, a_second) = most(&played.spans);
    ensure!(
        a_second <= RATE,
        "{a_second} first accepted within a second"
    );
    let effect = i128::from(EFFECT_MS);
    let all = effects_at_once(&played.writes, effect, 0, i128::MAX);
    ensure!(
        all <= CONCURRENCY,
        "{all} effects at once (the ledger's writes), over the limit of {CONCURRENCY}"
    );
    let marks = marks.lock().unwrap().clone();
    let at = |what: &str| -> Result<i128> {
        marks
            .iter()
            .find(|(w, _)| *w == what)
            .map(|(_, t)| *t)
            .with_context(|| format!("the mark {what}"))
    };
    // A lease after each went away (and time to spare), the others use
    // every slot again: the calls first accepted then, by the replicas
    // still serving, are 4 at once between `accepted` and their final
    // receipt (a slot's whole time but the claim; the effects alone, a
    // second of it, met 3 at once under a loaded CI run's PostgreSQL
    // suite, when the claims and receipts took most of a second more).
    let window = |from: i128, to: i128| {
        let writes = played
            .writes
            .iter()
            .filter(|w| (from..to).contains(*w))
            .count();
        (
            taken_at_once(&played.spans, from, to),
            effects_at_once(&played.writes, effect, from, to),
            writes,
        )
    };
    let (killed, killed_effects, killed_writes) = window(at("kill")? + AFTER_MS, at("restart")?);
    let (paused, paused_effects, paused_writes) = window(at("stop")? + AFTER_MS, at("cont")?);
    let said = format!(
        "{killed} calls at once while one was killed ({killed_effects} effects at once, {killed_writes} writes then), {paused} while one was paused ({paused_effects} effects at once, {paused_writes} writes then; limit {CONCURRENCY})"
    );
    eprintln!(
        "flow: killed and paused: {all} effects at once at most; {said}; {a_second} first accepted a second at most"
    );
    ensure!(
        killed == CONCURRENCY && paused == CONCURRENCY,
        "the slots of a replica that went away did not come back within a lease: {said}"
    );
    Ok(())
}

/// The most calls at once between their first `accepted` and their final
/// receipt, among the calls first accepted in `from..to`.
fn taken_at_once(spans: &[(i128, i128)], from: i128, to: i128) -> usize {
    let taken: Vec<(i128, i128)> = spans
        .iter()
        .copied()
        .filter(|(accepted, _)| (from..to).contains(accepted))
        .collect();
    most(&taken).0
}

/// What `flow.stored` takes.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct Job {
    /// Which one.
    n: u64,
}

/// What it gives back.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Done {
    /// Which one.
    n: u64,
}

/// How many run now, and the most at once.
#[derive(Clone, Default)]
struct AtOnce {
    now: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    most: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

async fn stored_work(
    toolrunner::State(at_once): toolrunner::State<AtOnce>,
    _ctx: toolrunner::CallContext,
    job: Job,
) -> Result<Done, toolrunner::ToolError> {
    use std::sync::atomic::Ordering;
    let now = at_once.now.fetch_add(1, Ordering::SeqCst) + 1;
    at_once.most.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(150)).await;
    at_once.now.fetch_sub(1, Ordering::SeqCst);
    Ok(Done { n: job.n })
}

/// A limit set in the store (`toolrunner limits set`) applies to an
/// executor that runs already, within about a second, without a restart:
/// a tool with no limit of its own runs 1 at once, then 3 once the store
/// says 3.
pub(crate) async fn a_limit_set_in_the_store_applies_without_a_restart(url: &str) -> Result<()> {
    use std::sync::atomic::Ordering;
    const TOOL: &str = "flow.stored";
    let stored = toolrunner::StoredLimits::open(url).await?;
    stored.clear(TOOL).await?;
    stored
        .set(TOOL, toolrunner::Limits::none().concurrency(1))
        .await?;
    let platform = DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let admin = Platform::new(&platform.base_url(), "dev-admin")?;
    let agent = admin.create_agent("flow-stored").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "stored", &[TOOL])
        .await?;
    let tool = json!({
        "name": TOOL, "description": "Works a while", "binding_id": binding.binding_id,
        "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                         "required": ["n"], "additionalProperties": false},
        "output_schema": {"type": "object", "properties": {"n": {"type": "integer"}}}
    });
    let published = admin
        .request(
            toolrunner::platform::Method::POST,
            &format!("/agents/{}/versions", agent.agent_id),
        )
        .json(&json!({ "tools": [tool] }))
        .send()
        .await?
        .json();
    let version = published["agent_version"]
        .as_str()
        .with_context(|| format!("the version: {published}"))?
        .to_owned();
    let at_once = AtOnce::default();
    let id = format!("flow-stored-{:08x}", rand::random::<u32>());
    let running = toolrunner::Executor::builder()
        .base_url(platform.base_url())
        .token("dev-executor")
        .executor_id(&id)
        .binding_id(&binding.binding_id)
        .store_url(url)
        .capacity(8)
        .poll_interval(Duration::from_millis(50))
        .allow_all()
        .state(at_once.clone())
        .tool(toolrunner::tool::write(TOOL, stored_work).describe("Works a while"))
        .build()?
        .start()
        .await?;
    let run = |n: u64| {
        let calls = (0..n)
            .map(|i| toolrunner::platform::NewToolCall::new(TOOL, json!({"n": i})))
            .collect();
        admin.create_run(&version, "user_42", calls)
    };
    let outcome = async {
        let first = run(6).await?;
        admin
            .wait_settled(&first.run_id, Duration::from_secs(60))
            .await?;
        let under_one = at_once.most.swap(0, Ordering::SeqCst);
        stored
            .set(TOOL, toolrunner::Limits::none().concurrency(3))
            .await?;
        // Every replica reads the store's limits again once a second.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let second = run(12).await?;
        let settled = admin
            .wait_settled(&second.run_id, Duration::from_secs(60))
            .await?;
        let under_three = at_once.most.load(Ordering::SeqCst);
        eprintln!(
            "flow: the store's limit 1 held {under_one} at once; set to 3 while running, {under_three} at once"
        );
        ensure!(
            settled
                .tool_calls
                .iter()
                .all(|c| c.state.as_str() == "completed"),
            "every call completes"
        );
        ensure!(
            under_one == 1 && under_three == 3,
            "the store's limits did not apply: {under_one} at once under 1, {under_three} under 3"
        );
        Ok(())
    }
    .await;
    let stopped = running
        .shutdown(toolrunner::Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await;
    platform.shutdown().await;
    stored.clear(TOOL).await?;
    let cleaned = super::clean_up(url, &[id]).await;
    outcome.and(stopped.map_err(Into::into)).and(cleaned)
}
