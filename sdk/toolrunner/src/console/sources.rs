//! The stores a console shows, each labelled with its identity: the ones
//! given, SQLite files (one per executor), and every executor identity of
//! a PostgreSQL database, found again as replicas come and go. A database
//! that cannot be reached, or an identity whose store went away, is a
//! problem the pages name; the other stores stay in view.
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::approvals::ApproverCheck;
use crate::error::{Error, Kind, Result};
use crate::reconciler::Reconciler;
use crate::store::approvals::ApprovalBook;

/// How long a list of a database's identities is used before it is read
/// again.
const REDISCOVER_AFTER: Duration = Duration::from_secs(5);
/// How long a look at a database's identities, or the opening of one's
/// store, may take.
const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(3);
/// How long one store's reads for a page may take: a database that does
/// not answer is named on the page instead of holding it up.
pub(super) const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// One executor's store, as the console shows it.
#[derive(Clone)]
pub(super) struct Source {
    /// The identity: the executor id (a SQLite file's: the id its calls
    /// were claimed by, or its file name while it has none), or the given
    /// label (unique among the console's stores).
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
    /// Each database's flow limits, opened at the first look.
    limits: tokio::sync::Mutex<Vec<Option<Arc<crate::StoredLimits>>>>,
    /// Each database's approval requests, opened at the first look.
    approvals: tokio::sync::Mutex<Vec<Option<Arc<dyn ApprovalBook>>>>,
}

/// One book of approval requests: a store's own (a SQLite file's), or a
/// PostgreSQL database's (every replica and identity of it shares one).
pub(super) struct Book {
    /// What the pages name it by: the store's label, or the database
    /// (named without its credentials).
    pub(super) name: String,
    /// Its requests, decided under the console's approver check.
    pub(super) approvals: crate::Approvals,
}

/// One database's tools as its flow limits show them.
pub(super) struct FlowOf {
    /// The database, named without its credentials.
    pub(super) database: String,
    /// Its tools, their stored limits and use.
    pub(super) tools: Vec<crate::ToolLimits>,
}

/// The identities found on the PostgreSQL databases.
#[derive(Default)]
struct Found {
    /// Each with the database it is on (its index) and its executor id.
    sources: Vec<(usize, String, Source)>,
    /// Why a database could not be looked at, by database.
    problems: Vec<String>,
    at: Option<Instant>,
}

/// The stores in view, and what could not be read.
pub(super) struct InView {
    /// The stores.
    pub(super) sources: Vec<Source>,
    /// What could not be read, in words (a database down, …).
    pub(super) problems: Vec<String>,
}

impl Sources {
    /// Opens the stores given and the databases' (their identities now).
    pub(super) async fn open(
        stores: Vec<(String, Reconciler)>,
        databases: Vec<String>,
        platform: Option<(String, String)>,
    ) -> Result<Sources> {
        let mut fixed: Vec<Source> = Vec::new();
        for (label, reconciler) in stores {
            if fixed.iter().any(|s| s.label == label) {
                return Err(Error::new(
                    Kind::Builder,
                    format!("two stores are labelled {label:?}: give each its own label"),
                ));
            }
            fixed.push(Source {
                label,
                reconciler: Arc::new(reconciler),
            });
        }
        let mut postgres: Vec<String> = Vec::new();
        let mut files: Vec<std::path::PathBuf> = Vec::new();
        for url in databases {
            if crate::store::is_postgres(&url) {
                // A database given twice is shown once.
                if !postgres.contains(&url) {
                    postgres.push(url);
                }
                continue;
            }
            let path = url.strip_prefix("sqlite://").unwrap_or(&url);
            let path = path.split('?').next().unwrap_or(path);
            // A file given twice (a path, then its URL) is shown once.
            if let Ok(real) = std::fs::canonicalize(path) {
                if files.contains(&real) {
                    continue;
                }
                files.push(real);
            }
            if !std::path::Path::new(path).exists() {
                return Err(Error::new(
                    Kind::Builder,
                    format!(
                        "no executor store at {path}: give the store file of an executor (--db PATH)"
                    ),
                ));
            }
            let reconciler = with_platform(Reconciler::open(&sqlite_url(&url)).await?, &platform)?;
            let ids = reconciler.executor_ids().await.unwrap_or_default();
            let label = unique(
                fixed.iter().map(|s| s.label.as_str()),
                store_label(&ids, &url),
            );
            fixed.push(Source {
                label,
                reconciler: Arc::new(reconciler),
            });
        }
        let sources = Sources {
            fixed,
            databases: postgres.clone(),
            platform,
            found: tokio::sync::Mutex::default(),
            limits: tokio::sync::Mutex::new(vec![None; postgres.len()]),
            approvals: tokio::sync::Mutex::new(vec![None; postgres.len()]),
        };
        // At start a database that cannot be read is a mistake to report.
        let first = sources.in_view().await;
        if let Some(problem) = first.problems.first() {
            return Err(Error::new(Kind::Store, problem.clone()));
        }
        Ok(sources)
    }

