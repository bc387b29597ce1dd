//! Recovery after a (re)connect: every call the store or the platform
//! still knows is resumed from where it stopped (protocol crash table).
use std::sync::Arc;

use toolrunner_protocol::wire::{CallState, Outstanding};

use super::{CallKey, Core, call, outbox};
use crate::store::{CallFilter, Change, LocalCall, LocalState, PendingReport};

pub(crate) async fn resume(core: &Arc<Core>, outstanding: Vec<Outstanding>) {
    let bound: std::collections::HashSet<CallKey> = outstanding
        .iter()
        .map(|o| CallKey {
            run_id: o.run_id.clone(),
            call_id: o.call_id.clone(),
        })
        .collect();
    let mut unknown = Vec::new();
    for o in outstanding {
        match core.store.call(&o.run_id, &o.call_id).await {
            Ok(Some(_)) => {}
            Ok(None) => unknown.push(o),
            Err(e) => tracing::error!(error = %e, "cannot read the store during recovery"),
        }
    }
    // A call the store does not know is never executed.
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let mut changes = Vec::new();
    for o in unknown {
        let (state, report, reason) = match o.state {
            CallState::Claimed => (
                LocalState::Released,
                Some(PendingReport::Released),
                "claimed by this executor id but unknown to its store: released",
            ),
            CallState::Running => (
                LocalState::ReconciliationRequired,
                Some(PendingReport::ReconciliationRequired),
                "unknown_to_executor",
            ),
            _ => (
                LocalState::ReconciliationRequired,
                None,
                "unknown_to_executor",
            ),
        };
        tracing::warn!(run_id = %o.run_id, call_id = %o.call_id, state = o.state.as_str(), "the platform lists a call this store does not know");
        changes.push(Change::PutCall(LocalCall {
            run_id: o.run_id,
            call_id: o.call_id,
            tool_name: String::new(),
            operation_key: String::new(),
            state,
            assignment: None,
            next_sequence: 0,
            reason: Some(reason.into()),
            report,
            created_at: now.clone(),
            updated_at: now.clone(),
        }));
    }
    if !changes.is_empty()
        && let Err(e) = core.commit(changes, None).await
    {
        tracing::error!(error = %e, "cannot record unknown calls");
    }
    let filter = CallFilter {
        states: vec![
            LocalState::Claiming,
            LocalState::Assigned,
            LocalState::Running,
            LocalState::Settled,
        ],
        ..CallFilter::default()
    };
    if let Ok(calls) = core.store.calls(&filter).await {
        for mut c in calls {
            if core.is_active(&CallKey::of(&c)) {
                continue;
            }
            if c.state == LocalState::Assigned && !bound.contains(&CallKey::of(&c)) {
                // The platform released the claim while we were away (a
                // lapsed lease): the old assignment's `accepted` is never
                // sent; claim again with the same key.
                c = match reclaim(core, c).await {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::error!(error = %e, "cannot record a released claim");
                        continue;
                    }
                };
            }
            let permit = core.slots.clone().try_acquire_owned().ok();
            call::spawn_drive(core.clone(), c, true, permit);
        }
    }
    outbox::spawn_flush_reports(core.clone());
}

/// Marks the assignment's unsent receipts superseded and goes back to
/// claiming with the saved operation key.
async fn reclaim(
    core: &Arc<Core>,
    mut c: LocalCall,
) -> Result<LocalCall, crate::store::StoreError> {
    let mut changes = Vec::new();
    for r in core.store.receipts(&c.run_id, &c.call_id).await? {
        if r.status == crate::store::ReceiptStatus::Pending {
            changes.push(Change::ReceiptStatus {
                receipt_id: r.receipt_id,
                status: crate::store::ReceiptStatus::Superseded,
                error: Some("the platform no longer binds this assignment".into()),
                attempt: false,
            });
        }
    }
    c.state = LocalState::Claiming;
    c.reason = Some("the claim lapsed while the executor was away".into());
    changes.push(Change::Expect {
        run_id: c.run_id.clone(),
        call_id: c.call_id.clone(),
        states: vec![LocalState::Assigned],
    });
    changes.push(Change::PutCall(c.clone()));
    core.commit(changes, Some(&c)).await?;
    Ok(c)
}
