//! Replicas on one PostgreSQL database that come back and survive a
//! pause, one executor process (this test's) at a time per identity, on
//! the development platform. A replica is "paused" by pausing the TCP
//! proxies its database and platform connections go through (`pause.rs`):
//! it stands still to the world while its timers go on, as after SIGSTOP.
//! The handler of a paused replica is held by the test, and makes its
//! effect when the test resumes the replica.
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};
use serde_json::json;
use sqlx::Connection;
use toolrunner::platform::{NewToolCall, Platform};
use toolrunner::protocol::wire::CallState;
use toolrunner::testing::store::PgStore;
use toolrunner::{
    CallContext, Effect, Executor, Reconciled, RunningExecutor, Shutdown, Tool, ToolError,
    async_trait,
};
use toolrunner_devserver::DevServer;

use super::pause::{Proxy, address_of};
use super::{LeaseRow, clean_up, lease};

/// Each lease of these tests lives this long after a renewal.
pub(super) const TTL: Duration = Duration::from_millis(500);
/// The platform's lease.
const PLATFORM_LEASE_MS: u64 = 1_000;

/// What a probe call does (its arguments).
#[toolrunner::schema]
#[derive(Debug, Deserialize)]
pub(super) struct Probe {
    /// `ok`, `held` (waits for the test, then makes its effect), `unknown`
    /// (fails with an unknown outcome, and its hook cannot tell),
    /// `long_tx` (holds its transaction for a while) or `commit_held`
    /// (waits for the test, passes its commit point, waits for the test
    /// again, then makes its effect).
    mode: String,
}

/// A probe's result.
#[toolrunner::schema]
#[derive(Debug, Serialize)]
pub(super) struct Done {
    /// The number of effects made so far.
    effects: usize,
}

/// The business system these replicas share.
#[derive(Default)]
pub(super) struct Business {
    /// Operation keys of the effects made.
    effects: Mutex<Vec<String>>,
    /// Handler starts: operation key and mode.
    starts: Mutex<Vec<(String, String)>>,
    /// Held handlers go on when notified.
    pub(super) gate: tokio::sync::Notify,
    /// A `commit_held` handler passes its commit point when notified…
    pub(super) commit: tokio::sync::Notify,
    /// …says that it did (or why not)…
    pub(super) committed: Mutex<Option<Result<Instant, String>>>,
    /// …and makes its effect when notified again.
    pub(super) effect: tokio::sync::Notify,
    /// When the `reconcile` hook was asked, each time.
    pub(super) hooks: Mutex<Vec<Instant>>,
}

impl Business {
    pub(super) fn effects(&self) -> Vec<String> {
        self.effects.lock().expect("lock").clone()
    }

    pub(super) fn starts(&self) -> usize {
        self.starts.lock().expect("lock").len()
    }

    fn mode_of(&self, key: &str) -> Option<String> {
        let starts = self.starts.lock().expect("lock");
        starts
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, m)| m.clone())
    }
}

/// The write tool `probe.write`.
struct ProbeTool {
    business: Arc<Business>,
    effect: Effect,
}

#[async_trait]
impl Tool for ProbeTool {
    type Input = Probe;
    type Output = Done;

    fn name(&self) -> &str {
        if self.effect == Effect::Transactional {
            "probe.tx"
        } else {
            "probe.write"
        }
    }

    fn description(&self) -> &str {
        "A probe of the replicas"
    }

    fn effect(&self) -> Effect {
        self.effect
    }

    fn commit_window(&self) -> Duration {
        Duration::from_secs(4)
    }

    async fn call(&self, ctx: &CallContext, input: Probe) -> Result<Done, ToolError> {
        let key = ctx.operation_key().to_owned();
        self.business
            .starts
            .lock()
            .expect("lock")
            .push((key.clone(), input.mode.clone()));
        match input.mode.as_str() {
            "held" => self.business.gate.notified().await,
            "commit_held" => {
                self.business.commit.notified().await;
                let passed = ctx.commit_point().await;
                *self.business.committed.lock().expect("lock") = Some(
                    passed
                        .as_ref()
                        .map(|()| Instant::now())
                        .map_err(ToString::to_string),
                );
                passed?;
                self.business.effect.notified().await;
            }
            "unknown" => return Err(ToolError::unknown("the downstream did not answer")),
            "long_tx" => {
                ctx.transaction(async |tx| {
                    sqlx::query("SELECT 1")
                        .execute(tx.postgres()?)
                        .await
                        .map_err(ToolError::unknown)?;
                    // Longer than the lease and the grace together.
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    Ok(())
                })
                .await?;
            }
            _ => {}
        }
        let mut effects = self.business.effects.lock().expect("lock");
        effects.push(key);
        Ok(Done {
            effects: effects.len(),
        })
    }

