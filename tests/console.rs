//! The operator console (`toolrunner::console`) in a real browser: headless
//! Chromium driven through chromedriver (WebDriver) by fantoccini.
//!
//! ```text
//! cargo test --test console
//! ```
//!
//! Each trial builds its own fixture: three stores behind one console on
//! `127.0.0.1:0`:
//!
//! - `live`: a test kit with the write tool `payments.charge`, one call
//!   completed, one failed and two in `reconciliation_required` (one of
//!   them with markup in its arguments);
//! - `stalled`: a test kit whose executor crashed after saving a final
//!   receipt, before delivering it: the receipt waits in the outbox;
//! - `seeded`: a SQLite store seeded through the testing seam with one
//!   call in each local state.
//!
//! The chromedriver (env `CHROMEDRIVER`, else `/usr/bin/chromedriver`,
//! else `chromedriver` on `PATH`) is started once, on a free loopback
//! port, by the first trial that needs it, and killed at the end; every
//! trial opens a browser session of its own and closes it, failed or not.
//! Without chromedriver or Chromium (env `CHROME`, else
//! `/usr/bin/chromium`) the suite runs nothing and says so.
//!
//! With `TOOLRUNNER_CONSOLE_SCREENSHOTS=DIR`, one more trial saves
//! `DIR/console-overview.png` and `DIR/console-call.png`.

use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow, bail, ensure};
use fantoccini::elements::Element;
use fantoccini::{Client, ClientBuilder, Locator};
use futures_util::FutureExt;
use libtest_mimic::{Arguments, Failed, Trial};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tempfile::TempDir;
use toolrunner::console::Console;
use toolrunner::platform::CallState;
use toolrunner::protocol::wire::{Assignment, Grant, ReceiptKind};
use toolrunner::testing::store::{
    Change, LocalCall, LocalState, OutboxReceipt, PendingReport, ReceiptStatus, SqliteStore, Store,
    Timestamp,
};
use toolrunner::testing::{CallHandle, Step, TestKit};
use toolrunner::{
    ApprovalState, Approvals, Attempt, AuthorizationRequest, Authorizer, CallContext, Denied,
    Reconciler, ToolError,
};

/// How long a page may take to show what a step waits for.
const PAGE: Duration = Duration::from_secs(10);
/// How long a delivery may take to reach the platform.
const DELIVERY: Duration = Duration::from_secs(15);
/// The screenshots' directory, when set.
const SCREENSHOTS_VAR: &str = "TOOLRUNNER_CONSOLE_SCREENSHOTS";
/// The note with markup of one `live` call.
const MARKUP: &str = "<script>window.__pwned=1</script><b>bold</b>";
/// The executor named in the seeded store's receipts.
const SEEDED_EXECUTOR: &str = "exe_console_seeded";

fn main() -> ExitCode {
    let args = Arguments::from_args();
    // reqwest (rustls-no-provider) and the reconcilers' clients need one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let Some((chromedriver, chrome)) = browser() else {
        // `.ci/run` installs the browser and sets this: there, a missing
        // browser is a failure, not a skipped suite.
        if std::env::var_os("TOOLRUNNER_CONSOLE_REQUIRE_BROWSER").is_some_and(|v| !v.is_empty()) {
            eprintln!(
                "the console's browser tests cannot run: TOOLRUNNER_CONSOLE_REQUIRE_BROWSER is set and no chromedriver/chromium was found (apt-get install chromium chromium-driver, or set CHROMEDRIVER and CHROME)"
            );
            return ExitCode::FAILURE;
        }
        println!(
            "the console's browser tests were not run: no chromedriver/chromium found (apt-get install chromium chromium-driver)"
        );
        return libtest_mimic::run(&args, Vec::new()).exit_code();
    };
    let driver = Arc::new(Driver {
        binary: chromedriver,
        chrome,
        running: Mutex::new(None),
    });
    let mut trials = vec![
        browser_trial(
            "an_operator_resolves_a_call_from_the_browser",
            &driver,
            false,
            |fx, c| Box::pin(an_operator_resolves_a_call_from_the_browser(fx, c)),
        ),
        browser_trial(
            "a_result_that_fails_its_schema_is_refused_readably",
            &driver,
            false,
            |fx, c| Box::pin(a_result_that_fails_its_schema_is_refused_readably(fx, c)),
        ),
        browser_trial(
            "a_bulk_redeliver_previews_its_count_then_delivers",
            &driver,
            false,
            |fx, c| Box::pin(a_bulk_redeliver_previews_its_count_then_delivers(fx, c)),
        ),
        browser_trial(
            "read_only_hides_every_action_and_refuses_every_post",
            &driver,
            true,
            |fx, c| Box::pin(read_only_hides_every_action_and_refuses_every_post(fx, c)),
        ),
        browser_trial(
            "markup_in_arguments_renders_as_text",
            &driver,
            false,
            |fx, c| Box::pin(markup_in_arguments_renders_as_text(fx, c)),
        ),
        browser_trial(
            "a_forged_post_without_the_csrf_token_is_refused",
            &driver,
            false,
            |fx, c| Box::pin(a_forged_post_without_the_csrf_token_is_refused(fx, c)),
        ),
        browser_trial(
            "an_approver_approves_and_denies_from_the_browser",
            &driver,
            false,
            |_, c| Box::pin(an_approver_approves_and_denies_from_the_browser(c)),
        ),
    ];
    if std::env::var_os(SCREENSHOTS_VAR).is_some_and(|d| !d.is_empty()) {
        trials.push(browser_trial(
            "screenshots_of_the_overview_and_a_call_page",
            &driver,
            false,
            |fx, c| Box::pin(screenshots_of_the_overview_and_a_call_page(fx, c)),
        ));
    }
    let conclusion = libtest_mimic::run(&args, trials);
    driver.stop();
    conclusion.exit_code()
}

// ------------------------------------------------------------ the browser

