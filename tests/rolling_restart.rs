//! A rolling restart on SQLite: three `ledger` processes (each with a
//! store file of its own) serve one binding of an in-process development
//! platform under a steady stream of calls; each in turn is sent SIGTERM,
//! drains and exits 0, and is started again with the same executor id and
//! store, twice round. Every call completes, no effect happens twice, no
//! call waits for a lease to lapse, and the longest handover is printed
//! (the shared driver, `tests/support/rolling.rs`, says how each is told).
//!
//! `cargo test --test rolling_restart -- --nocapture` prints the figures.

#[path = "support/rolling.rs"]
mod rolling;

use std::path::PathBuf;

use anyhow::Result;
use toolrunner::testing::store::{SqliteStore, Store};

/// One store file per executor, in a directory of the test's own.
struct Sqlite {
    dir: PathBuf,
}

impl rolling::Backend for Sqlite {
    fn name(&self) -> &'static str {
        "sqlite"
    }

    fn db(&self, id: &str) -> String {
        self.dir.join(format!("{id}.db")).display().to_string()
    }

    /// A SQLite store has no identity lease: a restart opens the file at
    /// once (the shared checks of the platform's lease cover the rest).
    async fn drained(&self, _id: &str) -> Result<Option<String>> {
        Ok(None)
    }

    async fn store(&self, id: &str) -> Result<Box<dyn Store>> {
        Ok(Box::new(
            SqliteStore::open(&format!("sqlite://{}", self.db(id))).await?,
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_executors_restarted_in_turn_hand_every_call_over_on_sqlite() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let ids: Vec<String> = ["a", "b", "c"]
        .iter()
        .map(|n| format!("rolling-{n}"))
        .collect();
    let backend = Sqlite {
        dir: dir.path().to_owned(),
    };
    rolling::rolling_restart(&backend, &ids).await
}
