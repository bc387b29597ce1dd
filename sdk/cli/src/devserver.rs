//! `toolrunner devserver`.
use std::net::SocketAddr;
use std::path::PathBuf;

use toolrunner_devserver::{DevServer, Faults};

/// Flags of `toolrunner devserver` (protocol §7).
#[derive(Debug, clap::Args)]
pub(crate) struct DevserverArgs {
    /// Address to listen on; port 0 picks a free port.
    #[arg(long, default_value = "127.0.0.1:8700")]
    listen: SocketAddr,
    /// SQLite file that keeps all state across restarts (default: in memory).
    #[arg(long)]
    db: Option<PathBuf>,
    /// TOKEN=SCOPES, scopes comma-separated or `*`; repeatable. Default:
    /// dev-admin=* and dev-executor=executors:connect,tools:execute.
    #[arg(long = "token", value_name = "TOKEN=SCOPES")]
    tokens: Vec<String>,
    /// Executor lease time to live in milliseconds.
    #[arg(long, default_value_t = 15_000)]
    lease_ttl_ms: u64,
    /// Advised heartbeat interval in milliseconds.
    #[arg(long, default_value_t = 5_000)]
    heartbeat_interval_ms: u64,
    /// A run with no call change for this long expires; 0 never.
    #[arg(long, default_value_t = 0)]
    run_ttl_ms: u64,
    /// Fault injection, e.g. error_rate=0.1,drop_response_rate=0.1,latency_ms=5,seed=7.
    #[arg(long, value_parser = Faults::parse)]
    faults: Option<Faults>,
}

pub(crate) async fn devserver(args: DevserverArgs) -> crate::Outcome {
    let mut builder = DevServer::builder()
        .listen(args.listen)
        .lease_ttl_ms(args.lease_ttl_ms)
        .heartbeat_interval_ms(args.heartbeat_interval_ms)
        .run_ttl_ms(args.run_ttl_ms)
        .faults(args.faults.unwrap_or_default());
    if let Some(db) = args.db {
        builder = builder.db_path(db);
    }
    for spec in &args.tokens {
        builder = builder.token_spec(spec);
    }
    let server = match builder.start().await {
        Ok(s) => s,
        Err(e) => return Err(crate::Failure::Usage(e.to_string())),
    };
    println!("toolrunner devserver listening on {}", server.base_url());
    server.run_until(shutdown_signal()).await;
    Ok(())
}

/// Ctrl-C or SIGTERM (the SDK's own signal), then a log line.
async fn shutdown_signal() {
    toolrunner::shutdown_signal().await;
    tracing::info!("shutting down");
}
