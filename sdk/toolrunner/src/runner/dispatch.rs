//! One dispatch queue: whoever finds a call to drive (the claimer, recovery
//! on a connect, the automatic reconciliation) hands it here, and only the
//! queue's loop starts the drive. So no path leads from the connection or
//! recovery into the drive (which itself reconnects and recovers): the
//! async cycle drive → connect → recovery → drive is a message, not a
//! call. (Temporal's worker feeds its pollers into one dispatch loop the
//! same way.)

use std::sync::Arc;

use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use super::{Active, CallKey, Core};
use crate::store::LocalCall;

/// A call to drive.
pub(crate) struct Job {
    /// The call, marked as driven by this process from the moment it was
    /// handed over (so no other task picks it up meanwhile).
    active: Active,
    /// A slot of the executor's capacity, if the caller took one.
    permit: Option<OwnedSemaphorePermit>,
    /// The row as the caller just wrote it, if it did.
    known: Option<LocalCall>,
    /// The caller itself just moved the call to `running` (an automatic
    /// check that allowed a re-run), so its handler may start.
    confirmed: bool,
}

/// The queue's two ends: the sender lives in [`Core`], the receiver is
/// taken once by the loop.
pub(crate) struct Queue {
    sender: UnboundedSender<Job>,
    receiver: std::sync::Mutex<Option<UnboundedReceiver<Job>>>,
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
pub(crate) fn submit(
    core: &Arc<Core>,
    key: CallKey,
    known: Option<LocalCall>,
    permit: Option<OwnedSemaphorePermit>,
) {
    // Activated here, synchronously, so no other task can pick the call up
    // between this decision and the drive's start.
    let Some(active) = core.activate(&key) else {
        return;
    };
    submit_activated(core, permit, active, known, false);
}

/// [`submit`] for a call the caller has already activated.
pub(crate) fn submit_activated(
    core: &Core,
    permit: Option<OwnedSemaphorePermit>,
    active: Active,
    known: Option<LocalCall>,
    confirmed: bool,
) {
    let job = Job {
        active,
        permit,
        known,
        confirmed,
    };
    // The loop is gone only when the executor stopped: the job (and its
    // mark) is dropped, as a lost process would drop it.
    let _ = core.calls.dispatch.sender.send(job);
}

/// The queue's loop: starts a task that drives each call handed over,
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
    loop {
        let job = tokio::select! {
            biased;
            _ = core.life.halted() => return,
            job = jobs.recv() => job,
        };
        let Some(job) = job else { return };
        tokio::spawn(super::call::drive(
            core.clone(),
            job.confirmed,
            job.permit,
            job.active,
            job.known,
        ));
    }
}
