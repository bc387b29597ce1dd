//! Calls that wait for a person's approval: the request stored before
//! anything is told, what a decision makes of the call, and the calls the
//! claimer passes over while nobody decided.
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use toolrunner_protocol::wire::Assignment;

use super::checks::{AWAITS_APPROVAL, Refusal};
use crate::api::approval::{ApprovalRequest, EXPIRED_WHY};
use crate::api::authorizer::Authorizer;
use crate::api::context::CallKey;
use crate::store::approvals::{ApprovalBook, ApprovalRow, Stored};
use crate::store::{StoreError, Timestamp, now};

/// What the model reads of a call an approver denied.
pub(crate) const DENIED: &str = "denied by an approver";
/// What the model reads of a call nobody approved in time.
pub(crate) const EXPIRED: &str = "approval expired";

/// The latest expiry a request is stored with (a longer window is cut to
/// it): times are stored as text that compares in time order only with
/// four-digit years.
const LATEST_EXPIRY: &str = "9999-12-31T23:59:59.999Z";

/// How long the product's `on_approval_requested` may take to tell of one
/// request: a hook that hangs is given up (the request is told again
/// later) instead of keeping the request marked as being told for ever.
const TELL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long after a failed telling the requests not told are told again,
/// the first time; it doubles with each failure in a row, up to
/// [`RETELL_MAX`].
const RETELL_FIRST: Duration = Duration::from_secs(1);
const RETELL_MAX: Duration = Duration::from_secs(300);
/// How often the requests not told yet are looked for besides (those of
/// an asker that stopped before telling, on a shared book).
const UNTOLD_EVERY: Duration = Duration::from_secs(60);

impl Waiting {
    /// A telling failed: tell again later, after a wait that grows.
    fn telling_failed(&mut self) {
        let wait = RETELL_FIRST
            .saturating_mul(2u32.saturating_pow(self.failed_tellings.min(16)))
            .min(RETELL_MAX);
        self.failed_tellings = self.failed_tellings.saturating_add(1);
        self.retell = true;
        self.retell_after = Some(Instant::now() + wait);
    }
}

/// The approval requests of an executor's store, and the calls that wait
/// for a decision (read again at most once a poll interval).
pub(crate) struct Waits {
    book: Option<Arc<dyn ApprovalBook>>,
    /// Told of each request (`on_approval_requested`).
    authorizer: Arc<dyn Authorizer>,
    /// The identity that asks (and tells again what it asked).
    executor_id: String,
    waiting: Arc<StdMutex<Waiting>>,
}

#[derive(Default)]
struct Waiting {
    calls: HashSet<CallKey>,
    read_at: Option<Instant>,
    /// The requests being told now, by (run, call, digest).
    telling: HashSet<(String, String, String)>,
    /// The calls found waiting since the last read of the store, with
    /// when: kept through a read that began before they were found (it
    /// may have missed them), dropped by one that began after (it saw
    /// them, or their decision).
    fresh: HashMap<CallKey, Instant>,
    /// Whether this identity's requests not told yet are to be looked for
    /// (at the first read, and after a telling failed).
    retell: bool,
    /// After a telling failed: not before then (a hook that always
    /// fails is not called at every read).
    retell_after: Option<Instant>,
    /// When the requests not told yet were last looked for.
    looked_at: Option<Instant>,
    /// Tellings that failed in a row (each doubles the wait before the
    /// next, from [`RETELL_FIRST`] to [`RETELL_MAX`]).
    failed_tellings: u32,
    /// The decisions counted already (a call given back after its
    /// approval, by a flow limit, is consulted again: its decision is
    /// counted once), by (run, call, digest); forgotten past
    /// [`COUNTED_KEPT`].
    counted: HashSet<(String, String, String)>,
    /// The calls whose request's decision is being acted on (the digest),
    /// until what it made of the call is saved (see
    /// [`Waits::outcome_saved`]).
    acting: HashMap<CallKey, String>,
}

/// How many decisions [`Waiting::counted`] remembers before it starts
/// again (a decision consulted again after that is counted twice).
const COUNTED_KEPT: usize = 10_000;

impl Waits {
    /// Over `book` (`None`: a store that keeps no approvals; a call that
    /// needs one is refused).
    pub(crate) fn new(
        book: Option<Arc<dyn ApprovalBook>>,
        authorizer: Arc<dyn Authorizer>,
        executor_id: String,
    ) -> Waits {
        Waits {
            book,
            authorizer,
            executor_id,
            waiting: Arc::new(StdMutex::new(Waiting {
                retell: true,
                ..Waiting::default()
            })),
        }
    }

