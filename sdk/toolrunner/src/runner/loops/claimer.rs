//! Finds work: polls `pending` (woken early by the stream), claims only
//! with a free capacity slot and a free slot of the tool's limit, and
//! resumes calls that had to wait.
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::super::flow::Held;
use super::super::{CallKey, Core, Pause, connection, dispatch};
use crate::lifecycle::{self, Advanced, Event, Reads};
use crate::store::{CallFilter, LocalCall, LocalState, StoreError};

pub(crate) async fn claim_loop(core: Arc<Core>) {
    let mut resumed_at = tokio::time::Instant::now();
    loop {
        tokio::select! {
            _ = core.life.stopping() => return,
            _ = core.calls.wake.notified() => {}
            // A tool at its rate limit has a token again before the next
            // poll: look then.
            _ = tokio::time::sleep(core.calls.flow.next_token_in().map_or(
                core.cfg.timing.poll_interval,
                |d| d.clamp(std::time::Duration::from_millis(5), core.cfg.timing.poll_interval),
            )) => {}
        }
        if !core.life.claiming() {
            continue;
        }
        // Calls wait only when a task paused one (or, rarely, lost one):
        // look for them then, and once per poll interval; not at each
        // wake-up, which a finished call gives.
        if core.calls.paused.swap(false, Ordering::SeqCst)
            || resumed_at.elapsed() >= core.cfg.timing.poll_interval
        {
            resumed_at = tokio::time::Instant::now();
            resume_waiting(&core).await;
        }
        // An adopted identity finishes what was left and takes nothing
        // new; a process whose lease lapsed takes no work.
        if core.cfg.adopted || !core.lease.live() {
            continue;
        }
        if let Err(e) = claim_pending(&core).await {
            tracing::debug!(error = %e, "listing pending calls failed");
        }
    }
}

/// Calls the store holds that no task drives (a claim deferred for
/// capacity, a step that could not reach the platform).
async fn resume_waiting(core: &Arc<Core>) {
    let filter = CallFilter {
        states: vec![
            LocalState::Claiming,
            LocalState::Assigned,
            LocalState::Running,
        ],
        ..CallFilter::default()
    };
    let Ok(mut calls) = core.store.calls(&filter).await else {
        return;
    };
    // Calls the platform already counts against this executor's capacity
    // (`running`, `assigned`) go first: a claim waiting for capacity must
    // never starve the very call that holds it.
    calls.sort_by_key(|c| c.state != LocalState::Running && c.state != LocalState::Assigned);
    // The holds parked by calls that no longer wait here go back.
    let waiting: Vec<CallKey> = calls.iter().map(CallKey::of).collect();
    core.calls
        .flow
        .sweep(&core.cfg.executor_id, &waiting, |k| core.is_active(k));
    for c in calls {
        let key = CallKey::of(&c);
        if core.is_active(&key) {
            continue;
        }
        // A call not claimed yet waits for its tool's slot like a new one;
        // one already claimed is this process's own work and takes its
        // slot whatever the count (or the one it parked when it paused).
        let claimed = c.state != LocalState::Claiming;
        // The capacity slot first: a hold taken back (a parked one) is
        // never dropped for want of one.
        let Ok(permit) = core.calls.slots.clone().try_acquire_owned() else {
            return;
        };
        let Some(tool) = core.resume_hold(&key, &c.tool_name, claimed).await else {
            continue;
        };
        let held = Held {
            capacity: Some(permit),
            tool,
        };
        // A `running` call that no task drives lost its task to an error:
        // it is resumed as after a crash (a write tool is never re-run).
        dispatch::submit(core, key, None, held);
    }
}

/// The most pages of `pending` one look reads (each up to 100 candidates).
const PAGES: usize = 5;

