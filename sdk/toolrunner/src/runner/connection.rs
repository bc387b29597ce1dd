//! Connect, heartbeat, reconnect, disconnect.
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use toolrunner_protocol::wire::{
    Connect, Disconnect, DisconnectMode, Heartbeat, InFlight, Outstanding, SdkInfo,
};

use super::{Conn, Core, Phase, Shutdown};
use crate::api::context::CommitPointError;
use crate::error::{Error, Kind};
use crate::net::client::ClientError;

/// Whether this build connects without confirming the lease first: a
/// deliberate bug, compiled only with
/// `RUSTFLAGS='--cfg toolrunner_planted="zombie"'`, which the simulation
/// must catch (`docs/simulation.md`).
use crate::api::context::{confirms_before_connect, may_act};

/// How long a connect keeps trying an unreachable platform.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Patience {
    /// The first connect of `start()`: the client's own retries, then the
    /// error goes to the caller (a wrong URL is said at once).
    Once,
    /// A reconnect of a running executor: until the platform answers or
    /// the executor stops.
    UntilStopped,
}

/// What a connect learnt, published for recovery (`runner/loops/recovery.rs`):
/// the connection itself never resumes a call.
#[derive(Debug)]
pub(crate) struct Connected {
    /// The calls the platform holds for this executor (the connect answer's
    /// list).
    pub(crate) outstanding: Vec<Outstanding>,
    /// When the connect was sent: a call changed since may have been
    /// claimed on the new connection after the list was made.
    pub(crate) asked_at: crate::store::Timestamp,
}

/// The connects not recovered from yet, in order (a part of
/// [`super::Link`]).
pub(crate) struct Learnt {
    sender: UnboundedSender<Connected>,
    receiver: tokio::sync::Mutex<UnboundedReceiver<Connected>>,
    /// Connects published so far.
    published: std::sync::atomic::AtomicU64,
    /// Connects recovered from so far.
    recovered: tokio::sync::watch::Sender<u64>,
}

impl Default for Learnt {
    fn default() -> Self {
        let (sender, receiver) = unbounded_channel();
        Learnt {
            sender,
            receiver: tokio::sync::Mutex::new(receiver),
            published: Default::default(),
            recovered: tokio::sync::watch::Sender::new(0),
        }
    }
}

impl Learnt {
    /// The next connect to recover from, waiting for one.
    pub(crate) async fn next(&self) -> Option<Connected> {
        self.receiver.lock().await.recv().await
    }

    /// The next connect to recover from, if one is waiting now.
    pub(crate) fn ready(&self) -> Option<Connected> {
        self.receiver.try_lock().ok()?.try_recv().ok()
    }

    /// Recovery is done with one connect it took.
    pub(crate) fn recovered(&self) {
        self.recovered.send_modify(|n| *n += 1);
    }

    /// Waits until recovery is done with every connect published before
    /// this call (or the executor halted). The task that connected goes on
    /// only once the crash table ran over what its connect listed, while
    /// its own call is still marked as driven (recovery leaves it alone),
    /// as when recovery ran inside the connect; the claimer waits before
    /// each claim, so the calls recovery resumes have their capacity slots
    /// first; a drain waits (up to its deadline) before it says goodbye.
    pub(crate) async fn caught_up(&self, core: &Core) {
        let published = self.published.load(Ordering::SeqCst);
        let mut recovered = self.recovered.subscribe();
        tokio::select! {
            _ = core.life.halted() => {}
            _ = recovered.wait_for(|n| *n >= published) => {}
        }
    }

    /// Publishes what a connect learnt (the connection's, and a test's).
    pub(crate) fn publish(&self, connected: Connected) {
        self.published.fetch_add(1, Ordering::SeqCst);
        // The receiver lives as long as the sender (both in `Link`).
        let _ = self.sender.send(connected);
    }
}

