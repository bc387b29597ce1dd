//! The only writers of a call row: a transition planned on the stored row
//! and committed as a compare-and-set, in the store or in a handler's own
//! transaction.

use super::*;

/// How [`advance`] ended.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)] // short-lived, returned once per transition
pub(crate) enum Advanced {
    /// The transition is durable: the row as it now is, and the receipt it
    /// wrote, if any.
    Moved {
        call: LocalCall,
        receipt: Option<OutboxReceipt>,
    },
    /// Nothing to do (the decision said so, or the table refused the event
    /// from the stored state): the row as it is.
    Stayed(Option<LocalCall>),
}

/// Whether [`advance`] reads the call's receipts before deciding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reads {
    Row,
    RowAndReceipts,
    /// The receipts with a fresh row only: the decision on the caller's
    /// own row (see [`advance_from`]) does without them.
    ReceiptsUnlessKnown,
}

/// The only way a call row changes: reads the call, asks `decide` for the
/// event, plans it and commits it as a compare-and-set on the row's
/// version. When another writer changed the call first, it reads and
/// decides again; a decision is never written over a newer row.
///
/// # Errors
/// The store failed (after retries with backoff for passing failures); the
/// call is then as the store last holds it.
pub(crate) async fn advance(
    store: &dyn Store,
    executor_id: &str,
    key: (&str, &str),
    reads: Reads,
    decide: impl FnMut(&Snapshot) -> Option<Event>,
) -> Result<Advanced, StoreError> {
    advance_from(store, executor_id, key, None, reads, decide).await
}

/// [`advance`] starting from the row as the caller last saw it (`known`;
/// `Some(None)`: the caller knows the call is not stored), which saves a
/// read. The known row is trusted only to write: the compare-and-set on its
/// version refuses it if the row moved on, and a decision not to move (or
/// one the table refuses) is taken again on a fresh read.
///
/// # Errors
/// As [`advance`].
pub(crate) async fn advance_from(
    store: &dyn Store,
    executor_id: &str,
    key: (&str, &str),
    known: Option<Option<LocalCall>>,
    reads: Reads,
    decide: impl FnMut(&Snapshot) -> Option<Event>,
) -> Result<Advanced, StoreError> {
    advance_then(store, executor_id, key, known, reads, decide, None).await
}

/// [`advance_from`], and when the decided event leads where the table
/// allows `then`, `then` too, in the same commit: the state between the
/// two is never stored alone (a crash leaves both or neither). The
/// answer is the row after both (or after the first, if the table
/// refuses `then` from where the first led).
///
/// # Errors
/// As [`advance`].
pub(crate) async fn advance_then(
    store: &dyn Store,
    executor_id: &str,
    key: (&str, &str),
    mut known: Option<Option<LocalCall>>,
    reads: Reads,
    mut decide: impl FnMut(&Snapshot) -> Option<Event>,
    then: Option<Event>,
) -> Result<Advanced, StoreError> {
    let mut failures = 0u32;
    let mut races = 0u32;
    loop {
        let guess = known.take();
        let guessed = guess.is_some();
        let call = match guess {
            Some(row) => row,
            None => store.call(key.0, key.1).await?,
        };
        let snapshot = Snapshot {
            call,
            receipts: match reads {
                Reads::Row => None,
                Reads::ReceiptsUnlessKnown if guessed => None,
                Reads::RowAndReceipts | Reads::ReceiptsUnlessKnown => {
                    Some(store.receipts(key.0, key.1).await?)
                }
            },
        };
        let Some(event) = decide(&snapshot) else {
            if guessed {
                continue;
            }
            return Ok(Advanced::Stayed(snapshot.call));
        };
        let name = event.name();
        let mut plan = match plan(&snapshot, key, event, executor_id) {
            Ok(p) => p,
            Err(_) if guessed => continue,
            Err(e) => {
                tracing::warn!(run_id = key.0, call_id = key.1, error = %e, "transition refused by the lifecycle table");
                return Ok(Advanced::Stayed(snapshot.call));
            }
        };
        if let Some(next) = &then {
            let between = Snapshot {
                call: Some(plan.call.clone()),
                receipts: None,
            };
            if let Ok(second) = self::plan(&between, key, next.clone(), executor_id) {
                plan.changes.extend(second.changes);
                plan.call = second.call;
                plan.receipt = second.receipt;
            }
        }
        let started = std::time::Instant::now();
        // The changes go to the store; what a retry needs is the plan's
        // row and receipt, which stay.
        let result = store.commit(std::mem::take(&mut plan.changes)).await;
        metrics::histogram!("toolrunner_store_commit_seconds", "executor_id" => executor_id.to_owned())
            .record(started.elapsed().as_secs_f64());
        let committed = match result {
            Ok(()) => true,
            Err(StoreError::Conflict(..)) if guessed || races < 50 => {
                races += u32::from(!guessed);
                tracing::debug!(
                    run_id = key.0,
                    call_id = key.1,
                    event = name,
                    "lost a race for the call; deciding again"
                );
                continue;
            }
            Err(
                e @ (StoreError::Refused(_)
                | StoreError::Closed
                | StoreError::Fenced(_)
                | StoreError::Conflict(..)),
            ) => {
                tracing::error!(run_id = key.0, call_id = key.1, event = name, error = %e, "transition not written");
                return Err(e);
            }
            // A commit reported as failed may have happened (an interrupted
            // COMMIT): look before trying again.
            Err(e) => match landed(store, key, &plan).await {
                Ok(true) => {
                    tracing::warn!(error = %e, "a commit reported an error but its changes are stored");
                    true
                }
                _ if failures < 8 => {
                    tracing::warn!(error = %e, attempt = failures, "store commit failed; trying again");
                    tokio::time::sleep(Duration::from_millis(20u64 << failures.min(6))).await;
                    failures += 1;
                    continue;
                }
                _ => return Err(e),
            },
        };
        debug_assert!(committed);
        let was_unknown = snapshot
            .call
            .as_ref()
            .is_some_and(|c| c.state == LocalState::ReconciliationRequired);
        if plan.call.state == LocalState::ReconciliationRequired && !was_unknown {
            crate::notice::needs_reconciliation(
                executor_id,
                key.0,
                key.1,
                &plan.call.tool_name,
                plan.call.reason.as_deref().unwrap_or(name),
            );
        }
        metrics::counter!("toolrunner_call_transitions_total", "executor_id" => executor_id.to_owned(), "event" => name, "state" => plan.call.state.as_str())
            .increment(1);
        return Ok(Advanced::Moved {
            call: plan.call,
            receipt: plan.receipt,
        });
    }
}

