//! Transactional handlers, written once for both stores: the business row
//! a handler writes in `ctx.transaction(…)` and the call's final receipt are
//! both stored or both absent, whatever step the process dies at, and no
//! such call ever needs reconciliation.
//!
//! The SQLite runs are in `tests/crash.rs`, the PostgreSQL ones in
//! `tests/postgres.rs`; each gives a store URL (a file, or a schema of its
//! own).
#![allow(dead_code)] // each suite uses the part it needs

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::platform::{NewToolCall, Platform};
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{LocalState, ReceiptStatus, Store};
use toolrunner::{CallContext, Executor, RunningExecutor, Shutdown, ToolError, Transaction, sqlx};
use toolrunner_devserver::DevServer;

/// The business table, in the store's database.
const CREATE_ORDERS: &str = "CREATE TABLE IF NOT EXISTS orders (operation_key TEXT PRIMARY KEY, amount BIGINT NOT NULL CHECK (amount > 0))";
const INSERT_ORDER: &str = "INSERT INTO orders (operation_key, amount) VALUES ($1, $2)";

/// Every durable step of a call, and the handler's own point between its
/// business write and its return (`commit_point`).
pub(crate) const STEPS: [&str; 7] = [
    "after_claim_answer",
    "after_assignment_saved",
    "after_accepted_saved",
    "after_accepted_confirmed",
    "commit_point",
    "after_handler",
    "after_final_saved",
];

/// `orders.place` arguments.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
pub(crate) struct Order {
    /// How much (positive; 0 makes the insert fail after the handler's
    /// other checks, so its error rolls back).
    pub(crate) amount: i64,
    /// Fail after the insert (the insert must be rolled back).
    #[serde(default)]
    pub(crate) fail_after_insert: bool,
    /// Report progress before opening the transaction.
    #[serde(default)]
    pub(crate) progress_first: bool,
    /// Hand a clone of the context to a task that outlives the handler and
    /// reaches for the call's transaction after the return.
    #[serde(default)]
    pub(crate) kept: bool,
    /// Give up on the transaction's closure half-way (after its insert),
    /// and return `Ok` all the same.
    #[serde(default)]
    pub(crate) interrupted: bool,
    /// Call `ctx.transaction` inside its own closure.
    #[serde(default)]
    pub(crate) nested: bool,
    /// Hand the context to a task that enters the transaction's closure
    /// and never leaves it, and return `Ok` meanwhile.
    #[serde(default)]
    pub(crate) kept_inside: bool,
    /// The first time: hand the context to a task that enters the
    /// transaction's closure and stays there for a minute, and do not
    /// return meanwhile (the test stops the executor); afterwards, place
    /// the order as usual.
    #[serde(default)]
    pub(crate) held_when_stopped: bool,
}

/// `orders.place` result.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
pub(crate) struct Placed {
    /// The order's key (the call's operation key).
    pub(crate) order: String,
}

/// How many times the handler ran (a crash between its insert and the
/// commit makes it run again: only one of its inserts may be stored).
static RUNS: AtomicUsize = AtomicUsize::new(0);

/// What a task that kept a handler's context was told when it reached for
/// the call's transaction after the handler returned.
static LATE_REFUSALS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// The operation keys whose held task is inside its closure.
static HELD: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// The operation key of every handler start (tests share the process).
static STARTS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// How many times the handler started for an operation key.
fn starts_of(key: &str) -> usize {
    STARTS
        .lock()
        .expect("lock")
        .iter()
        .filter(|k| *k == key)
        .count()
}

/// The interrupted mode's closure must have been cut off half-way.
fn ensure_timed_out(timed_out: bool) -> Result<(), ToolError> {
    if timed_out {
        Ok(())
    } else {
        Err(ToolError::failed("test", "the closure was not interrupted"))
    }
}

