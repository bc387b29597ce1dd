//! The operator console's router as a library, over HTTP on loopback (the
//! browser tests are `tests/console.rs`): mounted under a path of the
//! product's admin server, and a bulk redeliver that sends what its
//! preview counted, no more.

use anyhow::{Context, Result, ensure};
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::console::Console;
use toolrunner::testing::{Step, TestKit};
use toolrunner::{CallContext, ReceiptStatus, ToolError};

/// A charge.
#[toolrunner::schema]
#[derive(Deserialize)]
struct ChargeIn {
    /// How much.
    amount: u64,
}

/// The charge made.
#[toolrunner::schema]
#[derive(Serialize)]
struct Charged {
    /// Its id.
    charge_id: String,
}

/// Charges a card.
#[toolrunner::tool(name = "payments.charge", effect = write)]
async fn charge(_ctx: CallContext, input: ChargeIn) -> Result<Charged, ToolError> {
    Ok(Charged {
        charge_id: format!("ch_{}", input.amount),
    })
}

/// Serves `app` on 127.0.0.1:0; its base URL.
async fn serve(app: axum::Router) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(base)
}

/// The CSRF token a page's forms carry.
fn csrf(page: &str) -> Result<String> {
    let at = page
        .find("name=\"csrf\" value=\"")
        .with_context(|| format!("no CSRF token on the page: {page}"))?;
    let rest = &page[at + "name=\"csrf\" value=\"".len()..];
    Ok(rest[..rest.find('"').context("the token does not end")?].to_owned())
}

/// The value of the hidden field `name`.
fn hidden(page: &str, name: &str) -> Result<String> {
    let marker = format!("name=\"{name}\" value=\"");
    let at = page
        .find(&marker)
        .with_context(|| format!("no field {name} on the page: {page}"))?;
    let rest = &page[at + marker.len()..];
    let raw = &rest[..rest.find('"').context("the value does not end")?];
    Ok(raw
        .replace("&#10;", "\n")
        .replace("&quot;", "\"")
        .replace("&amp;", "&"))
}

