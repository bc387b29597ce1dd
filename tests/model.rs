//! Every interleaving of small worlds around the runner's call machine
//! (`toolrunner::testing::model`): the platform and store models, crashes
//! at every durable point, lost answers, a cancel, a lease expiry, a pause
//! and a takeover, an operator's resolve. Prints one line per world,
//! `model: WORLD: N states in S s`, and fails with the inputs that reach a
//! broken promise. `docs/simulation.md` lists the worlds and promises.

use toolrunner::testing::model::{explore, worlds};

/// More states than this is a world whose bounds are too loose.
const LIMIT: usize = 3_000_000;

#[test]
fn every_interleaving_of_the_small_worlds_keeps_the_promises() {
    let mut failures = Vec::new();
    for spec in worlds() {
        println!("model: {} — bounds: {}", spec.name, spec.bounds());
        match explore(&spec, LIMIT) {
            Ok(done) => println!(
                "model: {}: {} states in {:.1} s",
                spec.name, done.states, done.seconds
            ),
            Err(counterexample) => {
                println!("model: {}: FAILED: {counterexample}", spec.name);
                failures.push(format!("{}: {counterexample}", spec.name));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
