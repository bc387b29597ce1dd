//! The operator console: server-rendered HTML pages over one or more
//! executor stores, with the [`Reconciler`]'s actions, as an axum
//! [`Router`] to mount in the product's own admin server behind its own
//! authentication (feature `console`). The `toolrunner console` command
//! serves the same router.
//!
//! | path | what |
//! |---|---|
//! | `GET /` | the overview: calls by state and by tool, receipts waiting, calls needing a person, per identity; each PostgreSQL database's flow limits (stored, and every replica's use) |
//! | `GET /calls?state=STATE` | the calls, filtered (`state`, `tool`, `identity`, `run`, `older_than`, `q`), sorted by age, paginated |
//! | `GET /calls/RUN_ID/CALL_ID` | one call: its timeline, arguments, result and operation key |
//! | `GET /outbox` | the receipts waiting: why, since when, attempts, last error |
//! | `GET /approvals` | the calls waiting for a person's yes (arguments, subject, reason, expiry), and the decisions made |
//! | `POST /approvals/RUN_ID/CALL_ID` | approve or deny the request shown (the approver's name and a note recorded) |
//! | `POST /calls/RUN_ID/CALL_ID/{resolve,compensated,close,redeliver}` | an action: a preview first, then sent on confirmation |
//! | `POST /outbox/redeliver` | a bulk redeliver by filter, its count previewed first |
//!
//! Every action asks for evidence and an operator's name, is written to
//! the call's timeline, and goes through the [`Reconciler`] (the CLI's
//! rules). Every POST needs the page's CSRF token (403 otherwise); with
//! [`read_only`](ConsoleBuilder::read_only) no action is shown and every
//! POST answers 403. With an [`auth_token`](ConsoleBuilder::auth_token)
//! every page needs it, as `Authorization: Bearer TOKEN` or once through
//! the login form (an `HttpOnly`, `SameSite=Strict` cookie).
//!
//! Who acts: behind the product's own authentication, its middleware puts
//! an [`Operator`] on each request (or an authenticating proxy sets the
//! header named by [`operator_header`](ConsoleBuilder::operator_header)),
//! and every action and approval records that operator; the forms ask
//! for no name. Without either, the operator is the name typed into the
//! form (a console on loopback, for one operator).
//!
//! ```no_run
//! # async fn demo() -> toolrunner::Result<()> {
//! use toolrunner::console::Console;
//! let console = Console::builder()
//!     .database("sqlite:///var/lib/app/toolrunner.db")
//!     .platform("https://platform.example", "…")
//!     .build()
//!     .await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8710").await.expect("bind");
//! axum::serve(listener, console.router()).await.expect("serve");
//! # Ok(()) }
//! ```

mod actions;
mod approvals;
mod html;
mod pages;
mod security;
mod sources;

use std::sync::Arc;

use axum::Router;
use axum::routing::{get, post};

use crate::approvals::ApproverCheck;
use crate::error::{Error, Kind, Result};
use crate::reconciler::Reconciler;
pub use security::Operator;
use security::Security;
use sources::Sources;

/// An operator console over executor stores: [`router`](Console::router)
/// serves it.
#[derive(Clone)]
pub struct Console {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Console {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Console")
            .field("read_only", &self.inner.read_only)
            .field("authenticates", &self.inner.security.authenticates())
            .finish_non_exhaustive()
    }
}

/// What every page and action reads.
struct Inner {
    sources: Sources,
    security: Security,
    read_only: bool,
    /// Who may decide an approval request (none: anyone who names
    /// themselves).
    approver_check: Option<Arc<dyn ApproverCheck>>,
}

/// Settings of a [`Console`]; [`build`](ConsoleBuilder::build) opens the
/// stores.
#[derive(Default)]
#[must_use]
pub struct ConsoleBuilder {
    stores: Vec<(String, Reconciler)>,
    databases: Vec<String>,
    platform: Option<(String, String)>,
    read_only: bool,
    auth_token: Option<String>,
    hosts: Vec<String>,
    approver_check: Option<Arc<dyn ApproverCheck>>,
    operator_header: Option<String>,
}

impl std::fmt::Debug for ConsoleBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleBuilder")
            .field("stores", &self.stores.len())
            .field("databases", &self.databases.len())
            .field("platform", &self.platform.as_ref().map(|(url, _)| url))
            .field("read_only", &self.read_only)
            .field("auth_token", &self.auth_token.as_ref().map(|_| "…"))
            .field("hosts", &self.hosts)
            .field("approver_check", &self.approver_check.is_some())
            .field("operator_header", &self.operator_header)
            .finish()
    }
}

impl Console {
    /// A console with no store yet.
    pub fn builder() -> ConsoleBuilder {
        ConsoleBuilder::default()
    }

