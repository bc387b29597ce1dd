//! `toolrunner limits list|set`: the tools' limits a PostgreSQL store
//! keeps for every replica of its database.
use crate::output;
use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum LimitsCommand {
    /// Each tool the database knows: the limits set in the store, and the
    /// slots and rate tokens every replica holds now.
    List {
        /// The PostgreSQL store (`postgres://…`).
        #[arg(long, env = "TOOLRUNNER_DB")]
        db: String,
    },
    /// Sets a tool's limits in the store: every replica applies them
    /// within about a second, without a restart. A limit not given stays
    /// as it was; `--clear` drops both (the processes' own apply again).
    Set {
        /// The tool's name.
        tool: String,
        /// At most N calls of the tool held at once, by every replica.
        #[arg(long, value_name = "N")]
        concurrency: Option<u32>,
        /// At most N first `accepted` of the tool in any sliding second,
        /// by every replica.
        #[arg(long, value_name = "N")]
        rate: Option<u32>,
        /// Drop the tool's stored limits.
        #[arg(long, conflicts_with_all = ["concurrency", "rate"])]
        clear: bool,
        /// The PostgreSQL store (`postgres://…`).
        #[arg(long, env = "TOOLRUNNER_DB")]
        db: String,
    },
}

fn shown(limit: Option<u32>) -> String {
    limit.map_or_else(|| "-".to_owned(), |n| n.to_string())
}

pub(crate) async fn run(cmd: LimitsCommand) -> Outcome {
    match cmd {
        LimitsCommand::List { db } => {
            let limits = toolrunner::StoredLimits::open(&db).await?;
            let rows = limits
                .list()
                .await?
                .iter()
                .map(|t| {
                    vec![
                        t.tool().to_owned(),
                        shown(t.stored().max_concurrency()),
                        shown(t.stored().max_rate()),
                        t.slots_in_use().to_string(),
                        t.tokens_in_use().to_string(),
                    ]
                })
                .collect();
            println!(
                "{}",
                output::table(
                    &[
                        "tool",
                        "concurrency",
                        "rate",
                        "slots in use",
                        "tokens in use"
                    ],
                    rows
                )
            );
            Ok(())
        }
        LimitsCommand::Set {
            tool,
            concurrency,
            rate,
            clear,
            db,
        } => {
            let limits = toolrunner::StoredLimits::open(&db).await?;
            if clear {
                limits.clear(&tool).await?;
                println!("limits of {tool} cleared from the store: the processes' own apply");
                return Ok(());
            }
            let mut set = toolrunner::Limits::none();
            if let Some(n) = concurrency {
                set = set.concurrency(n);
            }
            if let Some(n) = rate {
                set = set.rate(n);
            }
            if concurrency.is_none() && rate.is_none() {
                return Err(Failure::Usage(
                    "give --concurrency N, --rate N (or both), or --clear".into(),
                ));
            }
            limits.set(&tool, set).await?;
            let now = limits
                .list()
                .await?
                .into_iter()
                .find(|t| t.tool() == tool)
                .map(|t| t.stored())
                .unwrap_or(set);
            println!(
                "limits of {tool} in the store now: concurrency {}, rate {} (every replica applies them within about a second)",
                shown(now.max_concurrency()),
                shown(now.max_rate())
            );
            Ok(())
        }
    }
}
