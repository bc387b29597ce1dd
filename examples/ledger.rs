//! `ledger`: a write tool that appends to a file, run by the toolrunner
//! executor.
//!
//! ```text
//! cargo run --example ledger                       # self-contained demo
//! cargo run --example ledger -- --base-url URL --binding-id ID --executor-id ID \
//!     --token TOKEN --db PATH|postgres://… --ledger PATH --capacity N --effect-delay-ms N \
//!     [--takeover-grace-ms N] [--lease-ttl-ms N] [--commit-window-ms N] \
//!     [--admin-listen ADDR] [--approve-over AMOUNT]
//! cargo run --example ledger -- --print-definitions   # {"tools": [...]} for `toolrunner tools publish`
//! ```
//!
//! With `--admin-listen ADDR` it serves, for as long as it runs,
//! `/healthz`, `/readyz` and `/metrics` (Prometheus text) at `ADDR`
//! (`toolrunner::admin`), and says where on stderr:
//! `admin listening on http://ADDR`.
//!
//! Without `--base-url` it starts the development platform in-process,
//! creates an agent, a binding, a version and a run of 20 calls, and exits
//! 0 once all have settled, printing their outcomes. With `--base-url` it
//! serves until SIGTERM (then drains and exits 0).
//!
//! The tool `ledger.append` takes `{"amount": integer >= 1, "memo": string}`
//! and returns `{"entry": line number}`. `memo == "fail"` is a confirmed
//! business failure (nothing written); otherwise one line
//! `{"operation_key","run_id","call_id","amount","at_ms"}` (`at_ms`: when,
//! in Unix milliseconds) is appended with one
//! write and an fsync, then it sleeps `--effect-delay-ms`; `memo == "boom"`
//! then returns an ordinary error (the outcome is unknown).
//!
//! With `--approve-over AMOUNT` an entry above `AMOUNT` needs a person's
//! approval (the tool's policy, an `Authorizer`): the call is given back
//! and waits for `toolrunner approvals approve|deny` (the demo approves
//! them itself, as `ledger-demo`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Parser;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio::sync::Mutex;
use toolrunner::platform::{NewToolCall, Platform};
use toolrunner::{
    CallContext, Effect, Executor, Reconciled, Shutdown, Tool, ToolError, async_trait,
};

#[path = "support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
#[command(about = "Run the ledger.append tool with the toolrunner executor")]
struct Args {
    /// The platform; without it a development platform starts in-process.
    #[arg(long)]
    base_url: Option<String>,
    /// Bearer token (default: TOOLRUNNER_TOKEN, or dev-executor in the demo).
    #[arg(long)]
    token: Option<String>,
    /// Executor id.
    #[arg(long, default_value = "ledger-01")]
    executor_id: String,
    /// Executor binding (required with --base-url).
    #[arg(long)]
    binding_id: Option<String>,
    /// The executor's store: a file (default: `executor.db` in
    /// `$TMPDIR/toolrunner-ledger/EXECUTOR_ID/`; the demo uses a fresh
    /// temporary directory), or, built with `--features postgres`, a
    /// `postgres://` URL.
    #[arg(long)]
    db: Option<String>,
    /// The ledger file (default: `ledger.jsonl` beside the default store;
    /// the demo uses a fresh temporary directory).
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// Most calls at once.
    #[arg(long, default_value_t = 4)]
    capacity: u32,
    /// Sleep after the write (a slow downstream confirmation).
    #[arg(long, default_value_t = 0)]
    effect_delay_ms: u64,
    /// At most N calls of `ledger.append` held at once, from the claim to
    /// the final receipt (this process's; see `toolrunner::Limits`).
    #[arg(long, value_name = "N")]
    concurrency: Option<u32>,
    /// At most N first `accepted` of `ledger.append` in any sliding second
    /// (this process's; see `toolrunner::Limits`).
    #[arg(long, value_name = "N")]
    rate: Option<u32>,
    /// Entries above AMOUNT need a person's approval (`toolrunner approvals
    /// approve|deny`) before they are written; a request waits an hour.
    #[arg(long, value_name = "AMOUNT")]
    approve_over: Option<u64>,
    /// Switch the automatic reconciliation hook off: every ambiguity stays
    /// for a human.
    #[arg(long)]
    no_auto_reconcile: bool,
    /// With a `postgres://` --db shared by replicas: adopt the executor
    /// identities whose lease lapsed longer than N ms ago (finish their
    /// calls, outbox and reconciliation under their identity). Default:
    /// never.
    #[arg(long, value_name = "N")]
    takeover_grace_ms: Option<u64>,
    /// With a `postgres://` --db: how long this process's hold on its
    /// executor identity lasts after each renewal (default: the SDK's, 3 s).
    #[arg(long, value_name = "N")]
    lease_ttl_ms: Option<u64>,
    /// How long the handler may take from its start to its effect (the
    /// line's write): after a takeover, the reconcile hook is asked only
    /// once the old holder's lease lapsed plus this (default: the SDK's,
    /// 30 s).
    #[arg(long, value_name = "N")]
    commit_window_ms: Option<u64>,
    /// Serve `/healthz`, `/readyz` and `/metrics` (Prometheus text) at this
    /// address for as long as the process runs (e.g. 127.0.0.1:9090; port
    /// 0 picks one, printed on stderr).
    #[arg(long, value_name = "ADDR")]
    admin_listen: Option<std::net::SocketAddr>,
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
}

