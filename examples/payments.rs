//! Payments: the operation key goes downstream as the payment provider's
//! idempotency key, and a reconcile hook looks a charge up by it.
//!
//! ```text
//! cargo run --example payments                       # the embedded platform
//! cargo run --example payments -- --base-url URL     # a real one (TOOLRUNNER_* variables)
//! cargo run --example payments -- --print-definitions # {"tools": [...]} for `toolrunner tools publish`
//! ```
//!
//! On the embedded platform it charges four times: one goes through, one
//! is declined (a business failure), one loses the provider's answer (the
//! outcome is unknown until the hook finds the charge), and in one the
//! executor's process dies right after the provider charged (the restarted
//! executor never charges again: the hook settles it). The provider's book
//! shows one charge per call.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use clap::Parser;
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::{Step, TestKit};
use toolrunner::{CallContext, Executor, OutcomeExt, Reconciled, State, ToolError};

#[path = "support/mod.rs"]
mod support;

#[derive(Debug, Parser)]
#[command(about = "Serve payments.charge with toolrunner")]
struct Args {
    /// A real platform (with TOOLRUNNER_TOKEN, _EXECUTOR_ID, _BINDING_ID):
    /// serve until SIGTERM instead of the demo.
    #[arg(long)]
    base_url: Option<String>,
    /// Print the tool definitions as `{"tools": [...]}` (for `toolrunner
    /// tools check` and `toolrunner tools publish`) and exit, starting
    /// nothing; the binding is TOOLRUNNER_BINDING_ID's.
    #[arg(long)]
    print_definitions: bool,
}

/// A payment provider that honours idempotency keys (a stand-in for a
/// real one's API).
#[derive(Clone, Default)]
struct Provider(Arc<Mutex<BTreeMap<String, (String, u64)>>>);

/// Why the provider's call did not give a charge.
#[derive(Debug)]
enum ProviderError {
    /// The card was declined: nothing was charged.
    Declined,
    /// The answer was lost: the charge may or may not have been made.
    AnswerLost,
}

impl std::fmt::Display for ProviderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ProviderError::Declined => "the card was declined",
            ProviderError::AnswerLost => "the provider's answer was lost",
        })
    }
}

impl std::error::Error for ProviderError {}

impl Provider {
    /// Charges once per idempotency key; the same key again returns the
    /// first charge.
    fn charge(&self, key: &str, card: &str, amount: u64) -> Result<String, ProviderError> {
        if card == "4000-declined" {
            return Err(ProviderError::Declined);
        }
        let mut book = self.0.lock().expect("not poisoned");
        let n = book.len();
        let (id, _) = book
            .entry(key.to_owned())
            .or_insert_with(|| (format!("ch_{}", n + 1), amount))
            .clone();
        if card == "4000-lost-answer" {
            return Err(ProviderError::AnswerLost);
        }
        Ok(id)
    }

    /// The charge made with this idempotency key, if any (a real
    /// provider's lookup can fail too: its answer lost, its API down).
    fn find(&self, key: &str) -> Result<Option<String>, ProviderError> {
        Ok(self
            .0
            .lock()
            .expect("not poisoned")
            .get(key)
            .map(|(id, _)| id.clone()))
    }

    fn charges(&self) -> usize {
        self.0.lock().expect("not poisoned").len()
    }
}

/// What to charge.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Charge {
    /// Amount in cents.
    amount: u64,
    /// The card's token.
    card: String,
}

/// The charge made.
#[toolrunner::schema]
#[derive(Serialize)]
struct Charged {
    /// The provider's charge id.
    charge_id: String,
}

/// Charges the customer's card.
#[toolrunner::tool(name = "payments.charge", effect = write, reconcile = find_charge)]
async fn charge(
    State(provider): State<Provider>,
    ctx: CallContext,
    c: Charge,
) -> Result<Charged, ToolError> {
    ctx.commit_point().await?; // right before the irreversible step
    // The operation key is the provider's idempotency key: a retry can
    // never charge twice.
    match provider.charge(ctx.operation_key(), &c.card, c.amount) {
        Ok(charge_id) => Ok(Charged { charge_id }),
        // A business failure the model may read.
        Err(e @ ProviderError::Declined) => Err(e).business_failure("card_declined"),
        // Anything else leaves the outcome unknown, for the hook to settle.
        Err(e) => Err(e).unknown_outcome(),
    }
}

/// Looks the charge up by the operation key it was made with. Only a
/// lookup that answered may say "not charged" (the call then fails); a
/// lookup that failed cannot tell, and an operator decides.
async fn find_charge(State(provider): State<Provider>, ctx: CallContext) -> Reconciled<Charged> {
    match provider.find(ctx.operation_key()) {
        Ok(found) => Reconciled::found(found.map(|charge_id| Charged { charge_id })),
        Err(_) => Reconciled::Unknown,
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    support::quiet_logs();
    let args = Args::parse();
    let provider = Provider::default();
    if args.print_definitions {
        return support::print_definitions(|b| b.state(provider).tool(charge));
    }
    if let Some(url) = args.base_url {
        let executor = Executor::from_env()
            .base_url(url)
            .state(provider)
            .allow_all()
            .tool(charge)
            .build()?;
        executor.serve(toolrunner::shutdown_signal()).await?;
        return Ok(());
    }
    let mut lines = Vec::new();
    let state = provider.clone();
    let kit = TestKit::start(move |b| b.state(state.clone()).tool(charge)).await?;
    for card in ["4242-ok", "4000-declined", "4000-lost-answer"] {
        let asked = json!({"amount": 1200, "card": card});
        let outcome = kit.call("payments.charge", asked.clone()).await?;
        lines.push(support::Line {
            tool: "payments.charge".into(),
            asked: asked.to_string(),
            outcome,
        });
    }
    kit.shutdown().await?;
    // The process dies right after the provider charged.
    let state = provider.clone();
    let mut kit = TestKit::builder()
        .crash_at(Step::AfterHandler)
        .start(move |b| b.state(state.clone()).tool(charge))
        .await?;
    let asked = json!({"amount": 990, "card": "4242-crash-after"});
    let call = kit.submit("payments.charge", asked.clone()).await?;
    kit.wait_crashed().await?;
    kit.restart().await?;
    let outcome = kit.wait(&call).await?;
    lines.push(support::Line {
        tool: "payments.charge (process lost)".into(),
        asked: asked.to_string(),
        outcome,
    });
    kit.shutdown().await?;
    support::print(&lines);
    println!(
        "the provider's book: {} charges for 4 calls, one declined",
        provider.charges()
    );
    Ok(())
}