/// How [`advance_in`] ended.
#[allow(clippy::large_enum_variant)] // short-lived, returned once per call
pub(crate) enum InTransaction {
    /// The transition is committed with the handler's writes, or the call
    /// stayed where it was (`decide` declined) and the transaction rolled
    /// back.
    Done(Advanced),
    /// Nothing of the transaction is stored: reading the row or writing a
    /// change failed before the `COMMIT` (a lost compare-and-set, a
    /// transaction the handler's own failed statement aborted).
    NotWritten(StoreError),
    /// The table refuses the event from the stored state: nothing stored.
    Refused(String),
    /// The process was fenced before the commit: nothing stored.
    Halted,
    /// The `COMMIT` failed and the store does not hold the transition:
    /// nothing of the transaction is stored.
    Lost(StoreError),
}

/// [`advance`] inside a handler's own transaction `tx`, after its
/// business writes: the row is read as the transaction sees it, locked
/// until it ends (so a change committed meanwhile cannot make the decision
/// stale), `decide` names the event, and the transition is written into
/// `tx` and committed once with the handler's writes: both are stored or
/// neither is. `halted` is asked right before the commit (a fenced process
/// writes nothing).
pub(crate) async fn advance_in(
    store: &dyn Store,
    mut tx: StoreTransaction,
    executor_id: &str,
    key: (&str, &str),
    decide: impl FnOnce(&Snapshot) -> Option<Event>,
    halted: impl Fn() -> bool,
) -> InTransaction {
    // Every way out before the commit rolls the transaction back and
    // waits for it (its locks go now, not when its connection is next
    // used).
    let call = match tx.locked_call(key.0, key.1).await {
        Ok(c) => c,
        Err(e) => {
            tx.rollback().await;
            return InTransaction::NotWritten(e);
        }
    };
    let snapshot = Snapshot {
        call,
        receipts: None,
    };
    let Some(event) = decide(&snapshot) else {
        tx.rollback().await;
        return InTransaction::Done(Advanced::Stayed(snapshot.call));
    };
    let name = event.name();
    let plan = match plan(&snapshot, key, event, executor_id) {
        Ok(p) => p,
        Err(e) => {
            tx.rollback().await;
            return InTransaction::Refused(e.to_string());
        }
    };
    if halted() {
        tx.rollback().await;
        return InTransaction::Halted;
    }
    let started = std::time::Instant::now();
    let result = tx.commit_with(&plan.changes).await;
    metrics::histogram!("toolrunner_store_commit_seconds", "executor_id" => executor_id.to_owned())
        .record(started.elapsed().as_secs_f64());
    match result {
        Ok(()) => {}
        Err(TxError::NotWritten(e)) => return InTransaction::NotWritten(e),
        // An interrupted `COMMIT`: only the store tells whether it is there.
        Err(TxError::Unknown(e)) => match landed(store, key, &plan).await {
            Ok(true) => {
                tracing::warn!(error = %e, "the transaction reported an error but it is stored");
            }
            _ => return InTransaction::Lost(e),
        },
    }
    metrics::counter!("toolrunner_call_transitions_total", "executor_id" => executor_id.to_owned(), "event" => name, "state" => plan.call.state.as_str())
        .increment(1);
    InTransaction::Done(Advanced::Moved {
        call: plan.call,
        receipt: plan.receipt,
    })
}

/// Records a delivery attempt of one receipt and its new status (the
/// call's row does not change): the only writer of a receipt's status
/// outside a transition.
///
/// # Errors
/// The store failed.
pub(crate) async fn mark_receipt(
    store: &dyn Store,
    receipt_id: &str,
    status: ReceiptStatus,
    error: Option<String>,
) -> Result<(), StoreError> {
    store
        .commit(vec![mark(receipt_id, status, error, true)])
        .await
}

/// Whether `plan` is what the store now holds: its very row (version and
/// time of the change) and, if it wrote one, its very receipt.
pub(super) async fn landed(
    store: &dyn Store,
    key: (&str, &str),
    plan: &Plan,
) -> Result<bool, StoreError> {
    let row = store.call(key.0, key.1).await?;
    let same_row = row.is_some_and(|now| {
        now.version == plan.call.version
            && now.state == plan.call.state
            && now.updated_at == plan.call.updated_at
    });
    if !same_row {
        return Ok(false);
    }
    match &plan.receipt {
        Some(r) => Ok(store.receipt(&r.receipt_id).await?.is_some()),
        None => Ok(true),
    }
}

/// Adds a timeline entry that changes nothing else.
pub(crate) async fn note(
    store: &dyn Store,
    key: (&str, &str),
    what: &str,
    detail: Option<String>,
) -> Result<(), StoreError> {
    store
        .commit(vec![Change::Note {
            run_id: key.0.to_owned(),
            call_id: key.1.to_owned(),
            what: what.to_owned(),
            detail,
        }])
        .await
}