/// `ledger.append` arguments.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct Append {
    /// Amount in minor units.
    #[schemars(range(min = 1))]
    amount: u64,
    /// Free text; `fail` and `boom` trigger the example's failure paths.
    memo: String,
}

/// `ledger.append` result.
#[derive(Debug, Serialize, JsonSchema)]
struct Appended {
    /// The line number of the new entry.
    entry: u64,
}

struct Ledger {
    path: PathBuf,
    delay: Duration,
    commit_window: Duration,
    /// Serializes appends; holds the number of lines so far.
    lines: Mutex<u64>,
}

impl Ledger {
    fn open(path: PathBuf, delay: Duration, commit_window: Duration) -> Result<Ledger> {
        let lines = match std::fs::read(&path) {
            Ok(bytes) => bytes.iter().filter(|b| **b == b'\n').count() as u64,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("cannot read the ledger {}", path.display()));
            }
        };
        Ok(Ledger {
            path,
            delay,
            commit_window,
            lines: Mutex::new(lines),
        })
    }
}

#[async_trait]
impl Tool for Ledger {
    type Input = Append;
    type Output = Appended;

    fn name(&self) -> &str {
        "ledger.append"
    }

    fn description(&self) -> &str {
        "Append one entry to the ledger"
    }

    fn effect(&self) -> Effect {
        Effect::Write
    }

    fn commit_window(&self) -> Duration {
        self.commit_window
    }