    /// Looks the operation key up; the hook of an `unknown` call cannot
    /// tell.
    async fn reconcile(&self, ctx: &CallContext) -> Reconciled<Done> {
        self.business
            .hooks
            .lock()
            .expect("lock")
            .push(Instant::now());
        if self.business.mode_of(ctx.operation_key()).as_deref() == Some("unknown") {
            return Reconciled::Unknown;
        }
        let effects = self.business.effects();
        if effects.iter().any(|k| k == ctx.operation_key()) {
            Reconciled::Happened(Done {
                effects: effects.len(),
            })
        } else {
            Reconciled::DidNotHappen
        }
    }
}

/// One test's platform, binding, business system and database.
pub(super) struct World {
    pub(super) server: DevServer,
    pub(super) admin: Platform,
    agent_id: String,
    binding_id: String,
    agent_version: String,
    pub(super) business: Arc<Business>,
    pub(super) url: String,
    ids: Mutex<Vec<String>>,
}

impl World {
    async fn new(url: &str) -> Result<World> {
        let server = DevServer::builder()
            .listen("127.0.0.1:0".parse()?)
            .lease_ttl_ms(PLATFORM_LEASE_MS)
            .heartbeat_interval_ms(200)
            .start()
            .await?;
        let admin = Platform::new(&server.base_url(), "dev-admin")?;
        let agent = admin.create_agent("takeover").await?;
        let binding = admin
            .create_binding(&agent.agent_id, "takeover", &["probe.write", "probe.tx"])
            .await?;
        let mut world = World {
            server,
            admin,
            agent_id: agent.agent_id,
            binding_id: binding.binding_id,
            agent_version: String::new(),
            business: Arc::default(),
            url: url.to_owned(),
            ids: Mutex::default(),
        };
        let definitions = world.executor("definitions", None).build()?;
        world.agent_version = world
            .admin
            .publish(&world.agent_id, definitions.tool_definitions())
            .await?
            .agent_version;
        Ok(world)
    }

    /// A fresh executor id of this test (dropped with its schema after).
    pub(super) fn id(&self, name: &str) -> String {
        let id = format!("tk-{name}-{:08x}", rand::random::<u32>());
        self.ids.lock().expect("lock").push(id.clone());
        id
    }

    /// An executor of `id` on the shared database, with a takeover grace
    /// if given.
    pub(super) fn executor(
        &self,
        id: &str,
        grace: Option<Duration>,
    ) -> toolrunner::ExecutorBuilder {
        self.executor_via(id, grace, &self.url, &self.server.base_url())
    }

    /// [`executor`](Self::executor) reaching the database and the platform
    /// at these URLs (proxies).
    pub(super) fn executor_via(
        &self,
        id: &str,
        grace: Option<Duration>,
        db: &str,
        base: &str,
    ) -> toolrunner::ExecutorBuilder {
        let mut b = Executor::builder()
            .base_url(base)
            .token("dev-executor")
            .executor_id(id)
            .binding_id(&self.binding_id)
            .store_url(db)
            .lease_ttl(TTL)
            .poll_interval(Duration::from_millis(50))
            .reconcile_interval(Duration::from_millis(100))
            .request_timeout(Duration::from_secs(2))
            .backoff(Duration::from_millis(20), Duration::from_millis(200), 3)
            .allow_all()
            .tool(ProbeTool {
                business: self.business.clone(),
                effect: Effect::Write,
            })
            .tool(ProbeTool {
                business: self.business.clone(),
                effect: Effect::Transactional,
            });
        if let Some(g) = grace {
            b = b.takeover_grace(g);
        }
        b
    }

