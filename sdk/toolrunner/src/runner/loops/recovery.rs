//! Recovery after a (re)connect: every call the store or the platform
//! still knows is resumed from where it stopped (protocol crash table).
//! The connection publishes what each connect learnt; this loop reads it,
//! records what the platform listed, and hands the calls to resume to the
//! dispatch queue.
use std::collections::HashSet;
use std::sync::Arc;

use toolrunner_protocol::wire::CallState;

use super::super::connection::Connected;
use super::super::dispatch::{self, Work};
use super::super::flow::Held;
use super::super::machine::resume::PLANTED_RESUME;
use super::super::{CallKey, Core};
use crate::lifecycle::{Event, Reads};
use crate::store::{CallFilter, LocalState, StoreError};

/// Recovers after each connect the connection publishes, until the
/// executor stops.
pub(crate) async fn recovery_loop(core: Arc<Core>) {
    loop {
        let connected = tokio::select! {
            biased;
            _ = core.life.halted() => return,
            c = core.link.learnt.next() => c,
        };
        let Some(connected) = connected else { return };
        recover(&core, connected).await;
    }
}

/// Recovers after the connects published so far (the start's own, before
/// any loop runs).
pub(crate) async fn catch_up(core: &Arc<Core>) {
    while let Some(connected) = core.link.learnt.ready() {
        recover(core, connected).await;
    }
}

/// [`resume`], counted as recovered however it ends: a recovery that
/// panics (a product's store) must not leave every task that connected
/// waiting for it.
async fn recover(core: &Arc<Core>, connected: Connected) {
    match super::super::unwind::catch(resume(core, connected)).await {
        Ok(()) => {}
        Err(panic) => {
            tracing::error!(%panic, "recovery after a connect panicked; the calls it did not reach resume from the store")
        }
    }
    core.link.learnt.recovered();
}

