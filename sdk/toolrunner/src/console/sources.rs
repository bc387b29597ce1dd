//! The stores a console shows, each labelled with its identity: the ones
//! given, SQLite files (one per executor), and every executor identity of
//! a PostgreSQL database, found again as replicas come and go.
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::reconciler::Reconciler;

/// How long a list of a database's identities is used before it is read
/// again.
const REDISCOVER_AFTER: Duration = Duration::from_secs(5);

/// One executor's store, as the console shows it.
#[derive(Clone)]
pub(super) struct Source {
    /// The identity: the executor id, the file's name, or the given label.
    pub(super) label: String,
    /// The operator's API over its store.
    pub(super) reconciler: Arc<Reconciler>,
}

/// Every store of the console.
pub(super) struct Sources {
    fixed: Vec<Source>,
    databases: Vec<String>,
    platform: Option<(String, String)>,
    found: tokio::sync::Mutex<Found>,
}

/// The identities found on the PostgreSQL databases.
#[derive(Default)]
struct Found {
    sources: Vec<Source>,
    at: Option<Instant>,
}

impl Sources {
    /// Opens the stores given and the databases' (their identities now).
    pub(super) async fn open(
        stores: Vec<(String, Reconciler)>,
        databases: Vec<String>,
        platform: Option<(String, String)>,
    ) -> Result<Sources> {
        let mut fixed: Vec<Source> = stores
            .into_iter()
            .map(|(label, reconciler)| Source {
                label,
                reconciler: Arc::new(reconciler),
            })
            .collect();
        let mut postgres = Vec::new();
        for url in databases {
            if crate::store::is_postgres(&url) {
                postgres.push(url);
                continue;
            }
            let path = url.strip_prefix("sqlite://").unwrap_or(&url);
            let path = path.split('?').next().unwrap_or(path);
            if !std::path::Path::new(path).exists() {
                return Err(crate::error::Error::new(
                    crate::error::Kind::Builder,
                    format!(
                        "no executor store at {path}: give the store file of an executor (--db PATH)"
                    ),
                ));
            }
            let reconciler = with_platform(Reconciler::open(&sqlite_url(&url)).await?, &platform)?;
            let label = unique(&fixed, file_label(&url));
            fixed.push(Source {
                label,
                reconciler: Arc::new(reconciler),
            });
        }
        let sources = Sources {
            fixed,
            databases: postgres,
            platform,
            found: tokio::sync::Mutex::default(),
        };
        sources.all().await?;
        Ok(sources)
    }

    /// Every store, the databases' identities found again when the last
    /// look is older than a few seconds.
    ///
    /// # Errors
    /// A database cannot be reached, or a new identity's store opened.
    pub(super) async fn all(&self) -> Result<Vec<Source>> {
        let mut all = self.fixed.clone();
        if self.databases.is_empty() {
            return Ok(all);
        }
        let mut found = self.found.lock().await;
        if found.at.is_none_or(|at| at.elapsed() >= REDISCOVER_AFTER) {
            for url in &self.databases {
                for (id, schema) in Reconciler::identities(url).await? {
                    if found.sources.iter().any(|s| s.label == id) {
                        continue;
                    }
                    let reconciler = with_platform(
                        Reconciler::open_identity(url, &schema).await?,
                        &self.platform,
                    )?;
                    found.sources.push(Source {
                        label: unique(&self.fixed, id),
                        reconciler: Arc::new(reconciler),
                    });
                }
            }
            found.sources.sort_by(|a, b| a.label.cmp(&b.label));
            found.at = Some(Instant::now());
        }
        all.extend(found.sources.iter().cloned());
        Ok(all)
    }

    /// The stores shown as `identity`, or every store for none.
    pub(super) async fn only(&self, identity: Option<&str>) -> Result<Vec<Source>> {
        let all = self.all().await?;
        Ok(match identity.filter(|i| !i.is_empty()) {
            Some(label) => all.into_iter().filter(|s| s.label == label).collect(),
            None => all,
        })
    }
}

/// A reconciler that delivers to `platform`, when one is given.
fn with_platform(r: Reconciler, platform: &Option<(String, String)>) -> Result<Reconciler> {
    match platform {
        Some((url, token)) => r.with_platform(url, token),
        None => Ok(r),
    }
}

/// A SQLite store's URL: a path is taken as one.
fn sqlite_url(db: &str) -> String {
    if db.starts_with("sqlite:") {
        db.to_owned()
    } else {
        format!("sqlite://{db}")
    }
}

/// A SQLite store's label: its file name without the extension.
fn file_label(db: &str) -> String {
    let path = db.strip_prefix("sqlite://").unwrap_or(db);
    let path = path.split('?').next().unwrap_or(path);
    std::path::Path::new(path)
        .file_stem()
        .map_or_else(|| path.to_owned(), |s| s.to_string_lossy().into_owned())
}

/// `label`, or `label (2)`, `label (3)`, … when a store already has it.
fn unique(taken: &[Source], label: String) -> String {
    let used = |l: &str| taken.iter().any(|s| s.label == l);
    if !used(&label) {
        return label;
    }
    (2..)
        .map(|n| format!("{label} ({n})"))
        .find(|l| !used(l))
        .unwrap_or(label)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sqlite_store_is_labelled_by_its_file_name() {
        assert_eq!(file_label("/var/lib/a/exec-1.db"), "exec-1");
        assert_eq!(
            file_label("sqlite:///var/lib/a/exec-2.db?mode=rwc"),
            "exec-2"
        );
        assert_eq!(sqlite_url("/x/y.db"), "sqlite:///x/y.db");
        assert_eq!(sqlite_url("sqlite://y.db"), "sqlite://y.db");
    }
}