    pub(super) async fn run(&self, tool: &str, modes: &[&str]) -> Result<String> {
        let calls = modes
            .iter()
            .map(|m| NewToolCall::new(tool, json!({ "mode": m })))
            .collect();
        Ok(self
            .admin
            .create_run(&self.agent_version, "takeover", calls)
            .await?
            .run_id)
    }

    /// An executor of `id` leaves a call waiting for a person (its hook
    /// cannot tell), and is lost: whoever adopts the identity keeps it.
    async fn leave_work(&self, id: &str) -> Result<()> {
        drop(self.waiting_for_a_person(self.executor(id, None)).await?);
        Ok(())
    }

    /// An executor of `id` whose database and platform connections go
    /// through pausable proxies, with a call waiting for a person (its hook
    /// cannot tell, and its reconciliation writes now and then).
    async fn waiting_behind_proxies(&self, id: &str) -> Result<(Proxy, Proxy, RunningExecutor)> {
        let db = Proxy::start(address_of(&self.url)).await?;
        let web = Proxy::start(address_of(&self.server.base_url())).await?;
        let (db_url, base) = (db.url(&self.url), web.url(&self.server.base_url()));
        let running = self
            .waiting_for_a_person(self.executor_via(id, None, &db_url, &base))
            .await?;
        Ok((db, web, running))
    }

    /// Starts `executor` with a call of its own that waits for a person
    /// (its hook cannot tell).
    async fn waiting_for_a_person(
        &self,
        executor: toolrunner::ExecutorBuilder,
    ) -> Result<RunningExecutor> {
        let run_id = self.run("probe.write", &["unknown"]).await?;
        let running = executor.build()?.start().await?;
        self.admin
            .wait_for(
                &run_id,
                Duration::from_secs(20),
                "waiting for a person",
                |r| r.tool_calls[0].state == CallState::ReconciliationRequired,
            )
            .await?;
        Ok(running)
    }

