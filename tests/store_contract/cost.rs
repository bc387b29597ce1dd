//! Counts kept by triggers, the outbox summed without bodies, and settled
//! calls pruned after the retention period.

use anyhow::Result;
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{
    Attempt, Change, LocalCall, LocalState, OutboxReceipt, ReceiptStatus, Store,
};

use super::rows::{self, at};

const LONG_AGO: &str = "2026-01-01T00:00:00.000Z";

fn call(id: &str, state: LocalState, updated_at: &str) -> LocalCall {
    LocalCall {
        next_sequence: 2,
        created_at: at(LONG_AGO),
        updated_at: at(updated_at),
        ..rows::call(id, state, 0)
    }
}

fn receipt(
    call_id: &str,
    kind: ReceiptKind,
    sequence: u64,
    status: ReceiptStatus,
) -> OutboxReceipt {
    let id = format!("rcp_{call_id}_{sequence}");
    OutboxReceipt {
        created_at: at(LONG_AGO),
        ..rows::receipt(call_id, &id, kind, sequence, status)
    }
}

fn attempt(call_id: &str) -> Attempt {
    Attempt::seed(
        "run_1",
        call_id,
        &format!("op_{call_id}"),
        Some("exe"),
        Some(&format!("asg_{call_id}")),
        at(LONG_AGO),
    )
}

/// Only calls settled for good before the cut-off go, with everything kept
/// for them; a call waiting for reconciliation, a call with a receipt still
/// to send, a call with a state still to report and a recent call stay.
/// The counts by state follow every insert, change and deletion.
pub(crate) async fn prune_takes_only_calls_settled_for_good_before_the_cut_off(
    store: &dyn Store,
) -> Result<()> {
    let mut reported = call("reported", LocalState::Delivered, LONG_AGO);
    reported.report = Some(toolrunner::testing::store::PendingReport::PendingDelivery);
    store
        .commit(vec![
            Change::InsertCall(call("old_done", LocalState::Delivered, LONG_AGO)),
            Change::AddReceipt(receipt(
                "old_done",
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
            )),
            Change::AddReceipt(receipt(
                "old_done",
                ReceiptKind::Completed,
                1,
                ReceiptStatus::Delivered,
            )),
            Change::AddAttempt(attempt("old_done")),
            Change::InsertCall(call("old_refused", LocalState::Abandoned, LONG_AGO)),
            Change::InsertCall(call(
                "waiting",
                LocalState::ReconciliationRequired,
                LONG_AGO,
            )),
            Change::InsertCall(call("unsent", LocalState::Delivered, LONG_AGO)),
            Change::AddReceipt(receipt(
                "unsent",
                ReceiptKind::Progress,
                1,
                ReceiptStatus::Pending,
            )),
            Change::InsertCall(reported),
            Change::InsertCall(call(
                "recent",
                LocalState::Delivered,
                "2026-11-30T00:00:00.000Z",
            )),
            Change::InsertCall(call("running", LocalState::Running, LONG_AGO)),
        ])
        .await?;
    let counts = store.count_by_state().await?;
    assert_eq!(counts.get(&LocalState::Delivered), Some(&4));
    assert_eq!(counts.get(&LocalState::Running), Some(&1));

    // A cut-off after the old calls, before the recent one; a batch of one
    // leaves the second prunable call for the next batch.
    let cut = at("2026-06-01T00:00:00.000Z");
    assert_eq!(store.prune(cut, 1).await?, 1);
    assert_eq!(store.prune(cut, 10).await?, 1);
    assert_eq!(store.prune(cut, 10).await?, 0);

    for gone in ["old_done", "old_refused"] {
        assert!(store.call("run_1", gone).await?.is_none(), "{gone} stays");
        assert!(store.receipts("run_1", gone).await?.is_empty());
        assert!(store.events("run_1", gone).await?.is_empty());
        assert!(store.attempts("run_1", gone).await?.is_empty());
    }
    for kept in ["waiting", "unsent", "reported", "recent", "running"] {
        assert!(
            store.call("run_1", kept).await?.is_some(),
            "{kept} was pruned"
        );
    }
    let counts = store.count_by_state().await?;
    assert_eq!(counts.get(&LocalState::Delivered), Some(&3));
    assert_eq!(counts.get(&LocalState::Abandoned), None);
    assert_eq!(counts.get(&LocalState::ReconciliationRequired), Some(&1));

    // A change of state moves the count.
    let mut settled = call("running", LocalState::Settled, LONG_AGO);
    settled.version = 1;
    store
        .commit(vec![Change::UpdateCall {
            expect_version: 0,
            call: settled,
        }])
        .await?;
    let counts = store.count_by_state().await?;
    assert_eq!(counts.get(&LocalState::Running), None);
    assert_eq!(counts.get(&LocalState::Settled), Some(&1));
    Ok(())
}

