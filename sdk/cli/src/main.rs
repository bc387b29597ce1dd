//! `toolrunner`: the operator command line.
//!
//! Exit codes: 0 done, 1 refused (nothing changed), 2 usage or setup error.

mod approvals;
mod budget;
mod calls;
mod console;
mod dev;
mod devserver;
mod limits;
mod outbox;
mod output;
mod reconcile;
mod tools;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Operate toolrunner executors and the development platform.
#[derive(Debug, Parser)]
#[command(name = "toolrunner", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the development platform.
    Devserver(devserver::DevserverArgs),
    /// Set a development platform up for a crate's tools, and run a call
    /// of one through it.
    #[command(subcommand)]
    Dev(dev::DevCommand),
    /// List and inspect the calls in an executor's store.
    #[command(subcommand)]
    Calls(calls::CallsCommand),
    /// Settle calls whose outcome is unknown.
    #[command(subcommand)]
    Reconcile(reconcile::ReconcileCommand),
    /// List, show, approve and deny the calls that wait for a person's
    /// yes.
    #[command(subcommand)]
    Approvals(approvals::ApprovalsCommand),
    /// List and set the tools' limits a PostgreSQL store keeps for every
    /// replica.
    #[command(subcommand)]
    Limits(limits::LimitsCommand),
    /// Inspect and redeliver the receipt outbox.
    #[command(subcommand)]
    Outbox(outbox::OutboxCommand),
    /// Check tool definitions and dry-run them against a platform.
    #[command(subcommand)]
    Tools(tools::ToolsCommand),
    /// Preview what the model sees of a result under a context budget.
    Budget(budget::BudgetArgs),
    /// Serve the operator console: calls, timelines and actions in a
    /// browser.
    Console(console::ConsoleArgs),
}

/// How a subcommand ended.
pub(crate) enum Failure {
    /// The request was refused; nothing changed (exit 1).
    Refused(String),
    /// A usage or setup problem (exit 2).
    Usage(String),
}

pub(crate) type Outcome = Result<(), Failure>;

impl From<toolrunner::Error> for Failure {
    fn from(e: toolrunner::Error) -> Self {
        if e.is_refused() {
            Failure::Refused(e.to_string())
        } else {
            Failure::Usage(e.to_string())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
                tracing_subscriber::EnvFilter::new(match cli.command {
                    Command::Devserver(_) | Command::Console(_) => "info",
                    _ => "warn",
                })
            }),
        )
        .init();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Devserver(args) => devserver::devserver(args).await,
            Command::Dev(c) => dev::run(c).await,
            Command::Calls(c) => calls::run(c).await,
            Command::Reconcile(c) => reconcile::run(c).await,
            Command::Outbox(c) => outbox::run(c).await,
            Command::Limits(c) => limits::run(c).await,
            Command::Approvals(c) => approvals::run(c).await,
            Command::Tools(c) => tools::run(c).await,
            Command::Budget(b) => budget::run(b),
            Command::Console(c) => console::run(c).await,
        }
    });
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Refused(m)) => {
            eprintln!("refused: {m}");
            ExitCode::from(1)
        }
        Err(Failure::Usage(m)) => {
            eprintln!("error: {m}");
            ExitCode::from(2)
        }
    }
}
