//! Breadth-first search of every interleaving, and the seeded walk.
//!
//! A search of our own rather than `stateright`: the world is one plain
//! value with a successor function, a visited set of 128-bit fingerprints
//! of its `Debug` text and parent links for the counterexample are all it
//! needs, and `dsim` walks the very same successors at random.

use std::collections::{HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Instant;

use super::world::{Input, World};
use super::worlds::WorldSpec;

/// A world explored to the end.
#[derive(Debug, Clone)]
pub struct Explored {
    /// Distinct states visited.
    pub states: usize,
    /// Seconds taken.
    pub seconds: f64,
}

/// A promise broken, and how to get there.
#[derive(Debug, Clone)]
pub struct Counterexample {
    /// The promise, in words.
    pub broken: String,
    /// The inputs from the world's first state, in order.
    pub inputs: Vec<Input>,
    /// What the machines decided at each input (replayed from the start).
    pub commands: Vec<Vec<String>>,
}

impl Counterexample {
    fn new(spec: &WorldSpec, broken: String, inputs: Vec<Input>) -> Box<Counterexample> {
        let mut world = World::new(&spec.shape());
        world.journal.0.clear();
        let commands = inputs
            .iter()
            .map(|input| {
                let _ = world.apply(input);
                std::mem::take(&mut world.journal.0)
            })
            .collect();
        Box::new(Counterexample {
            broken,
            inputs,
            commands,
        })
    }
}

impl std::fmt::Display for Counterexample {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.inputs.len();
        writeln!(f, "{}; reached by {n} inputs:", self.broken)?;
        for (i, input) in self.inputs.iter().enumerate() {
            writeln!(f, "  {:>3}. {input:?}", i + 1)?;
            for command in self.commands.get(i).into_iter().flatten() {
                writeln!(f, "         -> {command}")?;
            }
        }
        Ok(())
    }
}

fn fingerprint(w: &World) -> u128 {
    let text = w.fingerprint();
    let half = |salt: u8| {
        let mut h = DefaultHasher::new();
        salt.hash(&mut h);
        text.hash(&mut h);
        h.finish()
    };
    (u128::from(half(1)) << 64) | u128::from(half(2))
}

