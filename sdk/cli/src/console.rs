//! `toolrunner console`: the operator console in a browser, over one or
//! more executor stores.
use toolrunner::console::Console;

use crate::output::PlatformArgs;
use crate::{Failure, Outcome};

#[derive(Debug, clap::Args)]
pub(crate) struct ConsoleArgs {
    /// An executor's store: a SQLite file (a path or sqlite:// URL; repeat
    /// --db for each executor) or a postgres:// database (every executor
    /// identity on it).
    #[arg(long = "db", env = "TOOLRUNNER_DB", default_value = "toolrunner.db")]
    db: Vec<String>,
    /// Where to listen (HOST:PORT). A non-loopback address needs
    /// --auth-token.
    #[arg(long, default_value = "127.0.0.1:8710")]
    listen: String,
    /// The token every page needs (a bearer header, or the login form
    /// once); required off loopback.
    #[arg(long, env = "TOOLRUNNER_CONSOLE_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// Show calls, take no action: every POST answers 403.
    #[arg(long)]
    read_only: bool,
    /// The request header an authenticating proxy in front of the console
    /// sets to the signed-in operator's name (for example
    /// X-Forwarded-User): every request must carry it, and every action
    /// and approval records it as the operator. Only where the proxy alone
    /// reaches the console.
    #[arg(long, value_name = "HEADER")]
    operator_header: Option<String>,
    #[command(flatten)]
    platform: PlatformArgs,
}

pub(crate) async fn run(args: ConsoleArgs) -> Outcome {
    let addrs: Vec<std::net::SocketAddr> = tokio::net::lookup_host(&args.listen)
        .await
        .map_err(|e| Failure::Usage(format!("--listen {}: not HOST:PORT ({e})", args.listen)))?
        .collect();
    let Some(&addr) = addrs.first() else {
        return Err(Failure::Usage(format!(
            "--listen {}: no address",
            args.listen
        )));
    };
    if addrs.iter().any(|a| !a.ip().is_loopback()) && args.auth_token.is_none() {
        return Err(Failure::Usage(format!(
            "{} is not a loopback address: give --auth-token (or TOOLRUNNER_CONSOLE_TOKEN) so that only operators get in, or listen on 127.0.0.1",
            args.listen
        )));
    }
    let mut builder = Console::builder().read_only(args.read_only);
    // On loopback the console answers only to loopback host names, token
    // or not (a page of another site rebound to 127.0.0.1 cannot reach
    // even the login form).
    if addrs.iter().all(|a| a.ip().is_loopback()) {
        for host in ["localhost", "127.0.0.1", "[::1]"] {
            builder = builder.allow_host(host);
        }
    }
    for db in &args.db {
        builder = builder.database(db);
    }
    match (&args.platform.base_url, &args.platform.token) {
        (Some(url), Some(token)) => builder = builder.platform(url, token),
        (None, None) => {}
        _ => return Err(Failure::Usage("--base-url and --token go together".into())),
    }
    if let Some(token) = &args.auth_token {
        builder = builder.auth_token(token);
    }
    if let Some(header) = &args.operator_header {
        builder = builder.operator_header(header);
    }
    let console = builder.build().await?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| Failure::Usage(format!("cannot listen on {}: {e}", args.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| Failure::Usage(format!("cannot read the listening address: {e}")))?;
    println!("toolrunner console listening on http://{addr}");
    if args.auth_token.is_some() {
        eprintln!(
            "note: the console is served over plain HTTP; put TLS in front of it before its token crosses a network"
        );
    }
    axum::serve(listener, console.router())
        .with_graceful_shutdown(async {
            toolrunner::shutdown_signal().await;
        })
        .await
        .map_err(|e| Failure::Usage(format!("the console stopped: {e}")))
}
