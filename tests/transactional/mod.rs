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
    /// A closure that inserts the order, then fails (a refused second
    /// row) and returns `Err`, which the handler swallows before it returns
    /// `Ok`: the closure's writes must be rolled back, on every store.
    #[serde(default)]
    pub(crate) swallow_closure_error: bool,
    /// After its insert, the closure runs this statement on the
    /// transaction's connection itself (`COMMIT` or `ROLLBACK`).
    #[serde(default)]
    pub(crate) ends_transaction: Option<String>,
    /// With `ends_transaction`: what the closure does next instead of
    /// returning `Ok`: `panic`; `hold` (waits `hold_inside_ms`, past the
    /// SQLite bound); `begin_fail` (PostgreSQL: `BEGIN`, then a statement
    /// that fails, swallowed, then `Ok`).
    #[serde(default)]
    pub(crate) then: Option<String>,
    /// After its insert, the closure creates a temporary table of this
    /// name shaped as the store's own table of the same name (`calls`,
    /// `receipts`, `events`), which would take the store's unqualified
    /// statements.
    #[serde(default)]
    pub(crate) temp_table: Option<String>,
    /// PostgreSQL: after its insert, the closure changes its session
    /// (`decoy`: `SET search_path` to a schema with an application table
    /// named `calls` first; `replica`: `SET session_replication_role =
    /// replica`); `check`: the closure fails (`dirty_session`) when its
    /// connection carries such a change.
    #[serde(default)]
    pub(crate) session: Option<String>,
    /// After its closure, the handler waits this long (the transaction
    /// stays open) before it returns `Ok`.
    #[serde(default)]
    pub(crate) hold_after_ms: u64,
    /// Inside its closure, after its insert, the handler waits this long.
    #[serde(default)]
    pub(crate) hold_inside_ms: u64,
    /// The first time: cut the process off from its store (the test's
    /// `PAUSE_FAULTS`) and fail without opening the transaction, so that
    /// the call's settlement cannot be stored and the call pauses in
    /// `running`; afterwards, place the order as usual.
    #[serde(default)]
    pub(crate) pause_first: bool,
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

/// The faults of the executor whose handler pauses its call
/// (`pause_first`), and the operation keys that paused.
static PAUSE_FAULTS: std::sync::Mutex<Option<toolrunner::testing::ProcessFaults>> =
    std::sync::Mutex::new(None);
static PAUSED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

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

/// The swallowed closure must have failed.
fn ensure_failed<T>(closure: Result<T, ToolError>) -> Result<(), ToolError> {
    match closure {
        Err(_) => Ok(()),
        Ok(_) => Err(ToolError::failed("test", "the closure did not fail")),
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

/// Runs one statement of the handler's own on the call's transaction,
/// whichever store it is.
async fn execute(tx: &mut Transaction, sql: String) -> Result<(), ToolError> {
    let failed = |e: sqlx::Error| ToolError::failed("statement_failed", e.to_string());
    #[cfg(feature = "postgres")]
    if let Ok(conn) = tx.postgres() {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
            .execute(conn)
            .await
            .map_err(failed)?;
        return Ok(());
    }
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql))
        .execute(tx.sqlite()?)
        .await
        .map_err(failed)?;
    Ok(())
}

/// PostgreSQL: changes the connection's session as `mode` says (see
/// [`Order::session`]), or checks that it carries no such change.
#[cfg(feature = "postgres")]
async fn session(tx: &mut Transaction, mode: &str) -> Result<(), ToolError> {
    let conn = tx.postgres()?;
    let failed = |e: sqlx::Error| ToolError::failed("statement_failed", e.to_string());
    match mode {
        "decoy" => {
            let schema: String = sqlx::query_scalar("SELECT current_schema()")
                .fetch_one(&mut *conn)
                .await
                .map_err(failed)?;
            // Not `SET LOCAL`: the session's, for as long as it lives.
            let set = format!("SET search_path TO \"{schema}_decoy\", \"{schema}\"");
            sqlx::raw_sql(sqlx::AssertSqlSafe(set))
                .execute(&mut *conn)
                .await
                .map_err(failed)?;
        }
        "replica" => {
            sqlx::raw_sql("SET session_replication_role = replica")
                .execute(&mut *conn)
                .await
                .map_err(failed)?;
        }
        "check" => {
            let (path, role): (String, String) = sqlx::query_as(
                "SELECT current_setting('search_path'), current_setting('session_replication_role')",
            )
            .fetch_one(&mut *conn)
            .await
            .map_err(failed)?;
            if path.contains("_decoy") || role != "origin" {
                return Err(ToolError::failed(
                    "dirty_session",
                    format!(
                        "the transaction's connection carries search_path {path} and session_replication_role {role}"
                    ),
                ));
            }
        }
        other => {
            return Err(ToolError::failed(
                "test",
                format!("no session mode {other}"),
            ));
        }
    }
    Ok(())
}