/// Connects, and publishes what the platform listed for recovery;
/// `false` if another task connected while this one waited (and published
/// its own).
pub(crate) async fn connect(core: &Arc<Core>, patience: Patience) -> Result<bool, Error> {
    let _guard = core.link.reconnecting.lock().await;
    if core.link.conn.read().await.is_some() {
        // Another task connected while this one waited.
        return Ok(false);
    }
    let body = Connect {
        executor_id: core.cfg.executor_id.clone(),
        instance_id: Some(core.cfg.instance_id.clone()),
        binding_id: core.cfg.binding_id.clone(),
        tools: core.tools.keys().cloned().collect(),
        capacity: core.cfg.capacity,
        sdk: Some(SdkInfo {
            name: "toolrunner".into(),
            version: env!("CARGO_PKG_VERSION").into(),
        }),
    };
    let mut attempt = 0;
    let asked_at = crate::store::now();
    let connected = loop {
        // A process whose identity moved on never connects: it would
        // supersede the replica that holds the identity now.
        if confirms_before_connect()
            && let Err(e) = core.lease.confirm(core).await
        {
            if patience == Patience::UntilStopped && !core.life.is_halted() {
                tracing::warn!(error = %e, "not connecting before the executor's lease is confirmed; retrying");
                tokio::time::sleep(super::retry_delay(core, attempt.min(6))).await;
                attempt += 1;
                continue;
            }
            return Err(e);
        }
        // And live still right before the connect goes out (a process
        // frozen since the confirmation must confirm again).
        let lapsed = std::sync::atomic::AtomicBool::new(false);
        let live = || {
            if may_act(core.lease.live()) {
                true
            } else {
                lapsed.store(true, Ordering::SeqCst);
                false
            }
        };
        match core.client.connect(&body, &live).await {
            Ok(c) => break c,
            Err(_) if lapsed.load(Ordering::SeqCst) && patience == Patience::Once => {
                return Err(Error::new(
                    Kind::Store,
                    "the executor's lease lapsed before it could connect to the platform (the database answered too slowly): check the connection to PostgreSQL, then start again",
                ));
            }
            Err(e @ (ClientError::Unreachable(_) | ClientError::NotReady(_)))
                if patience == Patience::UntilStopped && !core.life.is_halted() =>
            {
                let m = unreachable_why(&e);
                core.health.platform(Err(m.clone()));
                tracing::warn!(error = %m, "cannot reach the platform; retrying connect");
                tokio::time::sleep(super::retry_delay(core, attempt.min(6))).await;
                attempt += 1;
            }
            Err(e) => {
                let err = connect_refused(core, e);
                if err.is_configuration() {
                    core.fail(err.clone());
                }
                return Err(err);
            }
        }
    };
    tracing::info!(executor_id = %core.cfg.executor_id, connection_id = %connected.connection_id, outstanding = connected.outstanding.len(), "connected");
    let first = patience != Patience::UntilStopped;
    crate::notice::serving(
        &core.cfg.executor_id,
        &core.cfg.binding_id,
        core.tools.keys().map(String::as_str),
        first,
    );
    if first {
        // What waits for a person from before this start (its own notice
        // may have been lost with the process that filed it).
        if let Ok(counts) = core.store.count_by_state().await {
            let waiting = counts
                .get(&crate::store::LocalState::ReconciliationRequired)
                .copied()
                .unwrap_or(0);
            crate::notice::waiting(&core.cfg.executor_id, waiting);
        }
    }
    if patience == Patience::UntilStopped {
        super::telemetry::reconnected(&core.cfg.executor_id);
    }
    core.health.platform(Ok(()));
    *core.link.conn.write().await = Some(Conn {
        connection_id: connected.connection_id.clone(),
        heartbeat_interval: beat(connected.heartbeat_interval_ms, connected.lease_ttl_ms),
        lease_ttl_ms: connected.lease_ttl_ms,
        stream_path: connected.stream_path.clone(),
    });
    // Published before the guard is let go: recovery sees the connects in
    // the order they were made.
    core.link.learnt.publish(Connected {
        outstanding: connected.outstanding,
        asked_at,
    });
    drop(_guard);
    Ok(true)
}

