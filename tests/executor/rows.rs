//! Rows for the store's own tests (`store_rules`, `group_commit`,
//! `flat_cost`): those of the store contract, and a fresh SQLite store.

use anyhow::Result;
use toolrunner::testing::store::SqliteStore;

pub(crate) use crate::store_contract::rows::*;

/// A new store in a temporary directory (kept while the directory lives).
pub(crate) async fn store() -> Result<(tempfile::TempDir, SqliteStore)> {
    let dir = tempfile::tempdir()?;
    let store = SqliteStore::open_path(&dir.path().join("s.db")).await?;
    Ok((dir, store))
}
