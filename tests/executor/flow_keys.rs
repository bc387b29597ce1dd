//! Per-key limits in one process: calls with one concurrency key (from
//! their arguments) never run more than the limit at once; a hot key with
//! half of the calls does not hold the other keys back: they finish while
//! most of the hot key's calls still wait, whether the hot calls are
//! interleaved with theirs or all older. A key function that reads
//! another type, or a tool without arguments, is refused at `build()`.
//!
//! The test counts (how many hot calls were done when the others were),
//! it does not time: beside the other tests of this binary the machine's
//! load moves durations by more than the margin the issue sets. The
//! durations it prints (the others alone, beside the hot key) are the
//! figures `docs/benchmarks.md` records from quiet runs: the others
//! finish within 20 % of their time alone.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use toolrunner::testing::TestKit;
use toolrunner::{CallContext, Executor, State, ToolError};

/// A charge for a merchant.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct Charge {
    /// The merchant's account: the concurrency key.
    merchant: String,
    /// Which charge.
    n: u64,
}

/// What was done.
#[toolrunner::schema]
#[derive(serde::Serialize)]
struct Charged {
    /// Which charge.
    n: u64,
}

/// Per merchant: how many run now and the most at once; when each
/// merchant's last call finished.
#[derive(Clone, Default)]
struct Downstream {
    running: Arc<Mutex<HashMap<String, (usize, usize)>>>,
    finished: Arc<Mutex<HashMap<String, Instant>>>,
    /// Per merchant: how many of its calls finished.
    done: Arc<Mutex<HashMap<String, usize>>>,
    /// Each call's merchant and when it finished, in order.
    log: Arc<Mutex<Vec<(String, Instant)>>>,
}

impl Downstream {
    /// How many calls of `hot` had finished when the last call of another
    /// merchant did.
    fn hot_done_when_others_were(&self, hot: &str) -> usize {
        let log = self.log.lock().unwrap();
        let last_other = log
            .iter()
            .rposition(|(m, _)| m != hot)
            .expect("other merchants ran");
        log[..last_other].iter().filter(|(m, _)| m == hot).count()
    }
}

const EFFECT: Duration = Duration::from_millis(300);
const PER_KEY: u32 = 2;

async fn charge(
    State(down): State<Downstream>,
    _ctx: CallContext,
    c: Charge,
) -> Result<Charged, ToolError> {
    {
        let mut running = down.running.lock().unwrap();
        let (now, most) = running.entry(c.merchant.clone()).or_default();
        *now += 1;
        *most = (*most).max(*now);
    }
    tokio::time::sleep(EFFECT).await;
    running_done(&down, &c.merchant);
    Ok(Charged { n: c.n })
}

fn running_done(down: &Downstream, merchant: &str) {
    if let Some((now, _)) = down.running.lock().unwrap().get_mut(merchant) {
        *now -= 1;
    }
    let now = Instant::now();
    down.finished
        .lock()
        .unwrap()
        .insert(merchant.to_owned(), now);
    down.log.lock().unwrap().push((merchant.to_owned(), now));
    *down
        .done
        .lock()
        .unwrap()
        .entry(merchant.to_owned())
        .or_default() += 1;
}

async fn kit(down: &Downstream) -> toolrunner::Result<TestKit> {
    let held = down.clone();
    TestKit::start(move |b| {
        b.tool(
            toolrunner::tool::write("charges.create", charge)
                .describe("Charges a merchant's customer")
                .concurrency_key(PER_KEY, |c: &Charge| c.merchant.clone()),
        )
        .state(held.clone())
        .capacity(32)
        .poll_interval(Duration::from_millis(50))
    })
    .await
}

