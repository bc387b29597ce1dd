//! `toolrunner::testing` as a product engineer uses it: a tool run on the
//! embedded platform in a few lines, and a crash after the handler that the
//! tool's reconcile hook settles, once.

use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::testing::{SettledBy, Step, TestKit};
use toolrunner::{CallContext, Reconciled, State, ToolError};

/// Whom to greet.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Greet {
    /// A name.
    name: String,
}

/// The greeting.
#[toolrunner::schema]
#[derive(Serialize)]
struct Greeting {
    /// The text.
    text: String,
}

/// Greets someone.
#[toolrunner::tool(name = "hello", effect = read)]
async fn hello(_ctx: CallContext, input: Greet) -> Result<Greeting, ToolError> {
    Ok(Greeting {
        text: format!("hello {}", input.name),
    })
}

#[tokio::test]
async fn a_tool_runs_on_the_embedded_platform() -> toolrunner::Result<()> {
    let kit = TestKit::start(|b| b.tool(hello)).await?;
    let outcome = kit.call("hello", json!({"name": "ada"})).await?;
    assert!(outcome.is_completed());
    assert_eq!(outcome.result, Some(json!({"text": "hello ada"})));
    assert_eq!(outcome.settled_by, SettledBy::Handler);
    kit.shutdown().await
}

/// The business system: payments made, by idempotency key.
#[derive(Clone, Default)]
struct Bank(Arc<Mutex<Vec<(String, u64)>>>);

/// What to charge.
#[toolrunner::schema]
#[derive(Deserialize)]
struct Charge {
    /// Amount in minor units.
    amount: u64,
}

/// The charge.
#[toolrunner::schema]
#[derive(Serialize)]
struct Charged {
    /// The bank's reference.
    reference: usize,
}

/// Charges an amount.
#[toolrunner::tool(name = "charge", effect = write, reconcile = find_charge)]
async fn charge(
    State(bank): State<Bank>,
    ctx: CallContext,
    input: Charge,
) -> Result<Charged, ToolError> {
    let mut payments = bank.0.lock().expect("not poisoned");
    payments.push((ctx.operation_key().to_owned(), input.amount));
    Ok(Charged {
        reference: payments.len(),
    })
}

async fn find_charge(State(bank): State<Bank>, ctx: CallContext) -> Reconciled<Charged> {
    let payments = bank.0.lock().expect("not poisoned");
    Reconciled::found(
        payments
            .iter()
            .position(|(k, _)| k == ctx.operation_key())
            .map(|i| Charged { reference: i + 1 }),
    )
}

/// The process dies right after the handler charged: nothing of its outcome
/// was saved. The restarted executor never charges again; its reconcile
/// hook finds the charge and settles the call `completed`, once.
#[tokio::test]
async fn a_crash_after_the_handler_is_settled_once_by_the_hook() -> toolrunner::Result<()> {
    let bank = Bank::default();
    let state = bank.clone();
    let mut kit = TestKit::builder()
        .crash_at(Step::AfterHandler)
        .start(move |b| b.state(state.clone()).tool(charge))
        .await?;
    let call = kit.submit("charge", json!({"amount": 1200})).await?;
    kit.wait_crashed().await?;
    kit.restart().await?;
    let outcome = kit.wait(&call).await?;
    assert!(outcome.is_completed(), "{outcome:?}");
    assert_eq!(outcome.settled_by, SettledBy::ReconcileHook);
    assert_eq!(outcome.result, Some(json!({"reference": 1})));
    assert_eq!(
        bank.0.lock().expect("not poisoned").len(),
        1,
        "charged once"
    );
    kit.shutdown().await
}

/// What a handler heard when it reported progress.
#[derive(Clone, Default)]
struct Heard(Arc<Mutex<Vec<toolrunner::ProgressError>>>);

/// Reports progress inside its own transaction, which a SQLite store
/// cannot take while the transaction holds its write lock.
#[toolrunner::tool(name = "progress.in_tx", effect = transactional)]
async fn progress_in_tx(
    State(heard): State<Heard>,
    ctx: CallContext,
    _input: Charge,
) -> Result<Charged, ToolError> {
    let inner = ctx.clone();
    ctx.transaction(async move |_tx| {
        if let Err(e) = inner.progress("half way").await {
            heard.0.lock().expect("not poisoned").push(e);
        }
        Ok(())
    })
    .await?;
    Ok(Charged { reference: 1 })
}

/// A progress report inside the call's SQLite transaction is refused at
/// once, as its own kind: the handler can tell it from a store failure.
#[tokio::test]
async fn progress_inside_a_sqlite_transaction_is_refused_as_such() -> toolrunner::Result<()> {
    let heard = Heard::default();
    let state = heard.clone();
    let kit = TestKit::start(move |b| b.state(state.clone()).tool(progress_in_tx)).await?;
    let outcome = kit.call("progress.in_tx", json!({"amount": 1})).await?;
    assert!(outcome.is_completed(), "{outcome:?}");
    let heard = heard.0.lock().expect("not poisoned").clone();
    assert!(
        matches!(
            heard.as_slice(),
            [toolrunner::ProgressError::TransactionOpen]
        ),
        "{heard:?}"
    );
    kit.shutdown().await
}

/// A task the handler left behind, told when to report.
#[derive(Clone, Default)]
struct Later(Arc<Mutex<Option<tokio::sync::oneshot::Sender<CallContext>>>>);

/// Hands its context to a task of the test's, and returns at once.
#[toolrunner::tool(name = "progress.later", effect = write)]
async fn progress_later(
    State(later): State<Later>,
    ctx: CallContext,
    _input: Charge,
) -> Result<Charged, ToolError> {
    if let Some(tx) = later.0.lock().expect("not poisoned").take() {
        let _ = tx.send(ctx);
    }
    Ok(Charged { reference: 1 })
}

/// A context kept past its call reports into a call that is no longer
/// running: the error says so, with the call's state, and nothing is
/// stored.
#[tokio::test]
async fn progress_after_the_call_settled_says_it_is_no_longer_running() -> toolrunner::Result<()> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let later = Later(Arc::new(Mutex::new(Some(tx))));
    let state = later.clone();
    let kit = TestKit::start(move |b| b.state(state.clone()).tool(progress_later)).await?;
    let outcome = kit.call("progress.later", json!({"amount": 1})).await?;
    assert!(outcome.is_completed(), "{outcome:?}");
    let ctx = rx
        .await
        .expect("the handler ran and handed its context over");
    let err = ctx
        .progress("too late")
        .await
        .expect_err("the call has settled");
    match err {
        toolrunner::ProgressError::NotRunning {
            state: Some(state), ..
        } => assert!(
            matches!(
                state,
                toolrunner::LocalState::Settled | toolrunner::LocalState::Delivered
            ),
            "{state}"
        ),
        other => panic!("expected NotRunning with the call's state, got {other:?}"),
    }
    kit.shutdown().await
}