    /// Waits until `by` adopted `id` and connected as it; the adoption's
    /// token.
    async fn adopted_and_connected(&self, id: &str, by: &str) -> Result<i64> {
        let (token, ..) = wait_lease(&self.url, id, Duration::from_secs(10), "adopted", |l| {
            l.2.as_deref() == Some(by)
        })
        .await?;
        let end = Instant::now() + Duration::from_secs(10);
        while self.connection_of(id).await?.is_none() {
            ensure!(Instant::now() < end, "the adopter never connected as {id}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(token)
    }

    /// The connection the platform holds for an executor identity.
    pub(super) async fn connection_of(&self, id: &str) -> Result<Option<String>> {
        let d = self
            .admin
            .diagnostics(&self.agent_id, &self.binding_id)
            .await?;
        Ok(d.executors
            .iter()
            .find(|e| e.executor_id == id)
            .map(|e| e.connection_id.clone()))
    }

    async fn finish(self) -> Result<()> {
        let ids = self.ids.lock().expect("lock").clone();
        self.server.shutdown().await;
        clean_up(&self.url, &ids).await
    }
}

/// Whether a transaction holds the lease row of `id` locked (a locking
/// read that does not wait is refused).
async fn lease_row_locked(url: &str, id: &str) -> Result<bool> {
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let locked = sqlx::query(
        "SELECT 1 FROM toolrunner_leases.executor_leases WHERE executor_id = $1 FOR UPDATE NOWAIT",
    )
    .bind(id)
    .fetch_optional(&mut conn)
    .await;
    conn.close().await?;
    match locked {
        Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("55P03") => Ok(true),
        other => other.map(|_| false).map_err(Into::into),
    }
}

/// Waits until `running` stops, saying that it lost its lease.
pub(super) async fn stops_fenced(running: &RunningExecutor, who: &str) -> Result<()> {
    let stopped = tokio::time::timeout(Duration::from_secs(10), running.wait())
        .await
        .with_context(|| format!("{who} did not stop"))?;
    let why = stopped.err().context("it stopped without saying why")?;
    ensure!(
        why.to_string().contains("lost its lease"),
        "it stopped for another reason: {why}"
    );
    Ok(())
}

/// Waits until the lease row of `id` satisfies `done`.
pub(super) async fn wait_lease(
    url: &str,
    id: &str,
    within: Duration,
    what: &str,
    done: impl Fn(&LeaseRow) -> bool,
) -> Result<LeaseRow> {
    let end = Instant::now() + within;
    loop {
        let row = lease(url, id).await?;
        if let Some(row) = row.as_ref().filter(|r| done(r)) {
            return Ok(row.clone());
        }
        ensure!(
            Instant::now() < end,
            "the lease of {id} was not {what} within {within:?}: {row:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs `body` with a world, cleaning up whether it passed or not.
pub(super) async fn with_world<F, Fut>(url: &str, body: F) -> Result<()>
where
    F: FnOnce(Arc<World>) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let world = Arc::new(World::new(url).await?);
    let outcome = body(world.clone()).await;
    let world = Arc::into_inner(world).context("the test kept its world")?;
    let cleaned = world.finish().await;
    outcome.and(cleaned)
}

pub(super) async fn drain(running: RunningExecutor) {
    let _ = running
        .shutdown(Shutdown::Drain {
            deadline: Duration::from_secs(2),
        })
        .await;
}

/// A replica with a call of its own in flight, its database and platform
/// connections paused (as by SIGSTOP) past its lease and the grace: the
/// other replica adopts it and recovers the call (`running`, a write tool:
/// `reconciliation_required`). The paused replica's handler, which has no
/// commit point, makes its effect when the replica resumes, within the
/// tool's commit window: the adopter's hook, asked only after the old
/// holder's lease lapsed plus that window, finds it. The call is
/// `completed` with one effect, never `failed`.
pub(crate) async fn a_paused_handler_has_its_effect_found_by_the_adopter(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let db = Proxy::start(address_of(&w.url)).await?;
        let web = Proxy::start(address_of(&w.server.base_url())).await?;
        let (a, b) = (w.id("a"), w.id("b"));
        let run_id = w.run("probe.write", &["held"]).await?;
        let paused = w
            .executor_via(&a, None, &db.url(&w.url), &web.url(&w.server.base_url()))
            .build()?
            .start()
            .await?;
        let end = Instant::now() + Duration::from_secs(20);
        while w.business.starts() == 0 {
            ensure!(Instant::now() < end, "the handler never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        db.pause();
        web.pause();
        let paused_at = Instant::now();
        let adopter = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        wait_lease(&w.url, &a, Duration::from_secs(10), "adopted", |l| {
            l.2.as_deref() == Some(b.as_str())
        })
        .await?;
        // Past the grace, well short of the lease and the commit window.
        tokio::time::sleep(Duration::from_millis(2_000).saturating_sub(paused_at.elapsed())).await;
        db.resume();
        web.resume();
        w.business.gate.notify_waiters();
        let run = w
            .admin
            .wait_for(&run_id, Duration::from_secs(20), "final", |r| {
                r.tool_calls.iter().all(|c| c.state.is_terminal())
            })
            .await?;
        let call = &run.tool_calls[0];
        let effects = w.business.effects();
        ensure!(
            call.state == CallState::Completed,
            "the paused handler's call is {} with {} effects (the adopter's hook was asked before the old holder's commit window)",
            call.state.as_str(),
            effects.len()
        );
        ensure!(effects.len() == 1, "{} effects", effects.len());
        drop(paused);
        drain(adopter).await;
        Ok(())
    })
    .await
}

/// A replica paused past the platform's lease and the grace resumes after
/// the other replica adopted its identity and connected as it: its
/// heartbeat is answered `lease_expired`, and it must not connect again
/// (that would supersede the adopter). It checks its fencing token first,
/// finds it moved on, and stops.
pub(crate) async fn a_paused_replica_never_connects_over_its_adopter(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        // A call the adopter must keep the identity for (its hook cannot
        // tell), so that it stays connected as the paused one.
        let (db, web, paused) = w.waiting_behind_proxies(&a).await?;
        db.pause();
        web.pause();
        // Adopted after the platform's lease of the paused one expired.
        let adopter = w
            .executor(&b, Some(Duration::from_millis(1_200)))
            .build()?
            .start()
            .await?;
        wait_lease(&w.url, &a, Duration::from_secs(10), "adopted", |l| {
            l.2.as_deref() == Some(b.as_str())
        })
        .await?;
        let end = Instant::now() + Duration::from_secs(10);
        let adopters = loop {
            let now = w.connection_of(&a).await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            // Connected as the identity, and settled on it.
            if now.is_some() && now == w.connection_of(&a).await? {
                break now;
            }
            ensure!(Instant::now() < end, "the adopter never connected as {a}");
        };
        db.resume();
        web.resume();
        stops_fenced(&paused, "the resumed replica").await?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = w.connection_of(&a).await?;
        ensure!(
            after == adopters,
            "the resumed replica connected over its adopter: the platform's connection of {a} went from {adopters:?} to {after:?}"
        );
        drop(paused);
        drain(adopter).await;
        Ok(())
    })
    .await
}

/// A replica paused (as by SIGSTOP) inside one of its store's write
/// transactions, after the token check took its lock on the lease row and
/// before the commit, holds that lock as long as the server keeps its
/// session: the server ends a session idle in such a transaction, so the
/// identity is still adopted (its adopter locks the row), and the thawed
/// replica stops, fenced.
pub(crate) async fn a_replica_paused_inside_a_write_is_adopted(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        // A call whose reconciliation writes now and then (its hook cannot
        // tell): the replica opens write transactions while it waits.
        let (db, web, paused) = w.waiting_behind_proxies(&a).await?;
        // Paused right behind the first statement after a `BEGIN`: the
        // token check, which the server runs and locks the row for.
        db.pause_after_next(b"BEGIN\0");
        let end = Instant::now() + Duration::from_secs(20);
        while !db.is_paused() {
            ensure!(
                Instant::now() < end,
                "the replica opened no write transaction"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        web.pause();
        ensure!(
            lease_row_locked(&w.url, &a).await?,
            "the paused replica holds no lock on its lease row"
        );
        let adopter = w
            .executor(&b, Some(Duration::from_millis(1_200)))
            .build()?
            .start()
            .await?;
        let adopted = wait_lease(&w.url, &a, Duration::from_secs(20), "adopted", |l| {
            l.2.as_deref() == Some(b.as_str())
        })
        .await;
        db.resume();
        web.resume();
        adopted?;
        // Thawed, it finds its transaction ended and its identity taken.
        stops_fenced(&paused, "the thawed replica").await?;
        drain(adopter).await;
        Ok(())
    })
    .await
}

/// A healthy replica whose transactional handler holds its transaction
/// longer than the lease and the grace together keeps its identity: its
/// renewals do not wait for its own writes. The call completes once.
pub(crate) async fn a_long_transaction_keeps_its_identity(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        let run_id = w.run("probe.tx", &["long_tx"]).await?;
        let busy = w.executor(&a, None).build()?;
        let instance = busy.instance_id().to_owned();
        let busy = busy.start().await?;
        let end = Instant::now() + Duration::from_secs(20);
        while w.business.starts() == 0 {
            ensure!(Instant::now() < end, "the handler never started");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let watcher = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        let run = w.admin.wait_settled(&run_id, Duration::from_secs(20)).await?;
        let (token, holder, adopted_by, age) = lease(&w.url, &a).await?.context("a's lease")?;
        ensure!(
            adopted_by.is_none() && holder == instance && token == 1,
            "the busy replica's identity moved: token {token}, holder {holder}, adopted by {adopted_by:?}"
        );
        ensure!(age < 1_000, "its lease was renewed {age} ms ago");
        ensure!(
            run.tool_calls[0].state == CallState::Completed,
            "the call is {}",
            run.tool_calls[0].state.as_str()
        );
        ensure!(w.business.starts() == 1, "{} handler runs", w.business.starts());
        drain(busy).await;
        drain(watcher).await;
        Ok(())
    })
    .await
}

/// An adopted identity whose executor stops serving (here the platform
/// stops accepting the token for it: `401`, and the executor stops
/// claiming) is let go: its adopter renews it no more, so it lapses (and
/// is adopted again), instead of being held for ever by an executor that
/// does nothing.
pub(crate) async fn an_adopted_identity_that_stops_serving_is_let_go(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        // Work the adopter keeps the identity for (its hook cannot tell).
        w.leave_work(&a).await?;
        // The adopter reaches the platform through a proxy that refuses,
        // once told to, the token for the adopted identity alone.
        let revoked = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let proxy = {
            let (revoked, a) = (revoked.clone(), a.clone());
            super::proxy::start(&w.server.base_url(), move |_, path, body| {
                let for_a = path.contains(&format!("/executors/{a}/"))
                    || (path.ends_with("/executors/connect")
                        && String::from_utf8_lossy(body).contains(&a));
                if for_a && revoked.load(std::sync::atomic::Ordering::SeqCst) {
                    super::proxy::Verdict::Unauthorized
                } else {
                    super::proxy::Verdict::Forward
                }
            })
            .await
        };
        let adopter = w
            // Above the renewal period (so that only a lapse is adopted).
            .executor_via(&b, Some(Duration::from_millis(1_200)), &w.url, &proxy)
            .stream(false)
            .build()?
            .start()
            .await?;
        let (adopted_token, ..) = wait_lease(&w.url, &a, Duration::from_secs(10), "adopted", |l| {
            l.2.as_deref() == Some(b.as_str())
        })
        .await?;
        let end = Instant::now() + Duration::from_secs(10);
        while w.connection_of(&a).await?.is_none() {
            ensure!(Instant::now() < end, "the adopter never connected as {a}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        revoked.store(true, std::sync::atomic::Ordering::SeqCst);
        // The adopter's executor of it stopped: its lease is renewed no
        // more, so it lapses (and is adopted again, with a new token).
        wait_lease(&w.url, &a, Duration::from_secs(10), "let go", |l| {
            l.0 != adopted_token || l.3 > 2 * TTL.as_millis() as i64
        })
        .await
        .context("the adopted identity whose executor stopped serving is still held")?;
        drain(adopter).await;
        Ok(())
    })
    .await
}

/// Two lapsed identities of one binding, the older one's store broken (its
/// schema holds another identity): the replica adopts the other one
/// instead of trying the broken one for ever.
pub(crate) async fn a_broken_lapsed_identity_blocks_no_other(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (broken, fine, b) = (w.id("broken"), w.id("fine"), w.id("b"));
        for (id, holder) in [(&broken, "ins_broken"), (&fine, "ins_fine")] {
            let store = PgStore::connect_as(&w.url, id, &w.binding_id, holder).await?;
            drop(store);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut conn = sqlx::PgConnection::connect(&w.url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {}.store_identity SET executor_id = 'someone-else'",
            PgStore::identity_schema(&broken)
        )))
        .execute(&mut conn)
        .await?;
        conn.close().await?;
        let adopter = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        // Adopted (the token bumped), and maybe let go again at once
        // (nothing was left).
        let adopted = wait_lease(&w.url, &fine, Duration::from_secs(15), "adopted", |l| {
            l.0 > 1
        })
        .await;
        drain(adopter).await;
        adopted.context("a broken lapsed identity blocked the adoption of a fine one")?;
        Ok(())
    })
    .await
}