/// Submits the calls in waves, each wave's at once (a later wave's calls
/// are newer on the platform), waits for every one to complete (with
/// `hot_too` false, the calls of `hot` are not waited for); how long
/// until the last call of a merchant other than `hot` finished.
async fn play(
    kit: &TestKit,
    down: &Downstream,
    waves: &[Vec<(String, u64)>],
    hot: &str,
    hot_too: bool,
) -> Duration {
    let start = Instant::now();
    let mut submitted = Vec::new();
    for calls in waves {
        let handles = futures_util::future::join_all(calls.iter().map(|(merchant, n)| {
            kit.submit("charges.create", json!({"merchant": merchant, "n": n}))
        }))
        .await;
        submitted.extend(
            calls
                .iter()
                .zip(handles)
                .filter(|((merchant, _), _)| hot_too || merchant != hot)
                .map(|(_, h)| h),
        );
    }
    for handle in submitted {
        let handle = handle.expect("submitted");
        let outcome = settled(kit, &handle).await;
        assert!(outcome.is_completed(), "{outcome:?}");
    }
    let finished = down.finished.lock().unwrap();
    finished
        .iter()
        .filter(|(m, _)| m.as_str() != hot)
        .map(|(_, at)| at.duration_since(start))
        .max()
        .expect("other merchants ran")
}

/// The call's outcome, waited for up to three minutes: the kit waits 30 s
/// at a time, and a machine loaded by the other tests (the test counts,
/// it does not time) must not fail it, nor a regression that only makes
/// the others slower than the count allows.
async fn settled(
    kit: &TestKit,
    handle: &toolrunner::testing::CallHandle,
) -> toolrunner::testing::CallOutcome {
    let mut tries = 0;
    loop {
        match kit.wait(handle).await {
            Ok(outcome) => return outcome,
            Err(e) if tries < 5 => {
                tries += 1;
                eprintln!("flow keys: still waiting ({e})");
            }
            Err(e) => panic!("not settled within three minutes: {e}"),
        }
    }
}

/// 100 calls over nine merchants (`m1`…`m9`), and, with `hot`, 100 more
/// of merchant `m0`, interleaved.
fn calls(hot: bool) -> Vec<(String, u64)> {
    let mut v = Vec::new();
    for n in 0..100u64 {
        if hot {
            v.push(("m0".to_owned(), 1000 + n));
        }
        v.push((format!("m{}", 1 + n % 9), n));
    }
    v
}

/// One test, its plays one after another (timings side by side must not
/// share the machine with each other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_key_takes_its_limit_and_never_starves_the_others() -> toolrunner::Result<()> {
    let alone = Downstream::default();
    let k = kit(&alone).await?;
    let others_alone = play(&k, &alone, &[calls(false)], "m0", true).await;
    k.shutdown().await?;

    // Interleaved: half of the calls the hot key's.
    let mixed = Downstream::default();
    let k = kit(&mixed).await?;
    let others_mixed = play(&k, &mixed, &[calls(true)], "m0", true).await;
    let hot_beside = mixed.hot_done_when_others_were("m0");
    k.shutdown().await?;

    // A hot key's 300 calls all older than the others (submitted first:
    // more than a page of `pending`, at most 100): the claimer looks past
    // the calls backing off (the next pages), so the others are not
    // hidden until the hot backlog fits in a page. Each hot call is
    // claimed once to learn its key (the arguments come with the claim);
    // the others finish while most of the hot backlog still waits. The
    // hot calls are not waited for.
    const HOT: usize = 300;
    let hot: Vec<(String, u64)> = (0..HOT as u64)
        .map(|n| ("m0".to_owned(), 1000 + n))
        .collect();
    let first = Downstream::default();
    let k = kit(&first).await?;
    let others_after = play(&k, &first, &[hot, calls(false)], "m0", false).await;
    let hot_done = first.hot_done_when_others_were("m0");
    k.shutdown().await?;

    let most = mixed.running.lock().unwrap().clone();
    eprintln!(
        "flow keys: the other keys' 100 calls took {others_alone:?} alone, {others_mixed:?} beside a hot key's 100 ({hot_beside} of them done by then), {others_after:?} after a hot key's {HOT} older ones ({hot_done} of them done by then); most at once by key {most:?}"
    );
    for (merchant, (_, at_once)) in most.iter().chain(first.running.lock().unwrap().iter()) {
        assert!(
            *at_once <= PER_KEY as usize,
            "{merchant}: {at_once} at once, over the per-key limit {PER_KEY}"
        );
    }
    assert_eq!(
        most.get("m0").map(|m| m.1),
        Some(PER_KEY as usize),
        "the hot key reached its limit"
    );
    // Round robin between keys: the others (nine keys, 18 at once) need
    // about six rounds of the effect, in which the hot key (2 at once)
    // finishes about a dozen; the others starved would finish only with
    // (or after) the hot key's calls.
    assert!(
        hot_beside < 50,
        "the other keys finished only once {hot_beside} of the hot key's 100 interleaved calls were done (after {others_mixed:?}, {others_alone:?} alone): they waited behind it"
    );
    // Each hot call is claimed once to learn its key, and given back: the
    // calls given back together share one flush of their `released`
    // reports (each flushing every report alone held the capacity for
    // 15 s: 122-149 hot calls done first on a quiet machine, over 200
    // beside the other tests; now about 26 on a quiet machine), and a call
    // whose key is still full here is not claimed again until a slot of it
    // comes back. How many hot calls finish meanwhile depends on how fast
    // the claimer learns the keys, which a loaded machine slows while the
    // hot effect's time stays (176 of 300 in a CI run beside a build):
    // asserted here is that the others never wait for the hot backlog,
    // with room for a loaded machine; the quiet figures are in
    // docs/benchmarks.md.
    assert!(
        hot_done < HOT - 50,
        "the other keys finished only once {hot_done} of the hot key's {HOT} older calls were done (after {others_after:?}): they waited behind it"
    );
    Ok(())
}