#[cfg(not(feature = "postgres"))]
async fn session(_tx: &mut Transaction, _mode: &str) -> Result<(), ToolError> {
    Err(ToolError::failed("test", "session modes are PostgreSQL's"))
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
    if order.pause_first && starts_of(&key) == 1 {
        if let Some(faults) = PAUSE_FAULTS.lock().expect("lock").as_ref() {
            faults.cut_store(true);
        }
        PAUSED.lock().expect("lock").push(key.clone());
        return Err(ToolError::failed(
            "paused",
            "the store was cut off before this outcome",
        ));
    }
    if order.swallow_closure_error {
        let closure = ctx
            .transaction(async |tx| {
                insert(tx, &key, order.amount).await?;
                // Refused by the table's CHECK: the closure fails after its
                // first insert.
                insert(tx, &format!("{key}-refused"), 0).await
            })
            .await;
        ensure_failed(closure)?;
        return Ok(Placed { order: key });
    }
    if let Some(statement) = &order.ends_transaction {
        let hold = Duration::from_millis(order.hold_inside_ms);
        ctx.transaction(async |tx| {
            insert(tx, &key, order.amount).await?;
            execute(tx, statement.clone()).await?;
            match order.then.as_deref() {
                Some("panic") => panic!("the handler panicked after its own {statement}"),
                Some("hold") => tokio::time::sleep(hold).await,
                Some("begin_fail") => {
                    execute(tx, "BEGIN".into()).await?;
                    let _ = execute(tx, "SELECT 1/0".into()).await;
                }
                _ => {}
            }
            Ok(())
        })
        .await?;
        return Ok(Placed { order: key });
    }
    if let Some(table) = &order.temp_table {
        let postgres = ctx.transaction(async |tx| Ok(tx.sqlite().is_err())).await?;
        // The name is the test's own (a store table's).
        let create = if postgres {
            format!("CREATE TEMP TABLE {table} AS SELECT * FROM {table} WHERE FALSE")
        } else {
            format!("CREATE TEMP TABLE {table} AS SELECT * FROM main.{table} WHERE 0")
        };
        ctx.transaction(async |tx| {
            insert(tx, &key, order.amount).await?;
            execute(tx, create).await
        })
        .await?;
        return Ok(Placed { order: key });
    }
    if let Some(mode) = &order.session {
        ctx.transaction(async |tx| {
            if mode != "check" {
                insert(tx, &key, order.amount).await?;
            }
            session(tx, mode).await
        })
        .await?;
        if mode == "check" {
            ctx.transaction(async |tx| insert(tx, &key, order.amount).await)
                .await?;
        }
        return Ok(Placed { order: key });
    }
    if order.hold_after_ms > 0 || order.hold_inside_ms > 0 {
        let inside = Duration::from_millis(order.hold_inside_ms);
        ctx.transaction(async |tx| {
            insert(tx, &key, order.amount).await?;
            tokio::time::sleep(inside).await;
            Ok(())
        })
        .await?;
        tokio::time::sleep(Duration::from_millis(order.hold_after_ms)).await;
        return Ok(Placed { order: key });
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
        self.executor_with(crash, |b| b)
    }

    /// [`executor`](Self::executor), with more settings.
    fn executor_with(
        &self,
        crash: Option<(&'static str, Arc<AtomicBool>)>,
        more: impl FnOnce(toolrunner::ExecutorBuilder) -> toolrunner::ExecutorBuilder,
    ) -> Result<Executor> {
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
        Ok(more(builder).build()?)
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

/// A closure that fails after a write, and whose `Err` the handler
/// swallows before it returns `Ok`, leaves nothing of its writes, on
/// SQLite as on PostgreSQL (each closure runs inside a savepoint, rolled
/// back on `Err`): the call completes, its order is not stored. (Before,
/// SQLite kept the closure's first insert and committed it with the
/// `completed`, while PostgreSQL's aborted transaction failed the call.)
pub(crate) async fn a_closure_that_fails_leaves_none_of_its_writes(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    let bench = Bench::start(store_url).await?;
    create_orders(store_url).await?;
    let running = bench.executor(None)?.start().await?;
    let run_id = bench
        .submit(vec![NewToolCall::new(
            "orders.place",
            json!({"amount": 4, "swallow_closure_error": true}),
        )])
        .await?;
    let call = settled(&bench, &run_id).await?;
    let next = bench
        .submit(vec![NewToolCall::new("orders.place", json!({"amount": 5}))])
        .await?;
    let next = settled(&bench, &next).await?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    let text = serde_json::to_string(&call)?;
    ensure!(
        call.state.as_str() == "completed",
        "the call whose failed closure was swallowed ended {}: {text}",
        call.state.as_str()
    );
    let key = call_key(&bench, store.as_ref(), &run_id).await?;
    let stored = orders(store_url, &key).await?;
    ensure!(
        stored == 0,
        "{stored} order rows of a closure that returned Err were committed with the call"
    );
    ensure!(
        next.state.as_str() == "completed",
        "the next call ended {}",
        next.state.as_str()
    );
    bench.server.shutdown().await;
    Ok(())
}

/// The operation key of a run's one call, as the executor stored it.
async fn call_key(bench: &Bench, store: &dyn Store, run_id: &str) -> Result<String> {
    let call = bench
        .admin
        .run(run_id)
        .await?
        .tool_calls
        .into_iter()
        .next()
        .context("the run's call")?;
    Ok(store
        .call(run_id, &call.call_id)
        .await?
        .context("the call's row")?
        .operation_key)
}

/// The platform's state of a run's one call, once it is no longer
/// `running` (or after 20 s).
async fn past_running(bench: &Bench, run_id: &str) -> Result<toolrunner::platform::RunCall> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let call = bench
            .admin
            .run(run_id)
            .await?
            .tool_calls
            .into_iter()
            .next()
            .context("the run's call")?;
        if !matches!(call.state.as_str(), "pending" | "claimed" | "running")
            || tokio::time::Instant::now() > deadline
        {
            return Ok(call);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A closure that ends the call's transaction itself (its own `COMMIT` or
/// `ROLLBACK` on the connection) is found out when it returns: nothing is
/// settled on that connection (on PostgreSQL it no longer holds the fencing
/// lock, and its statements would each commit alone), and since what it
/// wrote may be stored, the call's outcome is unknown: it goes to
/// `reconciliation_required`, never `completed` (nor `failed`, which would
/// say that nothing happened).
pub(crate) async fn a_closure_that_ends_the_transaction_is_an_unknown_outcome(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let running = bench.executor(None)?.start().await?;
    for statement in ["COMMIT", "ROLLBACK"] {
        let run_id = bench
            .submit(vec![NewToolCall::new(
                "orders.place",
                json!({"amount": 3, "ends_transaction": statement}),
            )])
            .await?;
        let call = past_running(&bench, &run_id).await?;
        let text = serde_json::to_string(&call)?;
        ensure!(
            call.state.as_str() == "reconciliation_required",
            "the call whose closure ran {statement} ended {} on the platform (expected reconciliation_required): {text}",
            call.state.as_str()
        );
        let row = store
            .call(&run_id, &call.call_id)
            .await?
            .context("the call's row")?;
        ensure!(
            row.state == LocalState::ReconciliationRequired,
            "the call whose closure ran {statement} is {} here",
            row.state
        );
        let finals = store
            .receipts(&run_id, &call.call_id)
            .await?
            .into_iter()
            .filter(|r| r.kind.is_final())
            .count();
        ensure!(
            finals == 0,
            "{finals} final receipts for the call whose closure ran {statement}"
        );
    }
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    bench.server.shutdown().await;
    Ok(())
}

/// A closure that ends the call's transaction itself and then does not come
/// back as `Ok` would (it panics; on SQLite it stays past the transaction's
/// bound; on PostgreSQL it begins another transaction whose statement
/// fails, swallows the error and returns `Ok`) is found out all the same:
/// its insert is stored, so the call's outcome is unknown
/// (`reconciliation_required`), never `failed` (which would say that
/// nothing was written).
pub(crate) async fn a_closure_that_ends_the_transaction_and_stops_is_an_unknown_outcome(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let running = bench.executor(None)?.start().await?;
    let postgres = store_url.starts_with("postgres");
    let thens: &[(&str, u64)] = if postgres {
        &[("panic", 0), ("begin_fail", 0)]
    } else {
        &[("panic", 0), ("hold", 1_500)]
    };
    for (then, hold) in thens {
        let run_id = bench
            .submit(vec![NewToolCall::new(
                "orders.place",
                json!({"amount": 3, "ends_transaction": "COMMIT", "then": then, "hold_inside_ms": hold}),
            )])
            .await?;
        let call = past_running(&bench, &run_id).await?;
        let row = store
            .call(&run_id, &call.call_id)
            .await?
            .context("the call's row")?;
        ensure!(
            call.state.as_str() == "reconciliation_required"
                && row.state == LocalState::ReconciliationRequired,
            "the call whose closure ran COMMIT, then {then}, ended {} on the platform and {} here ({:?}), with its order stored: the outcome was guessed",
            call.state.as_str(),
            row.state,
            row.reason
        );
    }
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    bench.server.shutdown().await;
    Ok(())
}

/// A handler's temporary table named as one of the store's own (`calls`,
/// `receipts`, `events`) takes none of the settlement's writes: the call
/// completes once, its order stored, and its `completed` receipt is in the
/// store's own table.
pub(crate) async fn a_temporary_table_takes_none_of_the_store_s_writes(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let running = bench.executor(None)?.start().await?;
    for table in ["events", "receipts", "calls"] {
        let run_id = bench
            .submit(vec![NewToolCall::new(
                "orders.place",
                json!({"amount": 4, "temp_table": table}),
            )])
            .await?;
        let call = past_running(&bench, &run_id).await?;
        // Delivered here a moment after the platform took the receipt.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let row = loop {
            let row = store
                .call(&run_id, &call.call_id)
                .await?
                .context("the call's row")?;
            if row.state != LocalState::Settled || tokio::time::Instant::now() > deadline {
                break row;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let completed = store
            .receipts(&run_id, &call.call_id)
            .await?
            .into_iter()
            .filter(|r| r.kind.as_str() == "completed")
            .count();
        ensure!(
            call.state.as_str() == "completed"
                && row.state == LocalState::Delivered
                && completed == 1,
            "with a temporary table named {table}, the call ended {} on the platform and {} here ({:?}), with {completed} completed receipts in the store",
            call.state.as_str(),
            row.state,
            row.reason
        );
    }
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    bench.server.shutdown().await;
    Ok(())
}

/// PostgreSQL: a handler that changes its transaction's session (not `SET
/// LOCAL`) changes nothing of the store's: with `search_path` naming first
/// a schema whose application table is named `calls`, its call completes
/// all the same (the settlement runs on the store's own settings); with
/// `session_replication_role = replica` the store's count triggers still
/// count its call; and no later handler's transaction finds either change
/// on its connection.
pub(crate) async fn a_handler_cannot_change_the_store_s_session(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    use sqlx::Connection;
    create_orders(store_url).await?;
    let mut conn = sqlx::PgConnection::connect(store_url).await?;
    let schema: String = sqlx::query_scalar("SELECT current_schema()")
        .fetch_one(&mut conn)
        .await?;
    // The name is the test's own schema's (letters, digits, `_`).
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "CREATE SCHEMA \"{schema}_decoy\"; CREATE TABLE \"{schema}_decoy\".calls (id INT)"
    )))
    .execute(&mut conn)
    .await?;
    let outcome = session_calls(store_url, store).await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}_decoy\" CASCADE"
    )))
    .execute(&mut conn)
    .await?;
    conn.close().await?;
    outcome
}