/// A replica that drained with nothing left is never adopted: its
/// identity was released.
pub(crate) async fn a_clean_drain_is_never_adopted(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        let run_id = w.run("probe.write", &["ok"]).await?;
        let leaving = w.executor(&a, None).build()?.start().await?;
        w.admin
            .wait_settled(&run_id, Duration::from_secs(20))
            .await?;
        leaving
            .shutdown(Shutdown::Drain {
                deadline: Duration::from_secs(5),
            })
            .await?;
        let watcher = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        tokio::time::sleep(TTL * 2 + Duration::from_millis(300) * 4).await;
        let row = lease(&w.url, &a).await?.context("a's lease")?;
        drain(watcher).await;
        ensure!(
            row.2.is_none(),
            "a replica that drained clean was adopted: {row:?}"
        );
        Ok(())
    })
    .await
}

/// A start frozen (as by SIGSTOP) while it holds its lease row locked,
/// between its `SELECT … FOR UPDATE` and its commit, holds no later start
/// of the identity back for long: the server ends its session once it
/// sat idle in that transaction a few seconds, as it does for the store's
/// own transactions.
pub(crate) async fn a_start_frozen_while_it_takes_the_lease_holds_no_other_back(
    url: &str,
) -> Result<()> {
    with_world(url, |w| async move {
        let db = Proxy::start(address_of(&w.url)).await?;
        let a = w.id("a");
        // The identity's row, released by a clean drain.
        drain(w.executor(&a, None).build()?.start().await?).await;
        // Paused right behind the row's locking read: its text goes out
        // to be prepared, then the execution, behind which the proxy
        // pauses.
        db.pause_after_next(b"WHERE executor_id = $1 FOR UPDATE");
        let frozen = w
            .executor_via(&a, None, &db.url(&w.url), &w.server.base_url())
            .build()?;
        let frozen = tokio::spawn(frozen.start());
        let end = Instant::now() + Duration::from_secs(20);
        while !db.is_paused() {
            ensure!(Instant::now() < end, "the start never took its lease");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ensure!(
            lease_row_locked(&w.url, &a).await?,
            "the frozen start holds no lock on its lease row"
        );
        let again = tokio::time::timeout(
            Duration::from_secs(15),
            w.executor(&a, None).build()?.start(),
        )
        .await;
        db.resume();
        let again = again
            .context("a start waited for one frozen while it took the lease")?
            .context("the second start failed")?;
        drain(again).await;
        let _ = tokio::time::timeout(Duration::from_secs(10), frozen).await;
        Ok(())
    })
    .await
}

/// An adoption that took long (here its store's opening waits for a lock
/// the test holds) starts its lease when it commits, not when it began: a
/// replica looking right after does not adopt the identity again.
pub(crate) async fn a_slow_adoption_is_not_adopted_again_at_once(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (x, b, c) = (w.id("x"), w.id("b"), w.id("c"));
        // Work its adopter keeps the identity for.
        w.leave_work(&x).await?;
        let mut lock = sqlx::PgConnection::connect(&w.url).await?;
        sqlx::query("BEGIN").execute(&mut lock).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "LOCK TABLE {}.store_identity IN ACCESS EXCLUSIVE MODE",
            PgStore::identity_schema(&x)
        )))
        .execute(&mut lock)
        .await?;
        let grace = Some(Duration::from_millis(800));
        let slow = w.executor(&b, grace).build()?.start().await?;
        // b's adoption has the lapsed identity locked, and waits.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let other = w.executor(&c, grace).build()?.start().await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        sqlx::query("COMMIT").execute(&mut lock).await?;
        lock.close().await?;
        let adopted = wait_lease(&w.url, &x, Duration::from_secs(10), "adopted", |l| {
            l.2.is_some()
        })
        .await?;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let later = lease(&w.url, &x).await?.context("x's lease")?;
        drain(slow).await;
        drain(other).await;
        // Adopted once (by whichever replica's adoption committed first:
        // both waited for the lock), and not again at once.
        ensure!(
            later.0 == adopted.0 && later.2 == adopted.2,
            "the slow adoption was adopted again at once: {adopted:?} then {later:?} (replicas {b} and {c})"
        );
        Ok(())
    })
    .await
}

