//! What durability costs: the same N write calls, against the same
//! in-process development platform, first through a bare protocol loop
//! with no store, then through the durable executor (its store in a real
//! file: WAL, `synchronous=FULL`), at the same concurrency.
//!
//! ```text
//! cargo run --release --example bench -- [--calls 2000] [--capacity 64] [--dir DIR]
//! ```
//!
//! The bare loop makes the requests the executor makes for one call
//! (`pending`, claim, `accepted`, `completed`) and nothing else. The
//! executor serves a no-op write tool. For each side it prints calls/s and
//! p50/p99 per call (from the claim to the final receipt's answer); for the
//! executor also the store's commits and fsyncs per call (counted by the
//! store's writer), the process's CPU time per call (platform included, on
//! both sides: the difference is the executor's) and the peak resident
//! memory of the durable phase. Linux only (it reads `/proc/self`). Its
//! last line is:
//!
//! ```text
//! bench: durable D calls/s, bare B calls/s, ratio R, commits/call K, fsyncs/call F
//! ```

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::{Notify, Semaphore};
use toolrunner::platform::{NewToolCall, Platform};
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::store::{
    Attempt, CallFilter, Change, Event, LocalCall, LocalState, OutboxReceipt, OutboxSummary,
    ReceiptStatus, SqliteStore, Store, StoreError, Timestamp,
};
use toolrunner::{CallContext, Executor, Shutdown, ToolError};

#[derive(Debug, Parser)]
#[command(about = "The durable executor against the bare protocol, side by side")]
struct Args {
    /// Calls on each side.
    #[arg(long, default_value_t = 2000)]
    calls: usize,
    /// Calls in flight at once (the executor's capacity; the bare loop's
    /// concurrency).
    #[arg(long, default_value_t = 64)]
    capacity: u32,
    /// Where the executor's store file goes (default: a temporary
    /// directory).
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Run the durable side only (for profiling it; no last line).
    #[arg(long)]
    durable_only: bool,
    /// Memory instead of speed: the handler holds each call this long, and
    /// the bench prints the resident memory per call in flight once all
    /// are running (give `--capacity` at least `--calls`).
    #[arg(long, default_value_t = 0)]
    hold_ms: u64,
    /// Start-up instead of speed: the store first gets this many calls
    /// settled long ago (delivered, with their receipts and timeline) ...
    #[arg(long, default_value_t = 0)]
    seed_settled: usize,
    /// ... and this many waiting for reconciliation; the bench prints how
    /// long after `start` the first new call was claimed and run.
    #[arg(long, default_value_t = 0)]
    seed_unsettled: usize,
    /// An outage instead of speed: once every call runs, the platform
    /// refuses every receipt (503) while this many receipts (each call's
    /// progress and final) pile up, then comes back; the bench prints how
    /// long the outbox took to drain, its memory meanwhile, and whether any
    /// receipt was lost or sent twice with different bytes.
    #[arg(long, default_value_t = 0)]
    outage: usize,
    /// A development platform in another process (`toolrunner devserver`),
    /// so that this process's memory and CPU are the executor's alone;
    /// default: one in this process.
    #[arg(long)]
    base_url: Option<String>,
    /// The durable side's store in a PostgreSQL database instead of a
    /// SQLite file (`postgres://…`, built with `--features postgres`): a
    /// schema of its own, dropped at the end. Fsyncs are then the server's
    /// WAL syncs (`pg_stat_wal.wal_sync`) over the run.
    #[arg(long)]
    store_url: Option<String>,
}

/// A number to echo.
#[toolrunner::schema]
#[derive(Deserialize)]
struct In {
    /// The number.
    n: u64,
}

/// The number echoed.
#[toolrunner::schema]
#[derive(Serialize)]
struct Out {
    /// The number.
    n: u64,
}

/// How long the handler holds a call (`--hold-ms`).
static HOLD_MS: AtomicU64 = AtomicU64::new(0);
/// Calls in the handler now.
static IN_HANDLER: AtomicUsize = AtomicUsize::new(0);
/// Calls that entered the handler.
static IN_HANDLER_TOTAL: AtomicUsize = AtomicUsize::new(0);

/// Progress receipts each call sends once the outage begins (`--outage`).
static OUTAGE_PROGRESS: AtomicUsize = AtomicUsize::new(0);
/// The outage has begun: the handlers send their progress.
static OUTAGE_BEGUN: AtomicBool = AtomicBool::new(false);

