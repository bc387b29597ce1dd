//! The worlds `model` exhausts, each with its bounds, and the larger ones
//! `dsim` draws from a seed.

use super::world::{Budget, Shape};

/// A world: its calls, identities, processes and faults.
#[derive(Debug, Clone)]
pub struct WorldSpec {
    /// Its name, as `model` prints it.
    pub name: String,
    /// `(call, tool)`: `pay` is a write with a reconcile hook, `ship` a
    /// write whose hook runs it again when it did not happen, `book` a
    /// transactional tool, `refund` a write like `pay` whose every call
    /// needs a person's yes first.
    pub calls: Vec<(&'static str, &'static str)>,
    /// Executor identities.
    pub identities: usize,
    /// `(identity, database)` of each process; the first of each identity
    /// starts, the others take it over when it pauses or dies.
    pub procs: Vec<(usize, usize)>,
    /// Databases.
    pub dbs: usize,
    /// Faults it may inject.
    pub budget: Budget,
    /// The tools' concurrency limit in each store (`None`: none): a call
    /// is claimed only while its store holds fewer calls between their
    /// claim and the end of their drive.
    pub limit: Option<u32>,
}

impl WorldSpec {
    pub(crate) fn shape(&self) -> Shape {
        Shape {
            calls: self.calls.clone(),
            procs: self.procs.clone(),
            identities: self.identities,
            dbs: self.dbs,
            budget: self.budget.clone(),
            limit: self.limit,
        }
    }

    /// Its bounds, in one line.
    pub fn bounds(&self) -> String {
        let b = &self.budget;
        let limit = self
            .limit
            .map_or_else(String::new, |n| format!(", a concurrency limit of {n}"));
        format!(
            "calls {:?}, {} identities, processes {:?} (identity, database), {} databases{limit}; at most {} crashes, {} lost answers, {} cancels, {} lease expiries, {} pauses, {} operator resolves, {} decisions of a person",
            self.calls,
            self.identities,
            self.procs,
            self.dbs,
            b.crashes,
            b.lost,
            b.cancels,
            b.expiries,
            b.pauses,
            b.resolves,
            b.decisions
        )
    }

    /// A larger world drawn from `seed`: up to four calls, three
    /// identities, a pair of processes sharing an identity, every fault.
    pub(crate) fn drawn(seed: u64) -> WorldSpec {
        let pick = |shift: u32, n: u64| ((seed >> shift) % n) as usize;
        let tools = ["pay", "book", "ship"];
        let names = ["c1", "c2", "c3", "c4"];
        let mut calls: Vec<(&'static str, &'static str)> = (0..1 + pick(0, 4))
            .map(|i| (names[i], tools[pick(8 + 4 * i as u32, 3)]))
            .collect();
        // A quarter of the seeds: the first call needs a person's yes.
        if pick(50, 4) == 0 {
            calls[0].1 = "refund";
        }
        let identities = 1 + pick(32, 3);
        let mut procs: Vec<(usize, usize)> = (0..identities).map(|i| (i, i)).collect();
        if pick(36, 2) == 1 {
            procs.push((0, 0));
        }
        let dbs = identities;
        // Half of the seeds limit the tools to one or two calls a store.
        let limit = (pick(44, 2) == 1).then(|| 1 + pick(46, 2) as u32);
        WorldSpec {
            name: format!("drawn {seed:#x}"),
            calls,
            identities,
            procs,
            dbs,
            limit,
            budget: Budget {
                crashes: 3,
                lost: 4,
                cancels: pick(40, 2) as u8,
                expiries: 2,
                pauses: 2,
                resolves: 2,
                decisions: 2,
            },
        }
    }
}

/// The worlds `model` exhausts: small in a debug build, larger in release.
pub fn worlds() -> Vec<WorldSpec> {
    let full = !cfg!(debug_assertions);
    let one = |name: &str, calls, budget| WorldSpec {
        name: name.to_owned(),
        calls,
        identities: 1,
        procs: vec![(0, 0)],
        dbs: 1,
        budget,
        limit: None,
    };
    let faults = Budget {
        crashes: 1 + u8::from(full),
        lost: 1,
        cancels: 1,
        expiries: 1,
        pauses: 0,
        resolves: 1,
        decisions: 0,
    };
    vec![
        one("one write call", vec![("c1", "pay")], faults.clone()),
        one(
            "one write call whose hook runs it again",
            vec![("c1", "ship")],
            faults.clone(),
        ),
        one(
            "one transactional call",
            vec![("c1", "book")],
            faults.clone(),
        ),
        one(
            "two calls",
            vec![("c1", "pay"), ("c2", "book")],
            // Lost answers are in every world above; here two calls
            // interleave around a crash.
            Budget {
                crashes: u8::from(full),
                ..Budget::default()
            },
        ),
        WorldSpec {
            // Two calls of one tool with a limit of one: the second waits
            // for the first's slot, claimed only once the first is done or
            // left for reconciliation (and a re-run its hook allows takes
            // its slot whatever the count).
            limit: Some(1),
            ..one(
                "two calls, one slot",
                vec![("c1", "ship"), ("c2", "ship")],
                Budget {
                    crashes: 1,
                    lost: 1,
                    resolves: u8::from(full),
                    ..Budget::default()
                },
            )
        },
        WorldSpec {
            name: "two identities".into(),
            calls: vec![("c1", "pay")],
            identities: 2,
            procs: vec![(0, 0), (1, 1)],
            dbs: 2,
            limit: None,
            // A crash is in every world above; here the other identity
            // claims what one's lapse released.
            budget: Budget {
                crashes: u8::from(!full),
                lost: u8::from(full),
                expiries: u8::from(full),
                ..Budget::default()
            },
        },
        WorldSpec {
            name: "a pause and a takeover".into(),
            calls: vec![("c1", "pay")],
            identities: 1,
            procs: vec![(0, 0), (0, 0)],
            dbs: 1,
            limit: None,
            budget: Budget {
                crashes: 1,
                lost: u8::from(full),
                pauses: 1,
                resolves: 1,
                ..Budget::default()
            },
        },
        // A call that needs a person's yes (issue 34): asked and given back,
        // then approved, denied or left to expire, while the process runs,
        // crashes or is down; approved, it runs once.
        one(
            "one call that needs a person",
            vec![("c1", "refund")],
            Budget {
                decisions: 1,
                ..faults.clone()
            },
        ),
        WorldSpec {
            // Two executors on two databases: each asks in its own store,
            // and a person decides each request (or lets it expire).
            name: "a call that needs a person, two databases".into(),
            calls: vec![("c1", "refund")],
            identities: 2,
            procs: vec![(0, 0), (1, 1)],
            dbs: 2,
            limit: None,
            budget: Budget {
                crashes: u8::from(full),
                decisions: 1,
                ..Budget::default()
            },
        },
        WorldSpec {
            name: "a takeover of a call whose hook runs it again".into(),
            calls: vec![("c1", "ship")],
            identities: 1,
            procs: vec![(0, 0), (0, 0)],
            dbs: 1,
            limit: None,
            budget: Budget {
                pauses: 1,
                crashes: 1,
                lost: u8::from(full),
                cancels: u8::from(full),
                ..Budget::default()
            },
        },
    ]
}
