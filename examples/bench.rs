//! What durability costs: the same N write calls, against the same
//! in-process development platform, first through a bare protocol loop
//! with no store, then through the durable executor (its store in a real
//! file: WAL, `synchronous=FULL`), at the same concurrency.
//!
//! ```text
//! cargo run --release --example bench -- [--calls 2000] [--capacity 64] [--dir DIR]
//! cargo run --example bench -- --print-definitions   # {"tools": [...]} for `toolrunner tools publish`
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
use toolrunner::testing::store::{
    Attempt, CallFilter, Change, Event, LocalCall, LocalState, OutboxReceipt, OutboxSummary,
    ReceiptStatus, SqliteStore, Store, StoreError, Timestamp,
};
use toolrunner::{CallContext, Executor, Shutdown, ToolError};

#[path = "support/mod.rs"]
mod support;

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
    /// The durable side's tool limited to at most N calls held at once
    /// (`toolrunner::Limits`; default: no limit).
    #[arg(long, value_name = "N")]
    concurrency: Option<u32>,
    /// The durable side's tool limited to at most N first `accepted` a
    /// second (`toolrunner::Limits`; default: no limit).
    #[arg(long, value_name = "N")]
    rate: Option<u32>,
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
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
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

#[path = "support/bench/bare.rs"]
mod bare;
#[path = "support/bench/durable.rs"]
mod durable;
#[path = "support/bench/process.rs"]
mod process;
#[path = "support/proxy.rs"]
mod proxy;
#[path = "support/bench/seed.rs"]
mod seed;
#[path = "support/bench/timed.rs"]
mod timed;

use bare::bare;
use durable::*;
use process::*;
use seed::*;
use timed::*;

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
    if args.print_definitions {
        return support::print_definitions(|b| b.tool(noop));
    }
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
        .limit("bench.noop", support::limits(args.concurrency, args.rate))
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
