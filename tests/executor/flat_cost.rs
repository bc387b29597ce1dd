//! The store's cost stays flat as it grows: counts kept by triggers, the
//! outbox summed without bodies, and settled calls pruned after the
//! retention period.

use anyhow::Result;

use super::rows;
use crate::store_contract;

/// Only calls settled for good before the cut-off go, with everything kept
/// for them; a call waiting for reconciliation, a call with a receipt still
/// to send, a call with a state still to report and a recent call stay.
/// The counts by state follow every insert, change and deletion.
#[tokio::test]
async fn prune_takes_only_calls_settled_for_good_before_the_cut_off() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::prune_takes_only_calls_settled_for_good_before_the_cut_off(&store).await
}

/// The outbox summary counts every pending receipt and lists the calls to
/// deliver, leaving out a call whose only pending receipt is an `accepted`.
#[tokio::test]
async fn the_outbox_summary_lists_what_waits_without_reading_bodies() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::the_outbox_summary_lists_what_waits_without_reading_bodies(&store).await
}

/// Retention keeps a `rejected` call and an unknown-outcome `orphaned`
/// one until an operator closes it.
#[tokio::test]
async fn prune_keeps_what_needs_a_person() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::prune_keeps_what_needs_a_person(&store).await
}

/// An operator closes an unknown-outcome orphaned call with evidence;
/// retention may then prune it.
#[tokio::test]
async fn an_operator_closes_an_unknown_outcome_orphaned_call() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::an_operator_closes_an_unknown_outcome_orphaned_call(std::sync::Arc::new(store))
        .await
}

/// How each call ended and which executors claimed them, read in one
/// query when many calls are asked for.
#[tokio::test]
async fn outcomes_and_executor_ids_are_read_as_stored() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::outcomes_and_executor_ids_are_read_as_stored(&store).await
}
