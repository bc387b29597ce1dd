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
            // Settled here as "nothing ran" while the platform still holds
            // the claim: give it back.
            Ok(Some(mut c))
                if o.state == CallState::Claimed
                    && matches!(c.state, LocalState::Abandoned | LocalState::Released)
                    && c.report.is_none() =>
            {
                c.report = Some(PendingReport::Released);
                let guard = Change::Expect {
                    run_id: c.run_id.clone(),
                    call_id: c.call_id.clone(),
                    states: vec![c.state],
                };
                if let Err(e) = core.commit(vec![guard, Change::PutCall(c)], None).await {
                    tracing::error!(error = %e, "cannot record a claim to give back");
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => unknown.push(o),
            Err(e) => tracing::error!(error = %e, "cannot read the store during recovery"),
        }
    }
    // A call the store does not know is never executed.
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
        let mut c = LocalCall::new(o.run_id, o.call_id, String::new(), String::new(), state);
        c.reason = Some(reason.into());
        c.report = report;
        changes.push(Change::PutCall(c));
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

/// Goes back to claiming with the saved operation key. The old
/// assignment's unsent receipts stay as they are: the claim's answer decides
/// (a new assignment supersedes them; the same one, replayed, sends them).
async fn reclaim(
    core: &Arc<Core>,
    mut c: LocalCall,
) -> Result<LocalCall, crate::store::StoreError> {
    c.state = LocalState::Claiming;
    c.reason = Some("the claim may have lapsed while the executor was away".into());
    let guard = Change::Expect {
        run_id: c.run_id.clone(),
        call_id: c.call_id.clone(),
        states: vec![LocalState::Assigned],
    };
    core.commit(vec![guard, Change::PutCall(c.clone())], Some(&c))
        .await?;
    Ok(c)
}
