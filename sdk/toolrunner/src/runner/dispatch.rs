//! One dispatch queue: the loops (`runner/loops/`) decide what there is to
//! do and hand it here as [`Work`]; only the queue's loop starts it. So no
//! loop drives, checks or delivers a call itself, and no path leads from
//! the connection or recovery into the drive (which itself reconnects):
//! the async cycle drive → connect → recovery → drive is a message, not a
//! call. (Temporal's worker feeds its pollers into one dispatch loop the
//! same way.)

use std::sync::Arc;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::call::{Checked, check};
use super::flow::Held;
use super::{Active, CallKey, Core, Pause, outbox};
use crate::store::LocalCall;

/// What a loop hands to the queue.
pub(crate) enum Work {
    /// Drive a call, from where its row says it is.
    Drive(Job),
    /// Ask a call's `reconcile` hook (the reconciliation loop's schedule);
    /// the answer says how the check ended.
    Check {
        /// The call, marked as driven by this process.
        active: Active,
        /// Its row, read after it was marked (boxed: a row is large, the
        /// other work small).
        call: Box<LocalCall>,
        /// Hears how the check ended (dropped if the executor stops).
        done: oneshot::Sender<CheckEnd>,
    },
    /// Deliver a call's stored receipts that no task is delivering.
    Redeliver {
        /// The call, marked as driven by this process.
        active: Active,
        /// Hears when the delivery attempt ended.
        done: Option<oneshot::Sender<()>>,
    },
    /// Send every state still to report (`calls/report`).
    Reports {
        /// Hears when the reports went out (or could not).
        done: Option<oneshot::Sender<()>>,
    },
    /// Delete a batch of the calls settled for good before `before` (or,
    /// with `approvals`, of the approval requests nobody needs since).
    Prune {
        /// The approval requests, not the calls.
        approvals: bool,
        /// Settled before this instant.
        before: crate::store::Timestamp,
        /// At most this many calls.
        batch: u32,
        /// Hears how many went.
        done: oneshot::Sender<Result<u64, crate::store::StoreError>>,
    },
    /// Probe the store, publish the gauges and the health facts.
    Gauges {
        /// Hears when they are published.
        done: oneshot::Sender<()>,
    },
}

/// How an automatic check ended, for the loop that schedules the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CheckEnd {
    /// The call moved on (settled, or handed back to a drive).
    Moved,
    /// Not asked yet: the hook may be asked from this instant.
    NotYet(std::time::Instant),
    /// Still unknown, or the check could not finish: ask again later.
    Again,
}

/// A call to drive.
pub(crate) struct Job {
    /// The call, marked as driven by this process from the moment it was
    /// handed over (so no other task picks it up meanwhile).
    active: Active,
    /// The slots the caller took: of the executor's capacity, of the
    /// tool's limit.
    held: Held,
    /// The row as the caller just wrote it, if it did (boxed: see
    /// `call::drive`).
    known: Option<Box<LocalCall>>,
    /// The caller itself just moved the call to `running` (an automatic
    /// check that allowed a re-run), so its handler may start.
    confirmed: bool,
}

/// The queue's two ends: the sender lives in [`Core`], the receiver is
/// taken once by the loop.
pub(crate) struct Queue {
    sender: UnboundedSender<(Work, tracing::Span)>,
    receiver: std::sync::Mutex<Option<UnboundedReceiver<(Work, tracing::Span)>>>,
}

impl Default for Queue {
    fn default() -> Self {
        let (sender, receiver) = unbounded_channel();
        Queue {
            sender,
            receiver: std::sync::Mutex::new(Some(receiver)),
        }
    }
}

/// Hands a call to the queue, unless this process already drives it.
pub(crate) fn submit(core: &Arc<Core>, key: CallKey, known: Option<LocalCall>, held: Held) {
    // Activated here, synchronously, so no other task can pick the call up
    // between this decision and the drive's start.
    let Some(active) = core.activate(&key) else {
        return;
    };
    submit_activated(core, held, active, known);
}

/// [`submit`] for a call the caller has already activated.
pub(crate) fn submit_activated(core: &Core, held: Held, active: Active, known: Option<LocalCall>) {
    hand(
        core,
        Work::Drive(Job {
            active,
            held,
            known: known.map(Box::new),
            confirmed: false,
        }),
    );
}

/// Hands any work to the queue.
pub(crate) fn hand(core: &Core, work: Work) {
    // The loop is gone only when the executor stopped: the work (and its
    // call's mark) is dropped, as a lost process would drop it.
    // With the span it was handed over in: work other than a drive (which
    // has a span of its own) runs inside it, as when its loop or a drain
    // did it itself.
    let _ = core
        .calls
        .dispatch
        .sender
        .send((work, tracing::Span::current()));
}

