//! Refunds: a write tool whose large calls wait for a person's yes.
//!
//! ```text
//! cargo run --example refunds                        # the embedded platform
//! cargo run --example refunds -- --threshold 50000   # refunds above 500.00 need a person
//! cargo run --example refunds -- --base-url URL      # a real one (TOOLRUNNER_* variables)
//! cargo run --example refunds -- --print-definitions # {"tools": [...]} for `toolrunner tools publish`
//! ```
//!
//! The authorizer answers `Denied::needs_approval` for a refund above the
//! threshold: the executor gives the claim back (nothing accepted, nothing
//! run) and stores an approval request. On the embedded platform the
//! example asks for three refunds: a small one runs at once; of two large
//! ones, one is approved (it runs once) and one denied (settled `failed`,
//! code `forbidden`, "denied by an approver"), each decided through
//! `toolrunner::Approvals` as `toolrunner approvals approve|deny` would.

use std::time::Duration;

use clap::Parser;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::TestKit;
use toolrunner::{
    Approvals, AuthorizationRequest, Authorizer, CallContext, Denied, Executor, State, ToolError,
};

#[path = "support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
#[command(about = "Serve a refund tool whose large calls need a person's approval")]
struct Args {
    /// A real platform (with TOOLRUNNER_TOKEN, _EXECUTOR_ID, _BINDING_ID):
    /// serve until SIGTERM instead of the demo.
    #[arg(long)]
    base_url: Option<String>,
    /// Refunds above this many cents need a person's approval.
    #[arg(long, default_value_t = 100_000)]
    threshold: u64,
    /// How long a request waits for a decision before the call is settled
    /// `forbidden` ("approval expired").
    #[arg(long, default_value_t = 3600)]
    expiry_secs: u64,
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
}

/// A refund to make.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Refund {
    /// Whose order.
    customer: String,
    /// How much, in cents.
    amount_cents: u64,
}

/// The refund made.
#[toolrunner::schema]
#[derive(Serialize)]
struct Refunded {
    /// The provider's refund number.
    refund: usize,
}

/// The payment provider's refunds (the effect).
#[derive(Clone, Default)]
struct Provider(std::sync::Arc<std::sync::Mutex<Vec<(String, u64)>>>);

/// Refunds a customer's order.
#[toolrunner::tool(name = "refunds.refund", effect = write)]
async fn refund(
    State(provider): State<Provider>,
    ctx: CallContext,
    r: Refund,
) -> Result<Refunded, ToolError> {
    ctx.commit_point().await?; // nothing irreversible before this line
    let mut made = provider.0.lock().expect("not poisoned");
    made.push((r.customer, r.amount_cents));
    Ok(Refunded { refund: made.len() })
}

/// The product's policy: refunds above a threshold need a person.
struct OverThreshold {
    cents: u64,
    expiry: Duration,
}

#[toolrunner::async_trait]
impl Authorizer for OverThreshold {
    async fn authorize(&self, request: &AuthorizationRequest) -> Result<(), Denied> {
        match request.arguments["amount_cents"].as_u64() {
            Some(amount) if amount > self.cents => Err(Denied::needs_approval(
                format!("a refund of {amount} cents is over {} cents", self.cents),
                self.expiry,
            )),
            _ => Ok(()),
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    support::quiet_logs();
    let args = Args::parse();
    let provider = Provider::default();
    if args.print_definitions {
        return support::print_definitions(|b| b.state(provider).tool(refund));
    }
    let policy = move || OverThreshold {
        cents: args.threshold,
        expiry: Duration::from_secs(args.expiry_secs),
    };
    if let Some(url) = args.base_url {
        let executor = Executor::from_env()
            .base_url(url)
            .state(provider)
            .authorizer(policy())
            .tool(refund)
            .build()?;
        executor.serve(toolrunner::shutdown_signal()).await?;
        return Ok(());
    }
    let state = provider.clone();
    let kit =
        TestKit::start(move |b| b.state(state.clone()).authorizer(policy()).tool(refund)).await?;
    let approvals = Approvals::open_path(kit.store_path()).await?;
    let large = args.threshold + 1;
    let asked = [
        (json!({"customer": "ann", "amount_cents": 1_200}), None),
        (json!({"customer": "bo", "amount_cents": large}), Some(true)),
        (
            json!({"customer": "cy", "amount_cents": large}),
            Some(false),
        ),
    ];
    let mut lines = Vec::new();
    for (arguments, approve) in asked {
        let call = kit.submit("refunds.refund", arguments.clone()).await?;
        if let Some(approve) = approve {
            // The request is stored before the claim goes back.
            let mut waiting = None;
            for _ in 0..200 {
                if let Ok(r) = approvals.show(&call.run_id, &call.call_id).await {
                    waiting = Some(r);
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let request = waiting.ok_or_else(|| anyhow::anyhow!("no approval was asked"))?;
            let verb = if approve { "approve" } else { "deny" };
            println!(
                "waiting for a person ({}): toolrunner approvals {verb} {}/{} --db {} --who NAME",
                request.reason(),
                call.run_id,
                call.call_id,
                kit.store_path().display()
            );
            if approve {
                approvals
                    .approve(&call.run_id, &call.call_id, "alice", Some("order checked"))
                    .await?;
            } else {
                approvals
                    .deny(
                        &call.run_id,
                        &call.call_id,
                        "bob",
                        Some("not this customer"),
                    )
                    .await?;
            }
        }
        let outcome = kit.wait(&call).await?;
        lines.push(support::Line {
            tool: "refunds.refund".into(),
            asked: arguments.to_string(),
            outcome,
        });
    }
    support::print(&lines);
    let made = provider.0.lock().expect("not poisoned").clone();
    println!("\nrefunds made: {made:?}");
    kit.shutdown().await?;
    anyhow::ensure!(
        made.len() == 2,
        "the small and the approved refund, each once"
    );
    Ok(())
}
