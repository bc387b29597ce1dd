//! The store's own rules: a call row changes only as a compare-and-set on
//! its version, and rows that must never exist are refused.

use anyhow::Result;

use super::rows;
use crate::store_contract;

/// A decision taken on an old snapshot is never written: the second writer
/// of version 0 is refused, and the row stays as the first wrote it (this
/// is what once let a progress receipt undo an operator's resolve, and a
/// report undo a sequence increment).
#[tokio::test]
async fn a_change_decided_on_an_old_version_is_refused() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::a_change_decided_on_an_old_version_is_refused(&store).await
}

/// The schema refuses what must never exist, whoever writes it.
#[tokio::test]
async fn impossible_receipts_are_refused() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::impossible_receipts_are_refused(&store).await
}

/// Free text holding NUL characters is stored (each shown as `␀`).
#[tokio::test]
async fn text_with_nul_characters_is_stored() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    store_contract::text_with_nul_characters_is_stored(&store).await
}
