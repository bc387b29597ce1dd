//! The operator console's router as a library, over HTTP on loopback (the
//! browser tests are `tests/console.rs`): mounted under a path of the
//! product's admin server, a bulk redeliver that sends what its preview
//! counted, no more, and the signed-in operator as the approver.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde::{Deserialize, Serialize};
use serde_json::json;
use toolrunner::console::{Console, Operator};
use toolrunner::platform::CallState;
use toolrunner::testing::{CallHandle, Step, TestKit};
use toolrunner::{
    ApprovalState, Approvals, AuthorizationRequest, CallContext, Denied, ReceiptStatus, ToolError,
};

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

/// Every charge waits for a person's yes.
fn every_charge_needs_a_person(_: &AuthorizationRequest) -> Result<(), Denied> {
    Err(Denied::needs_approval(
        "a person checks every charge",
        Duration::from_secs(600),
    ))
}

/// The waiting request of `call` (its digest), once it is stored.
async fn waiting_digest(book: &Approvals, call: &CallHandle) -> Result<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(r) = book.list().await?.into_iter().find(|r| {
            r.run_id() == call.run_id
                && r.call_id() == call.call_id
                && r.state() == ApprovalState::Waiting
        }) {
            return Ok(r.digest().to_owned());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "no request of {} waits",
            call.call_id
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The console's signed-in operator is the approver, not the name typed
/// into the form: the product's authentication names them (an
/// [`Operator`] extension of the request, or the header an authenticating
/// proxy sets, `ConsoleBuilder::operator_header`), the page asks for no
/// name, and a request without the header is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_signed_in_operator_decides_not_the_name_typed() -> Result<()> {
    let kit = TestKit::start(|b| {
        b.tool(charge)
            .approval_policy("payments.charge", every_charge_needs_a_person)
            .poll_interval(Duration::from_millis(50))
    })
    .await?;
    let approved = kit.submit("payments.charge", json!({"amount": 1})).await?;
    let denied = kit.submit("payments.charge", json!({"amount": 2})).await?;
    let book = Approvals::open_path(kit.store_path()).await?;
    let approved_digest = waiting_digest(&book, &approved).await?;
    let denied_digest = waiting_digest(&book, &denied).await?;
    let http = client()?;

    // Mounted in the product's admin server, behind its sign-in, which
    // names the operator on every request.
    let mounted = Console::builder()
        .store("exec", kit.reconciler().await?)
        .build()
        .await?;
    let app =
        axum::Router::new()
            .nest("/admin", mounted.router())
            .layer(axum::middleware::from_fn(
                |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
                    request
                        .extensions_mut()
                        .insert(Operator::new("alice@example.com"));
                    next.run(request).await
                },
            ));
    let base = serve(app).await?;
    let page = http
        .get(format!("{base}/admin/approvals"))
        .send()
        .await?
        .text()
        .await?;
    ensure!(
        page.contains("alice@example.com") && !page.contains("name=\"who\""),
        "the page does not name the signed-in operator, or asks for a name: {page}"
    );
    let token = csrf(&page)?;
    let answer = post(
        &http,
        format!(
            "{base}/admin/approvals/{}/{}",
            approved.run_id, approved.call_id
        ),
        &[
            ("csrf", &token),
            ("store", "exec"),
            ("digest", &approved_digest),
            ("decision", "approve"),
            ("who", "mallory"),
        ],
    )
    .send()
    .await?;
    ensure!(answer.status() == 200, "approve: {}", answer.status());
    let shown = book.show(&approved.run_id, &approved.call_id).await?;
    ensure!(
        shown.decided_by() == Some("alice@example.com"),
        "the approval was recorded by {:?}, expected the signed-in operator",
        shown.decided_by()
    );

    // Behind an authenticating proxy that names the operator in a header.
    let proxied = Console::builder()
        .store("exec", kit.reconciler().await?)
        .operator_header("X-Forwarded-User")
        .build()
        .await?;
    let base = serve(proxied.router()).await?;
    let bare = http.get(format!("{base}/approvals")).send().await?;
    ensure!(
        bare.status() == 403,
        "a request without the operator's header: {}",
        bare.status()
    );
    let why = bare.text().await?;
    ensure!(
        why.contains("x-forwarded-user"),
        "the refusal does not name the header: {why}"
    );
    let page = http
        .get(format!("{base}/approvals"))
        .header("x-forwarded-user", "bob")
        .send()
        .await?
        .text()
        .await?;
    ensure!(
        page.contains("bob") && !page.contains("name=\"who\""),
        "the page does not name the proxy's operator: {page}"
    );
    let token = csrf(&page)?;
    let fields = [
        ("csrf", token.as_str()),
        ("store", "exec"),
        ("digest", denied_digest.as_str()),
        ("decision", "deny"),
        ("who", "mallory"),
    ];
    let path = format!("{base}/approvals/{}/{}", denied.run_id, denied.call_id);
    let unsigned = post(&http, path.clone(), &fields).send().await?;
    ensure!(
        unsigned.status() == 403,
        "a decision without the operator's header: {}",
        unsigned.status()
    );
    ensure!(
        book.show(&denied.run_id, &denied.call_id).await?.state() == ApprovalState::Waiting,
        "a decision without the operator's header was recorded"
    );
    let answer = post(&http, path, &fields)
        .header("x-forwarded-user", "bob")
        .send()
        .await?;
    ensure!(answer.status() == 200, "deny: {}", answer.status());
    let shown = book.show(&denied.run_id, &denied.call_id).await?;
    ensure!(
        shown.decided_by() == Some("bob") && shown.state() == ApprovalState::Denied,
        "the deny was recorded as {:?} by {:?}, expected denied by bob",
        shown.state(),
        shown.decided_by()
    );
    ensure!(
        kit.wait(&approved).await?.state == CallState::Completed,
        "the approved charge did not complete"
    );
    let denied_outcome = kit.wait(&denied).await?;
    ensure!(
        denied_outcome.error_code.as_deref() == Some("forbidden"),
        "the denied charge ended {:?}",
        denied_outcome.error_code
    );
    let refused = Console::builder()
        .store("exec", kit.reconciler().await?)
        .operator_header("not a header")
        .build()
        .await
        .err()
        .context("a console with an operator header that is no header name was built")?;
    ensure!(
        refused.to_string().contains("is not a header name"),
        "{refused}"
    );
    kit.shutdown().await?;
    Ok(())
}