/// A replica adopted while it was gone starts again with its own id (a
/// StatefulSet pod, a systemd unit): it takes its identity back at once,
/// the adopter's executor of it stops, and it serves.
pub(crate) async fn an_adopted_replica_restarted_serves_again(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        // Work the adopter keeps the identity for.
        w.leave_work(&a).await?;
        let adopter = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        let adopted = wait_lease(&w.url, &a, Duration::from_secs(10), "adopted", |l| {
            l.2.as_deref() == Some(b.as_str())
        })
        .await?;
        let again = w.executor(&a, None).build()?;
        let instance = again.instance_id().to_owned();
        let started = Instant::now();
        let again = again
            .start()
            .await
            .context("the replica restarted after its adoption did not start")?;
        ensure!(
            started.elapsed() < Duration::from_secs(3),
            "taking the identity back from its adopter took {:?}",
            started.elapsed()
        );
        let row = lease(&w.url, &a).await?.context("a's lease")?;
        ensure!(
            row.1 == instance && row.2.is_none() && row.0 > adopted.0,
            "the restarted replica does not hold its identity: {row:?}"
        );
        // The adopter lets go; the restarted replica serves new calls.
        drain(adopter).await;
        let run_id = w.run("probe.write", &["ok", "ok"]).await?;
        let run = w
            .admin
            .wait_settled(&run_id, Duration::from_secs(20))
            .await?;
        for c in &run.tool_calls {
            ensure!(
                c.state == CallState::Completed && c.executor_id.as_deref() == Some(a.as_str()),
                "a new call is {} by {:?}",
                c.state.as_str(),
                c.executor_id
            );
        }
        ensure!(
            w.connection_of(&a).await?.is_some(),
            "the restarted replica is not connected"
        );
        drain(again).await;
        Ok(())
    })
    .await
}

