//! Seeding a store with months of calls, and one call through the bare loop.

use super::*;

/// Fills a store as months of work would: `settled` calls delivered long
/// ago (each with its `accepted` and `completed` receipts, an attempt and
/// its timeline) and `unsettled` calls waiting for reconciliation.
pub(crate) async fn seed(store: &SqliteStore, settled: usize, unsettled: usize) -> Result<()> {
    let long_ago: toolrunner::testing::store::Timestamp = "2026-01-01T00:00:00.000Z".parse()?;
    let row = |n: usize, state: LocalState| LocalCall {
        run_id: format!("run_seed_{}", n / 100),
        call_id: format!("call_seed_{n}"),
        tool_name: "bench.noop".into(),
        operation_key: format!("op_seed_{n}"),
        state,
        assignment: None,
        next_sequence: 2,
        reason: (state == LocalState::ReconciliationRequired)
            .then(|| "seeded: the outcome is unknown".to_owned()),
        report: None,
        created_at: long_ago,
        updated_at: long_ago,
        version: 0,
    };
    let receipt = |c: &LocalCall, kind: ReceiptKind, sequence: u64| OutboxReceipt {
        receipt_id: format!("rcp_{}_{sequence}", c.call_id),
        run_id: c.run_id.clone(),
        call_id: c.call_id.clone(),
        assignment_id: format!("asg_{}", c.call_id),
        kind,
        sequence,
        body: json!({"kind": kind, "sequence": sequence, "result": {"n": 1}}).to_string(),
        status: ReceiptStatus::Delivered,
        attempts: 1,
        last_error: None,
        created_at: long_ago,
        delivered_at: Some(long_ago),
    };
    for chunk in (0..settled + unsettled).collect::<Vec<_>>().chunks(500) {
        let mut changes = Vec::new();
        for &n in chunk {
            if n < settled {
                let c = row(n, LocalState::Delivered);
                changes.push(Change::AddReceipt(receipt(&c, ReceiptKind::Accepted, 0)));
                changes.push(Change::AddReceipt(receipt(&c, ReceiptKind::Completed, 1)));
                for what in ["claiming", "assigned", "running", "settled", "delivered"] {
                    changes.push(Change::Note {
                        run_id: c.run_id.clone(),
                        call_id: c.call_id.clone(),
                        what: what.into(),
                        detail: None,
                    });
                }
                changes.insert(changes.len() - 7, Change::InsertCall(c));
            } else {
                changes.push(Change::InsertCall(row(
                    n,
                    LocalState::ReconciliationRequired,
                )));
            }
        }
        store.commit(changes).await?;
    }
    Ok(())
}

/// Claim, `accepted`, `completed`: one call of the bare loop.
pub(crate) async fn one_call(
    api: &Platform,
    executor_id: &str,
    connection_id: &str,
    run_id: &str,
    call_id: &str,
) -> Result<()> {
    let call_path = format!("/runs/{run_id}/tool-calls/{call_id}");
    let claim = api
        .request(
            toolrunner::platform::Method::POST,
            &format!("{call_path}/claim"),
        )
        .json(
            &json!({"executor_id": executor_id, "connection_id": connection_id,
            "operation_key": format!("op-{call_id}")}),
        )
        .send()
        .await?;
    let claim = claim.json();
    let assignment = &claim["assignment"];
    let grant = assignment["grant"]
        .as_str()
        .with_context(|| format!("claim answered {claim}"))?;
    let n = assignment["arguments"]["n"].clone();
    let receipt = |sequence: u64, kind: &str, extra: Value| {
        let mut body = json!({"executor_id": executor_id,
            "assignment_id": assignment["assignment_id"],
            "receipt_id": format!("rcp-{call_id}-{sequence}"),
            "sequence": sequence, "kind": kind});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        body
    };
    let path = format!("{call_path}/receipts");
    let accepted = api
        .request(toolrunner::platform::Method::POST, &path)
        .header("Tool-Grant", grant)
        .json(&receipt(0, "accepted", json!({})))
        .send()
        .await?
        .json();
    if accepted["accepted"] != json!(true) {
        bail!("accepted was not confirmed: {accepted}");
    }
    let completed = api
        .request(toolrunner::platform::Method::POST, &path)
        .header("Tool-Grant", grant)
        .json(&receipt(1, "completed", json!({"result": {"n": n}})))
        .send()
        .await?;
    if !(200..300).contains(&completed.status) {
        bail!("completed refused: {}", completed.json());
    }
    Ok(())
}

/// A call's run and call ids.
pub(crate) type CallId = (String, String);
