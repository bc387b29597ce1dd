//! Once a second, the gauges and the health facts are published
//! (`runner/gauges.rs`, started by the dispatch queue).
use std::sync::Arc;
use std::time::Duration;

use super::super::Core;
use super::super::dispatch::{self, Work};

/// How often the store is probed and the gauges published.
const EVERY: Duration = Duration::from_secs(1);

/// Publishes until the executor ends (a drain included); the start
/// published once already.
pub(crate) async fn gauges_loop(core: Arc<Core>) {
    loop {
        tokio::select! {
            _ = core.life.halted() => return,
            _ = tokio::time::sleep(EVERY) => {}
        }
        dispatch::done(&core, |done| Work::Gauges { done }).await;
    }
}