/// Does nothing, durably (or holds the call, with `--hold-ms`; or sends
/// progress through an outage, with `--outage`).
#[toolrunner::tool(name = "bench.noop", effect = write)]
async fn noop(ctx: CallContext, input: In) -> Result<Out, ToolError> {
    IN_HANDLER_TOTAL.fetch_add(1, Ordering::SeqCst);
    let progress = OUTAGE_PROGRESS.load(Ordering::SeqCst);
    if progress > 0 {
        IN_HANDLER.fetch_add(1, Ordering::SeqCst);
        while !OUTAGE_BEGUN.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for step in 0..progress {
            ctx.progress(format!("step {step}"))
                .await
                .map_err(ToolError::unknown)?;
        }
    }
    let hold = HOLD_MS.load(Ordering::Relaxed);
    if hold > 0 {
        IN_HANDLER.fetch_add(1, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(hold)).await;
        IN_HANDLER.fetch_sub(1, Ordering::SeqCst);
    }
    Ok(Out { n: input.n })
}

#[path = "support/proxy.rs"]
mod proxy;

const ADMIN: &str = "dev-admin";
const EXEC: &str = "dev-executor";
const RUN_SIZE: usize = 100;

/// One side's figures.
struct Side {
    calls: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    cpu: Duration,
}

impl Side {
    fn rate(&self) -> f64 {
        self.calls as f64 / self.elapsed.as_secs_f64()
    }

    fn pct(&self, p: f64) -> Duration {
        let mut l = self.latencies.clone();
        l.sort();
        l.get(((l.len().max(1) - 1) as f64 * p).round() as usize)
            .copied()
            .unwrap_or_default()
    }

    fn print(&self, name: &str) {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        println!(
            "{name:<8} {:>7} calls in {:>6.2} s: {:>7.0} calls/s  p50 {:>7.2} ms  p99 {:>7.2} ms  cpu/call {:>6.0} us",
            self.calls,
            self.elapsed.as_secs_f64(),
            self.rate(),
            ms(self.pct(0.5)),
            ms(self.pct(0.99)),
            self.cpu.as_secs_f64() * 1e6 / self.calls as f64,
        );
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let server = match &args.base_url {
        Some(_) => None,
        None => {
            let mut b = toolrunner_devserver::DevServer::builder().listen("127.0.0.1:0".parse()?);
            if args.outage > 0 {
                // Every receipt request, to check that none was sent twice
                // with different bytes.
                b = b.record_receipts();
            }
            Some(b.start().await?)
        }
    };
    let base = match (&args.base_url, &server) {
        (Some(url), _) => url.clone(),
        (None, Some(s)) => s.base_url(),
        (None, None) => unreachable!("a server is started when no URL is given"),
    };
    let admin = Platform::new(&base, ADMIN)?;
    let agent = admin.create_agent("bench").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "bench", &["bench.noop"])
        .await?;
    let executor = Executor::builder()
        .base_url(&base)
        .token(EXEC)
        .executor_id("bench-durable")
        .binding_id(&binding.binding_id)
        .capacity(args.capacity)
        .allow_all()
        .tool(noop)
        .build()?;
    let version = admin
        .publish(&agent.agent_id, executor.tool_definitions())
        .await?;
    let new_calls = |first: usize| {
        (first..first + RUN_SIZE)
            .map(|n| NewToolCall::new("bench.noop", json!({ "n": n })))
            .collect::<Vec<_>>()
    };
    let mut made = 0;
    let mut make_calls = async |n: usize| -> Result<()> {
        for first in (0..n).step_by(RUN_SIZE) {
            let mut list = new_calls(made + first);
            list.truncate(n - first);
            admin
                .create_run(&version.agent_version, "bench", list)
                .await?;
        }
        made += n;
        Ok(())
    };

