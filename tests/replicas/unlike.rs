//! Replicas that are not alike: unlike lease lengths, graces and
//! `auto_reconcile`, a release followed by a restart, a database clock
//! that steps, and twins of one executor id on two databases. Each
//! replica is an executor of this process on the world of `takeover.rs`,
//! its database and platform connections behind pausable proxies where it
//! must stand still (as by SIGSTOP).
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use sqlx::Connection;
use toolrunner::protocol::wire::CallState;
use toolrunner::testing::store::PgStore;

use super::lease;
use super::pause::{Proxy, address_of};
use super::takeover::{World, drain, wait_lease, with_world};

/// The probe tool's commit window (`takeover.rs`).
const WINDOW: Duration = Duration::from_secs(4);

/// Waits until the probe's handler started `n` times in all.
async fn started(w: &World, n: usize) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(20);
    while w.business.starts() < n {
        ensure!(Instant::now() < end, "the handler never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// The run's one call, once it settled for good.
async fn settled(w: &World, run_id: &str, within: Duration) -> Result<CallState> {
    let run = w
        .admin
        .wait_for(run_id, within, "final", |r| {
            r.tool_calls.iter().all(|c| c.state.is_terminal())
        })
        .await?;
    Ok(run.tool_calls[0].state)
}

/// Finding 1 (a): the commit-window deadline survives a release. A holds a
/// call whose handler started and freezes (its database and platform
/// connections paused); B, a replica with `auto_reconcile(false)`, adopts
/// A, files the call `reconciliation_required`, counts itself idle (it
/// reconciles nothing) and releases the identity; a new process with A's
/// id and default settings takes the released identity at once. Its hook
/// must still wait for A's lease and commit window: A thaws inside them
/// and makes its effect, which the hook then finds (`completed`, one
/// effect), never `failed` / not performed.
pub(crate) async fn a_release_carries_the_wait_owed_to_a_frozen_holder(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let db = Proxy::start(address_of(&w.url)).await?;
        let web = Proxy::start(address_of(&w.server.base_url())).await?;
        let (a, b) = (w.id("a"), w.id("b"));
        let run_id = w.run("probe.write", &["held"]).await?;
        let frozen = w
            .executor_via(&a, None, &db.url(&w.url), &web.url(&w.server.base_url()))
            .build()?
            .start()
            .await?;
        started(&w, 1).await?;
        db.pause();
        web.pause();
        let frozen_at = Instant::now();
        let reconciles_nothing = w
            .executor(&b, Some(Duration::from_millis(300)))
            .auto_reconcile(false)
            .build()?
            .start()
            .await?;
        // Adopted, filed, counted idle, released.
        wait_lease(&w.url, &a, Duration::from_secs(15), "released", |l| {
            l.0 > 1 && l.1.is_empty() && l.2.is_none()
        })
        .await?;
        let restarted = w.executor(&a, None).build()?.start().await?;
        // A thaws well inside its lease and the commit window (from its
        // freeze: 2 × 500 ms + 4 s), and makes its effect.
        tokio::time::sleep(Duration::from_millis(3_000).saturating_sub(frozen_at.elapsed())).await;
        db.resume();
        web.resume();
        w.business.gate.notify_waiters();
        let state = settled(&w, &run_id, Duration::from_secs(30)).await?;
        let effects = w.business.effects();
        ensure!(
            state == CallState::Completed && effects.len() == 1,
            "the frozen holder's call is {} with {} effects: the restarted process asked its hook {} ms after the freeze, before the frozen holder's lease and commit window were over",
            state.as_str(),
            effects.len(),
            w.business
                .hooks
                .lock()
                .expect("lock")
                .first()
                .map_or(-1, |t| t.duration_since(frozen_at).as_millis() as i64)
        );
        drop(frozen);
        drain(restarted).await;
        drain(reconciles_nothing).await;
        Ok(())
    })
    .await
}

