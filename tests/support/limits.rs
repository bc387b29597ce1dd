//! What a run's receipts say of its tool's limits, as the platform
//! received them (shared by `ledger_limits` and the PostgreSQL suite's
//! `replicas::flow`).

use std::time::UNIX_EPOCH;

use anyhow::{Context, Result};
use toolrunner::platform::Run;
use toolrunner::protocol::wire::ReceiptKind;

/// A platform time (RFC 3339, milliseconds) in milliseconds.
fn ms(at: &str) -> Result<i128> {
    let t = humantime::parse_rfc3339(at).with_context(|| format!("a receipt time: {at}"))?;
    Ok(i128::try_from(t.duration_since(UNIX_EPOCH)?.as_millis())?)
}

/// Each call of `run` from its first `accepted` to its first `completed`,
/// as the platform received them (milliseconds).
pub(crate) fn spans(run: &Run) -> Result<Vec<(i128, i128)>> {
    let mut spans = Vec::new();
    for call in &run.tool_calls {
        let first = |kind: ReceiptKind| -> Result<i128> {
            let mut times = call
                .receipts
                .iter()
                .filter(|r| r.kind == kind)
                .map(|r| ms(&r.received_at))
                .collect::<Result<Vec<_>>>()?;
            times.sort_unstable();
            times.first().copied().context("a receipt of the kind")
        };
        spans.push((
            first(ReceiptKind::Accepted)?,
            first(ReceiptKind::Completed)?,
        ));
    }
    Ok(spans)
}

/// The most calls between their first `accepted` and final receipt at
/// once, and the most first `accepted` in one second.
pub(crate) fn most(spans: &[(i128, i128)]) -> (usize, usize) {
    let at_once = spans
        .iter()
        .map(|(start, _)| {
            spans
                .iter()
                .filter(|(a, f)| a <= start && start < f)
                .count()
        })
        .max()
        .unwrap_or(0);
    let mut starts: Vec<i128> = spans.iter().map(|(a, _)| *a).collect();
    starts.sort_unstable();
    let a_second = (0..starts.len())
        .map(|i| {
            starts[i..]
                .iter()
                .take_while(|t| **t - starts[i] < 1_000)
                .count()
        })
        .max()
        .unwrap_or(0);
    (at_once, a_second)
}