    if args.outage > 0 {
        let server = server.context("--outage needs the in-process platform")?;
        // The platform bounds an executor's calls in flight (1,024): the
        // receipts that pile up are each call's progress and final.
        let calls = (args.capacity as usize).min(args.outage);
        let per_call = args.outage.div_ceil(calls);
        OUTAGE_PROGRESS.store(per_call - 1, Ordering::SeqCst);
        let down = Arc::new(AtomicBool::new(false));
        let refusing = down.clone();
        let proxied = proxy::start(&base, move |method, path, _| {
            if method == "POST" && path.ends_with("/receipts") && refusing.load(Ordering::SeqCst) {
                proxy::Verdict::Refuse
            } else {
                proxy::Verdict::Forward
            }
        })
        .await;
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("executor.db");
        let _lock = SqliteStore::lock_path(&path)?;
        let store = SqliteStore::open_path(&path).await?;
        let timed = Arc::new(Timed::new(Arc::new(store.clone()), calls));
        let executor = Executor::builder()
            .base_url(&proxied)
            .token(EXEC)
            .executor_id("bench-outage")
            .binding_id(&binding.binding_id)
            .capacity(u32::try_from(calls)?)
            .stream(false)
            .poll_interval(Duration::from_millis(20))
            // One try a request: a refused receipt waits in the outbox.
            .backoff(Duration::from_millis(10), Duration::from_millis(50), 1)
            .allow_all()
            .tool(noop)
            .build()?;
        make_calls(calls).await?;
        let running = executor.start_with_store(timed.clone()).await?;
        while IN_HANDLER.load(Ordering::SeqCst) < calls {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let rss_before = rss_kib()?;
        // The outage: every receipt refused, while the handlers report.
        down.store(true, Ordering::SeqCst);
        OUTAGE_BEGUN.store(true, Ordering::SeqCst);
        let began = Instant::now();
        let mut rss_piling = rss_before;
        let want = (calls * per_call) as u64;
        loop {
            let waiting = store.outbox_summary().await?.pending;
            rss_piling = rss_piling.max(rss_kib()?);
            if waiting >= want {
                break;
            }
            if began.elapsed() > Duration::from_secs(1800) {
                bail!("only {waiting} of {want} receipts piled up in 30 minutes");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let piled = began.elapsed();
        down.store(false, Ordering::SeqCst);
        let back = Instant::now();
        let mut rss_draining = Vec::new();
        loop {
            rss_draining.push(rss_kib()?);
            if timed.latencies().len() == calls && store.outbox_summary().await?.pending == 0 {
                break;
            }
            if back.elapsed() > Duration::from_secs(1800) {
                bail!("the outbox did not drain in 30 minutes");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let drained = back.elapsed();
        running
            .shutdown(Shutdown::Drain {
                deadline: Duration::from_secs(10),
            })
            .await?;
        // None lost: every receipt the store holds reached the platform.
        // None sent twice with different bytes: one body per receipt id.
        let mut bodies: HashMap<String, HashSet<Vec<u8>>> = HashMap::new();
        let received = server.received_receipts();
        for r in &received {
            if let Some(id) = &r.receipt_id {
                bodies.entry(id.clone()).or_default().insert(r.body.clone());
            }
        }
        let differing = bodies.values().filter(|b| b.len() > 1).count();
        let mut stored = 0;
        let mut never_sent = 0;
        let mut refused = 0;
        for status in [ReceiptStatus::Delivered, ReceiptStatus::Rejected] {
            for r in store.receipts_with(status).await? {
                stored += 1;
                never_sent += usize::from(!bodies.contains_key(&r.receipt_id));
                refused += usize::from(status == ReceiptStatus::Rejected);
            }
        }
        let (low, high) = (
            rss_draining.iter().min().copied().unwrap_or(0),
            rss_draining.iter().max().copied().unwrap_or(0),
        );
        println!(
            "outage: {want} receipts of {calls} calls piled up in {:.1} s (resident memory {rss_before} KiB before, {rss_piling} KiB at most); the platform came back and the outbox drained in {:.1} s (resident memory {low}..{high} KiB meanwhile); {} of {calls} calls delivered; {stored} receipts stored, {never_sent} never sent, {refused} refused once back (late progress), {} requests for {} receipt ids, {differing} ids sent with different bytes",
            piled.as_secs_f64(),
            drained.as_secs_f64(),
            timed.latencies().len(),
            received.len(),
            bodies.len(),
        );
        server.shutdown().await;
        if differing > 0 || never_sent > 0 || timed.latencies().len() != calls {
            bail!("receipts lost or changed");
        }
        return Ok(());
    }

    if args.seed_settled + args.seed_unsettled > 0 {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("executor.db");
        let _lock = SqliteStore::lock_path(&path)?;
        let store = SqliteStore::open_path(&path).await?;
        let seeding = Instant::now();
        seed(&store, args.seed_settled, args.seed_unsettled).await?;
        let seeded = seeding.elapsed();
        let size = std::fs::metadata(&path)?.len() / 1024;
        make_calls(args.calls).await?;
        let timed = Arc::new(Timed::new(Arc::new(store), args.calls));
        let started = Instant::now();
        let running = executor.start_with_store(timed.clone()).await?;
        let up = started.elapsed();
        while timed.first_claim().is_none() || IN_HANDLER_TOTAL.load(Ordering::SeqCst) == 0 {
            if started.elapsed() > Duration::from_secs(600) {
                bail!("no call claimed 10 minutes after start");
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let ran = started.elapsed();
        let claimed = timed
            .first_claim()
            .map_or(ran, |t| t.duration_since(started));
        tokio::select! {
            _ = timed.all_delivered.notified() => {}
            _ = tokio::time::sleep(Duration::from_secs(600)) => bail!("the new calls did not finish in 10 minutes"),
        }
        let all = started.elapsed();
        println!(
            "startup: store of {} settled and {} unsettled calls ({size} KiB, seeded in {:.1} s): start returned after {:.0} ms, first claim after {:.0} ms, first handler after {:.0} ms, {} new calls done after {:.2} s",
            args.seed_settled,
            args.seed_unsettled,
            seeded.as_secs_f64(),
            up.as_secs_f64() * 1000.0,
            claimed.as_secs_f64() * 1000.0,
            ran.as_secs_f64() * 1000.0,
            args.calls,
            all.as_secs_f64(),
        );
        running.shutdown(Shutdown::Detach).await?;
        if let Some(s) = server {
            s.shutdown().await;
        }
        return Ok(());
    }

    if args.hold_ms > 0 {
        HOLD_MS.store(args.hold_ms, Ordering::Relaxed);
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("executor.db");
        let _lock = SqliteStore::lock_path(&path)?;
        let store = SqliteStore::open_path(&path).await?;
        let running = executor.start_with_store(Arc::new(store)).await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let idle = rss_kib()?;
        let created = Instant::now();
        make_calls(args.calls).await?;
        let want = args.calls.min(args.capacity as usize);
        while IN_HANDLER.load(Ordering::SeqCst) < want {
            if created.elapsed() > Duration::from_secs(600) {
                bail!(
                    "only {} of {want} calls running after 10 minutes",
                    IN_HANDLER.load(Ordering::SeqCst)
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let ramp = created.elapsed();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let full = rss_kib()?;
        println!(
            "hold: {want} calls in the handler {:.2} s after they were created ({:.0} claims/s); resident memory {idle} KiB idle, {full} KiB with them: {:.1} KiB per call in flight",
            ramp.as_secs_f64(),
            want as f64 / ramp.as_secs_f64(),
            full.saturating_sub(idle) as f64 / want as f64,
        );
        running.shutdown(Shutdown::Detach).await?;
        if let Some(s) = server {
            s.shutdown().await;
        }
        return Ok(());
    }

    let bare = if args.durable_only {
        None
    } else {
        make_calls(args.calls).await?;
        let bare = bare(&base, &binding.binding_id, args.calls, args.capacity).await?;
        bare.print("bare");
        Some(bare)
    };

    make_calls(args.calls).await?;
    reset_peak_rss();
    let dir = match &args.dir {
        Some(d) => {
            std::fs::create_dir_all(d)?;
            tempfile::tempdir_in(d)?
        }
        None => tempfile::tempdir()?,
    };
    let durable_store = DurableStore::open(dir.path(), args.store_url.as_deref()).await?;
    let timed = Arc::new(Timed::new(durable_store.store(), args.calls));
    let cpu = cpu_time()?;
    let started = Instant::now();
    let running = executor.start_with_store(timed.clone()).await?;
    tokio::select! {
        _ = timed.all_delivered.notified() => {}
        _ = tokio::time::sleep(Duration::from_secs(1800)) => bail!("the durable side did not finish in 30 minutes"),
    }
    let elapsed = started.elapsed();
    let cpu = cpu_time()? - cpu;
    let peak = peak_rss_kib()?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    let durable = Side {
        calls: args.calls,
        elapsed,
        latencies: timed.latencies(),
        cpu,
    };
    durable.print("durable");
    let jobs = timed.commits.lock().expect("lock").len() as u64;
    let stats = durable_store.stats(jobs).await?;
    durable_store.close().await?;
    let per_call = |n: u64| n as f64 / args.calls as f64;
    println!(
        "durable store: {:.2} changes/call in {:.2} transactions/call ({:.1} changes a commit), {} checkpoints, {:.2} fsyncs/call; peak RSS {} KiB",
        per_call(stats.jobs),
        per_call(stats.transactions),
        stats.jobs as f64 / stats.transactions.max(1) as f64,
        stats.checkpoints,
        per_call(stats.fsyncs),
        peak,
    );
    let commits = Side {
        calls: 0,
        elapsed: Duration::ZERO,
        latencies: timed.commits.lock().expect("lock").clone(),
        cpu: Duration::ZERO,
    };
    println!(
        "durable commit as its caller waits: p50 {:.3} ms, p99 {:.3} ms",
        commits.pct(0.5).as_secs_f64() * 1000.0,
        commits.pct(0.99).as_secs_f64() * 1000.0,
    );
    let [call, calls, receipts, receipt, other] = timed.reads();
    println!(
        "durable reads/call: {:.2} (a call {:.2}, lists of calls {:.2}, a call's receipts {:.2}, a receipt {:.2}, other {:.2})",
        per_call(call + calls + receipts + receipt + other),
        per_call(call),
        per_call(calls),
        per_call(receipts),
        per_call(receipt),
        per_call(other),
    );
    if let Some(s) = server {
        s.shutdown().await;
    }
    let Some(bare) = bare else { return Ok(()) };
    println!(
        "bench: durable {:.0} calls/s, bare {:.0} calls/s, ratio {:.2}, commits/call {:.2}, fsyncs/call {:.2}",
        durable.rate(),
        bare.rate(),
        durable.rate() / bare.rate(),
        per_call(stats.transactions),
        per_call(stats.fsyncs),
    );
    Ok(())
}

/// The bare protocol: one executor identity, `capacity` calls at a time,
/// each `pending` → claim → `accepted` → `completed`; no store.
async fn bare(base: &str, binding_id: &str, calls: usize, capacity: u32) -> Result<Side> {
    let api = Platform::new(base, EXEC)?;
    let executor_id = "bench-bare";
    let connected = api
        .request(reqwest::Method::POST, "/executors/connect")
        .json(
            &json!({"executor_id": executor_id, "binding_id": binding_id,
            "tools": ["bench.noop"], "capacity": capacity}),
        )
        .send()
        .await?
        .json();
    let connection_id = connected["connection_id"]
        .as_str()
        .with_context(|| format!("connect answered {connected}"))?
        .to_owned();
    let heartbeat = {
        let (api, connection_id) = (api.clone(), connection_id.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                let _ = api
                    .request(
                        reqwest::Method::POST,
                        &format!("/executors/{executor_id}/heartbeat"),
                    )
                    .json(&json!({"connection_id": connection_id, "in_flight": []}))
                    .send()
                    .await;
            }
        })
    };
    let slots = Arc::new(Semaphore::new(capacity as usize));
    let in_flight = Arc::new(Mutex::new(HashSet::<String>::new()));
    let latencies = Arc::new(Mutex::new(Vec::with_capacity(calls)));
    let freed = Arc::new(Notify::new());
    let cpu = cpu_time()?;
    let started = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    let mut claimed = 0;
    while claimed < calls {
        let free = slots.available_permits();
        if free == 0 {
            freed.notified().await;
            continue;
        }
        let path = format!(
            "/executors/{executor_id}/pending?connection_id={connection_id}&limit={}",
            free.min(100)
        );
        let page = api
            .request(reqwest::Method::GET, &path)
            .send()
            .await?
            .json();
        let data = page["data"]
            .as_array()
            .with_context(|| format!("pending answered {page}"))?;
        let mut any = false;
        for c in data {
            let run_id = c["run_id"].as_str().context("run_id")?.to_owned();
            let call_id = c["call_id"].as_str().context("call_id")?.to_owned();
            if !in_flight.lock().expect("lock").insert(call_id.clone()) {
                continue;
            }
            let Ok(permit) = slots.clone().try_acquire_owned() else {
                in_flight.lock().expect("lock").remove(&call_id);
                break;
            };
            any = true;
            claimed += 1;
            let (api, connection_id, latencies, freed) = (
                api.clone(),
                connection_id.clone(),
                latencies.clone(),
                freed.clone(),
            );
            workers.spawn(async move {
                let t = Instant::now();
                let result = one_call(&api, executor_id, &connection_id, &run_id, &call_id).await;
                latencies.lock().expect("lock").push(t.elapsed());
                drop(permit);
                freed.notify_one();
                result
            });
        }
        if !any {
            tokio::select! {
                _ = freed.notified() => {}
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
        while let Some(done) = workers.try_join_next() {
            done??;
        }
    }
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let elapsed = started.elapsed();
    let cpu = cpu_time()? - cpu;
    heartbeat.abort();
    let latencies = std::mem::take(&mut *latencies.lock().expect("lock"));
    Ok(Side {
        calls,
        elapsed,
        latencies,
        cpu,
    })
}

/// Fills a store as months of work would: `settled` calls delivered long
/// ago (each with its `accepted` and `completed` receipts, an attempt and
/// its timeline) and `unsettled` calls waiting for reconciliation.
async fn seed(store: &SqliteStore, settled: usize, unsettled: usize) -> Result<()> {
    let long_ago: toolrunner::store::Timestamp = "2026-01-01T00:00:00.000Z".parse()?;
    let row = |n: usize, state: LocalState| LocalCall {
        run_id: format!("run_seed_{}", n / 100),
        call_id: format!("call_seed_{n}"),
        tool_name: "bench.noop".into(),
        operation_key: format!("op_seed_{n}"),
        state,
        assignment: None,
        next_sequence: 2,
        reason: (state == LocalState::ReconciliationRequired)
            .then(|| "seeded: the outcome is unknown".to_owned()),
        report: None,
        created_at: long_ago,
        updated_at: long_ago,
        version: 0,
    };
    let receipt = |c: &LocalCall, kind: ReceiptKind, sequence: u64| OutboxReceipt {
        receipt_id: format!("rcp_{}_{sequence}", c.call_id),
        run_id: c.run_id.clone(),
        call_id: c.call_id.clone(),
        assignment_id: format!("asg_{}", c.call_id),
        kind,
        sequence,
        body: json!({"kind": kind, "sequence": sequence, "result": {"n": 1}}).to_string(),
        status: ReceiptStatus::Delivered,
        attempts: 1,
        last_error: None,
        created_at: long_ago,
        delivered_at: Some(long_ago),
    };
    for chunk in (0..settled + unsettled).collect::<Vec<_>>().chunks(500) {
        let mut changes = Vec::new();
        for &n in chunk {
            if n < settled {
                let c = row(n, LocalState::Delivered);
                changes.push(Change::AddReceipt(receipt(&c, ReceiptKind::Accepted, 0)));
                changes.push(Change::AddReceipt(receipt(&c, ReceiptKind::Completed, 1)));
                for what in ["claiming", "assigned", "running", "settled", "delivered"] {
                    changes.push(Change::Note {
                        run_id: c.run_id.clone(),
                        call_id: c.call_id.clone(),
                        what: what.into(),
                        detail: None,
                    });
                }
                changes.insert(changes.len() - 7, Change::InsertCall(c));
            } else {
                changes.push(Change::InsertCall(row(
                    n,
                    LocalState::ReconciliationRequired,
                )));
            }
        }
        store.commit(changes).await?;
    }
    Ok(())
}

/// Claim, `accepted`, `completed`: one call of the bare loop.
async fn one_call(
    api: &Platform,
    executor_id: &str,
    connection_id: &str,
    run_id: &str,
    call_id: &str,
) -> Result<()> {
    let call_path = format!("/runs/{run_id}/tool-calls/{call_id}");
    let claim = api
        .request(reqwest::Method::POST, &format!("{call_path}/claim"))
        .json(
            &json!({"executor_id": executor_id, "connection_id": connection_id,
            "operation_key": format!("op-{call_id}")}),
        )
        .send()
        .await?;
    let claim = claim.json();
    let assignment = &claim["assignment"];
    let grant = assignment["grant"]
        .as_str()
        .with_context(|| format!("claim answered {claim}"))?;
    let n = assignment["arguments"]["n"].clone();
    let receipt = |sequence: u64, kind: &str, extra: Value| {
        let mut body = json!({"executor_id": executor_id,
            "assignment_id": assignment["assignment_id"],
            "receipt_id": format!("rcp-{call_id}-{sequence}"),
            "sequence": sequence, "kind": kind});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        body
    };
    let path = format!("{call_path}/receipts");
    let accepted = api
        .request(reqwest::Method::POST, &path)
        .header("Tool-Grant", grant)
        .json(&receipt(0, "accepted", json!({})))
        .send()
        .await?
        .json();
    if accepted["accepted"] != json!(true) {
        bail!("accepted was not confirmed: {accepted}");
    }
    let completed = api
        .request(reqwest::Method::POST, &path)
        .header("Tool-Grant", grant)
        .json(&receipt(1, "completed", json!({"result": {"n": n}})))
        .send()
        .await?;
    if !(200..300).contains(&completed.status) {
        bail!("completed refused: {}", completed.json());
    }
    Ok(())
}

/// A call's run and call ids.
type CallId = (String, String);

/// The executor's store, timing each call from its first durable write
/// (the operation key, before the claim) to the platform's answer to its
/// final receipt (when the delivered mark is asked for).
struct Timed {
    inner: Arc<dyn Store>,
    /// Calls begun (when), and the times of those delivered.
    calls: Mutex<(HashMap<CallId, Instant>, Vec<Duration>)>,
    /// When the first call was inserted (its operation key saved).
    first: Mutex<Option<Instant>>,
    expected: usize,
    all_delivered: Notify,
    /// Reads by kind: call, calls, receipts, receipt, other.
    reads: [AtomicU64; 5],
    /// How long each commit took, as its caller waited.
    commits: Mutex<Vec<Duration>>,
}

impl Timed {
    fn new(inner: Arc<dyn Store>, expected: usize) -> Timed {
        Timed {
            inner,
            calls: Mutex::new((
                HashMap::with_capacity(expected),
                Vec::with_capacity(expected),
            )),
            expected,
            all_delivered: Notify::new(),
            first: Mutex::new(None),
            reads: Default::default(),
            commits: Mutex::new(Vec::with_capacity(expected * 6)),
        }
    }

    fn read(&self, kind: usize) {
        self.reads[kind].fetch_add(1, Ordering::Relaxed);
    }

    /// Reads so far by kind: call, calls, receipts, receipt, other.
    fn reads(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.reads[i].load(Ordering::Relaxed))
    }

    fn first_claim(&self) -> Option<Instant> {
        *self.first.lock().expect("lock")
    }

    fn latencies(&self) -> Vec<Duration> {
        self.calls.lock().expect("lock").1.clone()
    }

    /// The calls a commit starts (their first row) and ends (delivered).
    fn marks(changes: &[Change]) -> Vec<(bool, CallId)> {
        changes
            .iter()
            .filter_map(|change| match change {
                Change::InsertCall(c) => Some((true, (c.run_id.clone(), c.call_id.clone()))),
                Change::UpdateCall { call, .. } if call.state == LocalState::Delivered => {
                    Some((false, (call.run_id.clone(), call.call_id.clone())))
                }
                _ => None,
            })
            .collect()
    }

    fn observe(&self, marks: Vec<(bool, CallId)>, started: Instant) {
        let mut guard = self.calls.lock().expect("lock");
        let (begun, done) = &mut *guard;
        for (first, key) in marks {
            if first {
                self.first.lock().expect("lock").get_or_insert(started);
                begun.insert(key, started);
            } else if let Some(t) = begun.remove(&key) {
                // Until the platform's answer to the final receipt: the
                // delivered mark is asked for right after it.
                done.push(started.duration_since(t));
                if done.len() == self.expected {
                    self.all_delivered.notify_one();
                }
            }
        }
    }
}

#[toolrunner::async_trait]
impl Store for Timed {
    async fn commit(&self, changes: Vec<Change>) -> Result<(), StoreError> {
        let started = Instant::now();
        let marks = Self::marks(&changes);
        self.inner.commit(changes).await?;
        self.commits.lock().expect("lock").push(started.elapsed());
        self.observe(marks, started);
        Ok(())
    }
    async fn call(&self, run_id: &str, call_id: &str) -> Result<Option<LocalCall>, StoreError> {
        self.read(0);
        self.inner.call(run_id, call_id).await
    }
    async fn calls(&self, filter: &CallFilter) -> Result<Vec<LocalCall>, StoreError> {
        self.read(1);
        self.inner.calls(filter).await
    }
    async fn count_by_state(
        &self,
    ) -> Result<std::collections::BTreeMap<LocalState, u64>, StoreError> {
        self.read(4);
        self.inner.count_by_state().await
    }
    async fn receipts(
        &self,
        run_id: &str,
        call_id: &str,
    ) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.read(2);
        self.inner.receipts(run_id, call_id).await
    }
    async fn receipt(&self, receipt_id: &str) -> Result<Option<OutboxReceipt>, StoreError> {
        self.read(3);
        self.inner.receipt(receipt_id).await
    }
    async fn receipts_with(&self, status: ReceiptStatus) -> Result<Vec<OutboxReceipt>, StoreError> {
        self.read(4);
        self.inner.receipts_with(status).await
    }
    async fn events(&self, run_id: &str, call_id: &str) -> Result<Vec<Event>, StoreError> {
        self.read(4);
        self.inner.events(run_id, call_id).await
    }
    async fn attempts(&self, run_id: &str, call_id: &str) -> Result<Vec<Attempt>, StoreError> {
        self.read(4);
        self.inner.attempts(run_id, call_id).await
    }
    async fn prune(&self, settled_before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        self.inner.prune(settled_before, limit).await
    }
    async fn outbox_summary(&self) -> Result<OutboxSummary, StoreError> {
        self.read(4);
        self.inner.outbox_summary().await
    }
}

/// This process's CPU time (user + system), from `/proc/self/stat`.
fn cpu_time() -> Result<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // The fields after the command name (which may hold spaces).
    let rest = stat.rsplit_once(')').context("/proc/self/stat")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks =
        |i: usize| -> Result<u64> { Ok(fields.get(i).context("/proc/self/stat field")?.parse()?) };
    // utime and stime are fields 14 and 15 (1-based), in clock ticks of
    // 1/100 s on Linux.
    let total = ticks(11)? + ticks(12)?;
    Ok(Duration::from_millis(total * 10))
}

/// The resident memory now, from `/proc/self/status`.
fn rss_kib() -> Result<u64> {
    status_kib("VmRSS:")
}

/// A `/proc/self/status` figure in KiB.
fn status_kib(name: &str) -> Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    let line = status
        .lines()
        .find(|l| l.starts_with(name))
        .with_context(|| name.to_owned())?;
    Ok(line.split_whitespace().nth(1).context("a value")?.parse()?)
}

/// The peak resident memory since the last reset, from `/proc/self/status`.
fn peak_rss_kib() -> Result<u64> {
    status_kib("VmHWM:")
}

/// Starts the peak resident memory afresh (`/proc/self/clear_refs`, 5).
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// What the durable side's store did: changes asked for, transactions,
/// checkpoints and fsyncs.
struct StoreStats {
    jobs: u64,
    transactions: u64,
    checkpoints: u64,
    fsyncs: u64,
}

/// The durable side's store: a SQLite file, or (`--store-url`) a schema of
/// its own in a PostgreSQL database.
enum DurableStore {
    Sqlite {
        store: SqliteStore,
        _lock: toolrunner::store::StoreLock,
    },
    #[cfg(feature = "postgres")]
    Postgres {
        store: Box<toolrunner::store::PgStore>,
        url: String,
        schema: String,
        wal_syncs: i64,
    },
}

impl DurableStore {
    async fn open(dir: &std::path::Path, url: Option<&str>) -> Result<DurableStore> {
        match url {
            None => {
                let path = dir.join("executor.db");
                let lock = SqliteStore::lock_path(&path)?;
                Ok(DurableStore::Sqlite {
                    store: SqliteStore::open_path(&path).await?,
                    _lock: lock,
                })
            }
            #[cfg(feature = "postgres")]
            Some(url) => {
                let schema = format!("bench_{:08x}", rand::random::<u32>());
                toolrunner::store::PgStore::connect_in_schema(url, &schema).await?;
                // Held as the executor holds it: every write checks the
                // identity's fencing token first.
                let sep = if url.contains('?') { '&' } else { '?' };
                let in_schema = format!("{url}{sep}options=-c%20search_path%3D{schema}");
                let store = toolrunner::store::PgStore::connect_as(
                    &in_schema,
                    &format!("bench-durable-{schema}"),
                    "bnd_bench",
                    "ins_bench",
                )
                .await?;
                let wal_syncs = pg_wal_syncs(url).await?;
                Ok(DurableStore::Postgres {
                    store: Box::new(store),
                    url: url.to_owned(),
                    schema,
                    wal_syncs,
                })
            }
            #[cfg(not(feature = "postgres"))]
            Some(_) => bail!(
                "--store-url needs the postgres feature: cargo run --release --features postgres --example bench -- …"
            ),
        }
    }

    fn store(&self) -> Arc<dyn Store> {
        match self {
            DurableStore::Sqlite { store, .. } => Arc::new(store.clone()),
            #[cfg(feature = "postgres")]
            DurableStore::Postgres { store, .. } => Arc::new((**store).clone()),
        }
    }

    /// `jobs`: the commits the executor asked for (each its own
    /// transaction on PostgreSQL, which groups their WAL flushes itself;
    /// the SQLite writer counts its own).
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    async fn stats(&self, jobs: u64) -> Result<StoreStats> {
        match self {
            DurableStore::Sqlite { store, .. } => {
                let s = store.writer_stats();
                Ok(StoreStats {
                    jobs: s.jobs,
                    transactions: s.transactions,
                    checkpoints: s.checkpoints,
                    fsyncs: s.fsyncs,
                })
            }
            #[cfg(feature = "postgres")]
            DurableStore::Postgres {
                store,
                url,
                wal_syncs,
                ..
            } => {
                let now = pg_wal_syncs(url).await?;
                // The writer's own count (group commit puts several commits
                // of the store in one transaction).
                let s = store.writer_stats();
                Ok(StoreStats {
                    jobs: s.jobs.max(jobs),
                    transactions: s.transactions,
                    checkpoints: 0,
                    fsyncs: u64::try_from(now - wal_syncs).unwrap_or(0),
                })
            }
        }
    }

    /// Drops the PostgreSQL schema (a SQLite file goes with its directory).
    async fn close(self) -> Result<()> {
        match self {
            DurableStore::Sqlite { .. } => Ok(()),
            #[cfg(feature = "postgres")]
            DurableStore::Postgres { url, schema, .. } => {
                use sqlx::Connection;
                let mut conn = sqlx::PgConnection::connect(&url).await?;
                // The name is ours: `bench_` and hex digits.
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                    .execute(&mut conn)
                    .await?;
                sqlx::query("DELETE FROM toolrunner_leases.executor_leases WHERE executor_id = $1")
                    .bind(format!("bench-durable-{schema}"))
                    .execute(&mut conn)
                    .await?;
                conn.close().await?;
                Ok(())
            }
        }
    }
}

/// The server's WAL syncs so far (`pg_stat_wal`, the whole server).
#[cfg(feature = "postgres")]
async fn pg_wal_syncs(url: &str) -> Result<i64> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let n: i64 = sqlx::query_scalar("SELECT wal_sync FROM pg_stat_wal")
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(n)
}
