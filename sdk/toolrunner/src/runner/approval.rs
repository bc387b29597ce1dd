//! Calls that wait for a person's approval: the request stored before
//! anything is told, what a decision makes of the call, and the calls the
//! claimer passes over while nobody decided.
use std::collections::HashSet;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use toolrunner_protocol::wire::Assignment;

use super::checks::{AWAITS_APPROVAL, Refusal};
use crate::api::context::CallKey;
use crate::store::approvals::{ApprovalBook, ApprovalRow, Stored};
use crate::store::now;

/// What the model reads of a call an approver denied.
pub(crate) const DENIED: &str = "denied by an approver";
/// What the model reads of a call nobody approved in time.
pub(crate) const EXPIRED: &str = "approval expired";

/// The approval requests of an executor's store, and the calls that wait
/// for a decision (read again at most once a poll interval).
pub(crate) struct Waits {
    book: Option<Arc<dyn ApprovalBook>>,
    waiting: StdMutex<Waiting>,
}

#[derive(Default)]
struct Waiting {
    calls: HashSet<CallKey>,
    read_at: Option<Instant>,
}

impl Waits {
    /// Over `book` (`None`: a store that keeps no approvals; a call that
    /// needs one is refused).
    pub(crate) fn new(book: Option<Arc<dyn ApprovalBook>>) -> Waits {
        Waits {
            book,
            waiting: StdMutex::default(),
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the calls that wait for a decision again, if the last read is
    /// older than `every`: a decision takes effect within it.
    pub(crate) async fn refresh(&self, every: Duration) {
        let Some(book) = &self.book else { return };
        if self
            .waiting()
            .read_at
            .is_some_and(|at| at.elapsed() < every)
        {
            return;
        }
        match book.waiting(now()).await {
            Ok(calls) => {
                let mut w = self.waiting();
                w.calls = calls
                    .into_iter()
                    .map(|(run_id, call_id)| CallKey { run_id, call_id })
                    .collect();
                w.read_at = Some(Instant::now());
            }
            // The last read stands: a call found waiting again when claimed
            // is given back again.
            Err(e) => {
                tracing::debug!(error = %e, "reading the calls that wait for an approval failed")
            }
        }
    }

    /// Whether the call waits for a person's decision (not to be claimed).
    pub(crate) fn waits(&self, key: &CallKey) -> bool {
        self.waiting().calls.contains(key)
    }

    /// The authorizer asked for an approval of `asg` (`reason`, expiring
    /// after `window`): the request is stored (once per run, call and
    /// digest) before anything is told, and its decision answers. `Ok`:
    /// approved, the call goes on to `accepted`. Otherwise the refusal for
    /// sequence 0 (`forbidden`: denied, expired, closed), or
    /// [`AWAITS_APPROVAL`]: the claim goes back, the call waits.
    pub(crate) async fn consult(
        &self,
        executor_id: &str,
        asg: &Assignment,
        reason: &str,
        window: Duration,
    ) -> Result<(), Refusal> {
        let Some(book) = &self.book else {
            return Err((
                "forbidden",
                "this call needs a person's approval, and this executor's store keeps no approvals"
                    .to_owned(),
            ));
        };
        let asked_at = now();
        let window = chrono::TimeDelta::from_std(window)
            .unwrap_or(chrono::TimeDelta::MAX)
            .max(chrono::TimeDelta::milliseconds(1));
        let row = ApprovalRow {
            run_id: asg.run_id.clone(),
            call_id: asg.call_id.clone(),
            digest: asg.arguments_digest.clone(),
            tool: asg.tool_name.clone(),
            subject: asg.subject.clone(),
            agent_id: asg.agent_id.clone(),
            agent_version: asg.agent_version.clone(),
            arguments: asg.arguments.to_string(),
            reason: reason.to_owned(),
            executor_id: executor_id.to_owned(),
            asked_at,
            expires_at: asked_at
                .checked_add_signed(window)
                .unwrap_or(chrono::DateTime::<chrono::Utc>::MAX_UTC),
            state: Stored::Waiting,
            decided_by: None,
            note: None,
            decided_at: None,
            closed_why: None,
        };
        let key = CallKey {
            run_id: asg.run_id.clone(),
            call_id: asg.call_id.clone(),
        };
        let stored = match book.ask(&row).await {
            Ok(stored) => stored,
            Err(e) => {
                // Not stored: the claim goes back and the call is claimed
                // again later (nothing was told, nothing ran).
                tracing::warn!(error = %e, "the approval request could not be stored; the call is given back and asked again later");
                return Err((AWAITS_APPROVAL, reason.to_owned()));
            }
        };
        match stored.state {
            Stored::Approved => {
                tracing::info!(approver = ?stored.decided_by, "approved: the call goes on");
                Ok(())
            }
            Stored::Denied => Err(("forbidden", DENIED.to_owned())),
            Stored::Waiting if stored.expired_at(now()) => Err(("forbidden", EXPIRED.to_owned())),
            Stored::Waiting => {
                if stored.asked_at == asked_at {
                    tracing::info!(tool = %asg.tool_name, "waiting for a person's approval: the claim is given back");
                }
                self.waiting().calls.insert(key);
                Err((AWAITS_APPROVAL, stored.reason))
            }
            Stored::Closed => Err(("forbidden", "the approval request was closed".to_owned())),
        }
    }

    /// The call ended at the platform: its requests are closed (nothing
    /// will act on them).
    pub(crate) async fn close(&self, key: &CallKey, why: &str) {
        let Some(book) = &self.book else { return };
        self.waiting().calls.remove(key);
        if let Err(e) = book.close(&key.run_id, &key.call_id, why, now()).await {
            tracing::debug!(error = %e, "closing the call's approval requests failed");
        }
    }
}