/// The outbox summary counts every pending receipt and lists the calls to
/// deliver, leaving out a call whose only pending receipt is an `accepted`.
pub(crate) async fn the_outbox_summary_lists_what_waits_without_reading_bodies(
    store: &dyn Store,
) -> Result<()> {
    store
        .commit(vec![
            Change::InsertCall(call("a", LocalState::Settled, LONG_AGO)),
            Change::AddReceipt(receipt(
                "a",
                ReceiptKind::Completed,
                1,
                ReceiptStatus::Pending,
            )),
            Change::InsertCall(call("b", LocalState::Assigned, LONG_AGO)),
            Change::AddReceipt(receipt(
                "b",
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Pending,
            )),
            Change::InsertCall(call("c", LocalState::Delivered, LONG_AGO)),
            Change::AddReceipt(receipt(
                "c",
                ReceiptKind::Completed,
                1,
                ReceiptStatus::Delivered,
            )),
        ])
        .await?;
    let summary = store.outbox_summary().await?;
    assert_eq!(summary.pending, 2);
    assert_eq!(summary.calls, [("run_1".to_owned(), "a".to_owned())]);
    assert_eq!(summary.oldest, Some(at(LONG_AGO)));
    Ok(())
}

/// How each call ended (the kind of its latest final receipt), whether
/// asked one by one or for more calls than that at once, and every executor
/// id the calls were claimed by: what `calls list` and the console show.
pub(crate) async fn outcomes_and_executor_ids_are_read_as_stored(store: &dyn Store) -> Result<()> {
    assert_eq!(store.executor_ids().await?, Vec::<String>::new());
    let attempt = |id: &str, executor: Option<&str>| {
        Change::AddAttempt(Attempt::seed(
            "run_1",
            id,
            &format!("op_{id}"),
            executor,
            None,
            at(LONG_AGO),
        ))
    };
    store
        .commit(vec![
            Change::InsertCall(call("done", LocalState::Delivered, LONG_AGO)),
            Change::AddReceipt(receipt(
                "done",
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
            )),
            Change::AddReceipt(receipt(
                "done",
                ReceiptKind::Completed,
                1,
                ReceiptStatus::Delivered,
            )),
            Change::InsertCall(call("declined", LocalState::Delivered, LONG_AGO)),
            Change::AddReceipt(receipt(
                "declined",
                ReceiptKind::Failed,
                1,
                ReceiptStatus::Delivered,
            )),
            // An operator's later receipt wins over the first one.
            Change::InsertCall(call("resolved", LocalState::Settled, LONG_AGO)),
            Change::AddReceipt(receipt(
                "resolved",
                ReceiptKind::Completed,
                1,
                ReceiptStatus::Rejected,
            )),
            Change::AddReceipt(receipt(
                "resolved",
                ReceiptKind::Cancelled,
                2,
                ReceiptStatus::Pending,
            )),
            Change::InsertCall(call("running", LocalState::Running, LONG_AGO)),
            Change::AddReceipt(receipt(
                "running",
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
            )),
            attempt("done", Some("exe_b")),
            attempt("declined", Some("exe_a")),
            attempt("resolved", Some("exe_b")),
            attempt("running", None),
        ])
        .await?;
    let key = |id: &str| ("run_1".to_owned(), id.to_owned());
    let want = std::collections::HashMap::from([
        (key("done"), ReceiptKind::Completed),
        (key("declined"), ReceiptKind::Failed),
        (key("resolved"), ReceiptKind::Cancelled),
    ]);
    let asked: Vec<(String, String)> = ["done", "declined", "resolved", "running", "absent"]
        .into_iter()
        .map(key)
        .collect();
    assert_eq!(store.outcomes(&asked).await?, want, "one by one");
    // More calls than are looked up one by one: all final receipts at once.
    let many: Vec<(String, String)> = asked
        .iter()
        .cloned()
        .chain((0..100).map(|i| key(&format!("absent_{i}"))))
        .collect();
    assert_eq!(store.outcomes(&many).await?, want, "at once");
    // Only the calls asked for.
    assert_eq!(
        store.outcomes(&[key("declined")]).await?,
        std::collections::HashMap::from([(key("declined"), ReceiptKind::Failed)])
    );
    assert_eq!(store.executor_ids().await?, ["exe_a", "exe_b"]);
    Ok(())
}