    /// Tells the product of `row` beside the call (the authorizer's
    /// `on_approval_requested`), then records it told; a request being
    /// told already is not told twice at once.
    fn tell(&self, book: &Arc<dyn ApprovalBook>, row: ApprovalRow) {
        let at = (row.run_id.clone(), row.call_id.clone(), row.digest.clone());
        if !self.waiting().telling.insert(at.clone()) {
            return;
        }
        let book = book.clone();
        let authorizer = self.authorizer.clone();
        let request = ApprovalRequest::of(row, now());
        let waiting = self.waiting.clone();
        tokio::spawn(async move {
            let mut retell = false;
            let told = tokio::time::timeout(
                TELL_TIMEOUT,
                super::unwind::catch(authorizer.on_approval_requested(&request)),
            )
            .await;
            match told {
                Err(_) => {
                    tracing::warn!(
                        timeout_s = TELL_TIMEOUT.as_secs(),
                        "on_approval_requested did not return in time; the request is told again later"
                    );
                    retell = true;
                }
                Ok(Ok(())) => {
                    if let Err(e) = book.told((&at.0, &at.1, &at.2), now()).await {
                        tracing::debug!(error = %e, "recording that the product was told of an approval request failed; it is told again");
                        retell = true;
                    }
                }
                Ok(Err(panic)) => {
                    tracing::error!(%panic, "on_approval_requested panicked; the request is told again later");
                    retell = true;
                }
            }
            let mut w = waiting.lock().unwrap_or_else(|e| e.into_inner());
            w.telling.remove(&at);
            if retell {
                w.telling_failed();
            } else {
                w.failed_tellings = 0;
            }
        });
    }

