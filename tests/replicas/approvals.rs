//! Approvals across replicas on one PostgreSQL database (issue 34): the
//! request is database-wide, a decision is recorded once however many
//! approvers click at once, and the call it allows runs once although the
//! replica that acted on it died between the approval and its `accepted`.
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use sqlx::Connection;
use toolrunner::protocol::wire::CallState;
use toolrunner::{ApprovalState, Approvals, AuthorizationRequest, Decision, Denied};

use super::takeover::{TTL, drain, with_world};

/// The probe tool's own policy: every write needs a person's yes.
fn needs_a_person(_request: &AuthorizationRequest) -> Result<(), Denied> {
    Err(Denied::needs_approval(
        "a person checks every write",
        Duration::from_secs(120),
    ))
}

/// Replica A asks, and the call waits (given back: nothing ran). Three
/// approvals at once (a double click, and a second approver) record one
/// decision; a deny after it is refused. A claims the call again and dies
/// with its `accepted` saved and not sent; replica B then performs the
/// call, once.
pub(crate) async fn an_approval_is_acted_on_once_when_its_replica_dies_before_accepted(
    url: &str,
) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b) = (w.id("a"), w.id("b"));
        let run_id = w.run("probe.write", &["approved"]).await?;
        let call_id = w.admin.run(&run_id).await?.tool_calls[0].call_id.clone();
        let asking = w
            .executor(&a, None)
            .approval_policy("probe.write", needs_a_person)
            .crash_plan(|step| step == "after_accepted_saved")
            .build()?
            .start()
            .await?;
        let approvals = Approvals::open(&w.url).await?;
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(r) = approvals.show(&run_id, &call_id).await {
                ensure!(r.state() == ApprovalState::Waiting, "asked: {r:?}");
                ensure!(
                    r.reason() == "a person checks every write",
                    "the tool's policy is the reason: {r:?}"
                );
                break;
            }
            ensure!(Instant::now() < end, "no approval request was stored");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        w.admin
            .wait_for(&run_id, Duration::from_secs(20), "given back", |r| {
                r.tool_calls[0].state == CallState::Pending
            })
            .await?;
        ensure!(
            w.business.starts() == 0,
            "the handler ran before a decision"
        );

        let (one, two, three) = tokio::join!(
            approvals.approve(&run_id, &call_id, "alice", Some("checked")),
            approvals.approve(&run_id, &call_id, "alice", Some("checked")),
            approvals.approve(&run_id, &call_id, "bob", None),
        );
        let decisions = [one?, two?, three?];
        ensure!(
            decisions
                .iter()
                .filter(|d| **d == Decision::Recorded)
                .count()
                == 1,
            "three approvals at once recorded {decisions:?}, expected one Recorded"
        );
        let late = approvals.deny(&run_id, &call_id, "carol", None).await;
        ensure!(
            late.as_ref().is_err_and(toolrunner::Error::is_refused),
            "a deny after the approval: {late:?}, expected a refusal"
        );
        let stored = approvals.show(&run_id, &call_id).await?;
        ensure!(
            stored.state() == ApprovalState::Approved
                && matches!(stored.decided_by(), Some("alice" | "bob")),
            "the decision reads {stored:?}"
        );

        tokio::time::timeout(Duration::from_secs(20), asking.wait())
            .await
            .map_err(|_| anyhow::anyhow!("replica A never reached its accepted"))??;
        ensure!(
            w.business.starts() == 0,
            "the handler ran before its accepted was sent"
        );
        drop(asking);

        let other = w
            .executor(&b, Some(Duration::from_millis(300)))
            .approval_policy("probe.write", needs_a_person)
            .build()?
            .start()
            .await?;
        w.admin
            .wait_for(&run_id, Duration::from_secs(30), "completed", |r| {
                r.tool_calls[0].state == CallState::Completed
            })
            .await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let effects = w.business.effects();
        ensure!(
            effects.len() == 1,
            "the effect ran {} times: {effects:?}",
            effects.len()
        );
        drain(other).await;
        Ok(())
    })
    .await
}