/// Retention keeps what still needs a person, however old: a `rejected`
/// call (compensation may be due) and an `orphaned` call whose outcome was
/// unknown when the platform forgot it (timeline `orphaned_outcome_unknown`)
/// until an operator closes it (timeline `operator_closed`). An orphaned
/// call whose outcome was known goes.
pub(crate) async fn prune_keeps_what_needs_a_person(store: &dyn Store) -> Result<()> {
    let note = |id: &str, what: &str| Change::Note {
        run_id: "run_1".into(),
        call_id: id.into(),
        what: what.into(),
        detail: Some("evidence".into()),
    };
    store
        .commit(vec![
            Change::InsertCall(call("rejected", LocalState::Rejected, LONG_AGO)),
            Change::InsertCall(call("unknown", LocalState::Orphaned, LONG_AGO)),
            note("unknown", "orphaned_outcome_unknown"),
            Change::InsertCall(call("closed", LocalState::Orphaned, LONG_AGO)),
            note("closed", "orphaned_outcome_unknown"),
            note("closed", "operator_closed"),
            Change::InsertCall(call("known", LocalState::Orphaned, LONG_AGO)),
        ])
        .await?;
    let cut = at("2026-06-01T00:00:00.000Z");
    assert_eq!(store.prune(cut, 10).await?, 2);
    for gone in ["closed", "known"] {
        assert!(store.call("run_1", gone).await?.is_none(), "{gone} stays");
    }
    for kept in ["rejected", "unknown"] {
        assert!(
            store.call("run_1", kept).await?.is_some(),
            "{kept} was pruned"
        );
    }
    Ok(())
}