    /// Retention: deletes at most `limit` requests nobody needs any more
    /// since before `before` (a decision acted on, a request closed, or
    /// one expired undecided); how many.
    ///
    /// # Errors
    /// The database failed.
    pub(crate) async fn prune(&self, before: Timestamp, limit: u32) -> Result<u64, StoreError> {
        match &self.book {
            Some(book) => book.prune(before, limit).await,
            None => Ok(0),
        }
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads the calls that wait for a decision again, if the last read is
    /// older than `every`: a decision takes effect within it.
    pub(crate) async fn refresh(&self, every: Duration) {
        let Some(book) = &self.book else { return };
        let (read, retell) = {
            let mut w = self.waiting();
            if w.read_at.is_some_and(|at| at.elapsed() < every) {
                return;
            }
            // Nothing known to wait: the store is not asked (a call another
            // identity asked about is found waiting when claimed here).
            let read = w.read_at.is_none() || !w.calls.is_empty() || !w.fresh.is_empty();
            if !read {
                w.read_at = Some(Instant::now());
            }
            let due = w.retell_after.is_none_or(|after| Instant::now() >= after);
            let look = w.looked_at.is_none_or(|at| at.elapsed() >= UNTOLD_EVERY);
            let retell = due && (std::mem::take(&mut w.retell) || look);
            if retell {
                w.looked_at = Some(Instant::now());
            }
            (read, retell)
        };
        if retell {
            self.retell(book).await;
        }
        if !read {
            return;
        }
        let began = Instant::now();
        match book.waiting(now()).await {
            Ok(calls) => {
                let mut w = self.waiting();
                w.fresh.retain(|_, found| *found >= began);
                let fresh: Vec<CallKey> = w.fresh.keys().cloned().collect();
                w.calls = calls
                    .into_iter()
                    .map(|(run_id, call_id)| CallKey { run_id, call_id })
                    .chain(fresh)
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

    /// Tells again this identity's requests whose telling was not
    /// recorded (a crash between the two, a hook that panicked), and on a
    /// shared book those of an asker that stopped before telling.
    async fn retell(&self, book: &Arc<dyn ApprovalBook>) {
        match book.untold(&self.executor_id, now()).await {
            Ok(rows) => {
                for row in rows {
                    self.tell(book, row);
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "reading the approval requests not told yet failed");
                self.waiting().telling_failed();
            }
        }
    }

    /// Whether the call waits for a person's decision (not to be claimed).
    pub(crate) fn waits(&self, key: &CallKey) -> bool {
        self.waiting().calls.contains(key)
    }

    /// How many calls wait for a decision now (the claimer reads that many
    /// more candidates of `pending`, so that they never hide the others).
    pub(crate) fn waiting_now(&self) -> usize {
        self.waiting().calls.len()
    }

    /// The authorizer asked for an approval of `asg` (`reason`, expiring
    /// after `window`): the request is stored (once per run, call and
    /// digest) before anything is told, and its decision answers. `Ok`:
    /// approved, the call goes on to `accepted`. Otherwise the refusal for
    /// sequence 0 (`forbidden`: denied, expired, closed), or
    /// [`AWAITS_APPROVAL`]: the claim goes back, the call waits.
    pub(crate) async fn consult(
        &self,
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
        // Stored as text that compares in time order: four-digit years.
        let latest = chrono::DateTime::parse_from_rfc3339(LATEST_EXPIRY)
            .map(|t| t.with_timezone(&chrono::Utc))
            .unwrap_or(asked_at);
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
            executor_id: self.executor_id.clone(),
            asked_at,
            expires_at: asked_at
                .checked_add_signed(window)
                .map_or(latest, |t| t.min(latest)),
            state: Stored::Waiting,
            decided_by: None,
            note: None,
            decided_at: None,
            closed_why: None,
            notified_at: None,
        };
        let key = CallKey {
            run_id: asg.run_id.clone(),
            call_id: asg.call_id.clone(),
        };
        let stored = match book.ask(&row).await {
            Ok(stored) => stored,
            Err(e) => {
                // Not stored: the claim goes back (nothing was told,
                // nothing ran), and the call is passed over until a read
                // of the book succeeds: not claimed and given back at
                // every poll while the database is down.
                tracing::warn!(error = %e, "the approval request could not be stored; the call is given back and asked again once the store answers");
                self.passed_over(key);
                return Err((AWAITS_APPROVAL, reason.to_owned()));
            }
        };
        let at = (
            stored.run_id.clone(),
            stored.call_id.clone(),
            stored.digest.clone(),
        );
        let stored = if stored.expired_at(now()) {
            // Expired by this executor's clock: closed first (a
            // compare-and-set, so that no approver's decision lands after
            // the call is settled), or decided meanwhile: read again.
            match book.expire((&at.0, &at.1, &at.2), EXPIRED_WHY, now()).await {
                Ok(true) => {
                    self.acted(&stored, "expired");
                    return Err(("forbidden", EXPIRED.to_owned()));
                }
                Ok(false) => match book.of_call(&at.0, &at.1).await {
                    Ok(rows) => rows
                        .into_iter()
                        .find(|r| r.digest == at.2)
                        .unwrap_or(stored),
                    Err(_) => {
                        self.passed_over(key);
                        return Err((AWAITS_APPROVAL, reason.to_owned()));
                    }
                },
                // Nothing settled on a guess: asked again at the next claim
                // once the store answers.
                Err(_) => {
                    self.passed_over(key);
                    return Err((AWAITS_APPROVAL, reason.to_owned()));
                }
            }
        } else {
            stored
        };
        match stored.state {
            Stored::Approved => {
                tracing::info!(approver = ?stored.decided_by, "approved: the call goes on");
                self.acted(&stored, "approved");
                Ok(())
            }
            Stored::Denied => {
                self.acted(&stored, "denied");
                Err(("forbidden", DENIED.to_owned()))
            }
            Stored::Closed if stored.closed_why.as_deref() == Some(EXPIRED_WHY) => {
                self.acted(&stored, "expired");
                Err(("forbidden", EXPIRED.to_owned()))
            }
            // Its expiry passed by this clock, not yet by the one that
            // closes it: asked again at the next claim.
            Stored::Waiting if stored.expired_at(now()) => {
                Err((AWAITS_APPROVAL, reason.to_owned()))
            }
            Stored::Waiting => {
                if stored.asked_at == asked_at {
                    tracing::info!(tool = %asg.tool_name, "waiting for a person's approval: the claim is given back");
                    super::telemetry::approval_requested(&self.executor_id, &asg.tool_name);
                }
                self.passed_over(key);
                let reason = stored.reason.clone();
                if stored.notified_at.is_none() {
                    self.tell(book, stored);
                }
                Err((AWAITS_APPROVAL, reason))
            }
            Stored::Closed => Err(("forbidden", "the approval request was closed".to_owned())),
        }
    }

    /// The claimer passes the call over until a read of the book that
    /// begins after now finds it no longer waiting (while reads fail, the
    /// last one stands).
    fn passed_over(&self, key: CallKey) {
        let mut w = self.waiting();
        w.calls.insert(key.clone());
        w.fresh.insert(key, Instant::now());
    }

    /// Counts a decision acted on, and how long its request waited; the
    /// call's span says so.
    fn acted(&self, row: &ApprovalRow, decision: &'static str) {
        let waited = (now() - row.asked_at).num_milliseconds().max(0) as f64 / 1000.0;
        let first = {
            let mut w = self.waiting();
            if w.counted.len() >= COUNTED_KEPT {
                w.counted.clear();
            }
            if w.acting.len() >= COUNTED_KEPT {
                w.acting.clear();
            }
            w.acting.insert(
                CallKey {
                    run_id: row.run_id.clone(),
                    call_id: row.call_id.clone(),
                },
                row.digest.clone(),
            );
            w.counted
                .insert((row.run_id.clone(), row.call_id.clone(), row.digest.clone()))
        };
        if first {
            super::telemetry::approval_decided(&self.executor_id, &row.tool, decision, waited);
        }
        tracing::Span::current().record("toolrunner.approval", decision);
        tracing::info!(
            decision,
            waited_seconds = waited,
            "acting on a person's decision"
        );
    }

    /// What a decision made of the call (its `accepted`, or its `failed`
    /// at sequence 0) is confirmed by the platform (a saved one may still
    /// be refused, the call claimed again, and its request consulted
    /// again): the request is recorded acted on, and retention may take
    /// it once the period has passed. Until then it is kept, however old
    /// its decision: a decision not acted on is never deleted (nobody is
    /// asked again; a deny never turns into a new question). A failure to
    /// record it, or a crash before, only keeps the request longer.
    pub(crate) async fn outcome_saved(&self, key: &CallKey) {
        let Some(book) = &self.book else { return };
        let Some(digest) = self.waiting().acting.remove(key) else {
            return;
        };
        if let Err(e) = book
            .acted((&key.run_id, &key.call_id, &digest), now())
            .await
        {
            tracing::debug!(error = %e, "recording that a decision was acted on failed; its request is kept longer");
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::authorizer::AllowAll;
    use crate::store::SqliteStore;
    use crate::store::approvals::Verdict;

    /// A SQLite store's approval book, in a directory of its own.
    async fn book() -> (tempfile::TempDir, Arc<dyn ApprovalBook>) {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let store = SqliteStore::open_path(&dir.path().join("a.db"))
            .await
            .expect("a store");
        (dir, Arc::new(store.approvals()))
    }

    /// Approves `call_1`'s request as `alice`: whether it was recorded.
    async fn approve(book: &Arc<dyn ApprovalBook>) -> bool {
        book.decide(
            ("run_1", "call_1", "sha256:x"),
            Verdict::Approve,
            "alice",
            None,
            now(),
        )
        .await
        .expect("decided")
    }

    fn assignment(call_id: &str) -> Assignment {
        serde_json::from_value(serde_json::json!({
            "assignment_id": "asg_1", "run_id": "run_1", "call_id": call_id,
            "tool_name": "refunds.refund", "arguments": {"amount": 5}, "arguments_digest": "sha256:x",
            "grant": "grt_secret", "subject": "s", "agent_id": "agt_1", "agent_version": "agv_1",
            "binding_id": "bnd_1", "max_result_context_bytes": 16384,
            "input_schema": {"type": "object"}
        }))
        .expect("an assignment")
    }

    /// Counts the increments of one counter name (the rest is dropped).
    struct Counting {
        name: &'static str,
        count: Arc<std::sync::atomic::AtomicU64>,
    }

    struct Increments(Arc<std::sync::atomic::AtomicU64>);

    impl metrics::CounterFn for Increments {
        fn increment(&self, value: u64) {
            self.0.fetch_add(value, std::sync::atomic::Ordering::SeqCst);
        }

        fn absolute(&self, _value: u64) {}
    }

    impl metrics::Recorder for Counting {
        fn describe_counter(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_gauge(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }
        fn describe_histogram(
            &self,
            _: metrics::KeyName,
            _: Option<metrics::Unit>,
            _: metrics::SharedString,
        ) {
        }

        fn register_counter(
            &self,
            key: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Counter {
            if key.name() == self.name {
                metrics::Counter::from_arc(Arc::new(Increments(self.count.clone())))
            } else {
                metrics::Counter::noop()
            }
        }

        fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
            metrics::Gauge::noop()
        }

        fn register_histogram(
            &self,
            _: &metrics::Key,
            _: &metrics::Metadata<'_>,
        ) -> metrics::Histogram {
            metrics::Histogram::noop()
        }
    }

    /// A decision consulted again (the call given back after its
    /// approval, by a flow limit, and claimed again) is counted once.
    #[test]
    fn a_decision_consulted_twice_is_counted_once() {
        let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let recorder = Counting {
            name: crate::runner::telemetry::metric::APPROVALS_DECIDED,
            count: count.clone(),
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        metrics::with_local_recorder(&recorder, || {
            runtime.block_on(async {
                let (_dir, book) = book().await;
                let waits = Waits::new(Some(book.clone()), Arc::new(AllowAll), "exe_1".into());
                let asg = assignment("call_1");
                let window = Duration::from_secs(60);
                assert!(waits.consult(&asg, "over", window).await.is_err());
                assert!(approve(&book).await);
                assert_eq!(waits.consult(&asg, "over", window).await, Ok(()));
                assert_eq!(waits.consult(&asg, "over", window).await, Ok(()));
            });
        });
        assert_eq!(count.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    /// Tells of every request by panicking (the product's channel is
    /// down), counting its tries.
    struct PanicsTelling(Arc<std::sync::atomic::AtomicU32>);

    #[async_trait::async_trait]
    impl Authorizer for PanicsTelling {
        async fn authorize(
            &self,
            _request: &crate::AuthorizationRequest,
        ) -> Result<(), crate::Denied> {
            Ok(())
        }

        async fn on_approval_requested(&self, _request: &ApprovalRequest) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            panic!("the mail server is down");
        }
    }

    /// A telling that failed is tried again later, not at every read of
    /// the waiting calls (a hook that always fails is not called once a
    /// poll interval).
    #[tokio::test]
    async fn a_telling_that_failed_is_not_tried_again_at_once() {
        let (_dir, book) = book().await;
        let tries = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let waits = Waits::new(
            Some(book),
            Arc::new(PanicsTelling(tries.clone())),
            "exe_1".into(),
        );
        waits.refresh(Duration::ZERO).await;
        let asg = assignment("call_1");
        assert!(
            waits
                .consult(&asg, "over", Duration::from_secs(60))
                .await
                .is_err()
        );
        let told = || tries.load(std::sync::atomic::Ordering::SeqCst);
        for _ in 0..100 {
            if told() == 1 && waits.waiting().telling.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(told(), 1);
        for _ in 0..3 {
            waits.refresh(Duration::ZERO).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(told(), 1, "told again at once after a failed telling");
    }

    /// A decision made after the call was found waiting takes effect at
    /// the next read of the store (within one poll interval), not one
    /// read later.
    #[tokio::test]
    async fn a_decision_takes_effect_at_the_next_read() {
        let (_dir, book) = book().await;
        let waits = Waits::new(Some(book.clone()), Arc::new(AllowAll), "exe_1".into());
        // The first read, before anything waits.
        waits.refresh(Duration::ZERO).await;
        let asg = assignment("call_1");
        let asked = waits
            .consult(&asg, "over 1,000", Duration::from_secs(60))
            .await;
        assert_eq!(asked.map_err(|(code, _)| code), Err(AWAITS_APPROVAL));
        let key = CallKey {
            run_id: "run_1".into(),
            call_id: "call_1".into(),
        };
        assert!(waits.waits(&key), "found waiting when asked");
        assert!(approve(&book).await);
        waits.refresh(Duration::ZERO).await;
        assert!(
            !waits.waits(&key),
            "approved before the read began: the call is claimed again at once"
        );
    }

    /// A book whose database can be made to fail.
    struct Failing {
        inner: Arc<dyn ApprovalBook>,
        down: std::sync::atomic::AtomicBool,
    }

    impl Failing {
        fn check(&self) -> Result<(), StoreError> {
            if self.down.load(std::sync::atomic::Ordering::SeqCst) {
                Err(StoreError::Refused("the database is down".into()))
            } else {
                Ok(())
            }
        }
    }

    #[async_trait::async_trait]
    impl ApprovalBook for Failing {
        async fn ask(&self, row: &ApprovalRow) -> Result<ApprovalRow, StoreError> {
            self.check()?;
            self.inner.ask(row).await
        }
        async fn of_call(&self, run: &str, call: &str) -> Result<Vec<ApprovalRow>, StoreError> {
            self.check()?;
            self.inner.of_call(run, call).await
        }
        async fn list(&self) -> Result<Vec<ApprovalRow>, StoreError> {
            self.check()?;
            self.inner.list().await
        }
        async fn decide(
            &self,
            at: (&str, &str, &str),
            verdict: Verdict,
            who: &str,
            note: Option<&str>,
            now: Timestamp,
        ) -> Result<bool, StoreError> {
            self.check()?;
            self.inner.decide(at, verdict, who, note, now).await
        }
        async fn close(
            &self,
            run: &str,
            call: &str,
            why: &str,
            now: Timestamp,
        ) -> Result<(), StoreError> {
            self.check()?;
            self.inner.close(run, call, why, now).await
        }
        async fn expire(
            &self,
            at: (&str, &str, &str),
            why: &str,
            now: Timestamp,
        ) -> Result<bool, StoreError> {
            self.check()?;
            self.inner.expire(at, why, now).await
        }
        async fn told(&self, at: (&str, &str, &str), now: Timestamp) -> Result<(), StoreError> {
            self.check()?;
            self.inner.told(at, now).await
        }
        async fn untold(&self, id: &str, now: Timestamp) -> Result<Vec<ApprovalRow>, StoreError> {
            self.check()?;
            self.inner.untold(id, now).await
        }
        async fn waiting(&self, now: Timestamp) -> Result<Vec<(String, String)>, StoreError> {
            self.check()?;
            self.inner.waiting(now).await
        }
        async fn prune(&self, before: Timestamp, limit: u32) -> Result<u64, StoreError> {
            self.check()?;
            self.inner.prune(before, limit).await
        }
        async fn acted(&self, at: (&str, &str, &str), now: Timestamp) -> Result<(), StoreError> {
            self.check()?;
            self.inner.acted(at, now).await
        }
    }

    /// A request that cannot be stored (the database is down) leaves the
    /// call passed over while the database stays down, instead of claimed
    /// and given back at every poll; once a read succeeds, the call is
    /// claimed again and asked again.
    #[tokio::test]
    async fn a_request_that_cannot_be_stored_is_not_claimed_again_while_the_store_is_down() {
        let (_dir, inner) = book().await;
        let failing = Arc::new(Failing {
            inner,
            down: std::sync::atomic::AtomicBool::new(false),
        });
        let book: Arc<dyn ApprovalBook> = failing.clone();
        let waits = Waits::new(Some(book), Arc::new(AllowAll), "exe_1".into());
        waits.refresh(Duration::ZERO).await;
        failing
            .down
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let asked = waits
            .consult(&assignment("call_1"), "over 1,000", Duration::from_secs(60))
            .await;
        assert_eq!(asked.map_err(|(code, _)| code), Err(AWAITS_APPROVAL));
        let key = CallKey {
            run_id: "run_1".into(),
            call_id: "call_1".into(),
        };
        assert!(
            waits.waits(&key),
            "a call whose request could not be stored is claimed again at the next poll"
        );
        waits.refresh(Duration::ZERO).await;
        assert!(waits.waits(&key), "passed over while the store stays down");
        failing
            .down
            .store(false, std::sync::atomic::Ordering::SeqCst);
        waits.refresh(Duration::ZERO).await;
        assert!(
            !waits.waits(&key),
            "the store answers again: the call is claimed and asked again"
        );
    }

    /// A deny not yet acted on survives retention, however old: the call
    /// claimed again is refused `forbidden`, nobody is asked again. Once
    /// what it made of the call is saved, retention may take it.
    #[tokio::test]
    async fn a_decision_not_yet_acted_on_survives_retention() {
        let (_dir, book) = book().await;
        let waits = Waits::new(Some(book.clone()), Arc::new(AllowAll), "exe_1".into());
        let asg = assignment("call_1");
        let window = Duration::from_secs(60);
        assert!(waits.consult(&asg, "over", window).await.is_err());
        assert!(
            book.decide(
                ("run_1", "call_1", "sha256:x"),
                Verdict::Deny,
                "alice",
                None,
                now()
            )
            .await
            .expect("decided")
        );
        let long_after = now() + chrono::TimeDelta::days(400);
        assert_eq!(book.prune(long_after, 100).await.expect("pruned"), 0);
        let refused = waits.consult(&asg, "over", window).await;
        assert_eq!(refused, Err(("forbidden", DENIED.to_owned())));
        let key = CallKey {
            run_id: "run_1".into(),
            call_id: "call_1".into(),
        };
        waits.outcome_saved(&key).await;
        assert_eq!(book.prune(long_after, 100).await.expect("pruned"), 1);
    }
}