/// chromedriver and Chromium, when both are installed.
fn browser() -> Option<(PathBuf, PathBuf)> {
    let from_env = |var: &str| {
        std::env::var_os(var)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    let chromedriver = match from_env("CHROMEDRIVER") {
        Some(p) => Some(p).filter(|p| p.is_file()),
        None => Some(PathBuf::from("/usr/bin/chromedriver"))
            .filter(|p| p.is_file())
            .or_else(|| on_path("chromedriver")),
    }?;
    let chrome = from_env("CHROME").unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"));
    let chrome = Some(chrome).filter(|p| p.is_file())?;
    Some((chromedriver, chrome))
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// One chromedriver for the whole suite, started by the first trial that
/// needs it.
struct Driver {
    binary: PathBuf,
    chrome: PathBuf,
    running: Mutex<Option<std::result::Result<ChromeDriver, String>>>,
}

impl Driver {
    /// The WebDriver URL, starting chromedriver on first use.
    fn url(&self) -> Result<String> {
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(Ok(d)) = running.as_mut()
            && let Ok(Some(status)) = d.child.try_wait()
        {
            bail!(
                "chromedriver exited ({status}) during the run; its log:\n{}",
                d.log_tail()
            );
        }
        let started = running
            .get_or_insert_with(|| ChromeDriver::start(&self.binary).map_err(|e| format!("{e:#}")));
        match started {
            Ok(d) => Ok(format!("http://127.0.0.1:{}", d.port)),
            Err(e) => bail!("chromedriver did not start: {e}"),
        }
    }

    /// Kills chromedriver (when it was started).
    fn stop(&self) {
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
    }
}

/// A chromedriver process, killed when dropped.
struct ChromeDriver {
    child: Child,
    port: u16,
    log: PathBuf,
    _dir: TempDir,
}

impl Drop for ChromeDriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl ChromeDriver {
    /// Starts chromedriver on a free loopback port and waits until its
    /// `/status` says it is ready (a port taken meanwhile: another try).
    fn start(binary: &Path) -> Result<ChromeDriver> {
        let mut last = String::new();
        for _ in 0..3 {
            let port = free_port()?;
            let dir = tempfile::tempdir()?;
            let log = dir.path().join("chromedriver.log");
            let out = std::fs::File::create(&log)?;
            let child = Command::new(binary)
                .arg(format!("--port={port}"))
                .stdin(Stdio::null())
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()
                .with_context(|| format!("cannot run {}", binary.display()))?;
            let mut driver = ChromeDriver {
                child,
                port,
                log,
                _dir: dir,
            };
            let end = Instant::now() + Duration::from_secs(20);
            loop {
                if status_ready(port) {
                    return Ok(driver);
                }
                if let Some(status) = driver.child.try_wait()? {
                    last = format!("chromedriver exited ({status}):\n{}", driver.log_tail());
                    break;
                }
                if Instant::now() >= end {
                    bail!(
                        "chromedriver on port {port} did not answer /status as ready within 20 s; its log:\n{}",
                        driver.log_tail()
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        bail!("chromedriver did not start in 3 tries; last: {last}")
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(2000);
        text.get(start..).unwrap_or(&text).to_owned()
    }
}

fn free_port() -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

/// Whether chromedriver's `GET /status` answers `ready: true`.
fn status_ready(port: u16) -> bool {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let Ok(mut stream) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let request =
        format!("GET /status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let compact: String = answer.chars().filter(|c| !c.is_whitespace()).collect();
    answer.starts_with("HTTP/1.1 200") && compact.contains("\"ready\":true")
}

/// A browser session on the suite's chromedriver.
async fn session(webdriver: &str, chrome: &Path) -> Result<Client> {
    let caps = json!({
        "browserName": "chrome",
        "goog:chromeOptions": {
            "binary": chrome.to_string_lossy(),
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1280,1400"],
        },
    });
    let Value::Object(caps) = caps else {
        unreachable!("an object")
    };
    let mut builder = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
    builder.capabilities(caps);
    builder
        .connect(webdriver)
        .await
        .map_err(|e| anyhow!("cannot open a browser session on {webdriver}: {e}"))
}

// ------------------------------------------------------------- the trials

type BodyFuture<'a> = Pin<Box<dyn Future<Output = Result<()>> + 'a>>;
/// A trial's body: its fixture and its browser session.
type Body = for<'a> fn(&'a Fixture, &'a Client) -> BodyFuture<'a>;

fn browser_trial(name: &'static str, driver: &Arc<Driver>, read_only: bool, body: Body) -> Trial {
    let driver = driver.clone();
    Trial::test(name, move || {
        run_trial(&driver, read_only, body).map_err(|e| Failed::from(format!("{e:#}")))
    })
}

/// Builds the fixture and a session, runs `body`, then closes the session
/// and stops the fixture whatever happened.
fn run_trial(driver: &Driver, read_only: bool, body: Body) -> Result<()> {
    let webdriver = driver.url()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let fx = Fixture::start(read_only)
            .await
            .context("building the fixture")?;
        let client = match session(&webdriver, &driver.chrome).await {
            Ok(c) => c,
            Err(e) => {
                fx.shutdown().await;
                return Err(e);
            }
        };
        let outcome = AssertUnwindSafe(body(&fx, &client)).catch_unwind().await;
        let closed = client.close().await;
        fx.shutdown().await;
        match outcome {
            Ok(result) => result?,
            Err(panic) => std::panic::resume_unwind(panic),
        }
        closed.map_err(|e| anyhow!("closing the browser session: {e}"))?;
        Ok(())
    })
}

/// 1. Overview → the list of calls waiting → a call → resolve with
///    evidence → preview → confirm; the platform gets the result.
async fn an_operator_resolves_a_call_from_the_browser(fx: &Fixture, c: &Client) -> Result<()> {
    goto(c, &fx.url("/")).await?;
    let before = total(c, "reconciliation_required").await?;
    ensure!(
        before >= 3,
        "#total-reconciliation_required: expected at least 3 (2 live + 1 seeded), saw {before}"
    );
    let link = find(c, "a#total-reconciliation_required").await?;
    let href = link.attr("href").await?;
    ensure!(
        href.as_deref() == Some("/calls?state=reconciliation_required"),
        "#total-reconciliation_required href: expected /calls?state=reconciliation_required, saw {href:?}"
    );
    link.click().await?;
    wait_find(c, "table#calls").await?;
    let row = format!(
        "table#calls tr.call[data-call-id=\"{}\"][data-identity=\"live\"]",
        fx.plain.call_id
    );
    let state = find(c, &row).await?.attr("data-state").await?;
    ensure!(
        state.as_deref() == Some("reconciliation_required"),
        "{row}: data-state expected reconciliation_required, saw {state:?}"
    );
    let rows = c.find_all(Locator::Css("table#calls tr.call")).await?;
    for r in &rows {
        let s = r.attr("data-state").await?;
        ensure!(
            s.as_deref() == Some("reconciliation_required"),
            "/calls?state=reconciliation_required lists a call in state {s:?}{}",
            excerpt(c).await
        );
    }
    find(c, &format!("{row} a.call-link"))
        .await?
        .click()
        .await?;
    wait_find(c, "#call-state").await?;
    let url = c.current_url().await?;
    ensure!(
        url.path() == format!("/calls/{}/{}", fx.plain.run_id, fx.plain.call_id),
        "the call link led to {url}, expected /calls/{}/{}?identity=live",
        fx.plain.run_id,
        fx.plain.call_id
    );
    let shown_state = text(c, "#call-state").await?;
    ensure!(
        shown_state.trim() == "reconciliation_required",
        "#call-state: expected reconciliation_required, saw {shown_state:?}"
    );
    let timeline = fx
        .live_check
        .show(&fx.plain.run_id, &fx.plain.call_id)
        .await?;
    let key = find(c, "#operation-key").await?.prop("value").await?;
    ensure!(
        key.as_deref() == Some(timeline.call().operation_key()),
        "#operation-key: expected {:?} (reconciler.show), saw {key:?}",
        timeline.call().operation_key()
    );

    fill_resolve(
        c,
        "completed",
        r#"{"charge_id":"ch_manual"}"#,
        "alice",
        "provider dashboard shows ch_manual",
    )
    .await?;
    find(c, "#resolve-preview").await?.click().await?;
    let preview = wait_find(c, "#preview").await?.text().await?;
    ensure!(
        preview.contains("completed"),
        "#preview: expected it to mention `completed`, saw {preview:?}"
    );
    find(c, "#confirm-form #confirm").await?.click().await?;
    wait_find(c, "#done").await?;

    wait_for(
        "the live platform's call to become completed after the console's resolve",
        DELIVERY,
        || platform_state_is(&fx.live, &fx.plain, CallState::Completed),
    )
    .await?;

    goto(c, &fx.call_url("live", &fx.plain)).await?;
    let resolved = find(c, "#timeline li.event[data-what=\"operator_resolved\"]").await?;
    let said = resolved.text().await?;
    ensure!(
        said.contains("alice") && said.contains("provider dashboard shows ch_manual"),
        "the operator_resolved timeline entry: expected `alice` and `provider dashboard shows ch_manual`, saw {said:?}"
    );

    goto(c, &fx.url("/")).await?;
    let after = total(c, "reconciliation_required").await?;
    ensure!(
        after + 1 == before,
        "#total-reconciliation_required after the resolve: expected {}, saw {after}",
        before - 1
    );
    Ok(())
}

/// 2. A `completed` result that fails the tool's `output_schema` is
///    refused with a readable reason, and nothing changes.
async fn a_result_that_fails_its_schema_is_refused_readably(
    fx: &Fixture,
    c: &Client,
) -> Result<()> {
    let call = &fx.markup;
    let before = footprint(&fx.live_check, call).await?;
    goto(c, &fx.call_url("live", call)).await?;
    fill_resolve(
        c,
        "completed",
        r#"{"charge_id": 7}"#,
        "alice",
        "provider dashboard shows a charge",
    )
    .await?;
    find(c, "#resolve-preview").await?.click().await?;
    let shown = wait_find(c, "#preview, #error").await?;
    let refusal = if shown.attr("id").await?.as_deref() == Some("error") {
        // Refused at the preview already.
        shown.text().await?
    } else {
        find(c, "#confirm-form #confirm").await?.click().await?;
        wait_find(c, "#error").await?.text().await?
    };
    if let Some(status) = navigation_status(c).await? {
        ensure!(
            status == 422,
            "the refusal answered HTTP {status}, expected 422{}",
            excerpt(c).await
        );
    }
    ensure!(
        refusal.contains("does not match output_schema"),
        "#error: expected it to contain `does not match output_schema`, saw {refusal:?}"
    );
    let after = footprint(&fx.live_check, call).await?;
    ensure!(
        after.state == LocalState::ReconciliationRequired && after == before,
        "after the refusal the call changed: before {before:?}, after {after:?} (expected it still reconciliation_required, untouched)"
    );
    Ok(())
}

/// 3. The outbox's bulk redeliver for one identity: a preview with the
///    count, then the delivery.
async fn a_bulk_redeliver_previews_its_count_then_delivers(fx: &Fixture, c: &Client) -> Result<()> {
    let pending = fx.stalled_check.outbox().await?.pending().to_vec();
    ensure!(
        pending.len() == 1,
        "the stalled store's outbox: expected 1 pending receipt, saw {}",
        pending.len()
    );
    let receipt_id = pending[0].receipt_id().to_owned();

    goto(c, &fx.url("/outbox")).await?;
    find(c, "table#outbox").await?;
    find(
        c,
        &format!("table#outbox tr.receipt[data-receipt-id=\"{receipt_id}\"]"),
    )
    .await?;
    let form = "#bulk-redeliver-form";
    let action = find(c, form).await?.attr("action").await?;
    ensure!(
        action.as_deref() == Some("/outbox/redeliver"),
        "{form} action: expected /outbox/redeliver, saw {action:?}"
    );
    let select = find(c, &format!("{form} select[name=\"identity\"]")).await?;
    for value in ["", "live", "stalled", "seeded"] {
        find(
            c,
            &format!("{form} select[name=\"identity\"] option[value=\"{value}\"]"),
        )
        .await?;
    }
    select
        .select_by_value("stalled")
        .await
        .map_err(|e| anyhow!("choosing identity `stalled`: {e}"))?;
    fill(c, form, "who", "bob").await?;
    fill(c, form, "evidence", "the stalled executor's host is gone").await?;
    find(c, "#bulk-preview").await?.click().await?;
    let count = wait_find(c, "#bulk-count").await?.text().await?;
    ensure!(
        count.trim() == "1",
        "#bulk-count: expected 1 (the stalled store's one pending receipt), saw {count:?}{}",
        excerpt(c).await
    );
    find(c, "#confirm-form #confirm").await?.click().await?;
    wait_find(c, "#done").await?;

    wait_for(
        "the stalled platform's call to become completed after the bulk redeliver",
        DELIVERY,
        || platform_state_is(&fx.stalled, &fx.stalled_call, CallState::Completed),
    )
    .await?;
    goto(c, &fx.call_url("stalled", &fx.stalled_call)).await?;
    find(c, "#timeline li.event[data-what=\"operator_redelivered\"]").await?;
    Ok(())
}

/// 4. A read-only console shows no action and refuses every POST.
async fn read_only_hides_every_action_and_refuses_every_post(
    fx: &Fixture,
    c: &Client,
) -> Result<()> {
    let call = &fx.plain;
    let before = footprint(&fx.live_check, call).await?;
    for path in [
        "/".to_owned(),
        fx.call_path("live", call),
        "/outbox".to_owned(),
        "/approvals".to_owned(),
    ] {
        goto(c, &fx.url(&path)).await?;
        find(c, "#read-only").await?;
        absent(c, "#resolve-form").await?;
        absent(c, "#bulk-redeliver-form").await?;
        absent(c, "form[method=\"post\" i]").await?;
    }
    goto(c, &fx.url(&fx.call_path("live", call))).await?;
    let state = text(c, "#call-state").await?;
    ensure!(
        state.trim() == "reconciliation_required",
        "#call-state: expected reconciliation_required, saw {state:?}"
    );

    let http = reqwest::Client::new();
    let posts = [
        (
            format!(
                "/calls/{}/{}/resolve?identity=live",
                call.run_id, call.call_id
            ),
            vec![
                ("outcome", "completed"),
                ("result", r#"{"charge_id":"ch_ro"}"#),
                ("who", "mallory"),
                ("evidence", "read-only must refuse this"),
                ("csrf", "anything"),
            ],
        ),
        (
            "/outbox/redeliver".to_owned(),
            vec![
                ("identity", ""),
                ("who", "mallory"),
                ("evidence", "read-only must refuse this"),
                ("csrf", "anything"),
            ],
        ),
        (
            format!("/approvals/{}/{}", call.run_id, call.call_id),
            vec![
                ("store", "live"),
                ("digest", "sha256:0000"),
                ("decision", "approve"),
                ("who", "mallory"),
                ("csrf", "anything"),
            ],
        ),
    ];
    for (path, fields) in &posts {
        let answer = post_form(&http, &fx.url(path), fields).await?;
        // Refused for being read-only, not for the CSRF token the form
        // lacks: the answer says which.
        ensure!(
            answer.0 == 403 && answer.1.contains("read-only"),
            "POST {path} on a read-only console: expected 403 saying read-only, saw {}: {}",
            answer.0,
            clip(&answer.1, 1500)
        );
    }
    let after = footprint(&fx.live_check, call).await?;
    ensure!(
        after.state == LocalState::ReconciliationRequired && after == before,
        "after the refused POSTs the call changed: before {before:?}, after {after:?} (expected it still reconciliation_required, untouched)"
    );
    let stalled = fx.stalled_check.outbox().await?.pending().len();
    ensure!(
        stalled == 1,
        "after the refused redeliver the stalled outbox holds {stalled} pending receipts, expected 1"
    );
    Ok(())
}

/// 5. Arguments holding markup render as text: nothing runs, no element
///    is made of them.
async fn markup_in_arguments_renders_as_text(fx: &Fixture, c: &Client) -> Result<()> {
    goto(c, &fx.call_url("live", &fx.markup)).await?;
    let arguments = find(c, "pre#arguments").await?.text().await?;
    ensure!(
        arguments.contains("<script>window.__pwned=1</script>"),
        "#arguments: expected the literal text <script>window.__pwned=1</script>, saw {arguments:?}"
    );
    ensure!(
        arguments.contains("<b>bold</b>"),
        "#arguments: expected the literal text <b>bold</b>, saw {arguments:?}"
    );
    let untouched = c
        .execute("return window.__pwned === undefined", vec![])
        .await?;
    ensure!(
        untouched == Value::Bool(true),
        "window.__pwned === undefined: expected true, saw {untouched}: the arguments' script ran"
    );
    for tag in ["b", "script"] {
        let made = c
            .find_all(Locator::Css(&format!("#arguments {tag}")))
            .await?;
        ensure!(
            made.is_empty(),
            "#arguments holds {} <{tag}> element(s) made of the call's arguments{}",
            made.len(),
            excerpt(c).await
        );
    }
    Ok(())
}

/// 6. A POST built by another page's script, without the CSRF token, is
///    refused and changes nothing.
async fn a_forged_post_without_the_csrf_token_is_refused(fx: &Fixture, c: &Client) -> Result<()> {
    let call = &fx.plain;
    let before = footprint(&fx.live_check, call).await?;
    goto(c, &fx.call_url("live", call)).await?;
    find(c, "#resolve-form").await?;
    let action = format!(
        "/calls/{}/{}/resolve?identity=live",
        call.run_id, call.call_id
    );
    let fields = json!({
        "outcome": "completed",
        "result": r#"{"charge_id":"ch_forged"}"#,
        "who": "mallory",
        "evidence": "forged",
    });
    c.execute(
        r#"
        const [action, fields] = arguments;
        const form = document.createElement('form');
        form.method = 'post';
        form.action = action;
        for (const [name, value] of Object.entries(fields)) {
            const input = document.createElement('input');
            input.type = 'hidden';
            input.name = name;
            input.value = value;
            form.appendChild(input);
        }
        document.body.appendChild(form);
        setTimeout(() => form.submit(), 0);
        return true;
        "#,
        vec![json!(action), fields],
    )
    .await?;
    wait_for("the forged form's answer to load", PAGE, || async {
        Ok(c.current_url().await?.path().ends_with("/resolve"))
    })
    .await
    .map_err(|e| anyhow!("{e:#}"))?;
    wait_find(c, "#error").await?;
    if let Some(status) = navigation_status(c).await? {
        ensure!(
            status == 403,
            "the forged POST answered HTTP {status}, expected 403{}",
            excerpt(c).await
        );
    }

    let http = reqwest::Client::new();
    let (status, page) = post_form(
        &http,
        &fx.url(&action),
        &[
            ("outcome", "completed"),
            ("result", r#"{"charge_id":"ch_forged"}"#),
            ("who", "mallory"),
            ("evidence", "forged"),
        ],
    )
    .await?;
    ensure!(
        status == 403 && page.contains("id=\"error\""),
        "a POST without csrf: expected 403 with <div id=\"error\">, saw {status}: {}",
        clip(&page, 1500)
    );
    let (status, page) = post_form(
        &http,
        &fx.url(&action),
        &[
            ("outcome", "completed"),
            ("result", r#"{"charge_id":"ch_forged"}"#),
            ("who", "mallory"),
            ("evidence", "forged"),
            ("csrf", "not-the-token"),
        ],
    )
    .await?;
    ensure!(
        status == 403,
        "a POST with a wrong csrf: expected 403, saw {status}: {}",
        clip(&page, 1500)
    );

    let after = footprint(&fx.live_check, call).await?;
    ensure!(
        after.state == LocalState::ReconciliationRequired && after == before,
        "after the forged POSTs the call changed: before {before:?}, after {after:?} (expected it still reconciliation_required, untouched)"
    );
    let platform = platform_state(&fx.live, call).await?;
    ensure!(
        platform != CallState::Completed,
        "the platform's call became completed after a forged POST"
    );
    Ok(())
}

/// Every charge waits for a person's yes (for ten minutes).
struct EveryChargeNeedsAPerson;

#[toolrunner::async_trait]
impl Authorizer for EveryChargeNeedsAPerson {
    async fn authorize(&self, _request: &AuthorizationRequest) -> Result<(), Denied> {
        Err(Denied::needs_approval(
            "a person checks every charge",
            Duration::from_secs(600),
        ))
    }
}

/// 7. The approvals page (issue 34): three charges wait; one is approved
///    and runs, one is denied and is settled `forbidden`, a forged POST for
///    the third is refused and it still waits; its arguments (with markup)
///    show as text.
async fn an_approver_approves_and_denies_from_the_browser(c: &Client) -> Result<()> {
    let kit = TestKit::start(|b| {
        b.tool(charge)
            .authorizer(EveryChargeNeedsAPerson)
            .poll_interval(Duration::from_millis(50))
    })
    .await
    .context("starting the approving kit")?;
    let approved = kit
        .submit("payments.charge", json!({"mode": "ok", "note": MARKUP}))
        .await?;
    let denied = kit
        .submit("payments.charge", json!({"mode": "ok", "note": "deny me"}))
        .await?;
    let forged = kit
        .submit("payments.charge", json!({"mode": "ok", "note": "forged"}))
        .await?;
    let book = Approvals::open_path(kit.store_path()).await?;
    wait_for("three requests to wait", DELIVERY, || async {
        Ok(book
            .list()
            .await?
            .iter()
            .filter(|r| r.state() == ApprovalState::Waiting)
            .count()
            == 3)
    })
    .await?;
    let console = Console::builder()
        .store("approving", kit.reconciler().await?)
        .build()
        .await
        .context("building the console")?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let app = console.router();
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    let played = async {
        goto(c, &format!("{base}/approvals")).await?;
        let section = |call: &CallHandle| {
            format!(
                "section.approval[data-call-id=\"{}\"][data-run-id=\"{}\"]",
                call.call_id, call.run_id
            )
        };
        for call in [&approved, &denied, &forged] {
            find(c, &section(call)).await?;
        }
        // The arguments with markup are text: nothing ran, no element.
        let shown = text(c, &format!("{} pre.arguments", section(&approved))).await?;
        ensure!(
            shown.contains(MARKUP),
            "the arguments show {shown:?}, expected the literal text {MARKUP:?}"
        );
        let untouched = c
            .execute("return window.__pwned === undefined", vec![])
            .await?;
        ensure!(
            untouched == Value::Bool(true),
            "the arguments' script ran on the approvals page"
        );
        for tag in ["b", "script"] {
            absent(c, &format!("{} pre.arguments {tag}", section(&approved))).await?;
        }
        ensure!(
            text(c, &format!("{} .reason", section(&approved))).await?
                == "a person checks every charge",
            "the reason is not shown"
        );
        ensure!(
            text(c, &format!("{} .subject", section(&approved))).await? == "testkit-user",
            "the subject is not shown"
        );

        // Approve: the call runs once.
        let form = format!("{} form.decide", section(&approved));
        fill(c, &form, "who", "alice").await?;
        fill(c, &form, "note", "checked the order").await?;
        find(c, &format!("{form} button.approve")).await?.click().await?;
        let done = wait_find(c, "#done").await?.text().await?;
        ensure!(
            done.contains("approved") && done.contains("alice"),
            "after approve: {done:?}"
        );
        let outcome = kit.wait(&approved).await?;
        ensure!(
            outcome.state == CallState::Completed,
            "the approved charge ended {:?}, expected completed",
            outcome.state
        );
        let request = book.show(&approved.run_id, &approved.call_id).await?;
        ensure!(
            request.state() == ApprovalState::Approved
                && request.decided_by() == Some("alice")
                && request.note() == Some("checked the order"),
            "the approved request reads {request:?}"
        );

        // Deny: settled forbidden, with the message the model reads.
        goto(c, &format!("{base}/approvals")).await?;
        let form = format!("{} form.decide", section(&denied));
        fill(c, &form, "who", "bob").await?;
        find(c, &format!("{form} button.deny")).await?.click().await?;
        let done = wait_find(c, "#done").await?.text().await?;
        ensure!(done.contains("denied"), "after deny: {done:?}");
        let outcome = kit.wait(&denied).await?;
        ensure!(
            outcome.state == CallState::Failed
                && outcome
                    .call
                    .receipts
                    .iter()
                    .any(|r| r.body.get().contains("denied by an approver")
                        && r.body.get().contains("forbidden")),
            "the denied charge ended {:?} with {:?}, expected failed forbidden 'denied by an approver'",
            outcome.state,
            outcome.call.receipts
        );

        // A forged POST (no token, a wrong one) is refused; it still waits.
        goto(c, &format!("{base}/approvals")).await?;
        let digest = find(c, &format!("{} input[name=\"digest\"]", section(&forged)))
            .await?
            .attr("value")
            .await?
            .unwrap_or_default();
        let action = format!(
            "{base}/approvals/{}/{}",
            forged.run_id, forged.call_id
        );
        let http = reqwest::Client::new();
        let fields = [
            ("store", "approving"),
            ("digest", digest.as_str()),
            ("decision", "approve"),
            ("who", "mallory"),
        ];
        let (status, page) = post_form(&http, &action, &fields).await?;
        ensure!(
            status == 403,
            "a decision POST without csrf answered {status}: {}",
            clip(&page, 1500)
        );
        let mut wrong = fields.to_vec();
        wrong.push(("csrf", "not-the-token"));
        let (status, page) = post_form(&http, &action, &wrong).await?;
        ensure!(
            status == 403,
            "a decision POST with a wrong csrf answered {status}: {}",
            clip(&page, 1500)
        );
        // With the page's token but for other arguments than it showed:
        // refused, nothing decided.
        let csrf = find(c, &format!("{} input[name=\"csrf\"]", section(&forged)))
            .await?
            .attr("value")
            .await?
            .unwrap_or_default();
        let mut other = fields.to_vec();
        other[1] = ("digest", "sha256:0000");
        other.push(("csrf", csrf.as_str()));
        let (status, page) = post_form(&http, &action, &other).await?;
        ensure!(
            status == 422 && page.contains("not the one shown"),
            "a decision for another digest answered {status}: {}",
            clip(&page, 1500)
        );
        let request = book.show(&forged.run_id, &forged.call_id).await?;
        ensure!(
            request.state() == ApprovalState::Waiting,
            "after the forged POSTs the request reads {request:?}, expected waiting"
        );
        ensure!(
            platform_state(&kit, &forged).await? == CallState::Pending,
            "the platform's call of the forged request is no longer pending"
        );
        Ok::<(), anyhow::Error>(())
    }
    .await;
    server.abort();
    let _ = kit.shutdown().await;
    played
}

/// 8. Screenshots for the documentation (only with
///    `TOOLRUNNER_CONSOLE_SCREENSHOTS=DIR`).
async fn screenshots_of_the_overview_and_a_call_page(fx: &Fixture, c: &Client) -> Result<()> {
    let dir = PathBuf::from(
        std::env::var_os(SCREENSHOTS_VAR).context("TOOLRUNNER_CONSOLE_SCREENSHOTS is not set")?,
    );
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    goto(c, &fx.url("/")).await?;
    find(c, "#total-reconciliation_required").await?;
    let png = c.screenshot().await?;
    let overview = dir.join("console-overview.png");
    std::fs::write(&overview, png).with_context(|| format!("writing {}", overview.display()))?;
    // The whole call page: its timeline and the resolve form below it.
    c.set_window_size(1280, 1900).await?;
    goto(c, &fx.call_url("live", &fx.plain)).await?;
    find(c, "#resolve-form").await?;
    let png = c.screenshot().await?;
    let call = dir.join("console-call.png");
    std::fs::write(&call, png).with_context(|| format!("writing {}", call.display()))?;
    println!("screenshots: {} and {}", overview.display(), call.display());
    Ok(())
}

// ------------------------------------------------------------ page helpers

/// Where the browser is and what it shows (for failure messages).
async fn excerpt(c: &Client) -> String {
    let url = c
        .current_url()
        .await
        .map_or_else(|e| format!("(no URL: {e})"), |u| u.to_string());
    let text = c
        .execute(
            "return document.body ? document.body.innerText : ''",
            vec![],
        )
        .await
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default();
    let source = c.source().await.unwrap_or_default();
    format!(
        "\n--- page {url}, its text:\n{}\n--- its source:\n{}",
        clip(&text, 1500),
        clip(&source, 3000)
    )
}

fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes more)", &s[..end], s.len() - end)
}

async fn goto(c: &Client, url: &str) -> Result<()> {
    c.goto(url).await.map_err(|e| anyhow!("opening {url}: {e}"))
}

/// The element `css` on the page as it is now.
async fn find(c: &Client, css: &str) -> Result<Element> {
    match c.find(Locator::Css(css)).await {
        Ok(e) => Ok(e),
        Err(e) => bail!(
            "expected an element `{css}`, found none ({e}){}",
            excerpt(c).await
        ),
    }
}

/// The element `css`, once the page shows it (up to 10 s).
async fn wait_find(c: &Client, css: &str) -> Result<Element> {
    match c
        .wait()
        .at_most(PAGE)
        .every(Duration::from_millis(100))
        .for_element(Locator::Css(css))
        .await
    {
        Ok(e) => Ok(e),
        Err(e) => bail!(
            "expected an element `{css}` within {PAGE:?}, found none ({e}){}",
            excerpt(c).await
        ),
    }
}

/// No element `css` on the page.
async fn absent(c: &Client, css: &str) -> Result<()> {
    let found = c.find_all(Locator::Css(css)).await?;
    ensure!(
        found.is_empty(),
        "expected no element `{css}`, found {}{}",
        found.len(),
        excerpt(c).await
    );
    Ok(())
}

async fn text(c: &Client, css: &str) -> Result<String> {
    Ok(find(c, css).await?.text().await?)
}

/// The overview's total for `state`.
async fn total(c: &Client, state: &str) -> Result<usize> {
    let css = format!("a#total-{state}");
    let shown = text(c, &css).await?;
    shown
        .trim()
        .parse()
        .map_err(|e| anyhow!("{css}: expected a count, saw {shown:?} ({e})"))
}

/// Types `value` into the field `name` of the form `form`.
async fn fill(c: &Client, form: &str, name: &str, value: &str) -> Result<()> {
    let field = find(c, &format!("{form} [name=\"{name}\"]")).await?;
    field.clear().await?;
    field
        .send_keys(value)
        .await
        .map_err(|e| anyhow!("typing into {form} [name={name}]: {e}"))
}

/// Fills the call page's resolve form.
async fn fill_resolve(
    c: &Client,
    outcome: &str,
    result: &str,
    who: &str,
    evidence: &str,
) -> Result<()> {
    let form = "form#resolve-form";
    let method = find(c, form).await?.attr("method").await?;
    ensure!(
        method.as_deref().map(str::to_ascii_lowercase).as_deref() == Some("post"),
        "{form}: expected method=post, saw {method:?}"
    );
    find(c, &format!("{form} input[type=\"hidden\"][name=\"csrf\"]")).await?;
    for value in ["completed", "failed", "cancelled"] {
        find(
            c,
            &format!("{form} input[type=\"radio\"][name=\"outcome\"][value=\"{value}\"]"),
        )
        .await?;
    }
    for field in ["code", "message", "reason", "reference"] {
        find(c, &format!("{form} input[name=\"{field}\"]")).await?;
    }
    find(
        c,
        &format!("{form} input[type=\"radio\"][name=\"outcome\"][value=\"{outcome}\"]"),
    )
    .await?
    .click()
    .await?;
    find(c, &format!("{form} textarea[name=\"result\"]")).await?;
    fill(c, form, "result", result).await?;
    find(c, &format!("{form} input[name=\"who\"]")).await?;
    fill(c, form, "who", who).await?;
    find(c, &format!("{form} textarea[name=\"evidence\"]")).await?;
    fill(c, form, "evidence", evidence).await
}

/// The HTTP status of the page shown now, when the browser tells it
/// (`PerformanceNavigationTiming.responseStatus`).
async fn navigation_status(c: &Client) -> Result<Option<u64>> {
    let v = c
        .execute(
            "const n = performance.getEntriesByType('navigation')[0]; return n && n.responseStatus ? n.responseStatus : null;",
            vec![],
        )
        .await?;
    Ok(v.as_u64())
}

/// POSTs `fields` form-encoded; the status and the page.
async fn post_form(
    http: &reqwest::Client,
    url: &str,
    fields: &[(&str, &str)],
) -> Result<(u16, String)> {
    let body = fields
        .iter()
        .map(|(k, v)| format!("{}={}", form_encode(k), form_encode(v)))
        .collect::<Vec<_>>()
        .join("&");
    let answer = http
        .post(url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(body)
        .send()
        .await
        .with_context(|| format!("POST {url}"))?;
    let status = answer.status().as_u16();
    Ok((status, answer.text().await.unwrap_or_default()))
}

/// `application/x-www-form-urlencoded` encoding of one name or value.
fn form_encode(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'*' => {
                out.push(char::from(b));
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// Polls `condition` (every 100 ms) until it holds, up to `timeout`.
async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut condition: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<bool>>,
{
    let end = tokio::time::Instant::now() + timeout;
    loop {
        let last = match condition().await {
            Ok(true) => return Ok(()),
            Ok(false) => "the condition did not hold".to_owned(),
            Err(e) => format!("{e:#}"),
        };
        if tokio::time::Instant::now() >= end {
            bail!("waited {timeout:?} for {what}; last check: {last}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What an operator's action would change in a call: its state, its
/// receipts, and the operator's entries of its timeline (the executor's
/// own automatic checks keep adding entries of their own).
#[derive(Debug, PartialEq)]
struct Footprint {
    state: LocalState,
    receipts: Vec<String>,
    operator_events: Vec<String>,
}

async fn footprint(reconciler: &Reconciler, call: &CallHandle) -> Result<Footprint> {
    let timeline = reconciler.show(&call.run_id, &call.call_id).await?;
    Ok(Footprint {
        state: timeline.call().state(),
        receipts: timeline
            .receipts()
            .iter()
            .map(|r| format!("{} {:?} {}", r.receipt_id(), r.kind(), r.status()))
            .collect(),
        operator_events: timeline
            .events()
            .iter()
            .filter(|e| e.what().contains("operator"))
            .map(|e| e.what().to_owned())
            .collect(),
    })
}

/// The platform's state of a kit's call.
async fn platform_state(kit: &TestKit, call: &CallHandle) -> Result<CallState> {
    let run = kit.platform().run(&call.run_id).await?;
    run.tool_calls
        .iter()
        .find(|c| c.call_id == call.call_id)
        .map(|c| c.state)
        .with_context(|| format!("run {} has no call {}", call.run_id, call.call_id))
}

async fn platform_state_is(kit: &TestKit, call: &CallHandle, want: CallState) -> Result<bool> {
    let state = platform_state(kit, call).await?;
    if state == want {
        Ok(true)
    } else {
        bail!("the platform's call {} is {state:?}", call.call_id)
    }
}

// ------------------------------------------------------------ the fixture

/// What to charge.
#[toolrunner::schema]
#[derive(Deserialize)]
struct ChargeIn {
    /// `ok`, `fail` or `unknown`.
    mode: String,
    /// Free text kept with the call.
    #[serde(default)]
    note: String,
}

/// The charge made.
#[toolrunner::schema]
#[derive(Serialize)]
struct Charged {
    /// The provider's id of the charge.
    charge_id: String,
}

/// Charges a card: completes, fails or ends with an unknown outcome, as
/// `mode` says.
#[toolrunner::tool(name = "payments.charge", effect = write)]
async fn charge(_ctx: CallContext, input: ChargeIn) -> Result<Charged, ToolError> {
    let _kept = input.note;
    match input.mode.as_str() {
        "ok" => Ok(Charged {
            charge_id: "ch_1".into(),
        }),
        "fail" => Err(ToolError::failed("declined", "card declined")),
        _ => Err(ToolError::unknown("provider timed out")),
    }
}

/// Three stores behind one console, served on loopback.
struct Fixture {
    base: String,
    server: tokio::task::JoinHandle<()>,
    live: TestKit,
    stalled: TestKit,
    /// The operator's view of the `live` store, for the checks.
    live_check: Reconciler,
    /// The operator's view of the `stalled` store, for the checks.
    stalled_check: Reconciler,
    /// A `live` call in `reconciliation_required`, plain arguments.
    plain: CallHandle,
    /// A `live` call in `reconciliation_required` whose note holds markup.
    markup: CallHandle,
    /// The `stalled` call whose final receipt waits in the outbox.
    stalled_call: CallHandle,
    _seeded_dir: TempDir,
}

impl Fixture {
    async fn start(read_only: bool) -> Result<Fixture> {
        // 1. live
        let live = TestKit::start(|b| b.tool(charge))
            .await
            .context("starting the live kit")?;
        let settle = async |args: Value, want: CallState| -> Result<CallHandle> {
            let handle = live.submit("payments.charge", args.clone()).await?;
            let outcome = live.wait(&handle).await?;
            ensure!(
                outcome.state == want,
                "live call with {args}: expected {want:?}, saw {:?}",
                outcome.state
            );
            Ok(handle)
        };
        settle(json!({"mode": "ok"}), CallState::Completed).await?;
        settle(json!({"mode": "fail"}), CallState::Failed).await?;
        let plain = settle(
            json!({"mode": "unknown"}),
            CallState::ReconciliationRequired,
        )
        .await?;
        let markup = settle(
            json!({"mode": "unknown", "note": MARKUP}),
            CallState::ReconciliationRequired,
        )
        .await?;
        let live_check = live.reconciler().await?;
        for call in [&plain, &markup] {
            let state = live_check
                .show(&call.run_id, &call.call_id)
                .await?
                .call()
                .state();
            ensure!(
                state == LocalState::ReconciliationRequired,
                "the live store holds {}/{} as {state}, expected reconciliation_required",
                call.run_id,
                call.call_id
            );
        }

        // 2. stalled
        let mut stalled = TestKit::builder()
            .crash_at(Step::BeforeDelivery)
            .start(|b| b.tool(charge))
            .await
            .context("starting the stalled kit")?;
        let stalled_call = stalled
            .submit("payments.charge", json!({"mode": "ok"}))
            .await?;
        stalled.wait_crashed().await?;
        let stalled_check = stalled.reconciler().await?;

        // 3. seeded
        let seeded_dir = tempfile::tempdir()?;
        let seeded = seeded_store(seeded_dir.path()).await?;

        let console = Console::builder()
            .store(
                "live",
                live.reconciler()
                    .await?
                    .with_platform(&live.base_url(), live.executor_token())?,
            )
            .store(
                "stalled",
                stalled
                    .reconciler()
                    .await?
                    .with_platform(&stalled.base_url(), stalled.executor_token())?,
            )
            .store("seeded", Reconciler::new(Arc::new(seeded)))
            .read_only(read_only)
            .build()
            .await
            .context("building the console")?;
        let app = console.router();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Fixture {
            base,
            server,
            live,
            stalled,
            live_check,
            stalled_check,
            plain,
            markup,
            stalled_call,
            _seeded_dir: seeded_dir,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn call_path(&self, identity: &str, call: &CallHandle) -> String {
        format!(
            "/calls/{}/{}?identity={identity}",
            call.run_id, call.call_id
        )
    }

    fn call_url(&self, identity: &str, call: &CallHandle) -> String {
        self.url(&self.call_path(identity, call))
    }

    async fn shutdown(self) {
        self.server.abort();
        let _ = self.live.shutdown().await;
        let _ = self.stalled.shutdown().await;
    }
}

/// Now, to the millisecond (what a stored time holds).
fn now() -> Timestamp {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    Timestamp::from(UNIX_EPOCH + Duration::from_millis(ms))
}

fn seeded_assignment(run_id: &str, call_id: &str) -> Assignment {
    Assignment {
        assignment_id: format!("asg_{call_id}"),
        run_id: run_id.into(),
        call_id: call_id.into(),
        tool_name: "ledger.post".into(),
        arguments: json!({"amount": 5}),
        arguments_digest: "sha256:00".into(),
        grant: Grant::new("grt_console_seeded_secret"),
        subject: "user_42".into(),
        agent_id: "agt_1".into(),
        agent_version: "agv_1".into(),
        binding_id: "bnd_1".into(),
        max_result_context_bytes: 16384,
        input_schema: json!({"type":"object","properties":{"amount":{"type":"integer","minimum":1}},
                             "required":["amount"],"additionalProperties":false}),
        output_schema: Some(
            json!({"type":"object","properties":{"entry":{"type":"integer"}},"required":["entry"]}),
        ),
    }
}

/// A receipt of `call` as the executor would have stored it.
fn seeded_receipt(
    call: &LocalCall,
    kind: ReceiptKind,
    sequence: u64,
    status: ReceiptStatus,
    extra: Value,
) -> Result<OutboxReceipt> {
    let asg = call.assignment.as_ref().context("an assignment")?;
    let receipt_id = format!("rcp_{}_{sequence}", call.call_id);
    let mut body = json!({"receipt_id": receipt_id, "executor_id": SEEDED_EXECUTOR,
        "assignment_id": asg.assignment_id, "sequence": sequence, "kind": kind.as_str()});
    if let (Some(b), Value::Object(extra)) = (body.as_object_mut(), extra) {
        b.extend(extra);
    }
    Ok(OutboxReceipt {
        receipt_id,
        run_id: call.run_id.clone(),
        call_id: call.call_id.clone(),
        assignment_id: asg.assignment_id.clone(),
        kind,
        sequence,
        body: body.to_string(),
        status,
        attempts: u32::from(status != ReceiptStatus::Pending),
        last_error: (status == ReceiptStatus::Rejected)
            .then(|| "409 run_terminated: the run was cancelled".to_owned()),
        created_at: now(),
        delivered_at: (status == ReceiptStatus::Delivered).then(now),
    })
}

/// A store with one call in each local state (`run_seeded/call_<state>`).
async fn seeded_store(dir: &Path) -> Result<SqliteStore> {
    let store = SqliteStore::open_path(&dir.join("seeded.db")).await?;
    let run_id = "run_seeded";
    for &state in LocalState::ALL {
        let call_id = format!("call_{}", state.as_str());
        let assigned = !matches!(state, LocalState::Claiming | LocalState::Abandoned);
        let mut call = LocalCall {
            run_id: run_id.into(),
            call_id: call_id.clone(),
            tool_name: "ledger.post".into(),
            operation_key: format!("op_{call_id}"),
            state,
            assignment: assigned.then(|| seeded_assignment(run_id, &call_id)),
            next_sequence: 0,
            reason: None,
            report: None,
            created_at: now(),
            updated_at: now(),
            version: 0,
        };
        let mut receipts = Vec::new();
        if assigned {
            receipts.push(seeded_receipt(
                &call,
                ReceiptKind::Accepted,
                0,
                ReceiptStatus::Delivered,
                json!({}),
            )?);
            let last = match state {
                LocalState::Settled => Some(ReceiptStatus::Pending),
                LocalState::Delivered => Some(ReceiptStatus::Delivered),
                LocalState::Rejected | LocalState::Compensated => Some(ReceiptStatus::Rejected),
                _ => None,
            };
            if let Some(status) = last {
                receipts.push(seeded_receipt(
                    &call,
                    ReceiptKind::Completed,
                    1,
                    status,
                    json!({"result": {"entry": 9}}),
                )?);
            }
            call.next_sequence = u64::try_from(receipts.len())?;
        }
        match state {
            LocalState::ReconciliationRequired => {
                call.reason = Some("handler failed after accepted".into());
                call.report = Some(PendingReport::ReconciliationRequired);
            }
            LocalState::Settled => call.report = Some(PendingReport::PendingDelivery),
            LocalState::Rejected => {
                call.reason = Some("409 run_terminated: the run was cancelled".into());
            }
            _ => {}
        }
        let attempt = Attempt::seed(
            run_id,
            &call_id,
            &call.operation_key,
            Some(SEEDED_EXECUTOR),
            call.assignment.as_ref().map(|a| a.assignment_id.as_str()),
            now(),
        );
        let note = Change::Note {
            run_id: run_id.into(),
            call_id: call_id.clone(),
            what: state.as_str().to_owned(),
            detail: call.reason.clone(),
        };
        let mut changes = vec![Change::InsertCall(call), Change::AddAttempt(attempt), note];
        changes.extend(receipts.into_iter().map(Change::AddReceipt));
        store
            .commit(changes)
            .await
            .with_context(|| format!("seeding the call in state {state}"))?;
    }
    Ok(store)
}