/// The error of a refused connect, in words that say what to change.
fn connect_refused(core: &Core, e: ClientError) -> Error {
    let base = core.client.base();
    let binding = &core.cfg.binding_id;
    match &e {
        ClientError::Unreachable(m) => Error::new(
            Kind::Unreachable,
            format!(
                "cannot reach the platform at {base} ({m}): check that it runs and that TOOLRUNNER_BASE_URL (or .base_url(..)) points at it"
            ),
        ),
        ClientError::Api(api) if api.code() == "unknown_binding" => Error::new(
            Kind::Configuration,
            format!(
                "the platform at {base} knows no executor binding {binding}: check TOOLRUNNER_BINDING_ID (or .binding_id(..)), or create the binding (toolrunner::platform::Platform::create_binding)"
            ),
        )
        .with_api(api.clone()),
        ClientError::Api(api) if api.code() == "unknown_tool" => {
            let index = api
                .body
                .param
                .as_deref()
                .and_then(|p| p.strip_prefix("tools["))
                .and_then(|p| p.strip_suffix(']'))
                .and_then(|i| i.parse::<usize>().ok());
            let tool = index
                .and_then(|i| core.tools.keys().nth(i))
                .map_or_else(|| "a tool".to_owned(), |t| format!("the tool {t}"));
            Error::new(
                Kind::Configuration,
                format!(
                    "the binding {binding} does not list {tool} this executor serves: add it to the binding's tool_names, or do not register it here"
                ),
            )
            .with_api(api.clone())
        }
        _ => Error::from(e),
    }
}

/// The heartbeat interval: the advised one, but never so long that the
/// lease could lapse between two beats (at most a third of the lease).
fn beat(advised_ms: u64, lease_ttl_ms: u64) -> Duration {
    Duration::from_millis(advised_ms.min(lease_ttl_ms / 3).max(50))
}

/// The current connection id, connecting first if there is none.
pub(crate) async fn connection_id(core: &Arc<Core>) -> Result<String, Error> {
    if let Some(c) = core.link.conn.read().await.as_ref() {
        return Ok(c.connection_id.clone());
    }
    if connect(core, Patience::UntilStopped).await? {
        // The task that connected goes on once recovery ran over what its
        // connect listed, as when recovery ran inside the connect. (A task
        // that found the connection made by another goes on at once, as
        // before: the heartbeat is not held up by another's recovery.)
        core.link.learnt.caught_up(core).await;
    }
    core.link
        .conn
        .read()
        .await
        .as_ref()
        .map(|c| c.connection_id.clone())
        .ok_or_else(|| Error::new(Kind::Unreachable, "not connected"))
}