async fn session_calls(store_url: &str, store: Arc<dyn Store>) -> Result<()> {
    use sqlx::Connection;
    let bench = Bench::start(store_url).await?;
    let running = bench.executor(None)?.start().await?;
    let mut ran = Vec::new();
    for mode in ["decoy", "replica"] {
        let run_id = bench
            .submit(vec![NewToolCall::new(
                "orders.place",
                json!({"amount": 2, "session": mode}),
            )])
            .await?;
        ran.push((mode, run_id.clone(), settled(&bench, &run_id).await?));
    }
    let checks = bench
        .submit(
            (0..6)
                .map(|_| NewToolCall::new("orders.place", json!({"amount": 1, "session": "check"})))
                .collect(),
        )
        .await?;
    let checks = bench
        .admin
        .wait_settled(&checks, Duration::from_secs(60))
        .await?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    for (mode, run_id, call) in &ran {
        let text = serde_json::to_string(call)?;
        ensure!(
            call.state.as_str() == "completed",
            "the call that changed its session ({mode}) ended {}: {text}",
            call.state.as_str()
        );
        let key = call_key(&bench, store.as_ref(), run_id).await?;
        ensure!(
            orders(store_url, &key).await? == 1,
            "the order of the call that changed its session ({mode}) is not stored once"
        );
    }
    for call in &checks.tool_calls {
        let text = serde_json::to_string(call)?;
        ensure!(
            call.state.as_str() == "completed",
            "a later handler's transaction found a changed session: {text}"
        );
    }
    let counted = store.count_by_state().await?;
    let mut conn = sqlx::PgConnection::connect(store_url).await?;
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT state, COUNT(*) FROM calls GROUP BY state ORDER BY state")
            .fetch_all(&mut conn)
            .await?;
    conn.close().await?;
    let counted: Vec<(String, i64)> = counted
        .into_iter()
        .map(|(s, n)| (s.as_str().to_owned(), i64::try_from(n).unwrap_or(i64::MAX)))
        .collect();
    ensure!(
        counted == rows,
        "the store's counts {counted:?} are not its rows' {rows:?} (a handler's session turned its count triggers off)"
    );
    bench.server.shutdown().await;
    Ok(())
}