/// `k=v&…`, percent-encoded.
fn encoded(pairs: &[(&str, &str)]) -> String {
    let enc = |s: &str| -> String {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    pairs
        .iter()
        .map(|(k, v)| format!("{}={}", enc(k), enc(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// A form POST.
fn post(http: &reqwest::Client, url: String, pairs: &[(&str, &str)]) -> reqwest::RequestBuilder {
    http.post(url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(encoded(pairs))
}

fn client() -> Result<reqwest::Client> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_mounted_under_a_path_links_and_signs_in_there() -> Result<()> {
    let kit = TestKit::start(|b| b.tool(charge)).await?;
    let call = kit.call("payments.charge", json!({"amount": 5})).await?;
    let console = Console::builder()
        .store("exec", kit.reconciler().await?)
        .auth_token("tok-mount")
        .build()
        .await?;
    let base = serve(axum::Router::new().nest("/admin/console", console.router())).await?;
    let http = client()?;
    // Not signed in: the console's own login page, under the mount.
    let first = http.get(format!("{base}/admin/console")).send().await?;
    ensure!(
        first.status() == 303,
        "GET /admin/console: {}",
        first.status()
    );
    let to = first.headers()["location"].to_str()?.to_owned();
    ensure!(to == "/admin/console/login", "redirected to {to}");
    let login = http.get(format!("{base}{to}")).send().await?.text().await?;
    ensure!(
        login.contains("action=\"/admin/console/login\""),
        "the login form posts elsewhere: {login}"
    );
    let token = csrf(&login)?;
    let signed = post(
        &http,
        format!("{base}/admin/console/login"),
        &[("token", "tok-mount"), ("csrf", &token)],
    )
    .send()
    .await?;
    ensure!(signed.status() == 303, "sign-in: {}", signed.status());
    ensure!(
        signed.headers()["location"].to_str()? == "/admin/console",
        "after sign-in: {:?}",
        signed.headers()["location"]
    );
    let cookie = signed.headers()["set-cookie"].to_str()?.to_owned();
    ensure!(
        cookie.contains("Path=/admin/console")
            && cookie.contains("HttpOnly")
            && cookie.contains("SameSite=Strict"),
        "the cookie: {cookie}"
    );
    let session = cookie.split(';').next().unwrap_or_default().to_owned();
    let home = http
        .get(format!("{base}/admin/console"))
        .header("cookie", &session)
        .send()
        .await?;
    ensure!(home.status() == 200, "the overview: {}", home.status());
    let home = home.text().await?;
    ensure!(
        home.contains("href=\"/admin/console/calls?state=delivered\"")
            && home.contains("href=\"/admin/console/outbox\"")
            && !home.contains("href=\"/calls"),
        "the overview links outside the mount: {home}"
    );
    // Every link of the page stays inside the mount, and answers there.
    for href in home.split("href=\"").skip(1) {
        let href = &href[..href.find('"').unwrap_or(0)];
        ensure!(
            href.starts_with("/admin/console"),
            "the overview links to {href}"
        );
        let answer = http
            .get(format!("{base}{}", href.replace("&amp;", "&")))
            .header("cookie", &session)
            .send()
            .await?;
        ensure!(answer.status() == 200, "GET {href}: {}", answer.status());
    }
    let list = http
        .get(format!("{base}/admin/console/calls?state=delivered"))
        .header("cookie", &session)
        .send()
        .await?
        .text()
        .await?;
    let link = format!(
        "href=\"/admin/console/calls/{}/{}?identity=exec\"",
        call.run_id, call.call.call_id
    );
    ensure!(list.contains(&link), "no {link} in {list}");
    kit.shutdown().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_redeliver_sends_what_its_preview_counted() -> Result<()> {
    let mut kit = TestKit::builder()
        .crash_at(Step::BeforeDelivery)
        .start(|b| b.tool(charge))
        .await?;
    let call = kit.submit("payments.charge", json!({"amount": 7})).await?;
    kit.wait_crashed().await?;
    let check = kit.reconciler().await?;
    let waiting = check.outbox().await?.pending().to_vec();
    ensure!(waiting.len() == 1, "one receipt waits: {waiting:?}");
    let receipt = waiting[0].receipt_id().to_owned();
    let console = Console::builder()
        .store(
            "stalled",
            kit.reconciler()
                .await?
                .with_platform(&kit.base_url(), kit.executor_token())?,
        )
        .build()
        .await?;
    let base = serve(console.router()).await?;
    let http = client()?;
    let outbox = http
        .get(format!("{base}/outbox"))
        .send()
        .await?
        .text()
        .await?;
    let token = csrf(&outbox)?;
    let evidence = [("who", "ops"), ("evidence", "the network is back")];
    let preview = post(
        &http,
        format!("{base}/outbox/redeliver"),
        &[&evidence[..], &[("identity", "stalled"), ("csrf", &token)]].concat(),
    )
    .send()
    .await?
    .text()
    .await?;
    ensure!(
        preview.contains("<span id=\"bulk-count\">1</span>"),
        "the preview does not count 1: {preview}"
    );
    let previewed = hidden(&preview, "previewed")?;
    ensure!(
        previewed.contains(&receipt),
        "the preview carries {previewed:?}"
    );
    // A confirmation that carries nothing previewed sends nothing, though
    // the filter matches the waiting receipt.
    let empty = post(
        &http,
        format!("{base}/outbox/redeliver"),
        &[
            &evidence[..],
            &[
                ("identity", "stalled"),
                ("csrf", &token),
                ("confirm", "yes"),
                ("previewed", ""),
            ],
        ]
        .concat(),
    )
    .send()
    .await?
    .text()
    .await?;
    ensure!(empty.contains("0 receipt(s)"), "{empty}");
    let still = check.outbox().await?.pending().len();
    ensure!(
        still == 1,
        "a confirmation of nothing sent {} receipts",
        1 - still
    );
    // The confirmation of the preview sends its receipt.
    let done = post(
        &http,
        format!("{base}/outbox/redeliver"),
        &[
            &evidence[..],
            &[
                ("identity", "stalled"),
                ("csrf", &token),
                ("confirm", "yes"),
                ("previewed", &previewed),
            ],
        ]
        .concat(),
    )
    .send()
    .await?
    .text()
    .await?;
    ensure!(
        done.contains("id=\"done\"") && done.contains("1 delivered"),
        "{done}"
    );
    let shown = check.show(&call.run_id, &call.call_id).await?;
    ensure!(
        shown
            .receipts()
            .iter()
            .any(|r| r.receipt_id() == receipt && r.status() == ReceiptStatus::Delivered),
        "the receipt was not delivered: {:?}",
        shown.receipts()
    );
    ensure!(
        shown
            .events()
            .iter()
            .any(|e| e.what() == "operator_redelivered"
                && e.detail()
                    .is_some_and(|d| d.contains("the network is back"))),
        "the timeline has no operator_redelivered with the evidence"
    );
    Ok(())
}