    /// Every store in view, the databases' identities looked at again when
    /// the last look is older than a few seconds (a new identity appears,
    /// one whose store is gone leaves), and what could not be read.
    pub(super) async fn in_view(&self) -> InView {
        let mut sources = self.fixed.clone();
        if self.databases.is_empty() {
            return InView {
                sources,
                problems: Vec::new(),
            };
        }
        let mut found = self.found.lock().await;
        if found.at.is_none_or(|at| at.elapsed() >= REDISCOVER_AFTER) {
            self.discover(&mut found).await;
            found.at = Some(Instant::now());
        }
        sources.extend(found.sources.iter().map(|(_, _, s)| s.clone()));
        InView {
            sources,
            problems: found.problems.clone(),
        }
    }

    /// Each PostgreSQL database's tools: the limits stored there and their
    /// use by every replica (SQLite stores keep no limits: those are each
    /// process's); and what could not be read.
    pub(super) async fn flow(&self) -> (Vec<FlowOf>, Vec<String>) {
        let mut opened = self.limits.lock().await;
        let (mut shown, mut problems) = (Vec::new(), Vec::new());
        for (db, url) in self.databases.iter().enumerate() {
            let database = describe(url);
            if opened[db].is_none() {
                match tokio::time::timeout(READ_TIMEOUT, crate::StoredLimits::open(url)).await {
                    Ok(Ok(limits)) => opened[db] = Some(Arc::new(limits)),
                    Ok(Err(e)) => {
                        problems.push(format!("the flow limits of {database}: {e}"));
                        continue;
                    }
                    Err(_) => {
                        problems.push(format!("the flow limits of {database}: no answer"));
                        continue;
                    }
                }
            }
            let Some(limits) = opened[db].clone() else {
                continue;
            };
            match tokio::time::timeout(READ_TIMEOUT, limits.list()).await {
                Ok(Ok(tools)) => shown.push(FlowOf { database, tools }),
                Ok(Err(e)) => problems.push(format!("the flow limits of {database}: {e}")),
                Err(_) => problems.push(format!("the flow limits of {database}: no answer")),
            }
        }
        (shown, problems)
    }

    /// The books of approval requests: each given store's and SQLite
    /// file's own, and each PostgreSQL database's (opened at the first
    /// look), decided under `check`; and what could not be opened.
    pub(super) async fn books(
        &self,
        check: Option<&Arc<dyn ApproverCheck>>,
    ) -> (Vec<Book>, Vec<String>) {
        let over = |book: Arc<dyn ApprovalBook>| crate::Approvals::over(book, check.cloned());
        let mut books: Vec<Book> = self
            .fixed
            .iter()
            .filter_map(|s| {
                s.reconciler.approval_book().map(|book| Book {
                    name: s.label.clone(),
                    approvals: over(book),
                })
            })
            .collect();
        let mut problems = Vec::new();
        let mut opened = self.approvals.lock().await;
        for (db, url) in self.databases.iter().enumerate() {
            let database = describe(url);
            if opened[db].is_none() {
                match tokio::time::timeout(READ_TIMEOUT, crate::store::open_approvals(url)).await {
                    Ok(Ok(book)) => opened[db] = Some(book),
                    Ok(Err(e)) => {
                        problems.push(format!("the approval requests of {database}: {e}"));
                        continue;
                    }
                    Err(_) => {
                        problems.push(format!("the approval requests of {database}: no answer"));
                        continue;
                    }
                }
            }
            if let Some(book) = opened[db].clone() {
                books.push(Book {
                    name: database,
                    approvals: over(book),
                });
            }
        }
        (books, problems)
    }