/// SQLite: a handler that keeps its transaction open (and so the store's
/// write lock) longer than the bound is cut off: its transaction is rolled
/// back at the bound, the call fails `transaction_rolled_back` with nothing
/// stored, and the store takes writes all along (the health probe never
/// finds it unwritable). On PostgreSQL (the crash tests run there too),
/// where no bound applies, the store takes writes all along and the call
/// completes.
pub(crate) async fn a_transaction_held_open_is_cut_off_and_the_store_stays_writable(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let executor = bench.executor(None)?;
    let health = executor.health();
    let running = executor.start().await?;
    let run_id = bench
        .submit(vec![NewToolCall::new(
            "orders.place",
            json!({"amount": 2, "hold_after_ms": 4000}),
        )])
        .await?;
    let mut unwritable = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let call = loop {
        let report = health.report();
        if !report.store_writable() && unwritable.is_none() {
            unwritable = Some(format!("{:?}", report.reason()));
        }
        let call = bench
            .admin
            .run(&run_id)
            .await?
            .tool_calls
            .into_iter()
            .next()
            .context("the run's call")?;
        if call.state.is_terminal() {
            break call;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the call did not settle"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    if let Some(why) = unwritable {
        bail!("the store did not take writes while a handler held its transaction open: {why}");
    }
    let text = serde_json::to_string(&call)?;
    let key = call_key(&bench, store.as_ref(), &run_id).await?;
    if store_url.starts_with("postgres") {
        // No bound on PostgreSQL (a handler's transaction holds no lock of
        // the store's writer): the call completes, its order stored once.
        ensure!(
            call.state.as_str() == "completed" && orders(store_url, &key).await? == 1,
            "the call that held its transaction open on PostgreSQL ended {}: {text}",
            call.state.as_str()
        );
    } else {
        ensure!(
            call.state.as_str() == "failed" && text.contains("transaction_rolled_back"),
            "the call that held its transaction open ended {}: {text}",
            call.state.as_str()
        );
        ensure!(
            orders(store_url, &key).await? == 0,
            "the order of a transaction cut off at its bound is stored"
        );
    }
    bench.server.shutdown().await;
    Ok(())
}

/// PostgreSQL: more slow transactional handlers at once than the store's
/// own pool has connections (capacity 17, each handler holding its
/// transaction 3 s) starve nothing: handlers' transactions come from a
/// pool of their own, so the store takes writes all along, and every call
/// completes with its order.
pub(crate) async fn slow_handlers_at_capacity_leave_the_store_writable(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    const CALLS: i64 = 17;
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let executor = bench.executor_with(None, |b| b.capacity(17))?;
    let health = executor.health();
    let running = executor.start().await?;
    let run_id = bench
        .submit(
            (0..CALLS)
                .map(|n| {
                    NewToolCall::new(
                        "orders.place",
                        json!({"amount": n + 1, "hold_inside_ms": 3000}),
                    )
                })
                .collect(),
        )
        .await?;
    let mut unwritable = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let run = loop {
        let report = health.report();
        if !report.store_writable() && unwritable.is_none() {
            unwritable = Some(format!("{:?}", report.reason()));
        }
        let run = bench.admin.run(&run_id).await?;
        if run.tool_calls.iter().all(|c| c.state.is_terminal()) {
            break run;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the calls did not settle within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    if let Some(why) = unwritable {
        bail!(
            "the store did not take writes while {CALLS} handlers held their transactions: {why}"
        );
    }
    for call in &run.tool_calls {
        let text = serde_json::to_string(call)?;
        ensure!(
            call.state.as_str() == "completed",
            "a slow transactional call ended {}: {text}",
            call.state.as_str()
        );
        let row = store
            .call(&run_id, &call.call_id)
            .await?
            .context("the call's row")?;
        ensure!(
            orders(store_url, &row.operation_key).await? == 1,
            "a slow call's order is not stored once"
        );
    }
    bench.server.shutdown().await;
    Ok(())
}

/// A transactional call that paused in `running` (its settlement could not
/// be stored) while its run was cancelled, and whose cancel notice was lost
/// (the heartbeat answers that carried it never arrived, and no stream
/// runs), is not run again when the executor resumes it: the platform is
/// asked first, and answers that the call ended (choice 68). The handler
/// started once, no order is stored, and the call ends `abandoned` here.
pub(crate) async fn a_resumed_call_whose_run_ended_unseen_is_not_run_again(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let faults = toolrunner::testing::ProcessFaults::new();
    *PAUSE_FAULTS.lock().expect("lock") = Some(faults.clone());
    let executor = bench.executor_with(None, |b| b.stream(false).process_faults(&faults))?;
    let running = executor.start().await?;
    let (run_id, call_id, key) = paused_call(&bench, store.as_ref(), 3).await?;
    let lose = |rate: f64| toolrunner::platform::FaultSettings {
        error_rate: 0.0,
        drop_response_rate: rate,
        latency_ms: 0,
        seed: 7,
    };
    bench.admin.set_faults(&lose(1.0)).await?;
    bench.admin.cancel_run(&run_id).await?;
    // Two heartbeats or more carry the notice, and their answers are lost
    // (well within the platform's 3 s lease).
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    bench.admin.set_faults(&lose(0.0)).await?;
    faults.cut_store(false);
    // The claim loop resumes the paused call.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let row = loop {
        let row = store
            .call(&run_id, &call_id)
            .await?
            .context("the call's row")?;
        if row.state != LocalState::Running || tokio::time::Instant::now() > deadline {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    let starts = starts_of(&key);
    let stored = orders(store_url, &key).await?;
    ensure!(
        starts == 1,
        "the handler ran again after its run was cancelled unseen ({starts} starts); the call is {} here with {stored} order rows",
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

/// An order whose `accepted` was confirmed as its process was lost (the
/// call still `assigned` in its store, `running` on the platform), which
/// another store of the same executor id (`other_store_url`: a lost
/// store's replacement, a twin on another database) then reported
/// `reconciliation_required` because it did not know the call: on restart
/// the replayed `accepted` is answered `false` (`replayed`, the call
/// `reconciliation_required`). The call is this store's, and none of its
/// writes committed: it runs here once and completes with one order row,
/// never `abandoned` with the platform holding it for ever, never
/// `reconciliation_required` (simulation seed 205).
pub(crate) async fn a_call_reported_by_another_store_runs_here(
    store_url: &str,
    other_store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let crashed = Arc::new(AtomicBool::new(false));
    let first = bench
        .executor(Some(("after_accepted_confirmed", crashed.clone())))?
        .start()
        .await?;
    let run_id = bench
        .submit(vec![NewToolCall::new("orders.place", json!({"amount": 5}))])
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !crashed.load(Ordering::SeqCst) {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the executor never reached after_accepted_confirmed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Gone, as a lost process: nothing more is written or sent.
    drop(first);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let platform_state = |bench: &Bench| {
        let (admin, run_id) = (bench.admin.clone(), run_id.clone());
        async move {
            let call = admin
                .run(&run_id)
                .await?
                .tool_calls
                .into_iter()
                .next()
                .context("the run's call")?;
            Ok::<_, anyhow::Error>((call.call_id, call.state.as_str().to_owned()))
        }
    };
    let (call_id, state) = platform_state(&bench).await?;
    ensure!(state == "running", "the platform holds the call {state}");
    let row = store
        .call(&run_id, &call_id)
        .await?
        .context("the call's row")?;
    ensure!(
        row.state == LocalState::Assigned,
        "the call is {} here",
        row.state
    );
    let key = row.operation_key.clone();

    // Another store of the identity reports the call it does not know.
    let other = bench
        .executor_with(None, |b| b.store_url(other_store_url))?
        .start()
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, state) = platform_state(&bench).await?;
        if state == "reconciliation_required" {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the other store never reported the call (the platform holds it {state})"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    drop(other);
    tokio::time::sleep(Duration::from_millis(100)).await;

    let running = bench.executor(None)?.start().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let row = loop {
        let row = store
            .call(&run_id, &call_id)
            .await?
            .context("the call's row")?;
        if matches!(
            row.state,
            LocalState::Delivered | LocalState::Abandoned | LocalState::Released
        ) || tokio::time::Instant::now() > deadline
        {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (_, state) = platform_state(&bench).await?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    let stored = orders(store_url, &key).await?;
    ensure!(
        row.state == LocalState::Delivered && state == "completed",
        "the call is {} here ({:?}) and {state} on the platform, with {stored} order rows",
        row.state,
        row.reason
    );
    ensure!(stored == 1, "{stored} order rows were stored");
    let starts = starts_of(&key);
    ensure!(starts == 1, "the handler started {starts} times");
    bench.server.shutdown().await;
    Ok(())
}

/// Submits an order whose handler pauses its call the first time (its
/// store cut off: the settlement cannot be stored, and the call stays
/// `running`), and waits until it did: the run, the call and the
/// operation key.
async fn paused_call(
    bench: &Bench,
    store: &dyn Store,
    amount: i64,
) -> Result<(String, String, String)> {
    let run_id = bench
        .submit(vec![NewToolCall::new(
            "orders.place",
            json!({"amount": amount, "pause_first": true}),
        )])
        .await?;
    let call_id = bench
        .admin
        .run(&run_id)
        .await?
        .tool_calls
        .first()
        .context("the run's call")?
        .call_id
        .clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let key = loop {
        let row = store.call(&run_id, &call_id).await?;
        if let Some(k) = row
            .map(|r| r.operation_key)
            .filter(|k| PAUSED.lock().expect("lock").contains(k))
        {
            break k;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the handler never paused its call"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    // The settlement fails against the cut store; the call pauses.
    tokio::time::sleep(Duration::from_millis(300)).await;
    Ok((run_id, call_id, key))
}

/// The same as [`a_resumed_call_whose_run_ended_unseen_is_not_run_again`],
/// but the platform forgot the run while the call paused (its own
/// retention): the replayed claim is answered `404` or `400 unknown_call`,
/// and the call is not run again and settles `orphaned` (the platform no
/// longer knows the run; none of its writes was committed, so its outcome
/// is known), as the re-run check of a write tool settles it (choice 72).
pub(crate) async fn a_resumed_call_whose_run_was_forgotten_is_orphaned(
    store_url: &str,
    store: Arc<dyn Store>,
) -> Result<()> {
    create_orders(store_url).await?;
    let bench = Bench::start(store_url).await?;
    let faults = toolrunner::testing::ProcessFaults::new();
    *PAUSE_FAULTS.lock().expect("lock") = Some(faults.clone());
    let executor = bench.executor_with(None, |b| b.stream(false).process_faults(&faults))?;
    let running = executor.start().await?;
    let (run_id, call_id, key) = paused_call(&bench, store.as_ref(), 5).await?;
    bench.server.forget_run(&run_id).await?;
    faults.cut_store(false);
    // The claim loop resumes the paused call.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let row = loop {
        let row = store
            .call(&run_id, &call_id)
            .await?
            .context("the call's row")?;
        if row.state != LocalState::Running || tokio::time::Instant::now() > deadline {
            break row;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(5),
        })
        .await?;
    let starts = starts_of(&key);
    let stored = orders(store_url, &key).await?;
    ensure!(
        starts == 1 && stored == 0,
        "the handler ran again after its run was forgotten ({starts} starts, {stored} order rows)"
    );
    ensure!(
        row.state == LocalState::Orphaned,
        "the call whose run the platform forgot is {} here ({:?}; expected orphaned)",
        row.state,
        row.reason
    );
    bench.server.shutdown().await;
    Ok(())
}

/// A handler cut off (its timeout) while the executor releases the
/// savepoint of a closure that returned `Ok` holds a transaction that is
/// still the executor's: it is rolled back and the call fails
/// (`transaction_rolled_back`), never taken for a closure that ended the
/// transaction itself (an unknown outcome). The store's traffic goes
/// through a pausable proxy (`through` is its URL for the store): `arm`
/// pauses it right behind the closure's `RELEASE SAVEPOINT` (the server
/// releases it; its answer waits), `held` says whether it is paused,
/// `resume` lets everything through again.
pub(crate) async fn a_handler_cut_off_while_its_closure_is_released_rolls_back(
    store_url: &str,
    through: &str,
    arm: impl Fn(),
    held: impl Fn() -> bool,
    resume: impl Fn(),
) -> Result<()> {
    let mut bench = Bench::start(store_url).await?;
    create_orders(store_url).await?;
    bench.store_url = through.to_owned();
    let timeout = Duration::from_millis(800);
    let running = bench
        .executor_with(None, |b| b.handler_timeout(timeout))?
        .start()
        .await?;
    arm();
    let run = bench
        .submit(vec![NewToolCall::new("orders.place", json!({"amount": 7}))])
        .await?;
    let until = std::time::Instant::now() + Duration::from_secs(20);
    while !held() {
        ensure!(
            std::time::Instant::now() < until,
            "the store's traffic never paused behind the closure's release"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The handler times out while the release waits for its answer.
    tokio::time::sleep(timeout + Duration::from_millis(700)).await;
    resume();
    let call = settled(&bench, &run).await?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;
    let text = serde_json::to_string(&call)?;
    ensure!(
        call.state.as_str() == "failed" && text.contains("transaction_rolled_back"),
        "the call ended {}: {text}",
        call.state.as_str()
    );
    let key = STARTS
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .unwrap_or_default();
    ensure!(
        orders(store_url, &key).await? == 0,
        "the order of the cut-off handler was stored"
    );
    bench.server.shutdown().await;
    Ok(())
}
