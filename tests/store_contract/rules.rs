//! A call row changes only as a compare-and-set on its version, and rows
//! that must never exist are refused.

use anyhow::Result;
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{
    Change, LocalCall, LocalState, OutboxReceipt, ReceiptStatus, Store, StoreError,
};

use super::rows;

fn call(state: LocalState, version: u64) -> LocalCall {
    rows::call("call_1", state, version)
}

fn receipt(id: &str, kind: ReceiptKind, sequence: u64, status: ReceiptStatus) -> OutboxReceipt {
    rows::receipt("call_1", id, kind, sequence, status)
}

/// A decision taken on an old snapshot is never written: the second writer
/// of version 0 is refused, and the row stays as the first wrote it (this
/// is what once let a progress receipt undo an operator's resolve, and a
/// report undo a sequence increment).
pub(crate) async fn a_change_decided_on_an_old_version_is_refused(store: &dyn Store) -> Result<()> {
    store
        .commit(vec![Change::InsertCall(call(LocalState::Running, 0))])
        .await?;
    let again = store
        .commit(vec![Change::InsertCall(call(LocalState::Running, 0))])
        .await;
    assert!(matches!(again, Err(StoreError::Conflict(..))), "{again:?}");
    let mut first = call(LocalState::Settled, 1);
    first.next_sequence = 2;
    store
        .commit(vec![Change::UpdateCall {
            expect_version: 0,
            call: first,
        }])
        .await?;
    let stale = store
        .commit(vec![
            Change::UpdateCall {
                expect_version: 0,
                call: call(LocalState::ReconciliationRequired, 1),
            },
            Change::AddReceipt(receipt(
                "rcp_p",
                ReceiptKind::Progress,
                1,
                ReceiptStatus::Pending,
            )),
        ])
        .await;
    assert!(matches!(stale, Err(StoreError::Conflict(..))), "{stale:?}");
    let now = store.call("run_1", "call_1").await?.expect("stored");
    assert_eq!(
        (now.state, now.version, now.next_sequence),
        (LocalState::Settled, 1, 2)
    );
    assert!(
        store.receipt("rcp_p").await?.is_none(),
        "a refused transition writes nothing at all"
    );
    Ok(())
}

/// The schema refuses what must never exist, whoever writes it.
pub(crate) async fn impossible_receipts_are_refused(store: &dyn Store) -> Result<()> {
    store
        .commit(vec![
            Change::InsertCall(call(LocalState::Settled, 0)),
            Change::AddReceipt(receipt(
                "rcp_a",
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
            )),
            Change::AddReceipt(receipt(
                "rcp_f",
                ReceiptKind::Completed,
                1,
                ReceiptStatus::Pending,
            )),
        ])
        .await?;
    let cases = [
        (
            "a second live final",
            receipt("rcp_f2", ReceiptKind::Failed, 2, ReceiptStatus::Pending),
        ),
        (
            "a second accepted",
            receipt("rcp_a2", ReceiptKind::Accepted, 5, ReceiptStatus::Pending),
        ),
        (
            "a reused sequence",
            receipt("rcp_p", ReceiptKind::Progress, 1, ReceiptStatus::Rejected),
        ),
    ];
    for (what, r) in cases {
        let refused = store.commit(vec![Change::AddReceipt(r)]).await;
        assert!(
            matches!(refused, Err(StoreError::Refused(_))),
            "{what}: {refused:?}"
        );
    }
    let mut orphan = receipt("rcp_o", ReceiptKind::Progress, 9, ReceiptStatus::Pending);
    orphan.call_id = "call_unknown".into();
    let refused = store.commit(vec![Change::AddReceipt(orphan)]).await;
    assert!(
        matches!(refused, Err(StoreError::Refused(_))),
        "a receipt without its call: {refused:?}"
    );
    // A final that is no longer live leaves room for a new one.
    store
        .commit(vec![Change::ReceiptStatus {
            receipt_id: "rcp_f".into(),
            status: ReceiptStatus::Rejected,
            error: Some("sequence_conflict".into()),
            attempt: true,
        }])
        .await?;
    store
        .commit(vec![Change::AddReceipt(receipt(
            "rcp_f3",
            ReceiptKind::Completed,
            2,
            ReceiptStatus::Pending,
        ))])
        .await?;
    Ok(())
}

/// Whatever a handler, the platform or an operator sends is storable: free
/// text holding a NUL character (which PostgreSQL's `text` refuses) is
/// stored, with each NUL shown as `␀` (U+2400), in a call's reason, a
/// receipt's last error and the timeline; never a failed change.
pub(crate) async fn text_with_nul_characters_is_stored(store: &dyn Store) -> Result<()> {
    let mut settled = call(LocalState::Settled, 0);
    settled.reason = Some("bad\0reason".into());
    let mut final_receipt = receipt("rcp_n", ReceiptKind::Failed, 1, ReceiptStatus::Pending);
    final_receipt.last_error = Some("first\0error".into());
    store
        .commit(vec![
            Change::InsertCall(settled),
            Change::AddReceipt(final_receipt),
            Change::Note {
                run_id: "run_1".into(),
                call_id: "call_1".into(),
                what: "note\0what".into(),
                detail: Some("evidence\0detail".into()),
            },
        ])
        .await?;
    store
        .commit(vec![Change::ReceiptStatus {
            receipt_id: "rcp_n".into(),
            status: ReceiptStatus::Pending,
            error: Some("later\0error".into()),
            attempt: true,
        }])
        .await?;
    let stored = store.call("run_1", "call_1").await?.expect("stored");
    assert_eq!(stored.reason.as_deref(), Some("bad\u{2400}reason"));
    let r = store.receipt("rcp_n").await?.expect("stored");
    assert_eq!(r.last_error.as_deref(), Some("later\u{2400}error"));
    let events = store.events("run_1", "call_1").await?;
    assert!(
        events.iter().any(|e| e.what() == "note\u{2400}what"
            && e.detail() == Some("evidence\u{2400}detail")),
        "{events:?}"
    );
    Ok(())
}