    async fn call(&self, ctx: &CallContext, input: Append) -> Result<Appended, ToolError> {
        if input.memo == "fail" {
            return Err(ToolError::failed(
                "declined",
                "the ledger declined this entry",
            ));
        }
        // When the write was made (Unix milliseconds): what a downstream
        // would count its requests by.
        let at_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let line = json!({"operation_key": ctx.operation_key(), "run_id": ctx.run_id(), "call_id": ctx.call_id(), "amount": input.amount, "at_ms": at_ms});
        let entry = {
            let mut lines = self.lines.lock().await;
            let mut file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&self.path)?;
            file.write_all(format!("{line}\n").as_bytes())?;
            file.sync_all()?;
            *lines += 1;
            *lines
        };
        tokio::time::sleep(self.delay).await;
        if input.memo == "boom" {
            return Err(ToolError::unknown("the downstream confirmation failed"));
        }
        Ok(Appended { entry })
    }

    /// Looks the operation key up in the ledger: its line number if the
    /// entry is there; it did not happen only if the whole ledger was read
    /// and every line parsed (a ledger that cannot be read, or a torn
    /// line, cannot tell: an operator decides).
    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Appended> {
        let _lines = self.lines.lock().await;
        let text = match std::fs::read_to_string(&self.path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(_) => return Reconciled::Unknown,
        };
        for (i, line) in text.lines().enumerate() {
            let Ok(entry) = serde_json::from_str::<Value>(line) else {
                return Reconciled::Unknown;
            };
            if entry["operation_key"] == ctx.operation_key() {
                return Reconciled::Happened(Appended {
                    entry: i as u64 + 1,
                });
            }
        }
        Reconciled::DidNotHappen
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let mut args = Args::parse();
    if args.print_definitions {
        let ledger = Ledger {
            path: PathBuf::new(),
            delay: Duration::ZERO,
            commit_window: args
                .commit_window_ms
                .map_or(toolrunner::DEFAULT_COMMIT_WINDOW, Duration::from_millis),
            lines: Mutex::new(0),
        };
        return support::print_definitions(|b| b.tool(ledger));
    }
    let _ = rustls::crypto::ring::default_provider().install_default();
    let scratch = std::env::temp_dir().join(format!("toolrunner-ledger-{}", std::process::id()));
    let (db, file) = match args.base_url {
        Some(_) => {
            // Stable per executor id, so a restart finds its store again,
            // and never in the working directory.
            let dir = std::env::temp_dir()
                .join("toolrunner-ledger")
                .join(&args.executor_id);
            if args.db.is_none() || args.ledger.is_none() {
                std::fs::create_dir_all(&dir)?;
            }
            (dir.join("executor.db"), dir.join("ledger.jsonl"))
        }
        None => {
            std::fs::create_dir_all(&scratch)?;
            (scratch.join("executor.db"), scratch.join("ledger.jsonl"))
        }
    };
    args.db.get_or_insert(db.display().to_string());
    let ledger = Ledger::open(
        args.ledger.get_or_insert(file).clone(),
        Duration::from_millis(args.effect_delay_ms),
        args.commit_window_ms
            .map_or(toolrunner::DEFAULT_COMMIT_WINDOW, Duration::from_millis),
    )?;
    let result = match args.base_url.clone() {
        Some(url) => serve(&args, ledger, &url).await,
        None => demo(&args, ledger).await,
    };
    if args.base_url.is_none() {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    result
}

fn executor(
    args: &Args,
    ledger: Ledger,
    base_url: &str,
    binding_id: &str,
    token: &str,
) -> Result<Executor> {
    let mut builder = Executor::builder();
    builder = builder.limit(
        "ledger.append",
        support::limits(args.concurrency, args.rate),
    );
    if let Some(ms) = args.takeover_grace_ms {
        builder = builder.takeover_grace(Duration::from_millis(ms));
    }
    if let Some(ms) = args.lease_ttl_ms {
        builder = builder.lease_ttl(Duration::from_millis(ms));
    }
    Ok(builder
        .base_url(base_url)
        .token(token)
        .executor_id(&args.executor_id)
        .binding_id(binding_id)
        .store_url(store_url(args.db.as_deref().expect("set in main")))
        .capacity(args.capacity)
        .auto_reconcile(!args.no_auto_reconcile)
        .poll_interval(Duration::from_millis(200))
        .allow_all()
        .approval_policy("ledger.append", approve_over(args.approve_over))
        .tool(ledger)
        .build()?)
}

/// The tool's policy: entries above the amount (if any) need a person.
fn approve_over(
    over: Option<u64>,
) -> impl Fn(&toolrunner::AuthorizationRequest) -> std::result::Result<(), toolrunner::Denied>
+ Send
+ Sync
+ 'static {
    move |request| match (over, request.arguments["amount"].as_u64()) {
        (Some(over), Some(amount)) if amount > over => Err(toolrunner::Denied::needs_approval(
            format!("an entry of {amount} is over {over}"),
            Duration::from_secs(3600),
        )),
        _ => Ok(()),
    }
}

