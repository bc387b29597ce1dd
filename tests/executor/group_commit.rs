//! Group commit: the changes of concurrent callers share one transaction,
//! and each caller learns its own outcome.

use anyhow::Result;
use toolrunner::protocol::wire::ReceiptKind;
use toolrunner::testing::store::{
    Change, LocalCall, LocalState, OutboxReceipt, ReceiptStatus, Store, StoreError,
};

use super::rows;

fn call(n: usize, state: LocalState, version: u64) -> LocalCall {
    rows::call(&format!("call_{n}"), state, version)
}

fn receipt(n: usize, id: &str, sequence: u64) -> OutboxReceipt {
    let call_id = format!("call_{n}");
    rows::receipt(
        &call_id,
        id,
        ReceiptKind::Progress,
        sequence,
        ReceiptStatus::Pending,
    )
}

/// Forty callers commit at once: they share a few transactions. The two
/// that must fail fail alone, and nothing of theirs is written: a stale
/// compare-and-set (refused at its first change), and a job whose second
/// change the schema refuses after its first was applied (its receipt
/// reuses a sequence), so that its call row update must be undone too.
#[tokio::test]
async fn concurrent_commits_share_a_transaction_and_fail_alone() -> Result<()> {
    let (_dir, store) = rows::store().await?;
    // call_0 and call_1 exist at version 0; call_1 holds a receipt at sequence 1.
    store
        .commit(vec![
            Change::InsertCall(call(0, LocalState::Running, 0)),
            Change::InsertCall(call(1, LocalState::Running, 0)),
            Change::AddReceipt(receipt(1, "rcp_1a", 1)),
        ])
        .await?;
    let before = store.writer_stats();

    let stale = Change::UpdateCall {
        expect_version: 7,
        call: call(0, LocalState::Settled, 8),
    };
    let reused_sequence = vec![
        Change::UpdateCall {
            expect_version: 0,
            call: call(1, LocalState::Settled, 1),
        },
        Change::AddReceipt(receipt(1, "rcp_1b", 1)),
    ];
    let mut jobs = vec![vec![stale], reused_sequence];
    for n in 2..40 {
        jobs.push(vec![Change::InsertCall(call(n, LocalState::Claiming, 0))]);
    }
    let outcomes =
        futures_util::future::join_all(jobs.into_iter().map(|job| store.commit(job))).await;

    assert!(
        matches!(outcomes[0], Err(StoreError::Conflict(..))),
        "the stale write: {:?}",
        outcomes[0]
    );
    assert!(
        matches!(outcomes[1], Err(StoreError::Refused(..))),
        "the reused sequence: {:?}",
        outcomes[1]
    );
    for (n, outcome) in outcomes.iter().enumerate().skip(2) {
        assert!(outcome.is_ok(), "job {n}: {outcome:?}");
        let stored = store.call("run_1", &format!("call_{n}")).await?;
        assert_eq!(stored.map(|c| c.state), Some(LocalState::Claiming));
    }
    // Nothing of the failed jobs was written, not even the first change of
    // the job whose second change was refused.
    let c0 = store.call("run_1", "call_0").await?.expect("call_0");
    let c1 = store.call("run_1", "call_1").await?.expect("call_1");
    assert_eq!((c0.state, c0.version), (LocalState::Running, 0));
    assert_eq!((c1.state, c1.version), (LocalState::Running, 0));
    let ids: Vec<String> = store
        .receipts("run_1", "call_1")
        .await?
        .into_iter()
        .map(|r| r.receipt_id)
        .collect();
    assert_eq!(ids, ["rcp_1a"]);

    let after = store.writer_stats();
    let jobs = after.jobs - before.jobs;
    let transactions = after.transactions - before.transactions;
    assert_eq!(jobs, 40);
    assert!(
        transactions < 10,
        "40 concurrent commits took {transactions} transactions"
    );
    Ok(())
}