/// An operator closes an orphaned call whose outcome was unknown, with
/// evidence (through the `Reconciler`, as the CLI does): the close is in
/// the timeline, the call stays `orphaned` (nothing is sent), and
/// retention may then prune it. A call orphaned with a known outcome, a
/// call in another state and a call closed already are refused.
pub(crate) async fn an_operator_closes_an_unknown_outcome_orphaned_call(
    store: std::sync::Arc<dyn Store>,
) -> Result<()> {
    store
        .commit(vec![
            Change::InsertCall(call("unknown", LocalState::Orphaned, LONG_AGO)),
            Change::Note {
                run_id: "run_1".into(),
                call_id: "unknown".into(),
                what: "orphaned_outcome_unknown".into(),
                detail: None,
            },
            Change::InsertCall(call("known", LocalState::Orphaned, LONG_AGO)),
            Change::InsertCall(call(
                "waiting",
                LocalState::ReconciliationRequired,
                LONG_AGO,
            )),
        ])
        .await?;
    let reconciler = toolrunner::Reconciler::new(store.clone());
    // Evidence that names nobody or says nothing is refused before
    // anything is read or written.
    for blank in [
        toolrunner::Evidence::new(" ", "looked it up"),
        toolrunner::Evidence::new("ops", ""),
    ] {
        let closed = reconciler.close("run_1", "unknown", &blank).await;
        anyhow::ensure!(
            closed.as_ref().is_err_and(toolrunner::Error::is_refused),
            "blank evidence closed a call: {closed:?}"
        );
        let failed = toolrunner::Outcome::Failed {
            code: "declined".into(),
            message: "the bank declined".into(),
        };
        let resolved = reconciler.resolve("run_1", "waiting", failed, &blank).await;
        anyhow::ensure!(
            resolved.as_ref().is_err_and(toolrunner::Error::is_refused),
            "blank evidence resolved a call: {resolved:?}"
        );
    }
    let waiting = store
        .call("run_1", "waiting")
        .await?
        .ok_or_else(|| anyhow::anyhow!("the waiting call is kept"))?;
    anyhow::ensure!(waiting.state == LocalState::ReconciliationRequired);
    let evidence = toolrunner::Evidence::new("ops", "the provider has no charge for this key")
        .with_reference("TICKET-1");
    for refused in ["known", "waiting"] {
        let closed = reconciler.close("run_1", refused, &evidence).await;
        anyhow::ensure!(closed.is_err(), "{refused} was closed: {closed:?}");
    }
    // Kept however old, until closed.
    let cut = at("2026-06-01T00:00:00.000Z");
    store.prune(cut, 10).await?;
    anyhow::ensure!(store.call("run_1", "unknown").await?.is_some());
    reconciler.close("run_1", "unknown", &evidence).await?;
    let again = reconciler.close("run_1", "unknown", &evidence).await;
    anyhow::ensure!(
        again
            .as_ref()
            .is_err_and(|e| e.to_string().contains("closed already")),
        "a second close: {again:?}"
    );
    let events = store.events("run_1", "unknown").await?;
    anyhow::ensure!(
        events
            .iter()
            .any(|e| e.what() == "operator_closed"
                && e.detail().is_some_and(|d| d.contains("TICKET-1"))),
        "the close is not in the timeline: {events:?}"
    );
    let row = store.call("run_1", "unknown").await?.expect("kept");
    anyhow::ensure!(
        row.state == LocalState::Orphaned,
        "the call is {}",
        row.state
    );
    // The retention period runs from the close (its last change).
    store.prune(at("2100-01-01T00:00:00.000Z"), 10).await?;
    anyhow::ensure!(
        store.call("run_1", "unknown").await?.is_none(),
        "the closed call was not pruned"
    );
    Ok(())
}

/// The version of the migration that marks the unknown-outcome orphans an
/// older version wrote (`…_unknown_outcome_orphans.sql`, on both stores).
pub(crate) const ORPHANS_MIGRATION: i64 = 20261204000029;

/// A directory holding the migrations of `backend` (`sqlite` or
/// `postgres`) that came before [`ORPHANS_MIGRATION`]: a store migrated
/// with them is a store an older version left.
pub(crate) fn older_migrations(backend: &str) -> Result<tempfile::TempDir> {
    let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("sdk/toolrunner/migrations")
        .join(backend);
    let dir = tempfile::tempdir()?;
    let mut copied = 0;
    for entry in std::fs::read_dir(&from)? {
        let path = entry?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        let version: Option<i64> = name.split('_').next().and_then(|v| v.parse().ok());
        if version.is_some_and(|v| v < ORPHANS_MIGRATION) {
            std::fs::copy(&path, dir.path().join(name))?;
            copied += 1;
        }
    }
    anyhow::ensure!(copied > 0, "no migrations in {}", from.display());
    Ok(dir)
}