/// A replica that drains while a request of its waits for a person keeps
/// its identity: the request is work left, so the identity is not
/// released (a replica with a takeover grace adopts it, as one with calls
/// mid-way). Once its requests are decided or expired and their calls
/// settled, the next drain releases it, and retention takes them.
pub(crate) async fn an_undecided_request_keeps_its_identity_from_counting_as_idle(
    url: &str,
) -> Result<()> {
    with_world(url, |w| async move {
        let a = w.id("a");
        let run_id = w.run("probe.write", &["waits"]).await?;
        let call_id = w.admin.run(&run_id).await?.tool_calls[0].call_id.clone();
        let asking = w
            .executor(&a, None)
            .approval_policy("probe.write", needs_a_person)
            .build()?
            .start()
            .await?;
        let approvals = Approvals::open(&w.url).await?;
        let end = Instant::now() + Duration::from_secs(20);
        while approvals.show(&run_id, &call_id).await.is_err() {
            ensure!(Instant::now() < end, "no approval request was stored");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        w.admin
            .wait_for(&run_id, Duration::from_secs(20), "given back", |r| {
                r.tool_calls[0].state == CallState::Pending
            })
            .await?;
        drain(asking).await;
        let released = |id: String| {
            let url = w.url.clone();
            async move {
                let mut conn = sqlx::PgConnection::connect(&url).await?;
                let released: bool = sqlx::query_scalar(
                    "SELECT released FROM toolrunner_leases.executor_leases WHERE executor_id = $1",
                )
                .bind(&id)
                .fetch_one(&mut conn)
                .await?;
                conn.close().await?;
                anyhow::Ok(released)
            }
        };
        ensure!(
            !released(a.clone()).await?,
            "a replica whose request waits for a person released its identity at its drain, as if it had nothing left"
        );
        ensure!(
            approvals.show(&run_id, &call_id).await?.state() == ApprovalState::Waiting,
            "the request no longer waits"
        );

        // The same, its request expired: nothing is left to decide.
        let expired_run = w.run("probe.write", &["expires"]).await?;
        let expiring = w
            .executor(&a, None)
            .approval_policy("probe.write", |_: &AuthorizationRequest| {
                Err(Denied::needs_approval(
                    "a person checks every write",
                    Duration::from_millis(300),
                ))
            })
            .build()?
            .start()
            .await?;
        w.admin
            .wait_for(&expired_run, Duration::from_secs(30), "settled", |r| {
                r.tool_calls[0].state == CallState::Failed
            })
            .await?;
        // The first request is denied, and its call settled.
        let _ = approvals.deny(&run_id, &call_id, "carol", None).await?;
        w.admin
            .wait_for(&run_id, Duration::from_secs(30), "denied", |r| {
                r.tool_calls[0].state == CallState::Failed
            })
            .await?;
        drain(expiring).await;
        ensure!(
            released(a.clone()).await?,
            "a replica with nothing left to decide kept its identity at its drain"
        );

        // Retention takes the requests nobody needs any more (the denied
        // one, acted on, and the expired one), as it takes settled calls.
        let ours = |r: &toolrunner::ApprovalRequest| {
            r.run_id() == run_id || r.run_id() == expired_run
        };
        ensure!(
            approvals.list().await?.iter().filter(|r| ours(r)).count() == 2,
            "the two requests are not both kept before retention"
        );
        // Retention takes only decisions acted on (the approval tests
        // beside this one on the same database lose nothing they need).
        let pruning = w
            .executor(&a, None)
            .retention(Some(Duration::from_millis(1)))
            .build()?
            .start()
            .await?;
        let end = Instant::now() + Duration::from_secs(20);
        while approvals.list().await?.iter().any(ours) {
            ensure!(
                Instant::now() < end,
                "retention left the requests nobody can act on any more"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        drain(pruning).await;
        Ok(())
    })
    .await
}

/// Tells the product of each request by never answering (its channel
/// hangs): nothing is recorded told.
struct HangsTelling;

#[toolrunner::async_trait]
impl toolrunner::Authorizer for HangsTelling {
    async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
        Ok(())
    }

    async fn on_approval_requested(&self, _request: &toolrunner::ApprovalRequest) {
        tokio::time::sleep(Duration::from_secs(600)).await;
    }
}

/// Tells the product of each request by noting its call, then taking a
/// second to answer (a slow channel: the telling is recorded only then).
#[derive(Clone, Default)]
struct NotesTelling(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

#[toolrunner::async_trait]
impl toolrunner::Authorizer for NotesTelling {
    async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
        Ok(())
    }

    async fn on_approval_requested(&self, request: &toolrunner::ApprovalRequest) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(request.call_id().to_owned());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A request whose asker stopped before the product was told of it (its
/// lease lapsed; adopted or not) is told by another replica of its
/// binding, once between them; while the asker lives, the others leave
/// its telling to it.
pub(crate) async fn a_request_whose_asker_died_untold_is_told_by_another_replica(
    url: &str,
) -> Result<()> {
    with_world(url, |w| async move {
        let (a, b, c, d) = (w.id("a"), w.id("b"), w.id("c"), w.id("d"));
        let run_id = w.run("probe.write", &["untold"]).await?;
        let call_id = w.admin.run(&run_id).await?.tool_calls[0].call_id.clone();
        let faults = toolrunner::testing::ProcessFaults::new();
        let asking = w
            .executor(&a, None)
            .approval_policy("probe.write", needs_a_person)
            .authorizer(HangsTelling)
            .process_faults(&faults)
            .build()?
            .start()
            .await?;
        let approvals = Approvals::open(&w.url).await?;
        let end = Instant::now() + Duration::from_secs(20);
        while approvals.show(&run_id, &call_id).await.is_err() {
            ensure!(Instant::now() < end, "no approval request was stored");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The asker lives (its telling hangs): another replica leaves it.
        let beside = NotesTelling::default();
        let other = w
            .executor(&b, None)
            .approval_policy("probe.write", needs_a_person)
            .authorizer(beside.clone())
            .build()?
            .start()
            .await?;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let told = beside.0.lock().unwrap().clone();
        ensure!(
            told.is_empty(),
            "a replica told the request of a live asker: {told:?}"
        );
        // The asker stops for good (frozen: its lease lapses). Two
        // replicas start then, one of which adopts it (an adopted identity
        // claims nothing, so it tells nothing itself): between them they
        // tell the product once.
        faults.freeze();
        tokio::time::sleep(TTL * 5).await;
        let later = NotesTelling::default();
        let (third, fourth) = tokio::join!(
            w.executor(&c, Some(Duration::from_millis(300)))
                .approval_policy("probe.write", needs_a_person)
                .authorizer(later.clone())
                .build()?
                .start(),
            w.executor(&d, None)
                .approval_policy("probe.write", needs_a_person)
                .authorizer(later.clone())
                .build()?
                .start(),
        );
        let (third, fourth) = (third?, fourth?);
        let end = Instant::now() + Duration::from_secs(20);
        loop {
            let told = later.0.lock().unwrap().clone();
            if told.contains(&call_id) {
                break;
            }
            ensure!(
                Instant::now() < end,
                "the request of an asker that died untold was never told (told: {told:?})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Both replicas have looked (at their start), and the adopter's
        // adoption took its time: still told once.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let told = later.0.lock().unwrap().clone();
        ensure!(
            told.len() == 1,
            "the request was told more than once between two replicas: {told:?}"
        );
        let _ = approvals.deny(&run_id, &call_id, "carol", None).await?;
        drain(fourth).await;
        drain(third).await;
        drain(other).await;
        faults.thaw();
        drain(asking).await;
        Ok(())
    })
    .await
}
