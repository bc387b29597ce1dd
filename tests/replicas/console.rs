//! The operator console over one PostgreSQL database with three executor
//! identities: one view across the replicas, each call labelled with its
//! identity (issue 21). The database is made for the test and dropped
//! after it, so the console sees exactly these identities.

use anyhow::{Context, Result, ensure};
use sqlx::Connection;
use toolrunner::console::Console;
use toolrunner::testing::store::{Change, LocalState, PgStore, Store};

/// The identities, each with the calls its store holds.
const IDENTITIES: [(&str, &[(&str, LocalState)]); 3] = [
    (
        "console-a",
        &[
            ("call_a1", LocalState::Delivered),
            ("call_a2", LocalState::Running),
        ],
    ),
    (
        "console-b",
        &[("call_b1", LocalState::ReconciliationRequired)],
    ),
    (
        "console-c",
        &[
            ("call_c1", LocalState::Settled),
            ("call_c2", LocalState::Rejected),
        ],
    ),
];

/// `url` with its database replaced by `db`.
pub(super) fn with_database(url: &str, db: &str) -> Result<String> {
    let (head, tail) = url
        .rsplit_once('/')
        .context("the PostgreSQL URL has no database path")?;
    let query = tail
        .split_once('?')
        .map(|(_, q)| format!("?{q}"))
        .unwrap_or_default();
    Ok(format!("{head}/{db}{query}"))
}

/// The `<tr class="call" …>` tag of `call_id` on a calls page.
fn row<'a>(page: &'a str, call_id: &str) -> Option<&'a str> {
    let at = page.find(&format!("data-call-id=\"{call_id}\""))?;
    let start = page[..at].rfind("<tr")?;
    let end = at + page[at..].find('>')?;
    Some(&page[start..end])
}

pub(crate) async fn three_identities_show_each_their_calls(url: &str) -> Result<()> {
    let db = format!("toolrunner_console_{:08x}", rand::random::<u32>());
    in_new_database(url, &db, async |db_url, _| check(&db_url).await).await
}

/// Runs `body` on a database `db` made for it beside the one at `url`
/// (with the URL of `db` and a connection to `url` to drop it early),
/// then drops it, whatever `body` did.
pub(super) async fn in_new_database(
    url: &str,
    db: &str,
    body: impl AsyncFnOnce(String, &mut sqlx::PgConnection) -> Result<()>,
) -> Result<()> {
    let mut admin = sqlx::PgConnection::connect(url).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await?;
    let outcome = body(with_database(url, db)?, &mut admin).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await?;
    admin.close().await?;
    outcome
}

async fn check(url: &str) -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut stores = Vec::new();
    for (id, calls) in IDENTITIES {
        let store = PgStore::connect_as(url, id, "bnd_console", &format!("ins_{id}")).await?;
        for (n, (call_id, state)) in calls.iter().enumerate() {
            let mut call = crate::store_contract::rows::call(call_id, *state, 0);
            call.run_id = format!("run_{id}");
            call.tool_name = format!("tool.{}", n + 1);
            store.commit(vec![Change::InsertCall(call)]).await?;
        }
        stores.push(store);
    }
    // A limit kept in the store shows on the overview.
    toolrunner::StoredLimits::open(url)
        .await?
        .set("tool.1", toolrunner::Limits::none().concurrency(3))
        .await?;
    let console = Console::builder().database(url).build().await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let server = tokio::spawn(async move { axum::serve(listener, console.router()).await });
    let http = reqwest::Client::new();
    let get = |path: String| {
        let http = http.clone();
        let base = base.clone();
        async move {
            let response = http.get(format!("{base}{path}")).send().await?;
            ensure!(
                response.status() == 200,
                "GET {path}: {}",
                response.status()
            );
            Ok::<String, anyhow::Error>(response.text().await?)
        }
    };

    // One view: every identity's calls, each labelled with its identity.
    let all = get("/calls".into()).await?;
    for (id, calls) in IDENTITIES {
        for (call_id, state) in calls {
            let tag = row(&all, call_id)
                .with_context(|| format!("/calls does not list {call_id} of {id}"))?;
            ensure!(
                tag.contains(&format!("data-identity=\"{id}\""))
                    && tag.contains(&format!("data-state=\"{}\"", state.as_str())),
                "{call_id} is not shown as {id}'s, {}: {tag}",
                state.as_str()
            );
        }
    }
    let shown = all.matches("<tr class=\"call\"").count();
    ensure!(
        shown == 5,
        "/calls shows {shown} calls, not the 5 of the three identities"
    );

    let overview = get("/".into()).await?;
    let flow = overview
        .find("data-flow-tool=\"tool.1\"")
        .map(|at| &overview[at..overview.len().min(at + 400)])
        .context("the overview shows no flow limits of tool.1")?;
    ensure!(
        flow.contains("<td class=\"concurrency\">3</td>"),
        "the overview does not show tool.1's stored concurrency of 3: {flow}"
    );
    // The overview has a section per identity; the identity filter keeps
    // one identity's calls only.
    let overview = get("/".into()).await?;
    for (id, _) in IDENTITIES {
        ensure!(
            overview.contains(&format!("data-identity=\"{id}\"")),
            "the overview has no section for {id}"
        );
        let only = get(format!("/calls?identity={id}")).await?;
        for (other, calls) in IDENTITIES {
            for (call_id, _) in calls {
                ensure!(
                    row(&only, call_id).is_some() == (other == id),
                    "/calls?identity={id} shows {call_id} of {other} wrongly"
                );
            }
        }
    }
    ensure!(
        overview.contains(
            "id=\"total-reconciliation_required\" href=\"/calls?state=reconciliation_required\">1<"
        ),
        "the overview's total of reconciliation_required is not 1"
    );

    // A call's page, found in its identity's store.
    let page = get("/calls/run_console-b/call_b1?identity=console-b".into()).await?;
    ensure!(
        page.contains("id=\"call-identity\">console-b<")
            && page.contains("reconciliation_required"),
        "the page of call_b1 does not show it as console-b's, reconciliation_required"
    );

    // An identity that starts later shows up (the console looks again).
    let late = PgStore::connect_as(url, "console-d", "bnd_console", "ins_d").await?;
    let mut call = crate::store_contract::rows::call("call_d1", LocalState::Claiming, 0);
    call.run_id = "run_console-d".into();
    late.commit(vec![Change::InsertCall(call)]).await?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let now = get("/calls?identity=console-d".into()).await?;
        if row(&now, "call_d1").is_some_and(|t| t.contains("data-identity=\"console-d\"")) {
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "an identity started after the console never showed up"
        );
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    server.abort();
    drop(late);
    two_databases(url).await?;
    drop(stores);
    Ok(())
}

