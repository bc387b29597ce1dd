//! Approvals in one process: a call whose authorizer asks for a person's
//! yes is given back (nothing accepted, nothing run) and waits in the
//! store; approved, it runs once; denied or expired, it is settled
//! `forbidden` with a message the model reads; a decision is recorded once;
//! an approval stored for other arguments is never used.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::json;
use toolrunner::protocol::wire::CallState;
use toolrunner::testing::{CallHandle, TestKit};
use toolrunner::{
    ApprovalState, Approvals, AuthorizationRequest, Authorizer, CallContext, Denied, State,
    ToolError,
};

/// A refund to make.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct Refund {
    /// Whose.
    customer: String,
    /// How much, in cents.
    amount: u64,
}

/// A refund made.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Refunded {
    /// Whose.
    customer: String,
    /// How much, in cents.
    amount: u64,
}

/// The refunds made, by customer (the effect this test counts).
#[derive(Clone, Default)]
struct Ledger(Arc<Mutex<HashMap<String, u32>>>);

impl Ledger {
    fn made(&self, customer: &str) -> u32 {
        self.0
            .lock()
            .expect("not poisoned")
            .get(customer)
            .copied()
            .unwrap_or(0)
    }
}

/// Refunds a customer.
#[toolrunner::tool(name = "refunds.refund", effect = write)]
async fn refund(
    State(ledger): State<Ledger>,
    _ctx: CallContext,
    r: Refund,
) -> Result<Refunded, ToolError> {
    *ledger
        .0
        .lock()
        .expect("not poisoned")
        .entry(r.customer.clone())
        .or_default() += 1;
    Ok(Refunded {
        customer: r.customer,
        amount: r.amount,
    })
}

/// Refunds over 1,000 (100,000 cents) need a person, for `window`; the
/// calls whose requests it was told of.
struct OverAThousand {
    window: Duration,
    told: Told,
}

/// The calls whose approval requests the product was told of (with their
/// reason), in order.
#[derive(Clone, Default)]
struct Told(
    Arc<Mutex<Vec<(String, String)>>>,
    /// The next telling panics (the product's channel failed).
    Arc<std::sync::atomic::AtomicBool>,
);

impl Told {
    fn of(&self, call_id: &str) -> Vec<String> {
        self.0
            .lock()
            .expect("not poisoned")
            .iter()
            .filter(|(c, _)| c == call_id)
            .map(|(_, reason)| reason.clone())
            .collect()
    }
}

#[toolrunner::async_trait]
impl Authorizer for OverAThousand {
    async fn authorize(&self, request: &AuthorizationRequest) -> Result<(), Denied> {
        if request.arguments["amount"].as_u64().unwrap_or(0) > 100_000 {
            return Err(Denied::needs_approval(
                "refunds over 1,000 need a person",
                self.window,
            ));
        }
        Ok(())
    }

    async fn on_approval_requested(&self, request: &toolrunner::ApprovalRequest) {
        if self.told.1.swap(false, std::sync::atomic::Ordering::SeqCst) {
            panic!("the mail server is down");
        }
        self.told
            .0
            .lock()
            .expect("not poisoned")
            .push((request.call_id().to_owned(), request.reason().to_owned()));
    }
}

async fn kit(window: Duration) -> toolrunner::Result<(TestKit, Ledger)> {
    let (kit, ledger, _) = kit_told(window).await?;
    Ok((kit, ledger))
}

async fn kit_told(window: Duration) -> toolrunner::Result<(TestKit, Ledger, Told)> {
    let ledger = Ledger::default();
    let told = Told::default();
    let held = ledger.clone();
    let hook = told.clone();
    let kit = TestKit::start(move |b| {
        b.tool(refund)
            .state(held.clone())
            .authorizer(OverAThousand {
                window,
                told: hook.clone(),
            })
            .poll_interval(Duration::from_millis(50))
    })
    .await?;
    Ok((kit, ledger, told))
}

