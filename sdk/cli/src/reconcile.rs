//! `toolrunner reconcile resolve|compensated|close`.
use std::io::Read;

use toolrunner::{Evidence, Outcome as Settle};

use crate::output::{self, DbArg, PlatformArgs};
use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum ReconcileCommand {
    /// Settle a reconciliation_required (or rejected) call with evidence.
    Resolve {
        /// RUN_ID/CALL_ID.
        call: String,
        /// The effect happened: the result JSON from FILE, or - for stdin.
        #[arg(long, value_name = "FILE|-", group = "outcome")]
        completed: Option<String>,
        /// A confirmed business failure with this code (needs --message).
        #[arg(long, value_name = "CODE", group = "outcome", requires = "message")]
        failed: Option<String>,
        /// The failure's short message for the model.
        #[arg(long)]
        message: Option<String>,
        /// A confirmed business cancellation (needs --reason).
        #[arg(long, group = "outcome", requires = "reason")]
        cancelled: bool,
        /// The cancellation's reason.
        #[arg(long)]
        reason: Option<String>,
        #[command(flatten)]
        evidence: EvidenceArgs,
        #[command(flatten)]
        db: DbArg,
        #[command(flatten)]
        platform: PlatformArgs,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Record that a rejected call's effect was compensated.
    Compensated {
        /// RUN_ID/CALL_ID.
        call: String,
        #[command(flatten)]
        evidence: EvidenceArgs,
        #[command(flatten)]
        db: DbArg,
    },
    /// Close an orphaned call whose outcome was unknown (the platform
    /// forgot it while it waited for reconciliation): settled locally with
    /// evidence, nothing sent; retention may then prune it.
    Close {
        /// RUN_ID/CALL_ID.
        call: String,
        #[command(flatten)]
        evidence: EvidenceArgs,
        #[command(flatten)]
        db: DbArg,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct EvidenceArgs {
    /// Why this outcome is right (what was checked, where).
    #[arg(long)]
    evidence: String,
    /// Who decides (default: $USER).
    #[arg(long, env = "USER", default_value = "operator")]
    who: String,
    /// A reference: ticket, provider transaction id, ….
    #[arg(long)]
    reference: Option<String>,
}

impl EvidenceArgs {
    fn evidence(&self) -> Result<Evidence, Failure> {
        if self.evidence.trim().is_empty() {
            return Err(Failure::Refused(
                "--evidence must say what was checked".into(),
            ));
        }
        let evidence = Evidence::new(&self.who, &self.evidence);
        Ok(match &self.reference {
            Some(r) => evidence.with_reference(r),
            None => evidence,
        })
    }
}

fn read_result(source: &str) -> Result<serde_json::Value, Failure> {
    let mut text = String::new();
    if source == "-" {
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| Failure::Usage(format!("cannot read stdin: {e}")))?;
    } else {
        text = std::fs::read_to_string(source)
            .map_err(|e| Failure::Usage(format!("cannot read {source}: {e}")))?;
    }
    toolrunner::protocol::json::parse_strict(text.trim().as_bytes())
        .map_err(|e| Failure::Refused(format!("the result is not acceptable JSON: {e}")))
}

pub(crate) async fn run(cmd: ReconcileCommand) -> Outcome {
    match cmd {
        ReconcileCommand::Resolve {
            call,
            completed,
            failed,
            message,
            cancelled,
            reason,
            evidence,
            db,
            platform,
            json,
        } => {
            let (run_id, call_id) = output::call_ref(&call)?;
            let settle = match (completed, failed, cancelled) {
                (Some(src), None, false) => Settle::Completed(read_result(&src)?),
                (None, Some(code), false) => Settle::Failed {
                    code,
                    message: message.unwrap_or_default(),
                },
                (None, None, true) => Settle::Cancelled {
                    reason: reason.unwrap_or_default(),
                },
                _ => {
                    return Err(Failure::Usage(
                        "give exactly one of --completed, --failed, --cancelled".into(),
                    ));
                }
            };
            let evidence = evidence.evidence()?;
            let r = platform.apply(output::open(&db.db).await?)?;
            let done = r.resolve(&run_id, &call_id, settle, &evidence).await?;
            if json {
                return output::json(&done);
            }
            let how = if done.delivered() {
                "delivered"
            } else {
                "saved; the running executor's outbox delivers it"
            };
            println!(
                "resolved {run_id}/{call_id}: receipt {} {how} (state {})",
                done.receipt_id(),
                done.state().as_str()
            );
            Ok(())
        }
        ReconcileCommand::Compensated { call, evidence, db } => {
            let (run_id, call_id) = output::call_ref(&call)?;
            let evidence = evidence.evidence()?;
            output::open(&db.db)
                .await?
                .compensated(&run_id, &call_id, &evidence)
                .await?;
            println!("recorded {run_id}/{call_id} as compensated");
            Ok(())
        }
        ReconcileCommand::Close { call, evidence, db } => {
            let (run_id, call_id) = output::call_ref(&call)?;
            let evidence = evidence.evidence()?;
            output::open(&db.db)
                .await?
                .close(&run_id, &call_id, &evidence)
                .await?;
            println!(
                "closed {run_id}/{call_id}: its outcome stays unknown to the platform, which no longer knows the call; the evidence is in its timeline"
            );
            Ok(())
        }
    }
}