    /// The pages and actions, as an axum [`Router`] (mount it at the root
    /// of a host or of a path of its own with `Router::nest`).
    pub fn router(&self) -> Router {
        let state = self.inner.clone();
        Router::new()
            .route("/", get(pages::overview))
            .route("/calls", get(pages::calls))
            .route("/calls/{run_id}/{call_id}", get(pages::call))
            .route("/outbox", get(pages::outbox))
            .route("/calls/{run_id}/{call_id}/resolve", post(actions::resolve))
            .route(
                "/calls/{run_id}/{call_id}/compensated",
                post(actions::compensated),
            )
            .route("/calls/{run_id}/{call_id}/close", post(actions::close))
            .route(
                "/calls/{run_id}/{call_id}/redeliver",
                post(actions::redeliver),
            )
            .route("/outbox/redeliver", post(actions::bulk_redeliver))
            .route("/approvals", get(approvals::page))
            .route("/approvals/{run_id}/{call_id}", post(approvals::decide))
            .route("/login", get(security::login_page).post(security::login))
            .route("/logout", post(security::logout))
            .fallback(pages::not_found)
            .layer(axum::middleware::from_fn_with_state(
                state.clone(),
                security::guard,
            ))
            .with_state(state)
    }
}

impl ConsoleBuilder {
    /// One executor's store, through its reconciler, shown as the identity
    /// `label`. A reconciler [`with_platform`](Reconciler::with_platform)
    /// delivers what the console's actions send; one without saves them
    /// for the running executor's outbox.
    pub fn store(mut self, label: impl Into<String>, reconciler: Reconciler) -> Self {
        self.stores.push((label.into(), reconciler));
        self
    }

    /// The store at a URL: a SQLite file (`sqlite://PATH` or a path; one
    /// per executor, shown by the executor id its calls were claimed by, or
    /// by its file name while it records none when the console starts), or
    /// a PostgreSQL database (`postgres://…`, feature `postgres`) with
    /// every executor identity on it, each shown by its executor id
    /// (identities that appear later show up on the next page).
    pub fn database(mut self, url: impl Into<String>) -> Self {
        self.databases.push(url.into());
        self
    }

    /// The platform the stores opened by [`database`](Self::database)
    /// deliver to (`base_url` and the executors' `token`), as the CLI's
    /// `--base-url` and `TOOLRUNNER_TOKEN`.
    pub fn platform(mut self, base_url: impl Into<String>, token: impl Into<String>) -> Self {
        self.platform = Some((base_url.into(), token.into()));
        self
    }

    /// Shows no action and answers every POST with 403. Default off.
    pub fn read_only(mut self, read_only: bool) -> Self {
        self.read_only = read_only;
        self
    }

    /// Every page needs this token: `Authorization: Bearer TOKEN`, or the
    /// login form once (a session cookie). Default none (for loopback, or
    /// behind the product's own authentication).
    pub fn auth_token(mut self, token: impl Into<String>) -> Self {
        self.auth_token = Some(token.into());
        self
    }

    /// A host name requests may name (the `Host` header, without its
    /// port), besides the others given; once one is given, only those.
    /// Without any: every host when an [`auth_token`](Self::auth_token) is
    /// set, and otherwise only `localhost`, `127.0.0.1` (and the rest of
    /// `127.0.0.0/8`) and `[::1]`, so that a site whose name was rebound
    /// to the loopback address cannot reach the console (DNS rebinding).
    /// A product that mounts the console behind its own authentication
    /// names its host here.
    pub fn allow_host(mut self, host: impl Into<String>) -> Self {
        self.hosts.push(host.into());
        self
    }

    /// Refuses the approvers `check` refuses on the approvals page (for
    /// example the call's own subject: four eyes), as
    /// [`Approvals::with_approver_check`](crate::Approvals::with_approver_check)
    /// does. Default none: anyone who names themselves decides.
    pub fn approver_check(mut self, check: impl ApproverCheck) -> Self {
        self.approver_check = Some(Arc::new(check));
        self
    }

    /// Takes the signed-in operator from the request header `name` (for
    /// example `X-Forwarded-User`) that an authenticating proxy in front
    /// of the console sets: every request must carry it (403 otherwise),
    /// and every action and approval records it as the operator; the forms
    /// ask for no name. Only for a console the proxy alone can reach (a
    /// client that reaches it directly could name anyone). An
    /// [`Operator`] the product put on the request is taken first.
    pub fn operator_header(mut self, name: impl Into<String>) -> Self {
        self.operator_header = Some(name.into());
        self
    }

    /// Opens the stores.
    ///
    /// # Errors
    /// No store was given, a store cannot be opened, a label is used
    /// twice, the token is blank, the operator header is not a header
    /// name, or the platform's client cannot be built.
    pub async fn build(self) -> Result<Console> {
        if self.stores.is_empty() && self.databases.is_empty() {
            return Err(Error::new(
                Kind::Builder,
                "the console has no store: give at least one (--db URL)",
            ));
        }
        if self
            .auth_token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(Error::new(
                Kind::Builder,
                "the console's auth token is blank: give a token, or none on loopback",
            ));
        }
        let operator_header = match &self.operator_header {
            None => None,
            Some(name) => Some(
                axum::http::HeaderName::try_from(name.trim()).map_err(|_| {
                    Error::new(
                        Kind::Builder,
                        format!("the console's operator header {name:?} is not a header name: give one such as X-Forwarded-User"),
                    )
                })?,
            ),
        };
        let sources = Sources::open(self.stores, self.databases, self.platform).await?;
        Ok(Console {
            inner: Arc::new(Inner {
                sources,
                security: Security::new(self.auth_token, self.hosts, operator_header),
                read_only: self.read_only,
                approver_check: self.approver_check,
            }),
        })
    }
}
