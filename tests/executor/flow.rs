//! Flow control in one process: a tool's concurrency limit holds back the
//! claim (the call stays pending on the platform), never a claimed call;
//! configuration overrides the tool's own limit; bad limits are refused at
//! `build()`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::json;
use toolrunner::testing::TestKit;
use toolrunner::{CallContext, Executor, Limits, State, ToolError};

/// What to do.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct Job {
    /// Which one.
    n: u64,
}

/// What was done.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Done {
    /// Which one.
    n: u64,
}

/// How many handlers run now, and the most that ever ran at once.
#[derive(Clone, Default)]
struct Gauge {
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

/// Works a while, counting how many of its calls run at once.
#[toolrunner::tool(name = "slow.work", effect = write, concurrency = 2)]
async fn slow_work(
    State(gauge): State<Gauge>,
    _ctx: CallContext,
    job: Job,
) -> Result<Done, ToolError> {
    let now = gauge.now.fetch_add(1, Ordering::SeqCst) + 1;
    gauge.most.fetch_max(now, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(150)).await;
    gauge.now.fetch_sub(1, Ordering::SeqCst);
    Ok(Done { n: job.n })
}

/// Submits `n` calls at once and waits for all of them: every one must
/// complete.
async fn run_all(kit: &TestKit, n: u64) -> toolrunner::Result<()> {
    let mut handles = Vec::new();
    for i in 0..n {
        handles.push(kit.submit("slow.work", json!({"n": i})).await?);
    }
    for h in &handles {
        let outcome = kit.wait(h).await?;
        assert!(outcome.is_completed(), "{outcome:?}");
    }
    Ok(())
}

/// The kit with `slow.work` (its own limit 2) at capacity 8, each builder
/// passed through `configure` too; the gauge its calls count on.
async fn slow_kit(
    configure: fn(toolrunner::ExecutorBuilder) -> toolrunner::ExecutorBuilder,
) -> toolrunner::Result<(TestKit, Gauge)> {
    let gauge = Gauge::default();
    let held = gauge.clone();
    let kit = TestKit::start(move |b| {
        configure(
            b.tool(slow_work)
                .state(held.clone())
                .capacity(8)
                .poll_interval(Duration::from_millis(50)),
        )
    })
    .await?;
    Ok((kit, gauge))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_at_its_concurrency_limit_is_not_claimed_and_every_call_still_completes()
-> toolrunner::Result<()> {
    // Capacity 8 would let 8 run at once; the tool's own limit is 2.
    let (kit, gauge) = slow_kit(|b| b).await?;
    run_all(&kit, 10).await?;
    let most = gauge.most.load(Ordering::SeqCst);
    assert_eq!(most, 2, "at most 2 at once, and the limit was reached");
    kit.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configuration_overrides_the_tools_own_limit() -> toolrunner::Result<()> {
    let (kit, gauge) = slow_kit(|b| b.limit("slow.work", Limits::none().concurrency(1))).await?;
    run_all(&kit, 5).await?;
    assert_eq!(gauge.most.load(Ordering::SeqCst), 1);
    kit.shutdown().await
}

#[test]
fn bad_limits_are_refused_at_build_saying_what_to_set() {
    let build = |configure: fn(toolrunner::ExecutorBuilder) -> toolrunner::ExecutorBuilder| {
        configure(
            Executor::builder()
                .base_url("http://127.0.0.1:9")
                .token("tok")
                .executor_id("ex-1")
                .binding_id("bnd_1")
                .allow_all()
                .state(Gauge::default())
                .tool(slow_work),
        )
        .build()
        .err()
        .map(|e| (e.is_builder(), e.to_string()))
    };
    let zero = build(|b| b.limit("slow.work", Limits::none().concurrency(0)))
        .expect("a zero limit is refused");
    assert!(zero.0, "{zero:?}");
    assert!(
        zero.1.contains("slow.work") && zero.1.contains("at least 1"),
        "{}",
        zero.1
    );
    let unknown = build(|b| b.limit("slow.wrok", Limits::none().concurrency(2)))
        .expect("a limit for a tool not registered is refused");
    assert!(
        unknown.1.contains("\"slow.wrok\"") && unknown.1.contains("slow.work"),
        "it names the tool and the ones there are: {}",
        unknown.1
    );
    // An approval policy for a tool not registered, alike.
    let policy =
        build(|b| b.approval_policy("slow.wrok", |_: &toolrunner::AuthorizationRequest| Ok(())))
            .expect("a policy for a tool not registered is refused");
    assert!(
        policy.0
            && policy.1.contains("approval policy")
            && policy.1.contains("\"slow.wrok\"")
            && policy.1.contains("slow.work"),
        "it names the setting, the tool and the ones there are: {}",
        policy.1
    );
    let fn_tool = toolrunner::tool::write("zero.fn", |_ctx: CallContext, job: Job| async move {
        Ok::<_, ToolError>(Done { n: job.n })
    })
    .describe("Does it")
    .concurrency(0);
    let Err(refused) = Executor::builder()
        .base_url("http://127.0.0.1:9")
        .token("tok")
        .executor_id("ex-1")
        .binding_id("bnd_1")
        .allow_all()
        .tool(fn_tool)
        .build()
    else {
        panic!("a tool's own zero limit is refused");
    };
    assert!(refused.to_string().contains("zero.fn"), "{refused}");
    assert_eq!(build(|b| b), None, "the tool's own limit of 2 builds");
}

/// Answers at once.
#[toolrunner::tool(name = "quick.work", effect = write, rate = 3)]
async fn quick_work(_ctx: CallContext, job: Job) -> Result<Done, ToolError> {
    Ok(Done { n: job.n })
}

/// The most instants of `times` (milliseconds) within any `window_ms`.
fn most_within(times: &mut [i128], window_ms: i128) -> usize {
    times.sort_unstable();
    (0..times.len())
        .map(|i| {
            times[i..]
                .iter()
                .take_while(|t| **t - times[i] < window_ms)
                .count()
        })
        .max()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_second_sees_more_first_accepted_than_the_rate_and_every_call_completes()
-> toolrunner::Result<()> {
    let kit = TestKit::start(|b| {
        b.tool(quick_work)
            .capacity(8)
            .poll_interval(Duration::from_millis(50))
    })
    .await?;
    let started = std::time::Instant::now();
    let mut handles = Vec::new();
    for i in 0..9 {
        handles.push(kit.submit("quick.work", json!({"n": i})).await?);
    }
    let mut accepted_at = Vec::new();
    for h in &handles {
        let outcome = kit.wait(h).await?;
        assert!(outcome.is_completed(), "{outcome:?}");
        let run = kit.platform().run(&h.run_id).await?;
        let call = run
            .tool_calls
            .iter()
            .find(|c| c.call_id == h.call_id)
            .expect("the call is in its run");
        let first = call
            .receipts
            .iter()
            .filter(|r| r.kind == toolrunner::protocol::wire::ReceiptKind::Accepted)
            .map(|r| humantime::parse_rfc3339(&r.received_at).expect("an RFC 3339 time"))
            .min()
            .expect("an accepted");
        let ms = first
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_millis();
        accepted_at.push(i128::try_from(ms).expect("a time in milliseconds"));
    }
    // The platform stamps in milliseconds: a second is 1,000 of them, and
    // two stamps 1,000 apart are in two windows.
    let most = most_within(&mut accepted_at, 1_000);
    assert_eq!(
        most, 3,
        "at most 3 first accepted a second, and the rate was reached: {accepted_at:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "9 calls at 3 a second take at least two seconds after the first three"
    );
    kit.shutdown().await
}

/// Takes longer than a rate token's reservation lasts, the first time.
#[derive(Clone, Default)]
struct SlowOnce(Arc<AtomicUsize>);

#[toolrunner::async_trait]
impl toolrunner::Authorizer for SlowOnce {
    async fn authorize(
        &self,
        _request: &toolrunner::AuthorizationRequest,
    ) -> Result<(), toolrunner::Denied> {
        if self.0.fetch_add(1, Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(1_300)).await;
        }
        Ok(())
    }
}

/// Counts its runs.
#[toolrunner::tool(name = "counted.work", effect = write, rate = 5)]
async fn counted_work(
    State(runs): State<Arc<AtomicUsize>>,
    _ctx: CallContext,
    job: Job,
) -> Result<Done, ToolError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(Done { n: job.n })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_token_that_lapsed_before_accepted_gives_the_claim_back_and_the_call_runs_once_later()
-> toolrunner::Result<()> {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let kit = TestKit::start(move |b| {
        b.tool(counted_work)
            .state(counted.clone())
            .authorizer(SlowOnce::default())
            .poll_interval(Duration::from_millis(50))
    })
    .await?;
    let call = kit.submit("counted.work", json!({"n": 1})).await?;
    let outcome = kit.wait(&call).await?;
    assert!(outcome.is_completed(), "{outcome:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");
    let timeline = kit
        .reconciler()
        .await?
        .show(&call.run_id, &call.call_id)
        .await?;
    assert!(
        timeline.events().iter().any(|e| e.what() == "released"),
        "the claim was given back: {:?}",
        timeline.events()
    );
    let keys: std::collections::BTreeSet<&str> = timeline
        .attempts()
        .iter()
        .map(|a| a.operation_key())
        .collect();
    assert_eq!(
        keys.len(),
        2,
        "claimed again with a new key: {:?}",
        timeline.attempts()
    );
    kit.shutdown().await
}
