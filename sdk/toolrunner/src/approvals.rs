//! The approver's API over the store: the calls that wait for a person's
//! yes, and their decisions (`toolrunner approvals`, the console).
//!
//! A call whose authorizer answered [`Denied::needs_approval`] is given
//! back to the platform, nothing accepted and nothing run, and its request
//! waits here, bound to the run, the call and the arguments' digest. Once a
//! person approves it, an executor claims the call again and runs it (once,
//! whichever replica claims it); once denied, or expired, the call is
//! settled `failed` with code `forbidden`. A request is decided once: a
//! second approve changes nothing, an approve after a deny or an expiry is
//! refused.
//!
//! [`Denied::needs_approval`]: crate::Denied::needs_approval
use std::sync::Arc;

pub use crate::api::approval::{ApprovalRequest, ApprovalState};
use crate::error::{Error, Kind, Result};
use crate::store::approvals::{ApprovalBook, Stored, Verdict};
use crate::store::now;

/// What a decision did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Decision {
    /// This decision was recorded.
    Recorded,
    /// The same decision was recorded before (a second click): nothing
    /// changed.
    AlreadyMade,
}

/// Who may decide: a product's rule (four eyes: never the call's own
/// subject). Called before a decision is recorded.
pub trait ApproverCheck: Send + Sync + 'static {
    /// `Err(why)` refuses `approver` for `request`.
    ///
    /// # Errors
    /// The approver may not decide this request (the message says why).
    fn check(&self, request: &ApprovalRequest, approver: &str) -> std::result::Result<(), String>;
}

impl<F> ApproverCheck for F
where
    F: Fn(&ApprovalRequest, &str) -> std::result::Result<(), String> + Send + Sync + 'static,
{
    fn check(&self, request: &ApprovalRequest, approver: &str) -> std::result::Result<(), String> {
        self(request, approver)
    }
}

/// The approval requests of a store, to list and decide.
#[derive(Clone)]
pub struct Approvals {
    book: Arc<dyn ApprovalBook>,
    check: Option<Arc<dyn ApproverCheck>>,
}

impl std::fmt::Debug for Approvals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Approvals").finish_non_exhaustive()
    }
}

fn refused(message: impl Into<String>) -> Error {
    Error::new(Kind::Refused, message)
}

impl Approvals {
    /// Opens the approval requests of the store at `store_url` (a SQLite
    /// file's own; on PostgreSQL, those of every replica and identity of
    /// the database). Works beside a running executor.
    ///
    /// # Errors
    /// The store cannot be opened (or migrated), or a `postgres://` URL in
    /// a build without the `postgres` feature.
    pub async fn open(store_url: &str) -> Result<Approvals> {
        Ok(Approvals {
            book: crate::store::open_approvals(store_url).await?,
            check: None,
        })
    }

    /// Opens the approval requests of the SQLite store in the file at
    /// `path`, taken literally (no URL decoding).
    ///
    /// # Errors
    /// The store cannot be opened (or migrated).
    pub async fn open_path(path: &std::path::Path) -> Result<Approvals> {
        let store = crate::store::SqliteStore::open_path(path).await?;
        Ok(Approvals {
            book: Arc::new(store.approvals()),
            check: None,
        })
    }

    /// The requests of `book`, decided under `check` (the console's).
    #[cfg(feature = "console")]
    pub(crate) fn over(
        book: Arc<dyn ApprovalBook>,
        check: Option<Arc<dyn ApproverCheck>>,
    ) -> Approvals {
        Approvals { book, check }
    }

    /// Refuses approvers `check` refuses (for example the call's own
    /// subject: four eyes).
    #[must_use]
    pub fn with_approver_check(mut self, check: impl ApproverCheck) -> Approvals {
        self.check = Some(Arc::new(check));
        self
    }

    /// Every request, the newest first.
    ///
    /// # Errors
    /// The store failed.
    pub async fn list(&self) -> Result<Vec<ApprovalRequest>> {
        let now = now();
        Ok(self
            .book
            .list()
            .await?
            .into_iter()
            .map(|r| ApprovalRequest::of(r, now))
            .collect())
    }