/// Inserts the order in the call's transaction, whichever store it is.
async fn insert(tx: &mut Transaction, key: &str, amount: i64) -> Result<(), ToolError> {
    let failed = |e: sqlx::Error| ToolError::failed("order_refused", e.to_string());
    #[cfg(feature = "postgres")]
    if let Ok(conn) = tx.postgres() {
        sqlx::query(INSERT_ORDER)
            .bind(key)
            .bind(amount)
            .execute(conn)
            .await
            .map_err(failed)?;
        return Ok(());
    }
    sqlx::query(INSERT_ORDER)
        .bind(key)
        .bind(amount)
        .execute(tx.sqlite()?)
        .await
        .map_err(failed)?;
    Ok(())
}

/// Places an order: one row in `orders`, committed with the receipt.
#[toolrunner::tool(name = "orders.place", effect = transactional)]
async fn place(ctx: CallContext, order: Order) -> Result<Placed, ToolError> {
    RUNS.fetch_add(1, Ordering::SeqCst);
    STARTS
        .lock()
        .expect("lock")
        .push(ctx.operation_key().to_owned());
    if order.progress_first {
        ctx.progress("checking the stock")
            .await
            .map_err(|e| ToolError::failed("progress", e.to_string()))?;
    }
    let key = ctx.operation_key().to_owned();
    if order.nested {
        let inner = tokio::time::timeout(
            Duration::from_secs(2),
            ctx.transaction(async |_| {
                Ok(ctx
                    .transaction(async |tx| insert(tx, "nested", 1).await)
                    .await)
            }),
        )
        .await;
        return match inner {
            Ok(Ok(Err(e))) if e.to_string().contains("inside its own closure") => {
                Err(ToolError::failed("nested_refused", e.to_string()))
            }
            other => Err(ToolError::failed(
                "nested_not_refused",
                format!("{other:?}"),
            )),
        };
    }
    if order.held_when_stopped && starts_of(&key) == 1 {
        let held = ctx.clone();
        tokio::spawn(async move {
            let _ = held
                .transaction(async |tx| {
                    insert(tx, "held", 1).await?;
                    HELD.lock()
                        .expect("lock")
                        .push(held.operation_key().to_owned());
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Ok(())
                })
                .await;
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    if order.kept_inside {
        let late = ctx.clone();
        tokio::spawn(async move {
            let _ = late
                .transaction(async |tx| {
                    insert(tx, "inside", 1).await?;
                    std::future::pending::<()>().await;
                    Ok(())
                })
                .await;
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        return Ok(Placed { order: key });
    }
    if order.interrupted {
        let half_way = tokio::time::timeout(
            Duration::from_millis(200),
            ctx.transaction(async |tx| {
                insert(tx, &key, order.amount).await?;
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(())
            }),
        )
        .await;
        ensure_timed_out(half_way.is_err())?;
        return Ok(Placed { order: key });
    }
    ctx.transaction(async |tx| insert(tx, &key, order.amount).await)
        .await?;
    if order.kept {
        // A task that outlives the handler reaches for the transaction
        // after the return: refused, the call has ended.
        let late = ctx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let refused = late
                .transaction(async |tx| insert(tx, "late", 1).await)
                .await;
            if let Err(e) = refused {
                LATE_REFUSALS.lock().expect("lock").push(e.to_string());
            }
        });
        return Ok(Placed {
            order: ctx.operation_key().to_owned(),
        });
    }
    // Between the business write and the return: a test stops here.
    ctx.commit_point().await?;
    if order.fail_after_insert {
        return Err(ToolError::unknown("the handler failed after its insert"));
    }
    Ok(Placed {
        order: ctx.operation_key().to_owned(),
    })
}

/// An executor stopped (dropped, as when its process's executor is lost)
/// while a task that kept a call's context is inside the transaction's
/// closure holds nothing: the transaction is rolled back at once, so the
/// next executor on the store starts, the call runs again and completes
/// with one order, and a new call completes too, long before the task's
/// closure would have ended.
pub(crate) async fn an_executor_stopped_mid_transaction_holds_nothing(
    store_url: &str,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let running = bench.executor(None)?.start().await?;
    let held_run = bench
        .submit(vec![NewToolCall::new(
            "orders.place",
            json!({"amount": 4, "held_when_stopped": true}),
        )])
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let key = loop {
        let mut held = HELD.lock().expect("lock").clone();
        if let Some(k) = held.pop() {
            break k;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the task never entered its transaction"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    drop(running);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let within = Duration::from_secs(15);
    let next = bench.executor(None)?;
    let running = tokio::time::timeout(within, next.start())
        .await
        .map_err(|_| anyhow::anyhow!("the next executor did not start within {within:?}"))??;
    let next_run = bench
        .submit(vec![NewToolCall::new("orders.place", json!({"amount": 2}))])
        .await?;
    for run_id in [&held_run, &next_run] {
        let run = bench.admin.wait_settled(run_id, within).await.with_context(|| {
            format!("run {run_id} did not settle within {within:?}: the stopped executor's transaction still held the store")
        })?;
        let call = run.tool_calls.first().context("the run's call")?;
        ensure!(
            call.state.as_str() == "completed",
            "the call ended {}",
            call.state.as_str()
        );
    }
    ensure!(
        orders(store_url, &key).await? == 1 && orders(store_url, "held").await? == 0,
        "the orders stored are not the one call's"
    );
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    bench.server.shutdown().await;
    Ok(())
}

/// The platform with `orders.place` published.
struct Bench {
    server: DevServer,
    admin: Platform,
    version: String,
    binding: String,
    store_url: String,
    /// Its own, so that tests sharing a database (and its executor
    /// leases) do not fence each other.
    executor_id: String,
}

impl Bench {
    async fn start(store_url: &str) -> Result<Bench> {
        let server = DevServer::builder()
            .listen("127.0.0.1:0".parse()?)
            .lease_ttl_ms(3_000)
            .heartbeat_interval_ms(500)
            .start()
            .await?;
        let admin = Platform::new(&server.base_url(), "dev-admin")?;
        let agent = admin.create_agent("orders").await?;
        let binding = admin
            .create_binding(&agent.agent_id, "orders", &["orders.place"])
            .await?;
        let mut bench = Bench {
            server,
            admin,
            version: String::new(),
            binding: binding.binding_id,
            store_url: store_url.to_owned(),
            executor_id: format!("orders-exe-{:08x}", rand::random::<u32>()),
        };
        let executor = bench.executor(None)?;
        bench.version = bench
            .admin
            .publish(&agent.agent_id, executor.tool_definitions())
            .await?
            .agent_version;
        Ok(bench)
    }

    /// An executor on the store; with `crash`, it stops (as a lost
    /// process) the first time a call reaches that step, and raises the
    /// flag.
    fn executor(&self, crash: Option<(&'static str, Arc<AtomicBool>)>) -> Result<Executor> {
        let mut builder = Executor::builder()
            .base_url(self.server.base_url())
            .token("dev-executor")
            .executor_id(&self.executor_id)
            .binding_id(&self.binding)
            .store_url(&self.store_url)
            .poll_interval(Duration::from_millis(25))
            .reconcile_interval(Duration::from_millis(100))
            .backoff(Duration::from_millis(10), Duration::from_millis(100), 4)
            .allow_all()
            .tool(place);
        if let Some((step, crashed)) = crash {
            builder =
                builder.crash_plan(move |at| at == step && !crashed.swap(true, Ordering::SeqCst));
        }
        Ok(builder.build()?)
    }

    async fn submit(&self, calls: Vec<NewToolCall>) -> Result<String> {
        Ok(self
            .admin
            .create_run(&self.version, "orders", calls)
            .await?
            .run_id)
    }
}

/// The orders stored for an operation key.
async fn orders(store_url: &str, key: &str) -> Result<i64> {
    use sqlx::Connection;
    const COUNT: &str = "SELECT COUNT(*) FROM orders WHERE operation_key = $1";
    #[cfg(feature = "postgres")]
    if store_url.starts_with("postgres") {
        let mut conn = sqlx::PgConnection::connect(store_url).await?;
        let n: i64 = sqlx::query_scalar(COUNT)
            .bind(key)
            .fetch_one(&mut conn)
            .await?;
        conn.close().await?;
        return Ok(n);
    }
    let mut conn = sqlx::SqliteConnection::connect(store_url).await?;
    let n: i64 = sqlx::query_scalar(COUNT)
        .bind(key)
        .fetch_one(&mut conn)
        .await?;
    conn.close().await?;
    Ok(n)
}

/// Creates the business table in the store's database.
async fn create_orders(store_url: &str) -> Result<()> {
    use sqlx::Connection;
    #[cfg(feature = "postgres")]
    if store_url.starts_with("postgres") {
        let mut conn = sqlx::PgConnection::connect(store_url).await?;
        sqlx::query(CREATE_ORDERS).execute(&mut conn).await?;
        conn.close().await?;
        return Ok(());
    }
    let url = format!("{store_url}?mode=rwc");
    let mut conn = sqlx::SqliteConnection::connect(&url).await?;
    sqlx::query(CREATE_ORDERS).execute(&mut conn).await?;
    conn.close().await?;
    Ok(())
}

/// The one call of a run, once it settled.
async fn settled(bench: &Bench, run_id: &str) -> Result<toolrunner::platform::RunCall> {
    let run = bench
        .admin
        .wait_settled(run_id, Duration::from_secs(60))
        .await?;
    run.tool_calls.into_iter().next().context("the run's call")
}

/// Whether the business row and the final receipt are both present or
/// both absent; `Some(true)` when both are.
async fn both_or_neither(
    store: &dyn Store,
    store_url: &str,
    run_id: &str,
    call_id: &str,
    step: &str,
) -> Result<bool> {
    let Some(row) = store.call(run_id, call_id).await? else {
        return Ok(false);
    };
    let finals = store
        .receipts(run_id, call_id)
        .await?
        .into_iter()
        .filter(|r| r.kind == ReceiptKind::Completed)
        .count();
    let stored = orders(store_url, &row.operation_key).await?;
    ensure!(
        (stored, finals) == (0, 0) || (stored, finals) == (1, 1),
        "stopped at {step}: {stored} order rows and {finals} completed receipts (the call is {})",
        row.state
    );
    Ok(stored == 1)
}

/// Stops an executor at every step of a call in turn, then starts another
/// on the same store: at the stop, the business row and the final receipt
/// are both there or both absent; after the restart, the call completed
/// with exactly one business row, its receipt delivered, and no step left
/// it to reconciliation.
///
/// `open` opens the store for reading while no executor runs.
pub(crate) async fn both_or_neither_at_every_step<F, Fut>(store_url: &str, open: F) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Arc<dyn Store>>>,
{
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    for step in STEPS {
        let crashed = Arc::new(AtomicBool::new(false));
        let executor = bench.executor(Some((step, crashed.clone())))?;
        let running = executor.start().await?;
        let run_id = bench
            .submit(vec![NewToolCall::new("orders.place", json!({"amount": 5}))])
            .await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !crashed.load(Ordering::SeqCst) {
            if tokio::time::Instant::now() >= deadline {
                bail!("the executor never reached {step}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // Gone, as a lost process: nothing more is written or sent.
        drop(running);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let call_id = bench
            .admin
            .run(&run_id)
            .await?
            .tool_calls
            .first()
            .context("the run's call")?
            .call_id
            .clone();
        let store = open().await?;
        let at = format!("a stop at {step}");
        let before = both_or_neither(store.as_ref(), store_url, &run_id, &call_id, &at).await?;
        drop(store);

        let running = bench.executor(None)?.start().await?;
        let call = settled(&bench, &run_id).await?;
        running
            .shutdown(Shutdown::Drain {
                deadline: Duration::from_secs(10),
            })
            .await?;
        ensure!(
            call.state.as_str() == "completed",
            "after a stop at {step} the call ended {}",
            call.state.as_str()
        );
        let store = open().await?;
        let row = store
            .call(&run_id, &call_id)
            .await?
            .context("the call's row")?;
        ensure!(
            row.state == LocalState::Delivered,
            "after a stop at {step} the call is {} (never reconciliation_required)",
            row.state
        );
        let after = format!("a restart after {step}");
        ensure!(
            both_or_neither(store.as_ref(), store_url, &run_id, &call_id, &after).await?,
            "after a stop at {step} and a restart, the order is not stored"
        );
        let delivered = store
            .receipts(&run_id, &call_id)
            .await?
            .into_iter()
            .any(|r| r.kind == ReceiptKind::Completed && r.status == ReceiptStatus::Delivered);
        ensure!(
            delivered,
            "after a stop at {step} the receipt was not delivered"
        );
        if before {
            // Stored before the stop: the restart did not run it again.
            ensure!(
                step == "after_final_saved",
                "the order was stored before {step}"
            );
        }
    }
    bench.server.shutdown().await;
    Ok(())
}

/// An error after the business write rolls it back: the call fails
/// (`transaction_rolled_back`), no order is stored; a good call beside it
/// completes with its order; none ends in reconciliation.
pub(crate) async fn an_error_rolls_the_business_write_back(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let running: RunningExecutor = bench.executor(None)?.start().await?;
    let bad = bench
        .submit(vec![NewToolCall::new(
            "orders.place",
            json!({"amount": 7, "fail_after_insert": true}),
        )])
        .await?;
    let refused = bench
        .submit(vec![NewToolCall::new("orders.place", json!({"amount": 0}))])
        .await?;
    let calls = (0..12)
        .map(|n| NewToolCall::new("orders.place", json!({"amount": n + 1})))
        .collect();
    let good = bench.submit(calls).await?;
    let bad_call = settled(&bench, &bad).await?;
    let refused_call = settled(&bench, &refused).await?;
    let good_run = bench
        .admin
        .wait_settled(&good, Duration::from_secs(60))
        .await?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    for (call, code) in [
        (&bad_call, "transaction_rolled_back"),
        (&refused_call, "order_refused"),
    ] {
        ensure!(
            call.state.as_str() == "failed",
            "the call ended {}",
            call.state.as_str()
        );
        let text = serde_json::to_string(call)?;
        ensure!(
            text.contains(code),
            "the call failed without {code}: {text}"
        );
    }
    for (run_id, call) in [(&bad, &bad_call), (&refused, &refused_call)] {
        let row = store
            .call(run_id, &call.call_id)
            .await?
            .context("the call's row")?;
        ensure!(
            row.state == LocalState::Delivered,
            "the call is {}",
            row.state
        );
        ensure!(
            orders(store_url, &row.operation_key).await? == 0,
            "a failed call's order is stored"
        );
    }
    for call in &good_run.tool_calls {
        ensure!(
            call.state.as_str() == "completed",
            "a good call ended {}",
            call.state.as_str()
        );
        let row = store
            .call(&good, &call.call_id)
            .await?
            .context("the call's row")?;
        ensure!(
            orders(store_url, &row.operation_key).await? == 1,
            "a completed call's order is not stored once"
        );
    }
    bench.server.shutdown().await;
    Ok(())
}

/// A handler that reported progress before opening its transaction (the
/// call's row moved on meanwhile) completes once, with one order row and
/// one progress receipt: its transaction commits against the row as it is.
pub(crate) async fn progress_before_the_transaction_completes_once(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let running = bench.executor(None)?.start().await?;
    let run_id = bench
        .submit(vec![NewToolCall::new(
            "orders.place",
            json!({"amount": 3, "progress_first": true}),
        )])
        .await?;
    let run = bench
        .admin
        .wait_settled(&run_id, Duration::from_secs(20))
        .await;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    let run = run.context("the call did not settle within 20 s")?;
    let call = run.tool_calls.first().context("the run's call")?;
    ensure!(
        call.state.as_str() == "completed",
        "the call ended {}",
        call.state.as_str()
    );
    let progress = call
        .receipts
        .iter()
        .filter(|r| r.kind == ReceiptKind::Progress)
        .count();
    ensure!(
        progress == 1,
        "{progress} progress receipts (the handler ran again)"
    );
    let row = store
        .call(&run_id, &call.call_id)
        .await?
        .context("the call's row")?;
    ensure!(
        orders(store_url, &row.operation_key).await? == 1,
        "the order is not stored once"
    );
    bench.server.shutdown().await;
    Ok(())
}

/// A transactional call stopped inside its handler (its writes never
/// committed) whose run is cancelled while the process is down is not
/// run again by the restart: the platform ended the call (it is no longer
/// outstanding), so the handler never starts again, no order is stored,
/// and the call ends `abandoned` here (nothing ran, nothing to send),
/// never `rejected` with an order written.
pub(crate) async fn a_run_cancelled_while_down_is_not_run_again<F, Fut>(
    store_url: &str,
    open: F,
) -> Result<()>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Arc<dyn Store>>>,
{
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let crashed = Arc::new(AtomicBool::new(false));
    let running = bench
        .executor(Some(("commit_point", crashed.clone())))?
        .start()
        .await?;
    let run_id = bench
        .submit(vec![NewToolCall::new("orders.place", json!({"amount": 3}))])
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !crashed.load(Ordering::SeqCst) {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the handler never reached its commit point"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Gone, as a lost process; the run is cancelled meanwhile.
    drop(running);
    tokio::time::sleep(Duration::from_millis(100)).await;
    bench.admin.cancel_run(&run_id).await?;
    let running = bench.executor(None)?.start().await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    let call = bench
        .admin
        .run(&run_id)
        .await?
        .tool_calls
        .into_iter()
        .next()
        .context("the run's call")?;
    let store = open().await?;
    let row = store
        .call(&run_id, &call.call_id)
        .await?
        .context("the call's row")?;
    let stored = orders(store_url, &row.operation_key).await?;
    let starts = starts_of(&row.operation_key);
    ensure!(
        starts == 1,
        "the handler ran again after its run was cancelled ({starts} starts); the call is {} here with {stored} order rows",
        row.state
    );
    ensure!(stored == 0, "{stored} order rows were stored");
    ensure!(
        row.state == LocalState::Abandoned,
        "the call is {} here (expected abandoned: nothing ran)",
        row.state
    );
    bench.server.shutdown().await;
    Ok(())
}

/// Runs one call with `arguments` on an executor of its own: the call as
/// the platform ends it.
async fn one_call(
    bench: &Bench,
    arguments: serde_json::Value,
) -> Result<toolrunner::platform::RunCall> {
    create_orders(&bench.store_url).await?;
    let running = bench.executor(None)?.start().await?;
    let run = bench
        .submit(vec![NewToolCall::new("orders.place", arguments)])
        .await?;
    let call = settled(bench, &run).await?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    Ok(call)
}

/// Runs a call with `arguments`, then a plain one once it settled: both as
/// the platform ends them, and how long the second took.
async fn one_then_another(
    bench: &Bench,
    arguments: serde_json::Value,
) -> Result<(
    toolrunner::platform::RunCall,
    toolrunner::platform::RunCall,
    Duration,
)> {
    create_orders(&bench.store_url).await?;
    let running = bench.executor(None)?.start().await?;
    let first = bench
        .submit(vec![NewToolCall::new("orders.place", arguments)])
        .await?;
    let first = settled(bench, &first).await?;
    let started = tokio::time::Instant::now();
    let next = bench
        .submit(vec![NewToolCall::new("orders.place", json!({"amount": 5}))])
        .await?;
    let next = settled(bench, &next).await?;
    let took = started.elapsed();
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    Ok((first, next, took))
}

/// A handler that hands its context to a task outliving it, which reaches
/// for the call's transaction after the return: the task is refused (the
/// call has ended, and nothing of its writes is stored), the call
/// completes with its one order, and the next call is not held up (the
/// transaction ended with its call: the writer never stalls). On the API
/// before this one a kept transaction handle stalled the writer.
pub(crate) async fn a_kept_transaction_is_harmless(store_url: &str) -> Result<()> {
    let bench = Bench::start(store_url).await?;
    let (kept_call, next_call, took) =
        one_then_another(&bench, json!({"amount": 4, "kept": true})).await?;
    ensure!(
        kept_call.state.as_str() == "completed",
        "the call whose context was kept ended {}: {}",
        kept_call.state.as_str(),
        serde_json::to_string(&kept_call)?
    );
    ensure!(
        next_call.state.as_str() == "completed",
        "the next call ended {}",
        next_call.state.as_str()
    );
    ensure!(
        took < Duration::from_millis(2_500),
        "the next call took {took:?}: the writer stalled"
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while LATE_REFUSALS.lock().expect("lock").is_empty() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the late task was never refused"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refusal = LATE_REFUSALS.lock().expect("lock")[0].clone();
    ensure!(
        refusal.contains("has ended"),
        "the late task was told: {refusal}"
    );
    ensure!(
        orders(store_url, "late").await? == 0,
        "the late task's write was stored"
    );
    bench.server.shutdown().await;
    Ok(())
}

/// A handler that gives up on its transaction's closure half-way (after
/// an insert) and returns `Ok` all the same: the part written is not
/// committed with a `completed`; the call fails `transaction_rolled_back`.
pub(crate) async fn an_interrupted_transaction_is_rolled_back(store_url: &str) -> Result<()> {
    let bench = Bench::start(store_url).await?;
    let call = one_call(&bench, json!({"amount": 6, "interrupted": true})).await?;
    let text = serde_json::to_string(&call)?;
    ensure!(
        call.state.as_str() == "failed" && text.contains("transaction_rolled_back"),
        "the call ended {}: {text}",
        call.state.as_str()
    );
    bench.server.shutdown().await;
    Ok(())
}

/// `ctx.transaction` called inside its own closure is refused at once (it
/// would wait for itself).
pub(crate) async fn a_nested_transaction_is_refused_at_once(store_url: &str) -> Result<()> {
    let bench = Bench::start(store_url).await?;
    let call = one_call(&bench, json!({"amount": 2, "nested": true})).await?;
    let text = serde_json::to_string(&call)?;
    ensure!(
        text.contains("nested_refused"),
        "the nested call was not refused: {text}"
    );
    ensure!(
        orders(store_url, "nested").await? == 0,
        "the nested write was stored"
    );
    bench.server.shutdown().await;
    Ok(())
}

/// A task that kept the handler's context and is still inside the
/// transaction's closure when the handler returns is cut off: the call
/// settles at once (`transaction_rolled_back`: its closure was interrupted,
/// so nothing of the transaction commits), and the next call is not held
/// up.
pub(crate) async fn a_closure_still_running_when_the_handler_returns_is_cut_off(
    store_url: &str,
) -> Result<()> {
    let bench = Bench::start(store_url).await?;
    let (kept_call, next_call, took) =
        one_then_another(&bench, json!({"amount": 3, "kept_inside": true})).await?;
    let text = serde_json::to_string(&kept_call)?;
    ensure!(
        kept_call.state.as_str() == "failed" && text.contains("transaction_rolled_back"),
        "the call ended {}: {text}",
        kept_call.state.as_str()
    );
    ensure!(
        orders(store_url, "inside").await? == 0,
        "the cut-off write was stored"
    );
    ensure!(
        next_call.state.as_str() == "completed",
        "the next call ended {}",
        next_call.state.as_str()
    );
    ensure!(
        took < Duration::from_millis(2_500),
        "the next call took {took:?}: the writer stalled"
    );
    bench.server.shutdown().await;
    Ok(())
}