/// The demo's approver: approves every waiting request of the store, as
/// `ledger-demo`, until the demo ends.
async fn approve_all(db: String) -> Result<()> {
    let approvals = toolrunner::Approvals::open(&store_url(&db)).await?;
    loop {
        for r in approvals.list().await? {
            if r.state() == toolrunner::ApprovalState::Waiting {
                approvals
                    .approve(r.run_id(), r.call_id(), "ledger-demo", None)
                    .await?;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The store URL for `--db`: a PostgreSQL URL as it is, a file as
/// `sqlite://PATH`.
fn store_url(db: &str) -> String {
    if db.starts_with("postgres://") || db.starts_with("postgresql://") {
        db.to_owned()
    } else {
        format!("sqlite://{db}")
    }
}

/// Serves `/healthz`, `/readyz` and `/metrics` at `addr` until the process
/// ends, with a Prometheus recorder installed for the whole process.
async fn serve_admin(addr: std::net::SocketAddr, executor: &Executor) -> Result<()> {
    // Durations in seconds, from a millisecond to a minute: histograms (not
    // the exporter's default summaries) aggregate across replicas.
    let buckets = [
        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    ];
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets(&buckets)?
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    let upkeep = prometheus.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    let router =
        toolrunner::admin::router_with_metrics(executor.health(), move || prometheus.render());
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr} for --admin-listen"))?;
    eprintln!("admin listening on http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, router).await });
    Ok(())
}

/// Serves an external platform until SIGTERM, then drains.
async fn serve(args: &Args, ledger: Ledger, base_url: &str) -> Result<()> {
    let binding_id = args
        .binding_id
        .as_deref()
        .context("--binding-id is required with --base-url")?;
    let token = args
        .token
        .clone()
        .or_else(|| std::env::var("TOOLRUNNER_TOKEN").ok())
        .context("--token or TOOLRUNNER_TOKEN is required with --base-url")?;
    // Registered before the start, so a SIGTERM during connect or recovery
    // still drains instead of killing the process.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let executor = executor(args, ledger, base_url, binding_id, &token)?;
    if let Some(addr) = args.admin_listen {
        serve_admin(addr, &executor).await?;
    }
    let running = executor.start().await?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
        stopped = running.wait() => stopped?,
    }
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    Ok(())
}

/// The self-contained demo against an in-process platform.
async fn demo(args: &Args, ledger: Ledger) -> Result<()> {
    let platform = toolrunner_devserver::DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let admin = Platform::new(&platform.base_url(), "dev-admin")?;
    let agent = admin.create_agent("ledger-demo").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "ledger", &["ledger.append"])
        .await?;
    let token = args
        .token
        .clone()
        .unwrap_or_else(|| "dev-executor".to_owned());
    let executor = executor(
        args,
        ledger,
        &platform.base_url(),
        &binding.binding_id,
        &token,
    )?;
    let version = admin
        .publish(&agent.agent_id, executor.tool_definitions())
        .await?;
    if let Some(addr) = args.admin_listen {
        serve_admin(addr, &executor).await?;
    }
    let memos: Vec<&str> = (0..20)
        .map(|i| match i {
            7 => "fail",
            13 => "boom",
            _ => "coffee",
        })
        .collect();
    let calls: Vec<NewToolCall> = memos
        .iter()
        .enumerate()
        .map(|(i, m)| NewToolCall::new("ledger.append", json!({"amount": 100 + i, "memo": m})))
        .collect();
    let run = admin
        .create_run(&version.agent_version, "user_42", calls)
        .await?;
    let run_id = run.run_id;

    let running = executor.start().await?;
    let approver = args
        .approve_over
        .map(|_| tokio::spawn(approve_all(args.db.clone().expect("set in main"))));
    let settled = [
        "completed",
        "failed",
        "cancelled",
        "reconciliation_required",
        "terminated",
    ];
    let mut run = Value::Null;
    for _ in 0..300 {
        run = serde_json::to_value(admin.run(&run_id).await?)?;
        let calls = run["tool_calls"].as_array().context("tool_calls")?;
        if calls
            .iter()
            .all(|c| settled.contains(&c["state"].as_str().unwrap_or("")))
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if let Some(approver) = approver {
        approver.abort();
    }
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    platform.shutdown().await;

    println!(
        "{:<4} {:<8} {:>6}  {:<24} result",
        "#", "memo", "amount", "platform state"
    );
    let mut unsettled = 0;
    for (i, c) in run["tool_calls"]
        .as_array()
        .context("tool_calls")?
        .iter()
        .enumerate()
    {
        let state = c["state"].as_str().unwrap_or("?");
        unsettled += usize::from(!settled.contains(&state));
        let result = c["context_projection"]["result"].to_string();
        let last = c["receipts"]
            .as_array()
            .and_then(|r| r.last())
            .map(|r| r["body"].clone())
            .unwrap_or(Value::Null);
        let shown = match state {
            "completed" => result,
            "failed" => last["error"]["code"].to_string(),
            _ => String::new(),
        };
        println!(
            "{:<4} {:<8} {:>6}  {:<24} {}",
            i + 1,
            memos[i],
            c["arguments"]["amount"],
            state,
            shown
        );
    }
    if unsettled > 0 {
        bail!("{unsettled} calls did not settle in time");
    }
    Ok(())
}
