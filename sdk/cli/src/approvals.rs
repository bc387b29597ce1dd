//! `toolrunner approvals list|show|approve|deny`: the calls that wait for
//! a person's yes, beside a running executor on the same store.
use serde_json::json;
use toolrunner::{ApprovalRequest, Decision};

use crate::output::{self, DbArg};
use crate::{Failure, Outcome};

#[derive(Debug, clap::Subcommand)]
pub(crate) enum ApprovalsCommand {
    /// Every approval request, the newest first.
    List {
        /// Print `{"approvals": [...]}` as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArg,
    },
    /// One call's request: its arguments, subject, reason, expiry and
    /// decision.
    Show {
        /// RUN_ID/CALL_ID.
        call: String,
        /// Print it as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        db: DbArg,
    },
    /// Approve a call's request: an executor claims the call again within
    /// its poll interval and runs it once. A second approve changes
    /// nothing; an approve after a deny or an expiry is refused (exit 1).
    Approve {
        /// RUN_ID/CALL_ID.
        call: String,
        #[command(flatten)]
        decision: DecisionArgs,
        #[command(flatten)]
        db: DbArg,
    },
    /// Deny a call's request: an executor settles the call `failed` with
    /// code `forbidden` ("denied by an approver").
    Deny {
        /// RUN_ID/CALL_ID.
        call: String,
        #[command(flatten)]
        decision: DecisionArgs,
        #[command(flatten)]
        db: DbArg,
    },
}

#[derive(Debug, clap::Args)]
pub(crate) struct DecisionArgs {
    /// Who decides (recorded with the decision).
    #[arg(long)]
    who: String,
    /// A note recorded with the decision.
    #[arg(long)]
    note: Option<String>,
}

fn time(t: Option<toolrunner::Timestamp>) -> String {
    t.map_or_else(|| "-".to_owned(), |t| t.to_rfc3339())
}

/// A request as `list --json` and `show --json` print it.
fn as_json(r: &ApprovalRequest) -> serde_json::Value {
    json!({
        "run_id": r.run_id(),
        "call_id": r.call_id(),
        "tool": r.tool(),
        "digest": r.digest(),
        "state": r.state().as_str(),
        "subject": r.subject(),
        "agent_id": r.agent_id(),
        "agent_version": r.agent_version(),
        "reason": r.reason(),
        "arguments": r.arguments(),
        "asked_at": r.asked_at().to_rfc3339(),
        "expires_at": r.expires_at().to_rfc3339(),
        "decided_by": r.decided_by(),
        "note": r.note(),
        "decided_at": r.decided_at().map(|t| t.to_rfc3339()),
        "closed_why": r.closed_why(),
    })
}

pub(crate) async fn run(cmd: ApprovalsCommand) -> Outcome {
    match cmd {
        ApprovalsCommand::List { json, db } => {
            let requests = output::open_approvals(&db.db).await?.list().await?;
            if json {
                let all: Vec<_> = requests.iter().map(as_json).collect();
                return output::json(&json!({ "approvals": all }));
            }
            let rows = requests
                .iter()
                .map(|r| {
                    vec![
                        format!("{}/{}", r.run_id(), r.call_id()),
                        r.tool().to_owned(),
                        r.state().to_string(),
                        r.subject().to_owned(),
                        r.reason().to_owned(),
                        r.expires_at().to_rfc3339(),
                        r.decided_by().unwrap_or("-").to_owned(),
                    ]
                })
                .collect();
            println!(
                "{}",
                output::table(
                    &[
                        "call",
                        "tool",
                        "state",
                        "subject",
                        "reason",
                        "expires",
                        "decided by"
                    ],
                    rows
                )
            );
            Ok(())
        }
        ApprovalsCommand::Show { call, json, db } => {
            let (run_id, call_id) = output::call_ref(&call)?;
            let r = output::open_approvals(&db.db)
                .await?
                .show(&run_id, &call_id)
                .await?;
            if json {
                return output::json(&as_json(&r));
            }
            let arguments = serde_json::to_string_pretty(r.arguments())
                .map_err(|e| Failure::Usage(e.to_string()))?;
            println!("call        {}/{}", r.run_id(), r.call_id());
            println!("tool        {}", r.tool());
            println!("state       {}", r.state());
            println!("subject     {}", r.subject());
            println!("agent       {} {}", r.agent_id(), r.agent_version());
            println!("reason      {}", r.reason());
            println!("asked at    {}", r.asked_at().to_rfc3339());
            println!("expires at  {}", r.expires_at().to_rfc3339());
            println!("decided by  {}", r.decided_by().unwrap_or("-"));
            println!("decided at  {}", time(r.decided_at()));
            println!("note        {}", r.note().unwrap_or("-"));
            if let Some(why) = r.closed_why() {
                println!("closed      {why}");
            }
            println!("digest      {}", r.digest());
            println!("arguments\n{arguments}");
            Ok(())
        }
        ApprovalsCommand::Approve { call, decision, db } => {
            decide(&call, &decision, &db, true).await
        }
        ApprovalsCommand::Deny { call, decision, db } => decide(&call, &decision, &db, false).await,
    }
}

async fn decide(call: &str, args: &DecisionArgs, db: &DbArg, approve: bool) -> Outcome {
    let (run_id, call_id) = output::call_ref(call)?;
    let approvals = output::open_approvals(&db.db).await?;
    let note = args.note.as_deref();
    let done = if approve {
        approvals
            .approve(&run_id, &call_id, &args.who, note)
            .await?
    } else {
        approvals.deny(&run_id, &call_id, &args.who, note).await?
    };
    let what = if approve { "approved" } else { "denied" };
    match done {
        Decision::AlreadyMade => println!("{run_id}/{call_id} was {what} already: nothing changed"),
        _ => println!(
            "{run_id}/{call_id} {what} by {}: an executor acts on it within its poll interval",
            args.who
        ),
    }
    Ok(())
}
