//! Human tables and stable JSON.
use comfy_table::{Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;

use crate::Failure;

/// A table with a header row.
pub(crate) fn table(header: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_header(header.to_vec());
    for r in rows {
        t.add_row(r);
    }
    t.to_string()
}

/// Prints `value` as pretty JSON on stdout.
pub(crate) fn json<T: Serialize>(value: &T) -> crate::Outcome {
    let text = serde_json::to_string_pretty(value).map_err(|e| Failure::Usage(e.to_string()))?;
    println!("{text}");
    Ok(())
}

/// Splits `RUN_ID/CALL_ID`.
pub(crate) fn call_ref(s: &str) -> Result<(String, String), Failure> {
    match s.split_once('/') {
        Some((r, c)) if !r.is_empty() && !c.is_empty() => Ok((r.to_owned(), c.to_owned())),
        _ => Err(Failure::Usage(format!("{s:?} is not RUN_ID/CALL_ID"))),
    }
}

/// Opens a store for reading and guarded writes; the file must exist.
pub(crate) async fn open(db: &str) -> Result<toolrunner::Reconciler, Failure> {
    Ok(match store_at(db)? {
        StoreAt::Url(url) => toolrunner::Reconciler::open(url).await?,
        StoreAt::Path(path) => toolrunner::Reconciler::open_path(path).await?,
    })
}

/// The approval requests of the store `--db` names.
pub(crate) async fn open_approvals(db: &str) -> Result<toolrunner::Approvals, Failure> {
    Ok(match store_at(db)? {
        StoreAt::Url(url) => toolrunner::Approvals::open(url).await?,
        StoreAt::Path(path) => toolrunner::Approvals::open_path(path).await?,
    })
}

/// Where `--db` points: a URL, or a file taken literally.
enum StoreAt<'a> {
    Url(&'a str),
    Path(&'a std::path::Path),
}

/// A PostgreSQL URL, or an existing SQLite file (refused with what to pass
/// when there is none).
fn store_at(db: &str) -> Result<StoreAt<'_>, Failure> {
    if db.starts_with("postgres://") || db.starts_with("postgresql://") {
        return Ok(StoreAt::Url(db));
    }
    let path = db.strip_prefix("sqlite://").unwrap_or(db);
    if !std::path::Path::new(path).exists() {
        return Err(Failure::Usage(format!(
            "no executor store at {path}: pass --db PATH (or set TOOLRUNNER_DB)"
        )));
    }
    if db.starts_with("sqlite:") {
        return Ok(StoreAt::Url(db));
    }
    Ok(StoreAt::Path(std::path::Path::new(path)))
}

/// The `--db` flag shared by the store commands.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct DbArg {
    /// The executor's store (a path or a sqlite:// URL).
    #[arg(long, env = "TOOLRUNNER_DB", default_value = "toolrunner.db")]
    pub(crate) db: String,
}

/// `--base-url` and `--token` for commands that may talk to the platform.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct PlatformArgs {
    /// The platform (to deliver at once; otherwise a running executor does).
    #[arg(long, env = "TOOLRUNNER_BASE_URL")]
    pub(crate) base_url: Option<String>,
    /// Bearer token for the platform.
    #[arg(long, env = "TOOLRUNNER_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
}

impl PlatformArgs {
    /// Adds the platform to a reconciler when both flags are given.
    pub(crate) fn apply(
        &self,
        r: toolrunner::Reconciler,
    ) -> Result<toolrunner::Reconciler, Failure> {
        match (&self.base_url, &self.token) {
            (Some(url), Some(token)) => Ok(r.with_platform(url, token)?),
            (None, None) => Ok(r),
            _ => Err(Failure::Usage("--base-url and --token go together".into())),
        }
    }
}
