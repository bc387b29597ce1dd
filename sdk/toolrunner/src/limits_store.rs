//! The tools' limits an operator keeps in a PostgreSQL store, for every
//! replica of its database (`toolrunner limits list | set`).
use std::sync::Arc;

use crate::Limits;
use crate::error::{Error, Kind, Result};
use crate::store::flow::{Caps, SharedFlow};

/// The flow limits a PostgreSQL store holds: each one there takes the
/// place of the same limit from the processes' code and configuration
/// (read again by every replica within about a second), and each tool's
/// use now.
///
/// On SQLite a tool's limits are the process's alone (code, then
/// configuration): there is nothing to open.
pub struct StoredLimits {
    flow: Arc<dyn SharedFlow>,
}

impl std::fmt::Debug for StoredLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoredLimits").finish_non_exhaustive()
    }
}

/// One tool as the store holds it: the limits set there, and its use by
/// every replica now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolLimits {
    tool: String,
    stored: Limits,
    slots_in_use: u32,
    tokens_in_use: u32,
}

impl ToolLimits {
    /// The tool's name.
    pub fn tool(&self) -> &str {
        &self.tool
    }

    /// The limits set in the store (each unset one: the processes' own).
    pub fn stored(&self) -> Limits {
        self.stored
    }

    /// Slots held now, by every replica.
    pub fn slots_in_use(&self) -> u32 {
        self.slots_in_use
    }

    /// Rate tokens counting now (reserved, being sent, or sent in the
    /// last second), by every replica.
    pub fn tokens_in_use(&self) -> u32 {
        self.tokens_in_use
    }
}

fn caps(limits: Limits) -> Caps {
    Caps::of(limits.max_concurrency(), limits.max_rate())
}

impl StoredLimits {
    /// Opens the limits of the PostgreSQL database at `store_url`.
    ///
    /// # Errors
    /// A SQLite store (its limits are the process's: set them in code or
    /// configuration), a build without the `postgres` feature, or the
    /// database cannot be reached.
    pub async fn open(store_url: &str) -> Result<StoredLimits> {
        if !crate::store::is_postgres(store_url) {
            return Err(Error::new(
                Kind::Refused,
                "limits are kept in the store only on PostgreSQL, for every replica of the database; on SQLite they are the process's own: set them on the tool (`#[toolrunner::tool(concurrency = N, rate = N)]`) or with `ExecutorBuilder::limit`",
            ));
        }
        Ok(StoredLimits {
            flow: crate::store::open_shared_flow(store_url).await?,
        })
    }

    /// Every tool the database knows (one a limited process ran, or one
    /// an operator set), by name.
    ///
    /// # Errors
    /// The database failed.
    pub async fn list(&self) -> Result<Vec<ToolLimits>> {
        let rows = self.flow.list().await?;
        Ok(rows
            .into_iter()
            .map(|r| ToolLimits {
                tool: r.tool,
                stored: Limits::none().with(r.stored.concurrency, r.stored.rate),
                slots_in_use: r.slots,
                tokens_in_use: r.tokens,
            })
            .collect())
    }

    /// Sets `tool`'s limits in the store: each limit `limits` sets takes
    /// the place of the stored one (the others stay). Every replica applies
    /// it within about a second, without a restart.
    ///
    /// # Errors
    /// An empty tool name, a limit of zero (say at least 1), a per-key
    /// limit (kept in code with its key function), or the database failed.
    pub async fn set(&self, tool: &str, limits: Limits) -> Result<()> {
        if tool.is_empty() || tool.contains('\u{1f}') {
            return Err(Error::new(
                Kind::Refused,
                format!("{tool:?} is not a tool's name: name the tool as its definition does"),
            ));
        }
        if let Some(why) = limits.problem() {
            return Err(Error::new(Kind::Refused, format!("tool {tool}: {why}")));
        }
        if limits.max_per_key().is_some() {
            return Err(Error::new(
                Kind::Refused,
                format!(
                    "tool {tool}: a per-key limit is kept with its key function, in code (FnTool::concurrency_key), not in the store"
                ),
            ));
        }
        Ok(self.flow.set_limits(tool, caps(limits), false).await?)
    }

    /// Drops `tool`'s limits from the store: the processes' own apply
    /// again.
    ///
    /// # Errors
    /// The database failed.
    pub async fn clear(&self, tool: &str) -> Result<()> {
        Ok(self.flow.set_limits(tool, Caps::default(), true).await?)
    }
}