/// Finding 1 (b): the deadline survives an adopter with a shorter lease.
/// A holds its identity with a 10 s lease; its database is cut right
/// after a renewal, so its lease stays live for 10 s more; 9 s in, its
/// handler passes its commit point (the platform still answers), then A
/// freezes whole. B (lease 0.5 s, grace 0.3 s) adopts A once A's lease
/// lapsed, and a new process with A's id takes the identity back from B at
/// once. A makes its effect a lease and a commit window after its commit
/// point, the latest the contract lets it: the new process's hook must not
/// be asked before that, and finds the effect.
pub(crate) async fn a_take_back_keeps_what_a_shorter_lease_owed(url: &str) -> Result<()> {
    const LONG: Duration = Duration::from_secs(10);
    with_world(url, |w| async move {
        let db = Proxy::start(address_of(&w.url)).await?;
        let web = Proxy::start(address_of(&w.server.base_url())).await?;
        let (a, b) = (w.id("a"), w.id("b"));
        let run_id = w.run("probe.write", &["commit_held"]).await?;
        let long = w
            .executor_via(&a, None, &db.url(&w.url), &web.url(&w.server.base_url()))
            .lease_ttl(LONG)
            .build()?
            .start()
            .await?;
        let short = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        started(&w, 1).await?;
        // Cut from its database right after a renewal.
        let (token, ..) = lease(&w.url, &a).await?.context("a's lease")?;
        let end = Instant::now() + Duration::from_secs(15);
        let renewed = loop {
            let row = lease(&w.url, &a).await?.context("a's lease")?;
            if row.3 < 30 {
                db.pause();
                break Instant::now();
            }
            ensure!(Instant::now() < end, "a's lease was never renewed");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        tokio::time::sleep((renewed + Duration::from_secs(9)).saturating_duration_since(Instant::now()))
            .await;
        w.business.commit.notify_one();
        let end = Instant::now() + Duration::from_secs(3);
        let committed = loop {
            if let Some(c) = w.business.committed.lock().expect("lock").clone() {
                break c;
            }
            ensure!(Instant::now() < end, "the handler never reached its commit point");
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        let committed = committed
            .map_err(anyhow::Error::msg)
            .context("the handler's commit point, inside its lease, was refused")?;
        web.pause();
        wait_lease(&w.url, &a, Duration::from_secs(15), "adopted", |l| {
            l.0 > token && l.2.as_deref() == Some(b.as_str())
        })
        .await?;
        let took_back = w.executor(&a, None).build()?.start().await?;
        // The effect, a lease and a commit window after the commit point
        // (a little inside).
        let effect_at = committed + LONG + WINDOW - Duration::from_millis(500);
        tokio::time::sleep(effect_at.saturating_duration_since(Instant::now())).await;
        let first_hook = w.business.hooks.lock().expect("lock").first().copied();
        w.business.effect.notify_one();
        db.resume();
        web.resume();
        let state = settled(&w, &run_id, Duration::from_secs(30)).await?;
        let effects = w.business.effects();
        ensure!(
            first_hook.is_none(),
            "the hook was asked {} ms after the commit point, before the 10 s lease and the commit window were over (the call ended {} with {} effects)",
            first_hook.map_or(0, |t| t.duration_since(committed).as_millis()),
            state.as_str(),
            effects.len()
        );
        ensure!(
            state == CallState::Completed && effects.len() == 1,
            "the call is {} with {} effects",
            state.as_str(),
            effects.len()
        );
        drop(long);
        drain(took_back).await;
        drain(short).await;
        Ok(())
    })
    .await
}

/// Finding 5: a lapse is judged by the taker's own clock, not by the
/// database server's. The server's clock steps an hour forward: every
/// stamp taken before the step looks an hour old (here the stamps of A's
/// renewals are moved an hour back as they land, which looks the same to a
/// reader of `renewed_at`). A keeps renewing all along: B, a replica with a
/// short grace, must not adopt it, and A serves on.
pub(crate) async fn a_step_of_the_database_clock_takes_no_live_identity(url: &str) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        let live = w.executor(&a, None).build()?.start().await?;
        let (token, ..) = lease(&w.url, &a).await?.context("a's lease")?;
        let watcher = w
            .executor(&b, Some(Duration::from_millis(300)))
            .build()?
            .start()
            .await?;
        let mut conn = sqlx::PgConnection::connect(&w.url).await?;
        // This version's lease rows (as the SDK's own sessions say).
        sqlx::query("SET toolrunner.lease_format = '2'")
            .execute(&mut conn)
            .await?;
        let end = Instant::now() + Duration::from_secs(4);
        while Instant::now() < end {
            sqlx::query(
                "UPDATE toolrunner_leases.executor_leases
                    SET renewed_at = clock_timestamp() - interval '1 hour'
                  WHERE executor_id = $1",
            )
            .bind(&a)
            .execute(&mut conn)
            .await?;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        conn.close().await?;
        let (now, holder, adopted_by, _) = lease(&w.url, &a).await?.context("a's lease")?;
        ensure!(
            now == token && adopted_by.is_none(),
            "the live identity was taken over when the database's clock stepped: token {token} → {now}, holder {holder}, adopted by {adopted_by:?}"
        );
        ensure!(
            tokio::time::timeout(Duration::from_millis(100), live.wait())
                .await
                .is_err(),
            "the live executor stopped"
        );
        drain(live).await;
        drain(watcher).await;
        Ok(())
    })
    .await
}

