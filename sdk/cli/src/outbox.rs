//! `toolrunner outbox status|redeliver`.
use crate::output::{self, DbArg, PlatformArgs};
use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum OutboxCommand {
    /// Counts by delivery status and the undelivered receipts.
    Status {
        #[command(flatten)]
        db: DbArg,
        /// Stable JSON: OutboxStatus.
        #[arg(long)]
        json: bool,
    },
    /// Send undelivered receipts now.
    Redeliver {
        /// Every undelivered receipt.
        #[arg(long, conflicts_with = "receipt_id")]
        all: bool,
        /// One receipt.
        receipt_id: Option<String>,
        #[command(flatten)]
        db: DbArg,
        #[command(flatten)]
        platform: PlatformArgs,
    },
}

pub(crate) async fn run(cmd: OutboxCommand) -> Outcome {
    match cmd {
        OutboxCommand::Status { db, json } => {
            let s = output::open(&db.db).await?.outbox().await?;
            if json {
                return output::json(&s);
            }
            let counts = s
                .by_status()
                .iter()
                .map(|(k, v)| vec![k.clone(), v.to_string()])
                .collect();
            println!("{}", output::table(&["status", "receipts"], counts));
            println!(
                "oldest undelivered: {}",
                s.oldest_pending_at()
                    .as_ref()
                    .map_or_else(|| "none".to_owned(), crate::calls::stamp)
            );
            let rows = s
                .pending()
                .iter()
                .map(|r| {
                    vec![
                        r.receipt_id().to_owned(),
                        r.kind().as_str().to_owned(),
                        r.attempts().to_string(),
                        r.last_error().unwrap_or_default().to_owned(),
                    ]
                })
                .collect();
            println!(
                "{}",
                output::table(&["receipt", "kind", "attempts", "last error"], rows)
            );
            Ok(())
        }
        OutboxCommand::Redeliver {
            all,
            receipt_id,
            db,
            platform,
        } => {
            if !all && receipt_id.is_none() {
                return Err(Failure::Usage("give --all or a RECEIPT_ID".into()));
            }
            if platform.base_url.is_none() {
                return Err(Failure::Usage(
                    "redeliver needs --base-url and --token".into(),
                ));
            }
            let r = platform.apply(output::open(&db.db).await?)?;
            let done = r.redeliver(receipt_id.as_deref()).await?;
            for (id, status) in &done {
                println!("{id}: {}", status.as_str());
            }
            println!("{} receipts sent", done.len());
            let stuck = done
                .iter()
                .filter(|(_, s)| *s == toolrunner::ReceiptStatus::Pending)
                .count();
            if stuck > 0 {
                return Err(Failure::Refused(format!(
                    "{stuck} receipts are still undelivered (see `toolrunner outbox status` for the last error)"
                )));
            }
            Ok(())
        }
    }
}