/// Two live processes started with one executor id: the second fails fast,
/// naming the id, and the first serves on.
pub(crate) async fn a_second_live_process_of_one_id_fails_fast(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let a = w.id("a");
        let first = w.executor(&a, None).build()?;
        let instance = first.instance_id().to_owned();
        let first = first.start().await?;
        let started = Instant::now();
        let second = tokio::time::timeout(
            Duration::from_secs(10),
            w.executor(&a, None).build()?.start(),
        )
        .await
        .context("the second process did not fail within 10 s")?;
        let Err(e) = second else {
            bail!("the second process of {a} started");
        };
        ensure!(
            started.elapsed() < TTL * 4,
            "the second process took {:?} to fail",
            started.elapsed()
        );
        let said = e.to_string();
        ensure!(
            said.contains(&a) && said.contains("give every replica its own executor id"),
            "the error does not say what to do: {said}"
        );
        let row = lease(&w.url, &a).await?.context("a's lease")?;
        ensure!(
            row.1 == instance && row.0 == 1,
            "the first lost its lease: {row:?}"
        );
        let run_id = w.run("probe.write", &["ok"]).await?;
        let run = w
            .admin
            .wait_settled(&run_id, Duration::from_secs(20))
            .await?;
        ensure!(
            run.tool_calls[0].state == CallState::Completed,
            "the first does not serve: {}",
            run.tool_calls[0].state.as_str()
        );
        drain(first).await;
        Ok(())
    })
    .await
}