/// Finding 2: two processes with one executor id on two databases (a
/// blue/green switch onto a new cluster) each hold a lease on their own
/// database, and neither database knows the other. The later connector
/// serves; the earlier one, superseded by an instance its database never
/// recorded as a holder, stops claiming and says so (naming its database
/// and the other instance) instead of connecting again at every
/// heartbeat. The later one's recovery files no call it cannot act on
/// (the earlier one's call waiting for a person is no
/// `reconciliation_required` row of its store, which holds no assignment
/// for it).
pub(crate) async fn twins_on_two_databases_leave_the_later_one_serving(url: &str) -> Result<()> {
    let second = format!("toolrunner_twin_{:08x}", rand::random::<u32>());
    super::console::in_new_database(url, &second, async |second_url, _| {
        with_world(url, |w| async move {
            let id = w.id("twin");
            // The earlier twin leaves a call waiting for a person.
            let earlier = w.executor(&id, None).build()?;
            let earlier_instance = earlier.instance_id().to_owned();
            let run_id = w.run("probe.write", &["unknown"]).await?;
            let earlier = earlier.start().await?;
            w.admin
                .wait_for(&run_id, Duration::from_secs(20), "waiting for a person", |r| {
                    r.tool_calls[0].state == CallState::ReconciliationRequired
                })
                .await?;
            let later = w
                .executor_via(&id, None, &second_url, &w.server.base_url())
                .build()?;
            let later_instance = later.instance_id().to_owned();
            let later = later.start().await?;
            let started = Instant::now();
            let mut connections = Vec::new();
            while started.elapsed() < Duration::from_secs(3) {
                if let Some(c) = w.connection_of(&id).await?
                    && connections.last() != Some(&c)
                {
                    connections.push(c);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let stopped = tokio::time::timeout(Duration::from_millis(100), earlier.wait()).await;
            let Ok(stopped) = stopped else {
                anyhow::bail!(
                    "the earlier twin (instance {earlier_instance}) did not stop: the platform's connection of {id} changed {} times in 3 s",
                    connections.len().saturating_sub(1)
                );
            };
            let why = stopped.err().context("the earlier twin stopped without an error")?;
            // This database, by host, port and name.
            let name = url.rsplit('/').next().unwrap_or("").split('?').next().unwrap_or("");
            let database = format!("{}/{name}", address_of(url));
            ensure!(
                why.to_string().contains(&later_instance)
                    && why.to_string().contains(&database)
                    && why.is_superseded(),
                "the earlier twin stopped saying: {why}"
            );
            ensure!(
                connections.len() <= 2,
                "the connection of {id} flipped {} times",
                connections.len() - 1
            );
            // The later one serves.
            let serving = w.run("probe.write", &["ok"]).await?;
            ensure!(
                settled(&w, &serving, Duration::from_secs(20)).await? == CallState::Completed,
                "the later twin does not serve"
            );
            ensure!(
                tokio::time::timeout(Duration::from_millis(100), later.wait())
                    .await
                    .is_err(),
                "the later twin stopped"
            );
            // It files nothing it cannot act on.
            let store = toolrunner::testing::store::PgStore::connect_in_schema(
                &second_url,
                &toolrunner::testing::store::PgStore::identity_schema(&id),
            )
            .await?;
            let waiting = toolrunner::testing::store::Store::calls(
                &store,
                &toolrunner::testing::store::CallFilter::new()
                    .state(toolrunner::testing::store::LocalState::ReconciliationRequired),
            )
            .await?;
            ensure!(
                waiting.iter().all(|c| c.assignment.is_some()),
                "the later twin filed {} calls `reconciliation_required` without an assignment",
                waiting.iter().filter(|c| c.assignment.is_none()).count()
            );
            drain(later).await;
            drop(earlier);
            Ok(())
        })
        .await
    })
    .await
}

/// The upgrade to this lease format: old and new versions never share the
/// lease table. A database whose lease table is of the older format, with
/// a live lease of an older version's process on it: this version refuses
/// to start there, saying what to do. Once that lease lapsed, this version
/// starts and migrates the table; from then on a lease write of an older
/// version is refused by the database (saying so), and an older version's
/// start refuses the migrated table.
pub(crate) async fn an_upgrade_refuses_to_run_beside_an_older_version(url: &str) -> Result<()> {
    let db = format!("toolrunner_upgrade_{:08x}", rand::random::<u32>());
    super::console::in_new_database(url, &db, async |db_url, _| {
        let leases = format!(
            "{db_url}{}options=-c%20search_path%3Dtoolrunner_leases",
            if db_url.contains('?') { '&' } else { '?' }
        );
        let mut conn = sqlx::PgConnection::connect(&db_url).await?;
        sqlx::query("CREATE SCHEMA toolrunner_leases")
            .execute(&mut conn)
            .await?;
        conn.close().await?;
        // The lease table as the previous version left it: its own four
        // migrations, applied by sqlx.
        let older = tempfile::tempdir()?;
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/sdk/toolrunner/migrations/postgres-leases");
        for name in [
            "20261201000001_executor_leases.sql",
            "20261201000002_lease_groups.sql",
            "20261201000003_store_schema.sql",
            "20261201000004_lease_ttl.sql",
        ] {
            std::fs::copy(format!("{dir}/{name}"), older.path().join(name))?;
        }
        let previous = sqlx::migrate::Migrator::new(older.path()).await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&leases)
            .await?;
        previous.run(&pool).await?;
        let mut conn = sqlx::PgConnection::connect(&leases).await?;
        // A process of the previous version holds a live lease; another
        // identity was released by one (which may have owed a wait before
        // any hook: that version kept it in memory only).
        sqlx::query(
            "INSERT INTO executor_leases (executor_id, token, holder, renewed_at, binding_id, ttl_ms)
             VALUES ('old-a', 3, 'ins_old', clock_timestamp(), 'bnd_old', 600000)",
        )
        .execute(&mut conn)
        .await?;
        sqlx::query(
            "INSERT INTO executor_leases (executor_id, token, holder, renewed_at, binding_id, ttl_ms, released)
             VALUES ('old-r', 2, '', clock_timestamp(), 'bnd_old', 3000, TRUE)",
        )
        .execute(&mut conn)
        .await?;
        let refused = PgStore::connect_as(&db_url, "new-b", "bnd_old", "ins_new").await;
        let Err(refused) = refused else {
            anyhow::bail!("this version started beside a live lease of an older one");
        };
        ensure!(
            refused.to_string().contains("older toolrunner version")
                && refused.to_string().contains("old-a")
                && refused.to_string().contains("Upgrading"),
            "refused for another reason: {refused}"
        );
        // The older process is gone (its lease lapsed): this version starts.
        sqlx::query("UPDATE executor_leases SET renewed_at = renewed_at - interval '1 hour'")
            .execute(&mut conn)
            .await?;
        let store = PgStore::connect_as(&db_url, "new-b", "bnd_old", "ins_new").await?;
        // What the older version's release may have owed is owed still: two
        // of its leases and a default commit window.
        let owed: i64 = sqlx::query_scalar(
            "SELECT hook_wait_ms FROM executor_leases WHERE executor_id = 'old-r'",
        )
        .fetch_one(&mut conn)
        .await?;
        ensure!(
            owed >= 36_000,
            "the identity an older version released owes {owed} ms before a hook (it may have owed a frozen holder's commit window)"
        );
        // An older version's renewal (no session setting of this format)
        // is refused, saying why.
        let renewal = sqlx::query(
            "UPDATE executor_leases SET renewed_at = clock_timestamp() WHERE executor_id = 'old-a'",
        )
        .execute(&mut conn)
        .await;
        let Err(renewal) = renewal else {
            anyhow::bail!("an older version's lease write was taken on the migrated table");
        };
        ensure!(
            renewal.to_string().contains("stop every process of the older version"),
            "the older version's renewal was refused for another reason: {renewal}"
        );
        // And an older version's start refuses the migrated table.
        let start = previous.run(&pool).await;
        pool.close().await;
        ensure!(
            matches!(start, Err(sqlx::migrate::MigrateError::VersionMissing(_))),
            "an older version's migrations ran on the migrated table: {start:?}"
        );
        conn.close().await?;
        drop(store);
        Ok(())
    })
    .await
}

/// A connection pooler that drops the startup options (as PgBouncer with
/// `ignore_startup_parameters = options` does) would make every lease
/// write of this version look like an older version's: the start refuses
/// at once, saying that the option is dropped and what to do.
pub(crate) async fn a_pooler_that_drops_startup_options_is_named(url: &str) -> Result<()> {
    let proxy = OptionsDropper::start(address_of(url)).await?;
    let through = {
        let rest = url.split_once("://").context("a URL")?.1;
        let (auth, path) = rest.split_once('/').context("a database path")?;
        let user = auth.rsplit_once('@').map_or("", |(u, _)| u);
        let at = if user.is_empty() { "" } else { "@" };
        let sep = if path.contains('?') { '&' } else { '?' };
        format!(
            "postgres://{user}{at}{}/{path}{sep}sslmode=disable",
            proxy.addr
        )
    };
    let id = format!("pooled-{:08x}", rand::random::<u32>());
    let opened = PgStore::connect_as(&through, &id, "bnd_pooled", "ins_pooled").await;
    let Err(refused) = opened else {
        anyhow::bail!("a store opened through a pooler that drops the startup options");
    };
    ensure!(
        refused.to_string().contains("drops startup options"),
        "refused for another reason: {refused}"
    );
    super::clean_up(url, &[id]).await
}

/// A TCP proxy that removes the `options` parameter from each
/// connection's startup message (plain TCP: `sslmode=disable`).
struct OptionsDropper {
    addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OptionsDropper {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OptionsDropper {
    async fn start(upstream: std::net::SocketAddr) -> Result<OptionsDropper> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut len = [0u8; 4];
                    if client.read_exact(&mut len).await.is_err() {
                        return;
                    }
                    let n = u32::from_be_bytes(len) as usize;
                    let mut body = vec![0u8; n.saturating_sub(4)];
                    if client.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    // Protocol version, then key\0value\0 pairs, then \0.
                    let mut kept = body[..4].to_vec();
                    let mut fields = body[4..].split(|b| *b == 0);
                    while let (Some(k), Some(v)) = (fields.next(), fields.next()) {
                        if k.is_empty() {
                            break;
                        }
                        if k != b"options" {
                            kept.extend_from_slice(k);
                            kept.push(0);
                            kept.extend_from_slice(v);
                            kept.push(0);
                        }
                    }
                    kept.push(0);
                    let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let mut startup = ((kept.len() + 4) as u32).to_be_bytes().to_vec();
                    startup.extend_from_slice(&kept);
                    if server.write_all(&startup).await.is_err() {
                        return;
                    }
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                });
            }
        });
        Ok(OptionsDropper { addr, task })
    }
}