/// Hands work to the queue and waits until it is done; `None` if the
/// executor halted first (the work may still be under way: a halted
/// executor writes and sends nothing more).
pub(crate) async fn done<T>(
    core: &Core,
    work: impl FnOnce(oneshot::Sender<T>) -> Work,
) -> Option<T> {
    let (tell, told) = oneshot::channel();
    hand(core, work(tell));
    tokio::select! {
        _ = core.life.halted() => None,
        told = told => told.ok(),
    }
}

/// The queue's loop: starts a task for each piece of work handed over,
/// until the executor stops.
pub(crate) async fn dispatch_loop(core: Arc<Core>) {
    let Some(mut jobs) = core
        .calls
        .dispatch
        .receiver
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
    else {
        return;
    };
    // The work other than drives, held here so that the halt ends it and
    // the executor's stop waits until it has ended (a drive selects on the
    // halt itself).
    let mut running = tokio::task::JoinSet::new();
    loop {
        let work = tokio::select! {
            biased;
            _ = core.life.halted() => {
                running.shutdown().await;
                return;
            }
            // Ended work leaves the set.
            Some(_) = running.join_next(), if !running.is_empty() => continue,
            work = jobs.recv() => work,
        };
        let Some((work, parent)) = work else {
            running.shutdown().await;
            return;
        };
        match work {
            Work::Drive(job) => {
                tokio::spawn(super::call::drive(
                    core.clone(),
                    job.confirmed,
                    Box::new(job.held),
                    job.active,
                    job.known,
                ));
            }
            Work::Check { active, call, done } => {
                running.spawn(checked(core.clone(), active, call, done).instrument(parent));
            }
            Work::Redeliver { active, done } => {
                running.spawn(redeliver(core.clone(), active, done).instrument(parent));
            }
            Work::Reports { done } => {
                let c = core.clone();
                let work = async move {
                    outbox::flush_reports(&c).await;
                    if let Some(done) = done {
                        let _ = done.send(());
                    }
                };
                running.spawn(work.instrument(parent));
            }
            Work::Prune {
                approvals,
                before,
                batch,
                done,
            } => {
                let c = core.clone();
                let work = async move {
                    let pruned = if approvals {
                        c.calls.approvals.prune(before, batch).await
                    } else {
                        c.store.prune(before, batch).await
                    };
                    let _ = done.send(pruned);
                };
                running.spawn(work.instrument(parent));
            }
            Work::Gauges { done } => {
                let c = core.clone();
                let work = async move {
                    super::gauges::publish(&c).await;
                    let _ = done.send(());
                };
                running.spawn(work.instrument(parent));
            }
        }
    }
}

/// An automatic check, and what follows from it: a re-run goes on in the
/// same task (the call stays marked), a settled call's receipts go out.
async fn checked(
    core: Arc<Core>,
    active: Active,
    call: Box<LocalCall>,
    done: oneshot::Sender<CheckEnd>,
) {
    let key = active.key.clone();
    let checked = super::unwind::catch(check(&core, *call, &active.token))
        .await
        .unwrap_or_else(|panic| Err(Pause::waits(format!("the check panicked: {panic}"))));
    let end = match checked {
        Ok(Checked::Moved(moved)) if moved.state == crate::store::LocalState::Running => {
            // The check itself moved the call to `running`: its handler may
            // start, in a drive of its own (the call stays marked).
            let held = Held {
                capacity: core.calls.slots.clone().try_acquire_owned().ok(),
                tool: core
                    .resume_hold(&key, &moved.tool_name, true)
                    .await
                    .unwrap_or_default(),
            };
            hand(
                &core,
                Work::Drive(Job {
                    active,
                    held,
                    known: Some(Box::new(moved)),
                    confirmed: true,
                }),
            );
            let _ = done.send(CheckEnd::Moved);
            return;
        }
        Ok(Checked::Moved(moved)) => {
            outbox::deliver_call(&core, &key, Some(moved)).await;
            CheckEnd::Moved
        }
        Ok(Checked::NotYet(after)) => CheckEnd::NotYet(after),
        _ => CheckEnd::Again,
    };
    drop(active);
    let _ = done.send(end);
}

/// One call's receipts that no running task is delivering, in a span of
/// their own.
async fn redeliver(core: Arc<Core>, active: Active, done: Option<oneshot::Sender<()>>) {
    let key = active.key.clone();
    let span = super::telemetry::call_work_span!(
        "toolrunner.redeliver",
        core.cfg.executor_id.as_str(),
        key.run_id.as_str(),
        key.call_id.as_str()
    );
    let delivered = outbox::deliver_call(&core, &key, None)
        .instrument(span.clone())
        .await;
    span.record("toolrunner.outcome", outbox::delivery_name(delivered));
    drop(active);
    if let Some(done) = done {
        let _ = done.send(());
    }
}