/// Reacts to a connection-level refusal: `lease_expired` and an own-instance
/// supersede reconnect (returns `true`: try again); another instance stops
/// claiming. Anything else returns `false`.
pub(crate) async fn handle_refusal(core: &Arc<Core>, used: &str, e: &ClientError) -> bool {
    if e.status() == Some(401) || e.code() == Some("missing_scope") {
        core.fail(Error::from(e.clone()));
        return false;
    }
    match e.code() {
        Some("lease_expired") => {}
        Some("connection_superseded") => {
            let message = match e {
                ClientError::Api(api) => api.body.message.as_str(),
                _ => "",
            };
            let own = names_instance(message, std::slice::from_ref(&core.cfg.instance_id));
            // On a database shared by replicas the identity's lease says who
            // holds it: a process that connected as this identity while this
            // one still holds its token is fenced (a replica that held it
            // before, a paused process) and stops at its next renewal, so
            // this one connects again; if the token moved on, this one is
            // the fenced one, and stops saying so. But only a process this
            // database recorded as a holder of the identity is such a
            // takeover: any other is a twin with the same executor id on
            // another database, which no lease here can tell off, and the
            // later connector serves (protocol §4).
            if !own && core.lease.is_shared() {
                match core.lease.superseded_by_a_holder(message).await {
                    Ok(true) => {}
                    Ok(false) => {
                        if !core.life.is_halted() {
                            core.fail(Error::new(
                                Kind::Superseded,
                                format!(
                                    "another process connected as executor {} ({e}), and it never held this identity on this process's database ({}): two processes with one executor id on two databases (a blue/green switch, a second region); the later one serves, and this one stops claiming: give each its own executor id, or stop one of them",
                                    core.cfg.executor_id,
                                    core.lease.database().unwrap_or_default()
                                ),
                            ));
                        }
                        return false;
                    }
                    // Asked again at the next refusal (the next heartbeat).
                    Err(why) => {
                        tracing::warn!(executor_id = %core.cfg.executor_id, error = %e, %why, "superseded by another process, and this database could not say whether it ever held the identity: not connecting again before it can");
                        return false;
                    }
                }
                if core.lease.confirm(core).await.is_err() {
                    if !core.life.is_halted() {
                        core.fail(Error::new(
                            Kind::Superseded,
                            format!("another process connected as executor {} ({e}), and this process could not confirm that it still holds the identity's lease: check the connection to PostgreSQL", core.cfg.executor_id),
                        ));
                    }
                    return false;
                }
                tracing::warn!(executor_id = %core.cfg.executor_id, error = %e, "superseded by a process that no longer holds this executor identity's lease: connecting again");
            } else if !own {
                core.fail(Error::new(
                    Kind::Superseded,
                    format!("another process connected as executor {} ({e}); two live processes share one executor id: give each its own", core.cfg.executor_id),
                ));
                return false;
            }
        }
        _ => return false,
    }
    {
        let mut conn = core.link.conn.write().await;
        if conn.as_ref().is_some_and(|c| c.connection_id == used) {
            *conn = None;
        }
    }
    !core.life.is_halted() && connection_id(core).await.is_ok()
}

pub(crate) async fn heartbeat_loop(core: Arc<Core>) {
    loop {
        let interval = core
            .link
            .conn
            .read()
            .await
            .as_ref()
            .map_or(Duration::from_secs(1), |c| c.heartbeat_interval);
        tokio::select! {
            _ = core.life.halted() => return,
            _ = tokio::time::sleep(interval) => {}
        }
        match heartbeat(&core).await {
            Ok(true) => core.health.platform(Ok(())),
            Ok(false) => {}
            Err(ClientError::Unreachable(m)) => {
                tracing::debug!(error = %m, "heartbeat failed");
                core.health.platform(Err(m));
            }
            Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
        }
    }
}

/// One heartbeat: `Ok(true)` when the platform answered, `Ok(false)` when
/// there was no connection to beat on.
async fn heartbeat(core: &Arc<Core>) -> Result<bool, ClientError> {
    let Ok(connection_id) = connection_id(core).await else {
        return Ok(false);
    };
    if let Err(e) = beat_now(core, &connection_id).await {
        handle_refusal(core, &connection_id, &e).await;
        return Err(e);
    }
    Ok(true)
}

/// One heartbeat listing the calls in flight; applies the answer's advice
/// and its `cancel_requested`.
async fn beat_now(core: &Arc<Core>, connection_id: &str) -> Result<(), ClientError> {
    let body = Heartbeat {
        connection_id: connection_id.to_owned(),
        in_flight: in_flight(core),
    };
    let answer = core.client.heartbeat(&core.cfg.executor_id, &body).await?;
    if let Some(conn) = core
        .link
        .conn
        .write()
        .await
        .as_mut()
        .filter(|c| c.connection_id == connection_id)
    {
        conn.heartbeat_interval = beat(answer.heartbeat_interval_ms, conn.lease_ttl_ms);
    }
    for c in answer.cancel_requested {
        core.cancel_call(&super::CallKey {
            run_id: c.run_id,
            call_id: c.call_id,
        });
    }
    Ok(())
}