    /// Looks at each database's identities: opens the new ones, drops the
    /// ones whose store is gone; a database that does not answer keeps
    /// what was found on it before, and is a problem.
    async fn discover(&self, found: &mut Found) {
        found.problems.clear();
        for (db, url) in self.databases.iter().enumerate() {
            let listed =
                match tokio::time::timeout(DISCOVERY_TIMEOUT, Reconciler::identities(url)).await {
                    Ok(Ok(listed)) => listed,
                    Ok(Err(e)) => {
                        found.problems.push(format!(
                            "the database {} cannot be read: {e}",
                            describe(url)
                        ));
                        continue;
                    }
                    Err(_) => {
                        found.problems.push(format!(
                            "the database {} did not answer within {}s",
                            describe(url),
                            DISCOVERY_TIMEOUT.as_secs()
                        ));
                        continue;
                    }
                };
            found
                .sources
                .retain(|(d, id, _)| *d != db || listed.iter().any(|(l, _)| l == id));
            for (id, schema) in listed {
                if found.sources.iter().any(|(d, i, _)| *d == db && *i == id) {
                    continue;
                }
                let opened = tokio::time::timeout(
                    DISCOVERY_TIMEOUT,
                    Reconciler::open_identity(url, &schema),
                )
                .await
                .unwrap_or_else(|_| {
                    Err(Error::new(
                        Kind::Store,
                        format!("no answer within {}s", DISCOVERY_TIMEOUT.as_secs()),
                    ))
                });
                let reconciler = opened.and_then(|r| with_platform(r, &self.platform));
                match reconciler {
                    Ok(reconciler) => {
                        let taken = self
                            .fixed
                            .iter()
                            .map(|s| s.label.as_str())
                            .chain(found.sources.iter().map(|(_, _, s)| s.label.as_str()));
                        let label = unique(taken, id.clone());
                        found.sources.push((
                            db,
                            id,
                            Source {
                                label,
                                reconciler: Arc::new(reconciler),
                            },
                        ));
                    }
                    Err(e) => found
                        .problems
                        .push(format!("the store of {id} cannot be opened: {e}")),
                }
            }
        }
        found.sources.sort_by(|a, b| a.2.label.cmp(&b.2.label));
    }

    /// The labels of the stores in view, for a page's identity filter.
    pub(super) async fn labels(&self) -> Vec<String> {
        self.in_view()
            .await
            .sources
            .into_iter()
            .map(|s| s.label)
            .collect()
    }

    /// The stores in view shown as `identity` (every store for none).
    pub(super) async fn only(&self, identity: &str) -> InView {
        let mut view = self.in_view().await;
        if !identity.is_empty() {
            view.sources.retain(|s| s.label == identity);
        }
        view
    }
}

/// `read` on every store at once, each within a few seconds: the answers
/// by store, in the stores' order, and what could not be read.
pub(super) async fn each<T, F, Fut>(sources: &[Source], read: F) -> (Vec<(Source, T)>, Vec<String>)
where
    F: Fn(Source) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let reads = sources.iter().map(|source| {
        let read = read(source.clone());
        async move {
            let answer = tokio::time::timeout(READ_TIMEOUT, read).await;
            (source.clone(), answer)
        }
    });
    let mut answers = Vec::new();
    let mut problems = Vec::new();
    for (source, answer) in futures_util::future::join_all(reads).await {
        match answer {
            Ok(Ok(value)) => answers.push((source, value)),
            Ok(Err(e)) => {
                problems.push(format!("the store of {} cannot be read: {e}", source.label))
            }
            Err(_) => problems.push(format!(
                "the store of {} did not answer within {}s",
                source.label,
                READ_TIMEOUT.as_secs()
            )),
        }
    }
    (answers, problems)
}

/// A database's URL without its credentials or options, to name it.
fn describe(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, r)| r);
    rest.split('?').next().unwrap_or(rest).to_owned()
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

/// A SQLite store's label: the executor id(s) its calls were claimed by
/// (one store per executor: normally one), or its file name while it
/// records none.
fn store_label(executor_ids: &[String], db: &str) -> String {
    if executor_ids.is_empty() {
        file_label(db)
    } else {
        executor_ids.join(", ")
    }
}

/// A SQLite store's label when it records no executor id: its file name
/// without the extension.
fn file_label(db: &str) -> String {
    let path = db.strip_prefix("sqlite://").unwrap_or(db);
    let path = path.split('?').next().unwrap_or(path);
    std::path::Path::new(path)
        .file_stem()
        .map_or_else(|| path.to_owned(), |s| s.to_string_lossy().into_owned())
}

/// `label`, or `label (2)`, `label (3)`, … when one of `taken` has it.
fn unique<'a>(taken: impl Iterator<Item = &'a str> + Clone, label: String) -> String {
    let used = |l: &str| taken.clone().any(|t| t == l);
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
    fn a_sqlite_store_is_labelled_by_its_executor_ids_else_its_file_name() {
        assert_eq!(
            store_label(&["exe-a".into()], "/var/lib/a/exec-1.db"),
            "exe-a"
        );
        assert_eq!(
            store_label(&["exe-a".into(), "exe-b".into()], "/var/lib/a/exec-1.db"),
            "exe-a, exe-b"
        );
        assert_eq!(store_label(&[], "/var/lib/a/exec-1.db"), "exec-1");
    }

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

    #[test]
    fn a_database_is_named_without_its_credentials() {
        assert_eq!(
            describe("postgres://app:s3cret@db.internal:5432/ops?sslmode=require"),
            "db.internal:5432/ops"
        );
        assert_eq!(describe("postgres://127.0.0.1/test"), "127.0.0.1/test");
    }

    #[test]
    fn a_label_taken_gets_a_number() {
        let taken = ["a", "a (2)", "b"];
        assert_eq!(unique(taken.iter().copied(), "a".into()), "a (3)");
        assert_eq!(unique(taken.iter().copied(), "c".into()), "c");
    }
}