async fn claim_pending(core: &Arc<Core>) -> Result<(), Pause> {
    let free = core.calls.slots.available_permits();
    if free == 0 {
        return Ok(());
    }
    let connection_id = connection::connection_id(core)
        .await
        .map_err(|e| Pause::waits(e.to_string()))?;
    // Nothing new is claimed before recovery is done with every connect
    // (another task's included): the calls it resumes take their slots
    // first.
    core.link.learnt.caught_up(core).await;
    // The calls that wait for a person's decision are passed over; a
    // decision is read within a poll interval.
    core.calls
        .approvals
        .refresh(core.cfg.timing.poll_interval)
        .await;
    // Each new call's operation key is saved before its claim is sent. The
    // saves go to the store together, so they share one commit.
    let mut saves = Vec::new();
    let mut cursor: Option<String> = None;
    // The tools found at a limit in this look: their other candidates are
    // not asked about again (on a shared store, each ask is a round trip).
    let mut full: Vec<String> = Vec::new();
    for _ in 0..PAGES {
        let page = match core
            .client
            .pending(
                &core.cfg.executor_id,
                &connection_id,
                (free + core.calls.flow.backing_off_now() + core.calls.approvals.waiting_now())
                    .min(100),
                cursor.as_deref(),
            )
            .await
        {
            Ok(p) => p,
            Err(e) => {
                connection::handle_refusal(core, &connection_id, &e).await;
                return Err(e.into());
            }
        };
        let mut passed_over = 0usize;
        for candidate in page.data {
            if !core.tools.contains_key(&candidate.tool_name) || !core.life.claiming() {
                continue;
            }
            let key = CallKey {
                run_id: candidate.run_id.clone(),
                call_id: candidate.call_id.clone(),
            };
            if core.is_active(&key) {
                continue;
            }
            if core.calls.approvals.waits(&key) {
                passed_over += 1;
                continue;
            }
            if full.contains(&candidate.tool_name) {
                passed_over += 1;
                continue;
            }
            // Decided before the claim: a tool at its limit is not claimed
            // now (never claimed to wait); the candidate stays pending for
            // another replica, or for a later poll here.
            let Some(tool) = core
                .calls
                .flow
                .take_for_claim(core.flow_holder().as_ref(), &key, &candidate.tool_name)
                .await
            else {
                passed_over += 1;
                if !core.calls.flow.backs_off(&key) {
                    super::super::telemetry::flow_throttled(
                        &core.cfg.executor_id,
                        &candidate.tool_name,
                    );
                    tracing::debug!(run_id = %key.run_id, call_id = %key.call_id, tool = %candidate.tool_name, "not claimed: the tool is at its concurrency or rate limit");
                    full.push(candidate.tool_name);
                }
                continue;
            };
            let Ok(permit) = core.calls.slots.clone().try_acquire_owned() else {
                break;
            };
            let held = Held {
                capacity: Some(permit),
                tool,
            };
            saves.push(save_key(core, key, candidate.tool_name, held));
        }
        // Candidates passed over (backing off, a tool at its limit) never
        // hide the others: the next page is looked at while capacity is
        // left, up to a few pages a look.
        if passed_over == 0 || core.calls.slots.available_permits() == 0 {
            break;
        }
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    for saved in futures_util::future::join_all(saves).await {
        if let Some((call, held)) = saved? {
            core.crash_point("after_operation_key_saved")?;
            dispatch::submit(core, CallKey::of(&call), Some(call), held);
        }
    }
    Ok(())
}

/// A new call, or one settled here before (refused, released) that is
/// pending again: a new attempt with a new key, durable before the claim is
/// sent; the row as saved. `None` if the call is not this loop's to claim.
async fn save_key(
    core: &Arc<Core>,
    key: CallKey,
    tool_name: String,
    held: Held,
) -> Result<Option<(LocalCall, Held)>, StoreError> {
    // Usually a call this store has never seen: try the insert at once (it
    // is refused if the row exists, and then decided on a fresh read).
    let moved = core
        .advance_from(&key, Some(None), Reads::Row, |s| match &s.call {
            None => Some(Event::Discovered {
                tool_name: tool_name.clone(),
                operation_key: lifecycle::operation_key(),
            }),
            Some(c) if matches!(c.state, LocalState::Abandoned | LocalState::Released) => {
                Some(Event::Retried {
                    tool_name: tool_name.clone(),
                    operation_key: lifecycle::operation_key(),
                })
            }
            Some(_) => None,
        })
        .await?;
    Ok(match moved {
        Advanced::Moved { call, .. } => Some((call, held)),
        Advanced::Stayed(_) => None,
    })
}