/// An operator the product's sign-in names blank, or a proxy's header
/// given twice (a proxy that appends to the client's own), names nobody
/// for sure: the console refuses the request rather than take a name
/// typed into the form or the client's header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blank_or_doubled_operator_is_refused() -> Result<()> {
    let kit = TestKit::start(|b| b.tool(charge)).await?;
    let http = client()?;
    let mounted = Console::builder()
        .store("exec", kit.reconciler().await?)
        .build()
        .await?;
    let app = mounted.router().layer(axum::middleware::from_fn(
        |mut request: axum::extract::Request, next: axum::middleware::Next| async move {
            request.extensions_mut().insert(Operator::new("  "));
            next.run(request).await
        },
    ));
    let base = serve(app).await?;
    let blank = http.get(format!("{base}/approvals")).send().await?;
    ensure!(
        blank.status() == 403,
        "a blank signed-in operator: {}",
        blank.status()
    );
    let proxied = Console::builder()
        .store("exec", kit.reconciler().await?)
        .operator_header("X-Forwarded-User")
        .build()
        .await?;
    let base = serve(proxied.router()).await?;
    let doubled = http
        .get(format!("{base}/approvals"))
        .header("x-forwarded-user", "mallory")
        .header("x-forwarded-user", "bob")
        .send()
        .await?;
    ensure!(
        doubled.status() == 403,
        "the operator's header given twice: {}",
        doubled.status()
    );
    let merged = http
        .get(format!("{base}/approvals"))
        .header("x-forwarded-user", "mallory, bob")
        .send()
        .await?;
    ensure!(
        merged.status() == 403,
        "the operator's header as a list: {}",
        merged.status()
    );
    let once = http
        .get(format!("{base}/approvals"))
        .header("x-forwarded-user", "bob")
        .send()
        .await?;
    ensure!(once.status() == 200, "the header once: {}", once.status());
    kit.shutdown().await?;
    Ok(())
}
