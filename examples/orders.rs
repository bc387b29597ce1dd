//! `orders`: a transactional tool. Its side effect is a row in an `orders`
//! table of the executor's own database, written in the call's transaction
//! (`ctx.transaction(…)`); the executor adds the call's `completed` receipt
//! to that transaction and commits once. The row and the receipt are both
//! stored or both absent, crash or not, so such a call never needs
//! reconciliation: after a crash it simply runs again.
//!
//! ```text
//! cargo run --example orders                                   # SQLite, a fresh file
//! cargo run --example orders -- --db PATH                      # SQLite, this file
//! cargo run --example orders -- --print-definitions            # {"tools": [...]} for `toolrunner tools publish`
//! cargo run --features postgres --example orders -- --db postgres://postgres@127.0.0.1:5432/test
//! ```
//!
//! On PostgreSQL the `orders` table is `public.orders`: the executor's own
//! tables live in a schema of its identity, and business tables are named
//! with their schema, so every replica writes the same one.
//!
//! ```text
//! ```
//!
//! It starts the development platform in-process, runs 12 calls of
//! `orders.place` (`{"sku": string, "quantity": integer >= 1}`; the sku
//! `"gone"` is out of stock: the handler's error rolls its write back and
//! the call fails), prints each call's outcome beside the order rows, and
//! exits 0 once every completed call has exactly one row and no failed one
//! has any.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::platform::{NewToolCall, Platform};
use toolrunner::{CallContext, Executor, Shutdown, ToolError, Transaction, sqlx};

#[path = "support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
#[command(about = "Run the transactional orders.place tool with the toolrunner executor")]
struct Args {
    /// The executor's store, where the `orders` table lives too: a file
    /// (default: a fresh temporary one), or, built with `--features
    /// postgres`, a `postgres://` URL.
    #[arg(long)]
    db: Option<String>,
    /// How many calls to run.
    #[arg(long, default_value_t = 12)]
    calls: usize,
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
}

/// An order to place.
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
struct Order {
    /// What to order.
    sku: String,
    /// How many.
    #[schemars(range(min = 1))]
    quantity: i64,
}

/// The placed order.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
struct Placed {
    /// The order's id: the call's operation key.
    order_id: String,
}

/// The business table, in the store's database. On PostgreSQL its schema
/// is named (`public`): the store's connections search the executor
/// identity's own schema, and every replica must write the same table.
const CREATE_ORDERS: &str = "CREATE TABLE IF NOT EXISTS {orders} (
    order_id TEXT PRIMARY KEY, sku TEXT NOT NULL, quantity BIGINT NOT NULL CHECK (quantity > 0))";
const INSERT_ORDER: &str = "INSERT INTO {orders} (order_id, sku, quantity) VALUES ($1, $2, $3)";

/// The table's name on a backend.
#[cfg(feature = "postgres")]
fn on_postgres(sql: &str) -> String {
    sql.replace("{orders}", "public.orders")
}

fn on_sqlite(sql: &str) -> String {
    sql.replace("{orders}", "orders")
}

/// Places an order: one row in the `orders` table, committed together
/// with the call's receipt. An unknown sku is out of stock.
#[toolrunner::tool(name = "orders.place", effect = transactional)]
async fn place(ctx: CallContext, order: Order) -> Result<Placed, ToolError> {
    let order_id = ctx.operation_key().to_owned();
    ctx.transaction(async |tx| insert(tx, &order_id, &order).await)
        .await?;
    if order.sku == "gone" {
        // The row above is rolled back with the transaction.
        return Err(ToolError::failed("out_of_stock", "the sku is out of stock"));
    }
    Ok(Placed {
        order_id: ctx.operation_key().to_owned(),
    })
}

/// The insert, on whichever database the store is.
async fn insert(tx: &mut Transaction, order_id: &str, order: &Order) -> Result<(), ToolError> {
    let refused = |e: sqlx::Error| ToolError::failed("order_refused", e.to_string());
    #[cfg(feature = "postgres")]
    if let Ok(conn) = tx.postgres() {
        sqlx::query(sqlx::AssertSqlSafe(on_postgres(INSERT_ORDER)))
            .bind(order_id)
            .bind(&order.sku)
            .bind(order.quantity)
            .execute(conn)
            .await
            .map_err(refused)?;
        return Ok(());
    }
    sqlx::query(sqlx::AssertSqlSafe(on_sqlite(INSERT_ORDER)))
        .bind(order_id)
        .bind(&order.sku)
        .bind(order.quantity)
        .execute(tx.sqlite()?)
        .await
        .map_err(refused)?;
    Ok(())
}