/// `outstanding` is the connect answer's list; `asked_at` when
/// the connect was sent: a call changed since may have been claimed on the
/// new connection after the list was made.
async fn resume(core: &Arc<Core>, connected: Connected) {
    let Connected {
        outstanding,
        asked_at,
    } = connected;
    let bound: HashSet<CallKey> = outstanding
        .iter()
        .map(|o| CallKey {
            run_id: o.run_id.clone(),
            call_id: o.call_id.clone(),
        })
        .collect();
    for o in outstanding {
        let key = CallKey {
            run_id: o.run_id.clone(),
            call_id: o.call_id.clone(),
        };
        let platform = o.state;
        let moved = core
            .advance(&key, Reads::Row, |s| match &s.call {
                // A call the store does not know is never executed.
                None => {
                    tracing::warn!(run_id = %key.run_id, call_id = %key.call_id, state = platform.as_str(), "the platform lists a call this store does not know");
                    Some(match platform {
                        CallState::Claimed => Event::OutstandingClaimed,
                        CallState::Running => Event::OutstandingRunning,
                        _ => Event::OutstandingReconciling,
                    })
                }
                // Settled here as "nothing ran" while the platform still
                // holds the claim: give it back.
                Some(c)
                    if platform == CallState::Claimed
                        && matches!(c.state, LocalState::Abandoned | LocalState::Released)
                        && c.report.is_none() =>
                {
                    Some(Event::GiveBack)
                }
                Some(_) => None,
            })
            .await;
        if let Err(e) = moved {
            tracing::error!(error = %e, "cannot record an outstanding call during recovery");
        }
    }
    // A call this store holds running or awaiting reconciliation that the
    // platform no longer lists, unchanged since before the connect, is no
    // longer ours there (its run was cancelled or ended, perhaps while
    // this process was away, and a cancel notice may have gone to a
    // process that is gone): it is remembered as cancelled, so it is never
    // run again (a re-run after the hook's `DidNotHappen`, a transactional
    // resume).
    let ours = CallFilter {
        states: vec![LocalState::Running, LocalState::ReconciliationRequired],
        ..CallFilter::default()
    };
    match core.store.calls(&ours).await {
        Ok(calls) => {
            for c in calls {
                let key = CallKey::of(&c);
                if !bound.contains(&key) && c.updated_at < asked_at && !PLANTED_RESUME {
                    core.remember_ended(&key);
                }
            }
        }
        // A re-run still asks the platform first (`outbox::still_bound`).
        Err(e) => {
            tracing::warn!(error = %e, "cannot list the calls the platform no longer lists; a re-run asks the platform first")
        }
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
    let mut resumed = Vec::new();
    if let Ok(calls) = core.store.calls(&filter).await {
        for c in calls {
            let key = CallKey::of(&c);
            // Taken before deciding: no task drives the call meanwhile.
            let Some(active) = core.activate(&key) else {
                continue;
            };
            if c.state == LocalState::Assigned && !bound.contains(&key) && c.updated_at < asked_at {
                // The platform released the claim while we were away (a
                // lapsed lease): claim again with the same key; the claim's
                // answer decides about the saved `accepted`.
                if let Err(e) = on_listed_row(core, &c, Event::ClaimLapsed).await {
                    tracing::error!(error = %e, "cannot record a released claim");
                    continue;
                }
            }
            if c.state == LocalState::Running
                && !PLANTED_RESUME
                && !bound.contains(&key)
                && c.updated_at < asked_at
                && core
                    .tools
                    .get(&c.tool_name)
                    .is_some_and(|t| t.effect() == crate::Effect::Transactional)
            {
                // A `running` call the platform no longer lists is terminal
                // there (its run cancelled or ended): a transactional one,
                // none of whose writes committed, is not run again.
                tracing::warn!(run_id = %key.run_id, call_id = %key.call_id, "a transactional call the platform ended while this process was away: not run again");
                if let Err(e) = on_listed_row(core, &c, Event::TransactionalEnded).await {
                    tracing::error!(error = %e, "cannot record a transactional call the platform ended");
                }
                continue;
            }
            // Work the platform holds as this executor's is never refused:
            // it takes its tool's slot whatever the count (and a capacity
            // slot if one is free). A call still to be claimed (never
            // claimed, or its claim released while away) waits for its
            // tool's limits like a new claim: at a limit, it stays in the
            // store for the claimer.
            let claimed = match c.state {
                LocalState::Claiming | LocalState::Assigned => bound.contains(&key),
                _ => true,
            };
            let Some(tool) = core.resume_hold(&key, &c.tool_name, claimed).await else {
                continue;
            };
            let held = Held {
                capacity: core.calls.slots.clone().try_acquire_owned().ok(),
                tool,
            };
            resumed.push((held, active));
        }
    }
    // The states to report go out first, as when recovery started them on
    // a task of its own before any resumed call ran.
    dispatch::hand(core, Work::Reports { done: None });
    for (held, active) in resumed {
        dispatch::submit_activated(core, held, active, None);
    }
}

/// Applies `event` to the call only while its row is still as recovery
/// listed it (same state, same version): a newer row is left alone.
async fn on_listed_row(
    core: &Arc<Core>,
    listed: &crate::store::LocalCall,
    event: Event,
) -> Result<(), StoreError> {
    core.advance(&CallKey::of(listed), Reads::Row, |s| {
        s.call
            .as_ref()
            .filter(|now| now.state == listed.state && now.version == listed.version)
            .map(|_| event.clone())
    })
    .await
    .map(drop)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::runner::connection::Connected;
    use crate::runner::template::Template;

    fn connected() -> Connected {
        Connected {
            outstanding: Vec::new(),
            asked_at: crate::store::now(),
        }
    }

    /// A task that connected waits until recovery is done with every
    /// connect published before it asked (review of issue 31: once
    /// recovery left the connecting task, the claimer and the drive that
    /// reconnected ran ahead of it), and stops waiting when the executor
    /// halts.
    #[tokio::test]
    async fn a_task_that_connected_waits_for_recovery_of_what_it_learnt() {
        let (_dir, core) = Template::core_for_tests().await;
        let learnt = &core.link.learnt;
        // Nothing published: caught up at once.
        tokio::time::timeout(Duration::from_secs(1), learnt.caught_up(&core))
            .await
            .expect("caught up with nothing published");
        learnt.publish(connected());
        learnt.publish(connected());
        let waiting = tokio::time::timeout(Duration::from_millis(100), learnt.caught_up(&core));
        assert!(waiting.await.is_err(), "caught up before any recovery");
        assert!(learnt.ready().is_some());
        learnt.recovered();
        let waiting = tokio::time::timeout(Duration::from_millis(100), learnt.caught_up(&core));
        assert!(
            waiting.await.is_err(),
            "caught up after one recovery of two"
        );
        assert!(learnt.ready().is_some());
        learnt.recovered();
        tokio::time::timeout(Duration::from_secs(1), learnt.caught_up(&core))
            .await
            .expect("caught up after both");
        // A connect nobody will recover from: the halt ends the wait.
        learnt.publish(connected());
        let started = std::time::Instant::now();
        let halt = async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            core.halt();
        };
        tokio::time::timeout(Duration::from_secs(1), async {
            tokio::join!(learnt.caught_up(&core), halt)
        })
        .await
        .expect("the halt ends the wait");
        assert!(
            started.elapsed() >= Duration::from_millis(100),
            "caught up before the halt, with a connect not recovered from"
        );
    }
}