/// Visits every state of the world `spec` can reach.
///
/// # Errors
/// The first broken promise found (a shortest path to it), or a world
/// larger than `limit` states.
pub fn explore(spec: &WorldSpec, limit: usize) -> Result<Explored, Box<Counterexample>> {
    let started = Instant::now();
    let first = World::new(&spec.shape());
    let mut seen = HashSet::from([fingerprint(&first)]);
    // Parent links: (parent node, the input that led here).
    let mut nodes: Vec<(usize, Option<Input>)> = vec![(0, None)];
    let mut queue = VecDeque::from([(first, 0usize)]);
    let path = |nodes: &[(usize, Option<Input>)], mut at: usize, last: Option<Input>| {
        let mut inputs: Vec<Input> = last.into_iter().collect();
        while let (parent, Some(input)) = &nodes[at] {
            inputs.push(input.clone());
            at = *parent;
        }
        inputs.reverse();
        inputs
    };
    while let Some((world, node)) = queue.pop_front() {
        let here = fingerprint(&world);
        let mut moved = false;
        for input in world.inputs() {
            let mut next = world.clone();
            if let Err(broken) = next.apply(&input) {
                return Err(Counterexample::new(
                    spec,
                    broken,
                    path(&nodes, node, Some(input)),
                ));
            }
            let print = fingerprint(&next);
            if print == here {
                continue;
            }
            // At rest: nothing but a fault changes the world.
            moved |= !input.is_fault();
            if seen.insert(print) {
                if seen.len() > limit {
                    return Err(Counterexample::new(
                        spec,
                        format!("more than {limit} states: tighten the world's bounds"),
                        Vec::new(),
                    ));
                }
                nodes.push((node, Some(input)));
                queue.push_back((next, nodes.len() - 1));
            }
        }
        if !moved && let Err(broken) = world.check_quiet() {
            return Err(Counterexample::new(spec, broken, path(&nodes, node, None)));
        }
    }
    Ok(Explored {
        states: seen.len(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// One seeded walk, and what happened in it.
#[derive(Debug, Clone, Default)]
pub struct Simulated {
    /// Inputs applied.
    pub steps: usize,
    /// Effects that happened.
    pub effects: usize,
    /// Outcomes found unknown (a write call resumed after `accepted`).
    pub unknown: usize,
    /// Processes started after the first start (restarts, takeovers).
    pub restarts: usize,
    /// Crashes.
    pub crashes: usize,
    /// Answers lost.
    pub lost: usize,
    /// Approval requests a person decided (approved or denied; an
    /// expiry is not counted).
    pub decisions: usize,
}

impl Simulated {
    fn count(&mut self, input: &Input, commands: &[String]) {
        self.steps += 1;
        match input {
            Input::Start(_) => self.restarts += 1,
            Input::Crash(_) => self.crashes += 1,
            Input::Step { lost: true, .. } => self.lost += 1,
            Input::Decide {
                to: super::world::Asked::Approved | super::world::Asked::Denied,
                ..
            } => self.decisions += 1,
            _ => {}
        }
        for c in commands {
            self.effects += usize::from(c.ends_with("the effect happens"));
            self.unknown += usize::from(c.contains("OutcomeUnknown") && c.ends_with("Ok(())"));
        }
    }
}

/// SplitMix64: a seed's sequence is fixed by this code alone (no crate's
/// generator, whose stream may change between versions). The differential
/// test (`tests/model_platform.rs`) draws its sequences from it too.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next number of the sequence.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number below `n` (not 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Applies one input of a walk: its text and the commands it led to go to
/// the trace, in order, and the walk counts what happened.
fn step(
    world: &mut World,
    input: &Input,
    walk: &mut Simulated,
    trace: &mut dyn FnMut(&str),
) -> Result<(), String> {
    trace(&format!("{input:?}"));
    let done = world.apply(input);
    let commands: Vec<String> = world.journal.0.drain(..).collect();
    for command in &commands {
        trace(command);
    }
    walk.count(input, &commands);
    done
}

/// Walks a world drawn from `seed` at random, up to `max_steps` inputs,
/// handing `trace` the `Debug` text of every input and every command the
/// machines decided, in order.
///
/// # Errors
/// The broken promise and the inputs that led to it.
pub fn simulate(
    seed: u64,
    max_steps: usize,
    trace: &mut dyn FnMut(&str),
) -> Result<Simulated, Box<Counterexample>> {
    let mut rng = SplitMix(seed);
    let spec = WorldSpec::drawn(rng.next_u64());
    trace(&format!("{spec:?}"));
    let mut world = World::new(&spec.shape());
    let mut inputs = Vec::new();
    let mut walk = Simulated::default();
    for _ in 0..max_steps {
        let choices = world.inputs();
        if choices.is_empty() {
            break;
        }
        // A fault one time in sixteen, so that calls get far between them.
        let (faults, goes_on): (Vec<Input>, Vec<Input>) =
            choices.into_iter().partition(Input::is_fault);
        let pool = if !faults.is_empty() && (goes_on.is_empty() || rng.below(16) == 0) {
            faults
        } else {
            goes_on
        };
        let input = pool[rng.below(pool.len())].clone();
        if let Err(broken) = step(&mut world, &input, &mut walk, trace) {
            inputs.push(input);
            return Err(Counterexample::new(&spec, broken, inputs));
        }
        inputs.push(input);
    }
    // Then the faults stop and the world runs to rest: only inputs that
    // change it, until none does.
    world.budget = Default::default();
    let mut rest = false;
    for _ in 0..max_steps {
        let moving: Vec<Input> = world
            .inputs()
            .into_iter()
            .filter(|i| {
                let mut next = world.clone();
                next.apply(i).is_err() || next.fingerprint() != world.fingerprint()
            })
            .collect();
        if moving.is_empty() {
            if let Err(broken) = world.check_quiet() {
                return Err(Counterexample::new(&spec, broken, inputs));
            }
            rest = true;
            break;
        }
        let input = moving[rng.below(moving.len())].clone();
        if let Err(broken) = step(&mut world, &input, &mut walk, trace) {
            inputs.push(input);
            return Err(Counterexample::new(&spec, broken, inputs));
        }
        inputs.push(input);
    }
    if !rest {
        return Err(Counterexample::new(
            &spec,
            format!("no rest {max_steps} inputs after the last fault"),
            inputs,
        ));
    }
    Ok(walk)
}