/// The rows an older version wrote, as SQL on its schema (the same text
/// for SQLite and PostgreSQL): calls that went `orphaned` from various
/// states, with the timeline entries it wrote on the way (one named
/// after each new state). Versions before 0.1.0 wrote no
/// `orphaned_outcome_unknown` when a call went `orphaned` from
/// `reconciliation_required`.
pub(crate) fn older_orphans() -> Vec<String> {
    let call = |id: &str, state: &str| {
        format!(
            "INSERT INTO calls (run_id, call_id, tool_name, operation_key, state, assignment, next_sequence, reason, report, version, created_at, updated_at)
             VALUES ('run_1', '{id}', 't', 'op_{id}', '{state}', NULL, 1, 'the platform does not know the call', NULL, 5, '{LONG_AGO}', '{LONG_AGO}')"
        )
    };
    let timeline = |id: &str, entries: &[&str]| {
        entries
            .iter()
            .map(|what| {
                format!(
                    "INSERT INTO events (run_id, call_id, at, what, detail) VALUES ('run_1', '{id}', '{LONG_AGO}', '{what}', 'the platform does not know the call (400 unknown_call)')"
                )
            })
            .collect::<Vec<_>>()
    };
    let mut sql = Vec::new();
    // Orphaned while its outcome was unknown, by a version that did not
    // say so: kept until an operator closes it.
    sql.push(call("unknown", "orphaned"));
    sql.extend(timeline(
        "unknown",
        &[
            "claiming",
            "assigned",
            "running",
            "reconciliation_required",
            "reported",
            "orphaned",
        ],
    ));
    // Orphaned with a final receipt saved (its outcome known): pruned.
    sql.push(call("settled_first", "orphaned"));
    sql.extend(timeline(
        "settled_first",
        &[
            "claiming",
            "assigned",
            "running",
            "settled",
            "receipt completed orphaned",
            "orphaned",
        ],
    ));
    // Orphaned after its claim was given back (nothing ran): pruned.
    sql.push(call("released_first", "orphaned"));
    sql.extend(timeline(
        "released_first",
        &["claiming", "released", "orphaned"],
    ));
    // Orphaned from `reconciliation_required` by 0.1.0, which said so:
    // kept, and marked once.
    sql.push(call("marked", "orphaned"));
    sql.extend(timeline(
        "marked",
        &[
            "claiming",
            "reconciliation_required",
            "orphaned_outcome_unknown",
            "orphaned",
        ],
    ));
    // The same, closed by an operator: pruned.
    sql.push(call("closed", "orphaned"));
    sql.extend(timeline(
        "closed",
        &[
            "claiming",
            "reconciliation_required",
            "orphaned_outcome_unknown",
            "orphaned",
            "operator_closed",
        ],
    ));
    // Orphaned with no timeline to tell from where: the outcome is not
    // guessed, it is kept.
    sql.push(call("untold", "orphaned"));
    // Settled for good: pruned.
    sql.push(call("done", "delivered"));
    sql.extend(timeline("done", &["claiming", "settled", "delivered"]));
    sql
}

/// After the migration, retention keeps every orphaned call whose outcome
/// an older version left unknown (and one whose timeline cannot tell),
/// marked as the current version marks them (`orphaned_outcome_unknown`,
/// once), and prunes the orphaned calls whose outcome was known, as
/// before.
pub(crate) async fn retention_keeps_the_unknown_outcome_orphans_an_older_version_wrote(
    store: &dyn Store,
) -> Result<()> {
    let cut = at("2026-06-01T00:00:00.000Z");
    store.prune(cut, 100).await?;
    let mut kept = Vec::new();
    for id in [
        "unknown",
        "settled_first",
        "released_first",
        "marked",
        "closed",
        "untold",
        "done",
    ] {
        if store.call("run_1", id).await?.is_some() {
            kept.push(id);
        }
    }
    anyhow::ensure!(
        kept == ["unknown", "marked", "untold"],
        "retention kept {kept:?}, not the orphans whose outcome is unknown (unknown, marked, untold)"
    );
    for id in kept {
        let marks = store
            .events("run_1", id)
            .await?
            .into_iter()
            .filter(|e| e.what() == "orphaned_outcome_unknown")
            .count();
        anyhow::ensure!(marks == 1, "{id} is marked {marks} times");
    }
    Ok(())
}