/// `commit_point()`: a heartbeat right now, which must succeed.
pub(crate) async fn lease_check(core: &Arc<Core>) -> Result<(), CommitPointError> {
    let connection_id = core
        .link
        .conn
        .read()
        .await
        .as_ref()
        .map(|c| c.connection_id.clone());
    let Some(connection_id) = connection_id else {
        return Err(CommitPointError::LeaseLost);
    };
    match beat_now(core, &connection_id).await {
        Ok(()) => Ok(()),
        Err(e) => {
            let core = core.clone();
            tokio::spawn(async move { handle_refusal(&core, &connection_id, &e).await });
            Err(CommitPointError::LeaseLost)
        }
    }
}

/// The calls this process is driving, for `in_flight`.
fn in_flight(core: &Core) -> Vec<InFlight> {
    core.calls
        .active
        .lock()
        .expect("not poisoned")
        .keys()
        .map(|k| InFlight {
            run_id: k.run_id.clone(),
            call_id: k.call_id.clone(),
        })
        .collect()
}

/// Tells the platform this executor leaves (`drain` or `detach`): `true`
/// when the platform answered, so it holds no call of this executor that
/// did not start (a drain gives them back).
pub(crate) async fn disconnect(core: &Arc<Core>, how: Shutdown) -> Result<bool, Error> {
    core.life.enter(Phase::Stopping);
    let Some(conn) = core.link.conn.read().await.clone() else {
        return Ok(false);
    };
    let mode = match how {
        Shutdown::Drain { .. } => DisconnectMode::Drain,
        Shutdown::Detach => DisconnectMode::Detach,
    };
    let body = Disconnect {
        connection_id: conn.connection_id,
        mode,
    };
    match core.client.disconnect(&core.cfg.executor_id, &body).await {
        Ok(answer) => {
            tracing::info!(
                released = answer.released.len(),
                retained = answer.retained.len(),
                "disconnected"
            );
            Ok(true)
        }
        // Already over (expired, or superseded by a newer connection).
        Err(e) if matches!(e.code(), Some("lease_expired" | "connection_superseded")) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Whether `message` names one of `instances` as a word of its own (an
/// instance id's characters: letters, digits, `_`, `.`, `:` and `-`),
/// alone or followed by `:` and a suffix (an adopter's executor).
pub(crate) fn names_instance(message: &str, instances: &[String]) -> bool {
    message
        .split(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-')))
        .map(|word| word.trim_end_matches(['.', ':']))
        .any(|word| {
            instances.iter().any(|i| {
                word == i
                    || word
                        .strip_prefix(i.as_str())
                        .is_some_and(|rest| rest.starts_with(':'))
            })
        })
}

/// Why the platform could not be reached, as the health's reason holds it
/// (which says "platform unreachable: " itself, as the heartbeat's does).
fn unreachable_why(e: &ClientError) -> String {
    match e {
        ClientError::Unreachable(m) => m.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::names_instance;

    #[test]
    fn the_reason_of_an_unreachable_platform_says_so_once() {
        use crate::net::client::ClientError;
        let down =
            ClientError::Unreachable("POST /v1/executors/connect: connection refused".into());
        assert_eq!(
            super::unreachable_why(&down),
            "POST /v1/executors/connect: connection refused"
        );
        let held = ClientError::NotReady("POST /v1/executors/connect".into());
        assert_eq!(
            super::unreachable_why(&held),
            "POST /v1/executors/connect: not sent, the executor's lease is not live (it could not be renewed)"
        );
    }

    #[test]
    fn a_superseder_is_told_by_its_instance_id_as_a_word() {
        let held = vec!["ins_1".to_owned(), "ins_adopter".to_owned()];
        assert!(names_instance("superseded by instance ins_1", &held));
        assert!(names_instance(
            "superseded by instance ins_adopter:1a2b3c4d.",
            &held
        ));
        assert!(!names_instance("superseded by instance ins_12", &held));
        assert!(!names_instance("superseded by instance other:ins_1", &held));
        assert!(!names_instance("superseded by instance ins_twin", &held));
        // An own instance id is a word too, never a part of another.
        let own = vec!["ins_1".to_owned()];
        assert!(!names_instance(
            "connection con_7 was superseded by a new connect from instance_id ins_12",
            &own
        ));
    }
}