/// Takes nothing.
#[toolrunner::schema]
#[derive(serde::Deserialize)]
struct Nothing {}

#[test]
fn a_bad_key_function_is_refused_at_build_saying_what_to_do() {
    let build = |tool: toolrunner::FnTool<Charged>| {
        Executor::builder()
            .base_url("http://127.0.0.1:9")
            .token("tok")
            .executor_id("ex-1")
            .binding_id("bnd_1")
            .allow_all()
            .state(Downstream::default())
            .tool(tool)
            .build()
            .err()
            .map(|e| (e.is_builder(), e.to_string()))
    };
    let other_type = build(
        toolrunner::tool::write("charges.create", charge)
            .describe("Charges")
            .concurrency_key(2, |n: &Nothing| format!("{:p}", n)),
    );
    let (builder, said) = other_type.expect("refused");
    assert!(builder, "{said}");
    assert!(said.contains("reads") && said.contains("Charge"), "{said}");

    let no_arguments = build(
        toolrunner::tool::write(
            "charges.none",
            |_ctx: CallContext, _n: Nothing| async move { Ok(Charged { n: 0 }) },
        )
        .describe("Nothing")
        .concurrency_key(2, |_n: &Nothing| "all"),
    );
    let (_, said) = no_arguments.expect("refused");
    assert!(said.contains("takes no arguments"), "{said}");

    let zero = build(
        toolrunner::tool::write("charges.create", charge)
            .describe("Charges")
            .concurrency_key(0, |c: &Charge| c.merchant.clone()),
    );
    let (_, said) = zero.expect("refused");
    assert!(said.contains("at least 1"), "{said}");

    let no_function = Executor::builder()
        .base_url("http://127.0.0.1:9")
        .token("tok")
        .executor_id("ex-1")
        .binding_id("bnd_1")
        .allow_all()
        .state(Downstream::default())
        .tool(toolrunner::tool::write("charges.create", charge).describe("Charges"))
        .limit("charges.create", toolrunner::Limits::none().per_key(2))
        .build()
        .err()
        .map(|e| e.to_string())
        .expect("refused");
    assert!(
        no_function.contains("needs a key function"),
        "{no_function}"
    );
}