    /// The call's request: the one waiting, else the newest (a call has
    /// one unless a request for other arguments was planted).
    ///
    /// # Errors
    /// No request for this call, or the store failed.
    pub async fn show(&self, run_id: &str, call_id: &str) -> Result<ApprovalRequest> {
        let now = now();
        let requests = self.book.of_call(run_id, call_id).await?;
        // The one still waiting first (a planted request for other
        // arguments is never the one decided for the call's own).
        let waiting = requests
            .iter()
            .position(|r| r.state == Stored::Waiting && !r.expired_at(now));
        requests
            .into_iter()
            .nth(waiting.unwrap_or(0))
            .map(|r| ApprovalRequest::of(r, now))
            .ok_or_else(|| refused(format!("no approval request for call {run_id}/{call_id}")))
    }

    /// Approves the call's request: an executor claims the call again
    /// within its poll interval and runs it once.
    ///
    /// # Errors
    /// No request for the call; it was denied, expired or closed (the
    /// message says which, by whom and when); the approver check refused
    /// `who`; `who` is empty; the store failed.
    pub async fn approve(
        &self,
        run_id: &str,
        call_id: &str,
        who: &str,
        note: Option<&str>,
    ) -> Result<Decision> {
        self.decide(run_id, call_id, None, Verdict::Approve, who, note)
            .await
    }

    /// Denies the call's request: an executor settles the call `failed`
    /// with code `forbidden` ("denied by an approver").
    ///
    /// # Errors
    /// As [`approve`](Self::approve), the other way round.
    pub async fn deny(
        &self,
        run_id: &str,
        call_id: &str,
        who: &str,
        note: Option<&str>,
    ) -> Result<Decision> {
        self.decide(run_id, call_id, None, Verdict::Deny, who, note)
            .await
    }

    /// Decides the call's request for the arguments whose digest is
    /// `shown` (the console's form): a request for other arguments is
    /// refused, never decided in its place.
    #[cfg(feature = "console")]
    pub(crate) async fn decide_shown(
        &self,
        (run_id, call_id, shown): (&str, &str, &str),
        verdict: Verdict,
        who: &str,
        note: Option<&str>,
    ) -> Result<Decision> {
        self.decide(run_id, call_id, Some(shown), verdict, who, note)
            .await
    }

    async fn decide(
        &self,
        run_id: &str,
        call_id: &str,
        shown: Option<&str>,
        verdict: Verdict,
        who: &str,
        note: Option<&str>,
    ) -> Result<Decision> {
        if who.trim().is_empty() {
            return Err(refused(
                "a decision names its approver: give a name (`--who NAME`)",
            ));
        }
        let request = self.show(run_id, call_id).await?;
        if let Some(shown) = shown
            && shown != request.digest
        {
            return Err(refused(format!(
                "the request of call {run_id}/{call_id} is not the one shown (its arguments' digest is {}, not {shown}): look at it again",
                request.digest
            )));
        }
        if let Some(check) = &self.check
            && let Err(why) = check.check(&request, who)
        {
            return Err(refused(format!("{who} may not decide this request: {why}")));
        }
        let at = (run_id, call_id, request.digest.as_str());
        if self.book.decide(at, verdict, who, note, now()).await? {
            return Ok(Decision::Recorded);
        }
        // Decided, expired or closed before: read how.
        let now = now();
        let stored = self
            .book
            .of_call(run_id, call_id)
            .await?
            .into_iter()
            .find(|r| r.digest == request.digest)
            .map(|r| ApprovalRequest::of(r, now))
            .ok_or_else(|| refused(format!("no approval request for call {run_id}/{call_id}")))?;
        let wanted = match verdict {
            Verdict::Approve => ApprovalState::Approved,
            Verdict::Deny => ApprovalState::Denied,
        };
        if stored.state == wanted {
            return Ok(Decision::AlreadyMade);
        }
        let by = stored
            .decided_by
            .as_deref()
            .map(|w| format!(" by {w}"))
            .unwrap_or_default();
        Err(refused(match stored.state {
            ApprovalState::Expired => format!(
                "the request of call {run_id}/{call_id} expired at {}: no decision can follow (the call is settled forbidden)",
                crate::store::rfc3339(&stored.expires_at)
            ),
            ApprovalState::Closed => format!(
                "the request of call {run_id}/{call_id} is closed ({}): nothing to decide",
                stored.closed_why.as_deref().unwrap_or("the call ended")
            ),
            other => format!(
                "the request of call {run_id}/{call_id} was {other}{by}: a decision is made once"
            ),
        }))
    }
}