/// A process that no longer holds the identity's lease (its fenced former
/// holder, which this database recorded as a holder) connects as an
/// adopted identity: the adopter's executor of it still holds the token,
/// so it connects again instead of stopping, and the identity stays
/// served. (One superseded by an instance this database never recorded is
/// a twin on another database, and stops: `unlike.rs`.)
pub(crate) async fn an_adopter_superseded_by_a_process_without_the_lease_connects_again(
    url: &str,
) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        w.leave_work(&a).await?;
        let (_, former_instance, ..) = lease(&w.url, &a).await?.context("a's lease")?;
        let adopter = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        let adopted_token = w.adopted_and_connected(&a, &b).await?;
        let rogue = w
            .admin
            .with_token("dev-executor")
            .request(toolrunner::platform::Method::POST, "/executors/connect")
            .json(&json!({"executor_id": a, "instance_id": former_instance, "binding_id": w.binding_id,
                          "tools": ["probe.write"], "capacity": 1}))
            .send()
            .await?;
        ensure!(rogue.status == 200, "the rogue connect: {}", rogue.json());
        let theirs = rogue.json()["connection_id"].as_str().map(str::to_owned);
        // Connected again, and still holding the identity a while later.
        let end = Instant::now() + Duration::from_secs(10);
        loop {
            let now = w.connection_of(&a).await?;
            if now.is_some() && now != theirs {
                break;
            }
            ensure!(
                Instant::now() < end,
                "the adopter did not connect again over a process without the lease"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let row = lease(&w.url, &a).await?.context("a's lease")?;
        // The same adoption (not one that stopped, lapsed and was adopted
        // again).
        ensure!(
            row.0 == adopted_token && row.2.as_deref() == Some(b.as_str()),
            "the adopter's executor stopped instead of connecting again: {row:?}, adopted with token {adopted_token}"
        );
        drain(adopter).await;
        Ok(())
    })
    .await
}
