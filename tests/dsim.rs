//! Deterministic simulation: one seeded scheduler owns time, the network,
//! the store's commits and crashes, and drives the runner's own call
//! machine through the platform and store models
//! (`toolrunner::testing::model`): no wall clock, no threads inside a
//! seed, no tokio, no random ids. A seed replays bit for bit.
//!
//! `TOOLRUNNER_DSIM_SEEDS` (how many, from seed 0), `TOOLRUNNER_DSIM_SEED`
//! (one seed, and its trace), `TOOLRUNNER_DSIM_PARALLEL` (threads, each
//! running whole seeds; with one seed, that many plays of it at once, which
//! must all give the same trace). Prints `dsim: N seeds in S s, F failed`, and for
//! one seed `dsim: seed N trace HEX`: the SHA-256 of the `Debug` text of
//! every input and command in order (`TOOLRUNNER_DSIM_PRINT=1` prints
//! them).

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use sha2::{Digest, Sha256};
use toolrunner::testing::model::{Simulated, simulate};

/// Inputs a seed draws while faults may still happen.
const STEPS: usize = 300;

fn env(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}"))
    })
}

/// A seed's trace hash, or the failure with its replay command.
fn run(seed: u64) -> Result<String, String> {
    play(seed).map(|(trace, _)| trace)
}

/// A seed's trace hash and what happened in it.
fn play(seed: u64) -> Result<(String, Simulated), String> {
    let mut hash = Sha256::new();
    let print = std::env::var_os("TOOLRUNNER_DSIM_PRINT").is_some();
    let done = simulate(seed, STEPS, &mut |line: &str| {
        if print {
            println!("dsim: | {line}");
        }
        hash.update(line.as_bytes());
        hash.update(b"\n");
    });
    match done {
        Ok(walk) => {
            if std::env::var_os("TOOLRUNNER_DSIM_SEED").is_some() {
                println!("dsim: seed {seed}: {walk:?}");
            }
            Ok((hex(&hash.finalize()), walk))
        }
        Err(counterexample) => Err(format!(
            "seed {seed}: {counterexample}replay: {}TOOLRUNNER_DSIM_SEED={seed} cargo test --release --test dsim -- --nocapture",
            planted()
        )),
    }
}

/// The `RUSTFLAGS` of a build with a planted bug, for the replay command.
fn planted() -> &'static str {
    if cfg!(toolrunner_planted = "rerun") {
        "RUSTFLAGS='--cfg toolrunner_planted=\"rerun\"' "
    } else if cfg!(toolrunner_planted = "resume") {
        "RUSTFLAGS='--cfg toolrunner_planted=\"resume\"' "
    } else if cfg!(toolrunner_planted = "zombie") {
        "RUSTFLAGS='--cfg toolrunner_planted=\"zombie\"' "
    } else {
        ""
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[test]
fn seeded_walks_keep_the_promises() {
    let parallel = env("TOOLRUNNER_DSIM_PARALLEL").unwrap_or(2).max(1);
    if let Some(seed) = env("TOOLRUNNER_DSIM_SEED") {
        // The seed played on `parallel` threads at once: every play must
        // give the same trace.
        let started = Instant::now();
        let plays: Vec<Result<String, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..parallel).map(|_| s.spawn(|| run(seed))).collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a play"))
                .collect()
        });
        let done = plays[0].clone();
        match &done {
            Ok(trace) => println!("dsim: seed {seed} trace {trace}"),
            Err(e) => println!("dsim: {e}"),
        }
        println!(
            "dsim: 1 seeds in {:.1} s, {} failed",
            started.elapsed().as_secs_f64(),
            usize::from(done.is_err())
        );
        assert!(
            plays.iter().all(|p| *p == done),
            "the seed's {parallel} plays at once gave different traces: {plays:?}"
        );
        assert!(done.is_ok(), "{}", done.err().unwrap_or_default());
        return;
    }
    let seeds =
        env("TOOLRUNNER_DSIM_SEEDS").unwrap_or(if cfg!(debug_assertions) { 200 } else { 2_000 });
    let next = AtomicU64::new(0);
    let failures = Mutex::new(Vec::new());
    let total = Mutex::new(Simulated::default());
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..parallel {
            s.spawn(|| {
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= seeds {
                        break;
                    }
                    match play(seed) {
                        Ok((_, walk)) => {
                            let mut t = total.lock().expect("total");
                            t.steps += walk.steps;
                            t.effects += walk.effects;
                            t.unknown += walk.unknown;
                            t.restarts += walk.restarts;
                            t.crashes += walk.crashes;
                            t.lost += walk.lost;
                            t.decisions += walk.decisions;
                        }
                        Err(e) => failures.lock().expect("failures").push((seed, e)),
                    }
                }
            });
        }
    });
    let mut failures = failures.into_inner().expect("failures");
    failures.sort();
    for (_, e) in failures.iter().take(3) {
        println!("dsim: {e}");
    }
    println!(
        "dsim: {seeds} seeds in {:.1} s, {} failed",
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures[0].1);
    // The walks did reach what they are for.
    let t = total.into_inner().expect("total");
    println!(
        "dsim: {} inputs, {} effects, {} unknown outcomes, {} restarts and takeovers, {} crashes, {} lost answers, {} approval decisions",
        t.steps, t.effects, t.unknown, t.restarts, t.crashes, t.lost, t.decisions
    );
    if seeds >= 100 {
        for (what, n) in [
            ("effects", t.effects),
            ("unknown outcomes", t.unknown),
            ("restarts", t.restarts),
            ("crashes", t.crashes),
            ("lost answers", t.lost),
            ("approval decisions", t.decisions),
        ] {
            assert!(n > 0, "{seeds} seeds drew no {what}: the walk misses them");
        }
    }
}

/// A seed's trace is a function of the seed alone: the same run twice,
/// and on two threads at once, gives the same hash; another seed does not.
#[test]
fn a_seed_replays_bit_for_bit() {
    let first = run(7).expect("seed 7");
    assert_eq!(run(7).expect("seed 7 again"), first);
    let both = std::thread::scope(|s| {
        let a = s.spawn(|| run(7));
        let b = s.spawn(|| run(7));
        (a.join().expect("a"), b.join().expect("b"))
    });
    assert_eq!(both, (Ok(first.clone()), Ok(first.clone())));
    assert_ne!(run(8).expect("seed 8"), first);
}