async fn approvals(kit: &TestKit) -> toolrunner::Result<Approvals> {
    Approvals::open_path(kit.store_path()).await
}

/// Waits (up to 10 s) until the call's request is stored.
async fn asked(
    kit: &TestKit,
    call: &CallHandle,
) -> toolrunner::Result<toolrunner::ApprovalRequest> {
    let approvals = approvals(kit).await?;
    for _ in 0..200 {
        if let Ok(r) = approvals.show(&call.run_id, &call.call_id).await {
            return Ok(r);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no approval request was stored for {}", call.call_id);
}

/// The call's state on the platform.
async fn platform_state(kit: &TestKit, call: &CallHandle) -> toolrunner::Result<CallState> {
    let run = kit.platform().run(&call.run_id).await?;
    Ok(run
        .tool_calls
        .iter()
        .find(|c| c.call_id == call.call_id)
        .map(|c| c.state)
        .expect("the run has the call"))
}

/// The message of the call's final `failed` receipt.
fn failed_message(outcome: &toolrunner::testing::CallOutcome) -> String {
    outcome
        .call
        .receipts
        .iter()
        .rev()
        .find_map(|r| {
            let body: serde_json::Value = serde_json::from_str(r.body.get()).ok()?;
            body["error"]["message"].as_str().map(str::to_owned)
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approved_call_runs_once_and_a_second_approve_changes_nothing() -> toolrunner::Result<()>
{
    let (kit, ledger, told) = kit_told(Duration::from_secs(60)).await?;
    // Below the threshold: no person asked.
    let small = kit
        .call("refunds.refund", json!({"customer": "bo", "amount": 500}))
        .await?;
    assert!(small.is_completed(), "{small:?}");
    let call = kit
        .submit(
            "refunds.refund",
            json!({"customer": "ann", "amount": 400_000}),
        )
        .await?;
    let request = asked(&kit, &call).await?;
    assert_eq!(request.state(), ApprovalState::Waiting);
    assert_eq!(request.reason(), "refunds over 1,000 need a person");
    assert_eq!(request.subject(), "testkit-user");
    assert_eq!(request.arguments()["amount"], json!(400_000));
    // Nothing ran while it waits, and the platform holds the call for
    // whoever claims it (given back, never held waiting).
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(ledger.made("ann"), 0);
    assert_eq!(platform_state(&kit, &call).await?, CallState::Pending);
    // The product was told once (its telling recorded: never again).
    assert_eq!(
        told.of(&call.call_id),
        vec!["refunds over 1,000 need a person".to_owned()]
    );
    let approvals = approvals(&kit).await?;
    let first = approvals
        .approve(
            &call.run_id,
            &call.call_id,
            "alice",
            Some("checked the order"),
        )
        .await?;
    assert_eq!(first, toolrunner::Decision::Recorded);
    let second = approvals
        .approve(&call.run_id, &call.call_id, "alice", None)
        .await?;
    assert_eq!(second, toolrunner::Decision::AlreadyMade);
    let deny = approvals
        .deny(&call.run_id, &call.call_id, "bob", None)
        .await
        .expect_err("a deny after an approve is refused");
    assert!(deny.is_refused(), "{deny}");
    assert!(deny.to_string().contains("approved by alice"), "{deny}");
    let outcome = kit.wait(&call).await?;
    assert!(outcome.is_completed(), "{outcome:?}");
    assert_eq!(ledger.made("ann"), 1);
    let shown = approvals.show(&call.run_id, &call.call_id).await?;
    assert_eq!(shown.state(), ApprovalState::Approved);
    assert_eq!(shown.decided_by(), Some("alice"));
    assert_eq!(shown.note(), Some("checked the order"));
    // The call's timeline holds the request and the decision, who and when.
    let timeline = kit
        .reconciler()
        .await?
        .show(&call.run_id, &call.call_id)
        .await?;
    let entries: Vec<(String, String)> = timeline
        .events()
        .iter()
        .map(|e| (e.what().to_owned(), e.detail().unwrap_or("").to_owned()))
        .collect();
    let requested = entries
        .iter()
        .position(|(what, _)| what == "approval_requested")
        .unwrap_or_else(|| panic!("no approval_requested in {entries:?}"));
    let approved = entries
        .iter()
        .position(|(what, detail)| {
            what == "approval_approved" && detail == "by alice: checked the order"
        })
        .unwrap_or_else(|| panic!("no approval_approved by alice in {entries:?}"));
    assert!(requested < approved, "{entries:?}");
    kit.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_call_is_settled_forbidden_and_an_approve_after_it_is_refused()
-> toolrunner::Result<()> {
    let (kit, ledger) = kit(Duration::from_secs(60)).await?;
    let call = kit
        .submit(
            "refunds.refund",
            json!({"customer": "cy", "amount": 900_000}),
        )
        .await?;
    asked(&kit, &call).await?;
    let approvals = approvals(&kit).await?;
    let empty = approvals
        .deny(&call.run_id, &call.call_id, " ", None)
        .await
        .expect_err("a decision without an approver is refused");
    assert!(empty.to_string().contains("--who"), "{empty}");
    approvals
        .deny(
            &call.run_id,
            &call.call_id,
            "dana",
            Some("not this customer"),
        )
        .await?;
    let outcome = kit.wait(&call).await?;
    assert_eq!(outcome.state, CallState::Failed, "{outcome:?}");
    assert_eq!(outcome.error_code.as_deref(), Some("forbidden"));
    assert_eq!(failed_message(&outcome), "denied by an approver");
    assert_eq!(ledger.made("cy"), 0);
    let late = approvals
        .approve(&call.run_id, &call.call_id, "erin", None)
        .await
        .expect_err("an approve after a deny is refused");
    assert!(late.is_refused(), "{late}");
    kit.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_nobody_decided_in_time_settles_forbidden() -> toolrunner::Result<()> {
    let (kit, ledger) = kit(Duration::from_millis(600)).await?;
    let call = kit
        .submit(
            "refunds.refund",
            json!({"customer": "di", "amount": 200_000}),
        )
        .await?;
    asked(&kit, &call).await?;
    let outcome = kit.wait(&call).await?;
    assert_eq!(outcome.state, CallState::Failed, "{outcome:?}");
    assert_eq!(outcome.error_code.as_deref(), Some("forbidden"));
    assert_eq!(failed_message(&outcome), "approval expired");
    assert_eq!(ledger.made("di"), 0);
    let approvals = approvals(&kit).await?;
    assert_eq!(
        approvals.show(&call.run_id, &call.call_id).await?.state(),
        ApprovalState::Expired
    );
    let late = approvals
        .approve(&call.run_id, &call.call_id, "fay", None)
        .await
        .expect_err("an approve after the expiry is refused");
    assert!(late.to_string().contains("expired"), "{late}");
    kit.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_stored_for_other_arguments_is_never_used() -> toolrunner::Result<()> {
    let (kit, ledger) = kit(Duration::from_secs(60)).await?;
    let call = kit
        .submit(
            "refunds.refund",
            json!({"customer": "ed", "amount": 700_000}),
        )
        .await?;
    let request = asked(&kit, &call).await?;
    // Planted: an approved request of this very call, for another digest.
    let url = format!("sqlite://{}", kit.store_path().display());
    let pool = toolrunner::sqlx::SqlitePool::connect(&url)
        .await
        .expect("the store opens");
    let now = request.asked_at().to_rfc3339();
    toolrunner::sqlx::query(
        "INSERT INTO approvals (run_id, call_id, digest, tool, subject, agent_id, agent_version,
             arguments, reason, executor_id, asked_at, expires_at, state, decided_by, decided_at)
         VALUES (?, ?, 'sha256:0000', 'refunds.refund', 'testkit-user', 'a', 'v', '{}', 'planted',
             'exe_planted', ?, '2999-01-01T00:00:00.000Z', 'approved', 'mallory', ?)",
    )
    .bind(&call.run_id)
    .bind(&call.call_id)
    .bind(&now)
    .bind(&now)
    .execute(&pool)
    .await
    .expect("the planted row is stored");
    pool.close().await;
    // A few poll intervals: the call is claimed again only after a
    // decision of its own digest.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(ledger.made("ed"), 0);
    assert_eq!(platform_state(&kit, &call).await?, CallState::Pending);
    let approvals = approvals(&kit).await?;
    let shown = approvals.show(&call.run_id, &call.call_id).await?;
    assert_eq!(shown.digest(), request.digest());
    assert_eq!(shown.state(), ApprovalState::Waiting);
    approvals
        .deny(&call.run_id, &call.call_id, "gus", None)
        .await?;
    let outcome = kit.wait(&call).await?;
    assert_eq!(outcome.error_code.as_deref(), Some("forbidden"));
    assert_eq!(ledger.made("ed"), 0);
    kit.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_product_could_not_be_told_of_is_told_again() -> toolrunner::Result<()> {
    let (kit, ledger, told) = kit_told(Duration::from_secs(60)).await?;
    told.1.store(true, std::sync::atomic::Ordering::SeqCst);
    let call = kit
        .submit(
            "refunds.refund",
            json!({"customer": "flo", "amount": 300_000}),
        )
        .await?;
    asked(&kit, &call).await?;
    // The first telling panicked: the executor tells again (at its next
    // look for work), and records it told once it was.
    let mut again = Vec::new();
    for _ in 0..100 {
        again = told.of(&call.call_id);
        if !again.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(again.len(), 1, "told again after the panic: {again:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        told.of(&call.call_id).len(),
        1,
        "told once it succeeded, never again"
    );
    assert!(
        !told.1.load(std::sync::atomic::Ordering::SeqCst),
        "the first telling ran"
    );
    approvals(&kit)
        .await?
        .approve(&call.run_id, &call.call_id, "gil", None)
        .await?;
    assert!(kit.wait(&call).await?.is_completed());
    assert_eq!(ledger.made("flo"), 1);
    kit.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_an_end_is_stored_and_decided() -> toolrunner::Result<()> {
    let (kit, ledger) = kit(Duration::MAX).await?;
    let call = kit
        .submit(
            "refunds.refund",
            json!({"customer": "gia", "amount": 500_000}),
        )
        .await?;
    let request = asked(&kit, &call).await?;
    assert_eq!(request.state(), ApprovalState::Waiting);
    assert_eq!(
        request.expires_at().to_rfc3339(),
        "9999-12-31T23:59:59.999+00:00"
    );
    approvals(&kit)
        .await?
        .deny(&call.run_id, &call.call_id, "hal", None)
        .await?;
    let outcome = kit.wait(&call).await?;
    assert_eq!(outcome.error_code.as_deref(), Some("forbidden"));
    assert_eq!(ledger.made("gia"), 0);
    kit.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_waiting_for_a_person_never_hide_the_others() -> toolrunner::Result<()> {
    let ledger = Ledger::default();
    let held = ledger.clone();
    let kit = TestKit::start(move |b| {
        b.tool(refund)
            .state(held.clone())
            .authorizer(OverAThousand {
                window: Duration::from_secs(60),
                told: Told::default(),
            })
            .capacity(1)
            .poll_interval(Duration::from_millis(50))
    })
    .await?;
    // Six older calls wait for a person, more than the capacity of pending
    // candidates a look asks for.
    for n in 0..6 {
        let call = kit
            .submit(
                "refunds.refund",
                json!({"customer": format!("w{n}"), "amount": 200_000}),
            )
            .await?;
        asked(&kit, &call).await?;
    }
    let small = kit
        .call("refunds.refund", json!({"customer": "ivy", "amount": 100}))
        .await?;
    assert!(small.is_completed(), "{small:?}");
    assert_eq!(ledger.made("ivy"), 1);
    kit.shutdown().await
}