/// The order rows: `(order_id, sku, quantity)`.
async fn rows(store_url: &str) -> Result<Vec<(String, String, i64)>> {
    use sqlx::Connection;
    const SELECT: &str = "SELECT order_id, sku, quantity FROM {orders} ORDER BY order_id";
    #[cfg(feature = "postgres")]
    if store_url.starts_with("postgres") {
        let mut conn = sqlx::PgConnection::connect(store_url).await?;
        let select = sqlx::AssertSqlSafe(on_postgres(SELECT));
        return Ok(sqlx::query_as(select).fetch_all(&mut conn).await?);
    }
    let mut conn = sqlx::SqliteConnection::connect(store_url).await?;
    let select = sqlx::AssertSqlSafe(on_sqlite(SELECT));
    Ok(sqlx::query_as(select).fetch_all(&mut conn).await?)
}

/// The URL of an executor identity's own store: on PostgreSQL, the
/// identity's schema (where the executor keeps its calls).
fn own_store(store_url: &str, executor_id: &str) -> String {
    #[cfg(feature = "postgres")]
    if store_url.starts_with("postgres") && !store_url.contains("search_path") {
        let schema = toolrunner::postgres_schema(executor_id);
        let sep = if store_url.contains('?') { '&' } else { '?' };
        return format!("{store_url}{sep}options=-c%20search_path%3D{schema}");
    }
    let _ = executor_id;
    store_url.to_owned()
}

/// Creates the `orders` table beside the executor's tables.
async fn create_orders(store_url: &str) -> Result<()> {
    use sqlx::Connection;
    #[cfg(feature = "postgres")]
    if store_url.starts_with("postgres") {
        let mut conn = sqlx::PgConnection::connect(store_url).await?;
        sqlx::query(sqlx::AssertSqlSafe(on_postgres(CREATE_ORDERS)))
            .execute(&mut conn)
            .await?;
        return Ok(());
    }
    let mut conn = sqlx::SqliteConnection::connect(&format!("{store_url}?mode=rwc")).await?;
    sqlx::query(sqlx::AssertSqlSafe(on_sqlite(CREATE_ORDERS)))
        .execute(&mut conn)
        .await?;
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = Args::parse();
    if args.print_definitions {
        return support::print_definitions(|b| b.tool(place));
    }
    let scratch = tempfile::tempdir()?;
    let store_url = match &args.db {
        Some(db) if db.starts_with("postgres://") || db.starts_with("postgresql://") => {
            if !cfg!(feature = "postgres") {
                bail!("a postgres:// --db needs the example built with --features postgres");
            }
            db.clone()
        }
        Some(path) => format!("sqlite://{path}"),
        None => format!("sqlite://{}", scratch.path().join("orders.db").display()),
    };
    create_orders(&store_url).await?;

    let platform = toolrunner_devserver::DevServer::builder()
        .listen("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let admin = Platform::new(&platform.base_url(), "dev-admin")?;
    let agent = admin.create_agent("orders-demo").await?;
    let binding = admin
        .create_binding(&agent.agent_id, "orders", &["orders.place"])
        .await?;
    let executor = Executor::builder()
        .base_url(platform.base_url())
        .token("dev-executor")
        .executor_id("orders-01")
        .binding_id(&binding.binding_id)
        .store_url(&store_url)
        .allow_all()
        .tool(place)
        .build()?;
    let version = admin
        .publish(&agent.agent_id, executor.tool_definitions())
        .await?;
    let calls = (0..args.calls)
        .map(|i| {
            let sku = if i % 5 == 3 { "gone" } else { "coffee" };
            NewToolCall::new("orders.place", json!({"sku": sku, "quantity": i + 1}))
        })
        .collect();
    let run = admin
        .create_run(&version.agent_version, "user_42", calls)
        .await?;
    let running = executor.start().await?;
    let run = admin
        .wait_settled(&run.run_id, Duration::from_secs(60))
        .await?;
    running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(10),
        })
        .await?;

    let orders = rows(&store_url).await?;
    let store = toolrunner::Reconciler::open(&own_store(&store_url, "orders-01")).await?;
    let mut table = comfy_table::Table::new();
    table.set_header(["call", "state", "order row"]);
    let mut placed = 0;
    for call in &run.tool_calls {
        let timeline = store
            .show(&run.run_id, &call.call_id)
            .await
            .context("the call is in the store")?;
        let key = timeline.call().operation_key();
        let stored: Vec<_> = orders.iter().filter(|(id, ..)| *id == key).collect();
        let state = call.state.as_str();
        match state {
            "completed" => ensure!(stored.len() == 1, "{}: {} rows", call.call_id, stored.len()),
            _ => ensure!(
                stored.is_empty(),
                "{} is {state} yet has a row",
                call.call_id
            ),
        }
        placed += stored.len();
        let row = stored
            .first()
            .map_or("none".to_owned(), |(_, sku, q)| format!("{q} × {sku}"));
        table.add_row([call.call_id.as_str(), state, row.as_str()]);
    }
    println!("{table}");
    println!(
        "{} calls: {} order rows, each committed with its completed receipt",
        run.tool_calls.len(),
        placed
    );
    platform.shutdown().await;
    Ok(())
}
