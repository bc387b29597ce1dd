//! Retention: calls settled for good leave the store after the retention
//! period (default 7 days), a small batch at a time, so that a store that
//! has run for a month costs what a new one does; so do the approval
//! requests nobody needs any more (a decision acted on, a request closed,
//! or one expired undecided, that long ago; a decision not yet acted on
//! stays).
use std::sync::Arc;
use std::time::Duration;

use super::super::Core;
use super::super::dispatch::{self, Work};

/// Calls deleted in one transaction: a few milliseconds of the writer.
const BATCH: u32 = 200;

/// How often the store is looked at when there is nothing to prune.
const EVERY: Duration = Duration::from_secs(30);

pub(crate) async fn retention_loop(core: Arc<Core>) {
    let Some(keep) = core.cfg.timing.retention else {
        return;
    };
    let keep = chrono::Duration::from_std(keep).unwrap_or(chrono::Duration::MAX);
    let mut first = true;
    loop {
        // A pass at the start (a store that was down a while is pruned
        // at once), then one every `EVERY`.
        if !std::mem::take(&mut first) {
            tokio::select! {
                _ = core.life.halted() => return,
                _ = tokio::time::sleep(EVERY) => {}
            }
        }
        loop {
            let before = crate::store::now()
                .checked_sub_signed(keep)
                .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
            let pruned = dispatch::done(&core, |done| Work::Prune {
                approvals: false,
                before,
                batch: BATCH,
                done,
            })
            .await;
            let Some(pruned) = pruned else { return };
            match pruned {
                Ok(n) if n >= u64::from(BATCH) => {
                    tracing::debug!(pruned = n, "pruned settled calls; more to go");
                    // Let the calls in flight commit in between.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok(n) => {
                    if n > 0 {
                        tracing::debug!(pruned = n, "pruned settled calls");
                    }
                    break;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "pruning settled calls failed; trying again later");
                    break;
                }
            }
        }
        if !prune_approvals(&core, keep).await {
            return;
        }
    }
}

/// The approval requests nobody needs any more since before the
/// retention period, a batch at a time; `false` once the executor stops.
async fn prune_approvals(core: &Arc<Core>, keep: chrono::Duration) -> bool {
    loop {
        let before = crate::store::now()
            .checked_sub_signed(keep)
            .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC);
        let pruned = dispatch::done(core, |done| Work::Prune {
            approvals: true,
            before,
            batch: BATCH,
            done,
        })
        .await;
        let Some(pruned) = pruned else { return false };
        match pruned {
            Ok(n) if n >= u64::from(BATCH) => {
                tracing::debug!(pruned = n, "pruned approval requests; more to go");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(n) => {
                if n > 0 {
                    tracing::debug!(pruned = n, "pruned approval requests");
                }
                return true;
            }
            Err(e) => {
                tracing::warn!(error = %e, "pruning approval requests failed; trying again later");
                return true;
            }
        }
    }
}