/// A second database with an identity of the same id: both shown, told
/// apart, and neither opened again and again; an identity whose store is
/// dropped leaves the view; a database that goes away is named on the
/// pages, which still show the others.
async fn two_databases(url: &str) -> Result<()> {
    let db = format!("toolrunner_console2_{:08x}", rand::random::<u32>());
    in_new_database(url, &db, async |second, admin| {
        let twin = PgStore::connect_as(&second, "console-a", "bnd_console", "ins_twin").await?;
        let mut call = crate::store_contract::rows::call("call_a_db2", LocalState::Delivered, 0);
        call.run_id = "run_console-a".into();
        twin.commit(vec![Change::InsertCall(call)]).await?;
        drop(twin);
        // The second database through a proxy that can stop answering.
        let proxy = super::pause::Proxy::start(super::pause::address_of(&second)).await?;
        let console = Console::builder()
            .database(url)
            .database(proxy.url(&second))
            .build()
            .await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move { axum::serve(listener, console.router()).await });
        let http = reqwest::Client::new();
        let calls = || {
            let http = http.clone();
            let base = base.clone();
            async move {
                let answer = http.get(format!("{base}/calls")).send().await?;
                ensure!(answer.status() == 200, "GET /calls: {}", answer.status());
                Ok::<String, anyhow::Error>(answer.text().await?)
            }
        };
        let page = calls().await?;
        let first = row(&page, "call_a1").context("call_a1 is not listed")?;
        let twin =
            row(&page, "call_a_db2").context("the second database's console-a is not listed")?;
        ensure!(
            first.contains("data-identity=\"console-a\"")
                && twin.contains("data-identity=\"console-a (2)\""),
            "the two console-a are not told apart: {first} / {twin}"
        );
        let shown = page.matches("<tr class=\"call\"").count();
        // Found again after 5 s: the same calls, once each.
        tokio::time::sleep(std::time::Duration::from_secs(6)).await;
        let again = calls().await?;
        let now = again.matches("<tr class=\"call\"").count();
        ensure!(
            now == shown,
            "{shown} calls listed, then {now} once the identities were looked at again"
        );

        // The second database stops answering (its connections stand
        // still): the pages still answer within seconds, name it, and show
        // the first database's calls.
        proxy.pause();
        tokio::time::sleep(std::time::Duration::from_secs(6)).await;
        let asked = std::time::Instant::now();
        let page = calls().await?;
        let took = asked.elapsed();
        ensure!(
            took < std::time::Duration::from_secs(15),
            "with a database that does not answer, /calls took {took:?}"
        );
        ensure!(
            page.contains("id=\"store-problems\"") && row(&page, "call_a1").is_some(),
            "with the second database not answering: {page}"
        );
        proxy.resume();

        // console-c's store is dropped: it leaves the view, the rest stays.
        let mut conn = sqlx::PgConnection::connect(url).await?;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA {} CASCADE",
            PgStore::identity_schema("console-c")
        )))
        .execute(&mut conn)
        .await?;
        conn.close().await?;
        tokio::time::sleep(std::time::Duration::from_secs(6)).await;
        let page = calls().await?;
        ensure!(
            row(&page, "call_c1").is_none() && row(&page, "call_a1").is_some(),
            "after console-c's store was dropped: {page}"
        );

        // The second database goes away: named on the page, the first
        // database's calls still listed.
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE {db} WITH (FORCE)"
        )))
        .execute(&mut *admin)
        .await?;
        tokio::time::sleep(std::time::Duration::from_secs(6)).await;
        let page = calls().await?;
        ensure!(
            page.contains("id=\"store-problems\"") && row(&page, "call_a1").is_some(),
            "with the second database gone: {page}"
        );
        server.abort();
        Ok(())
    })
    .await
}
