//! `toolrunner console`: the listening line, the loopback rule, the CSRF
//! token, the read-only mode and the auth token, over HTTP on loopback
//! (the browser tests are the workspace's `console` target).
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command as Process, Stdio};

use super::*;

/// A console process, killed when dropped.
struct Served {
    child: Child,
    addr: String,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `toolrunner console --db DB --listen 127.0.0.1:0 EXTRA…`, once it
/// printed its one line.
fn serve(db: &str, extra: &[&str]) -> Served {
    let listen: &[&str] = if extra.contains(&"--listen") {
        &[]
    } else {
        &["--listen", "127.0.0.1:0"]
    };
    let mut child = Process::new(assert_cmd::cargo::cargo_bin("toolrunner"))
        .args(["console", "--db", db])
        .args(listen)
        .args(extra)
        .env_remove("TOOLRUNNER_DB")
        .env_remove("TOOLRUNNER_TOKEN")
        .env_remove("TOOLRUNNER_CONSOLE_TOKEN")
        .env_remove("TOOLRUNNER_BASE_URL")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start toolrunner console");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the console's line");
    let addr = line
        .trim_end()
        .strip_prefix("toolrunner console listening on http://")
        .unwrap_or_else(|| {
            panic!("the console printed {line:?}, not `toolrunner console listening on http://…`")
        })
        .to_owned();
    assert!(addr.starts_with("127.0.0.1:"), "listening on {addr}");
    Served { child, addr }
}

/// One HTTP/1.1 exchange: `(status, headers in lower case, body)`.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the console");
    let mut req = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\n");
    if !headers.iter().any(|(k, _)| k.eq_ignore_ascii_case("host")) {
        req.push_str(&format!("Host: {addr}\r\n"));
    }
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if method == "POST" {
        req.push_str("Content-Type: application/x-www-form-urlencoded\r\n");
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).expect("send");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("read the answer");
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, head.to_lowercase(), body.to_owned())
}

/// The CSRF token a page's forms carry.
fn csrf(page: &str) -> String {
    let at = page
        .find("name=\"csrf\" value=\"")
        .expect("a form with its CSRF token");
    let rest = &page[at + "name=\"csrf\" value=\"".len()..];
    rest[..rest.find('"').expect("end of the token")].to_owned()
}

#[test]
fn console_refuses_a_non_loopback_address_without_a_token() {
    let f = Fixture::seeded();
    let out = run(&["console", "--db", f.db(), "--listen", "0.0.0.0:0"]);
    out.code(2);
    assert!(
        out.stderr.contains("--auth-token") && out.stderr.contains("loopback"),
        "{}",
        out.stderr
    );
}

#[test]
fn console_lists_links_and_refuses_a_post_without_its_csrf_token() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &[]);
    let (status, _, overview) = http(&s.addr, "GET", "/", &[], "");
    assert_eq!(status, 200);
    assert!(
        overview.contains("id=\"total-reconciliation_required\""),
        "{overview}"
    );
    let (status, _, list) = http(
        &s.addr,
        "GET",
        "/calls?state=reconciliation_required",
        &[],
        "",
    );
    assert_eq!(status, 200);
    assert!(
        list.contains("href=\"/calls/run_1/call_recon?identity=exec\""),
        "{list}"
    );
    assert!(!list.contains("call_rejected"), "{list}");
    let (status, _, page) = http(&s.addr, "GET", "/calls/run_1/call_recon", &[], "");
    assert_eq!(status, 200);
    assert!(!page.contains(GRANT), "the grant is on the page");
    let token = csrf(&page);
    let form =
        "outcome=completed&result=%7B%22entry%22%3A1%7D&who=alice&evidence=checked&confirm=yes";
    for body in [form.to_owned(), format!("{form}&csrf=not{token}")] {
        let (status, _, refused) = http(
            &s.addr,
            "POST",
            "/calls/run_1/call_recon/resolve",
            &[],
            &body,
        );
        assert_eq!(status, 403, "{refused}");
        assert!(refused.contains("id=\"error\""), "{refused}");
    }
    assert_eq!(
        f.call(RECON).state,
        LocalState::ReconciliationRequired,
        "a refused POST changed the call"
    );
    // With the token and without `confirm`: a preview, nothing changed.
    let preview = format!(
        "outcome=completed&result=%7B%22entry%22%3A1%7D&who=alice&evidence=checked&csrf={token}"
    );
    let (status, _, page) = http(
        &s.addr,
        "POST",
        "/calls/run_1/call_recon/resolve",
        &[],
        &preview,
    );
    assert_eq!(status, 200, "{page}");
    assert!(
        page.contains("id=\"preview\"") && page.contains("id=\"confirm-form\""),
        "{page}"
    );
    assert_eq!(
        f.call(RECON).state,
        LocalState::ReconciliationRequired,
        "a preview changed the call"
    );
    // Confirmed: resolved (saved for the executor's outbox: no platform).
    let (status, _, page) = http(
        &s.addr,
        "POST",
        "/calls/run_1/call_recon/resolve",
        &[],
        &format!("{preview}&confirm=yes"),
    );
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("id=\"done\""), "{page}");
    assert_eq!(f.call(RECON).state, LocalState::Settled);
}

/// A store is shown by the executor id that claimed its calls; one that
/// records none yet (the seeded store: no attempts) by its file name.
#[test]
fn console_names_a_store_by_its_executor_id() {
    let f = Fixture::seeded();
    f.commit(vec![Change::AddAttempt(Attempt::seed(
        "run_1",
        "call_recon",
        "op_call_recon",
        Some(EXECUTOR),
        Some("asg_call_recon"),
        now(),
    ))]);
    let s = serve(f.db(), &[]);
    let (status, _, list) = http(&s.addr, "GET", "/calls", &[], "");
    assert_eq!(status, 200);
    assert!(
        list.contains(&format!(
            "href=\"/calls/run_1/call_recon?identity={EXECUTOR}\""
        )),
        "{list}"
    );
    assert!(!list.contains("identity=exec\""), "{list}");
    let (status, _, overview) = http(&s.addr, "GET", "/", &[], "");
    assert_eq!(status, 200);
    assert!(
        overview.contains(&format!("data-identity=\"{EXECUTOR}\"")),
        "{overview}"
    );
}

#[test]
fn a_read_only_console_shows_no_action_and_refuses_every_post() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &["--read-only"]);
    let (status, _, page) = http(&s.addr, "GET", "/calls/run_1/call_recon", &[], "");
    assert_eq!(status, 200);
    assert!(
        page.contains("id=\"read-only\"") && !page.contains("<form id=\"resolve-form\""),
        "{page}"
    );
    let (status, _, outbox) = http(&s.addr, "GET", "/outbox", &[], "");
    assert_eq!(status, 200);
    assert!(!outbox.contains("bulk-redeliver-form"), "{outbox}");
    for path in [
        "/calls/run_1/call_recon/resolve",
        "/outbox/redeliver",
        "/login",
        "/nowhere",
    ] {
        let (status, _, body) = http(
            &s.addr,
            "POST",
            path,
            &[],
            "outcome=completed&result=%7B%7D&who=a&evidence=b&confirm=yes&csrf=x",
        );
        assert_eq!(status, 403, "POST {path}");
        // Refused for being read-only, not for the CSRF token.
        assert!(body.contains("read-only"), "POST {path}: {body}");
    }
    assert_eq!(f.call(RECON).state, LocalState::ReconciliationRequired);
}

#[test]
fn with_an_auth_token_every_page_needs_it_and_the_login_sets_a_strict_cookie() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &["--auth-token", "s3cret-console-token"]);
    let (status, head, _) = http(&s.addr, "GET", "/", &[], "");
    assert_eq!(status, 303, "{head}");
    assert!(head.contains("location: /login"), "{head}");
    let (status, _, _) = http(
        &s.addr,
        "GET",
        "/",
        &[("Authorization", "Bearer wrong")],
        "",
    );
    assert_eq!(status, 303);
    let (status, _, page) = http(
        &s.addr,
        "GET",
        "/",
        &[("Authorization", "Bearer s3cret-console-token")],
        "",
    );
    assert_eq!(status, 200);
    assert!(
        page.contains("id=\"plain-http\""),
        "no plain-HTTP warning: {page}"
    );
    assert!(
        !page.contains("s3cret-console-token"),
        "the token is on the page"
    );
    let (status, _, login) = http(&s.addr, "GET", "/login", &[], "");
    assert_eq!(status, 200);
    let token = csrf(&login);
    let (status, _, _) = http(
        &s.addr,
        "POST",
        "/login",
        &[],
        &format!("token=wrong&csrf={token}"),
    );
    assert_eq!(status, 401);
    let (status, _, _) = http(&s.addr, "POST", "/login", &[], "token=s3cret-console-token");
    assert_eq!(status, 403, "a login without its CSRF token");
    let (status, head, _) = http(
        &s.addr,
        "POST",
        "/login",
        &[],
        &format!("token=s3cret-console-token&csrf={token}"),
    );
    assert_eq!(status, 303, "{head}");
    let cookie_line = head
        .lines()
        .find(|l| l.starts_with("set-cookie:"))
        .unwrap_or_else(|| panic!("no cookie: {head}"));
    assert!(
        cookie_line.contains("httponly") && cookie_line.contains("samesite=strict"),
        "{cookie_line}"
    );
    let cookie = cookie_line["set-cookie:".len()..]
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_owned();
    // The header was lower-cased; the cookie's value is hex, its name lower case.
    let (status, _, page) = http(&s.addr, "GET", "/calls", &[("Cookie", &cookie)], "");
    assert_eq!(status, 200, "{page}");
    assert!(page.contains("call_recon"), "{page}");
}

/// The session cookie a sign-in set (`name=value`).
fn session_cookie(head: &str) -> String {
    head.lines()
        .find_map(|l| l.strip_prefix("set-cookie:"))
        .and_then(|c| c.split(';').next())
        .unwrap_or_else(|| panic!("no cookie: {head}"))
        .trim()
        .to_owned()
}

#[test]
fn a_read_only_console_with_a_token_still_signs_in() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &["--read-only", "--auth-token", "tok-ro"]);
    let (_, _, login) = http(&s.addr, "GET", "/login", &[], "");
    let token = csrf(&login);
    let (status, head, _) = http(
        &s.addr,
        "POST",
        "/login",
        &[],
        &format!("token=tok-ro&csrf={token}"),
    );
    assert_eq!(status, 303, "{head}");
    let cookie = session_cookie(&head);
    let (status, _, page) = http(
        &s.addr,
        "GET",
        "/calls/run_1/call_recon",
        &[("Cookie", &cookie)],
        "",
    );
    assert_eq!(status, 200);
    assert!(
        page.contains("id=\"read-only\"") && !page.contains("resolve-form"),
        "{page}"
    );
    let session_csrf = csrf(&page);
    let (status, _, body) = http(
        &s.addr,
        "POST",
        "/calls/run_1/call_recon/resolve",
        &[("Cookie", &cookie)],
        &format!(
            "outcome=completed&result=%7B%22entry%22%3A1%7D&who=a&evidence=b&confirm=yes&csrf={session_csrf}"
        ),
    );
    assert_eq!(status, 403);
    assert!(body.contains("read-only"), "{body}");
    assert_eq!(f.call(RECON).state, LocalState::ReconciliationRequired);
}

#[test]
fn a_console_without_a_token_answers_only_to_loopback_host_names() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &[]);
    let port = s.addr.rsplit(':').next().unwrap_or_default().to_owned();
    // A page of another site whose name was rebound to 127.0.0.1 sends
    // its own host name: refused, so it can neither read the CSRF token
    // nor act.
    for host in [
        format!("attacker.example:{port}"),
        "attacker.example".to_owned(),
    ] {
        let (status, _, body) = http(
            &s.addr,
            "GET",
            "/calls/run_1/call_recon",
            &[("Host", &host)],
            "",
        );
        assert_eq!(status, 403, "Host: {host}");
        assert!(!body.contains("name=\"csrf\""), "{body}");
    }
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}")] {
        let (status, _, _) = http(&s.addr, "GET", "/", &[("Host", &host)], "");
        assert_eq!(status, 200, "Host: {host}");
    }
}

#[test]
fn the_login_forms_csrf_token_does_not_let_a_bearer_request_act() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &["--auth-token", "tok-b"]);
    // Anyone can read the login form's token.
    let (_, _, login) = http(&s.addr, "GET", "/login", &[], "");
    let public = csrf(&login);
    let form = "outcome=completed&result=%7B%22entry%22%3A1%7D&who=ops&evidence=x&confirm=yes";
    let (status, _, body) = http(
        &s.addr,
        "POST",
        "/calls/run_1/call_recon/resolve",
        &[("Authorization", "Bearer tok-b")],
        &format!("{form}&csrf={public}"),
    );
    assert_eq!(status, 403, "{body}");
    assert_eq!(f.call(RECON).state, LocalState::ReconciliationRequired);
    // The token of a page the bearer request itself read acts (the
    // scheme's case does not matter).
    let (_, _, page) = http(
        &s.addr,
        "GET",
        "/calls/run_1/call_recon",
        &[("Authorization", "bearer tok-b")],
        "",
    );
    let own = csrf(&page);
    assert_ne!(own, public);
    let (status, _, body) = http(
        &s.addr,
        "POST",
        "/calls/run_1/call_recon/resolve",
        &[("Authorization", "Bearer tok-b")],
        &format!("{form}&csrf={own}"),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(f.call(RECON).state, LocalState::Settled);
}

#[test]
fn sign_out_ends_the_session() {
    let f = Fixture::seeded();
    let s = serve(
        f.db(),
        &["--auth-token", "tok-c", "--listen", "localhost:0"],
    );
    let (_, _, login) = http(&s.addr, "GET", "/login", &[], "");
    let (_, head, _) = http(
        &s.addr,
        "POST",
        "/login",
        &[],
        &format!("token=tok-c&csrf={}", csrf(&login)),
    );
    let cookie = session_cookie(&head);
    let (status, _, page) = http(&s.addr, "GET", "/", &[("Cookie", &cookie)], "");
    assert_eq!(status, 200);
    assert!(page.contains("id=\"logout\""), "{page}");
    let (status, _, _) = http(
        &s.addr,
        "POST",
        "/logout",
        &[("Cookie", &cookie)],
        &format!("csrf={}", csrf(&page)),
    );
    assert_eq!(status, 303);
    let (status, _, _) = http(&s.addr, "GET", "/", &[("Cookie", &cookie)], "");
    assert_eq!(status, 303, "the session outlived its sign-out");
}

/// A POST of `form` with the CSRF token of the page at `page`.
fn post_with_token(s: &Served, page: &str, path: &str, form: &str) -> (u16, String, String) {
    let (_, _, shown) = http(&s.addr, "GET", page, &[], "");
    http(
        &s.addr,
        "POST",
        path,
        &[],
        &format!("{form}&csrf={}", csrf(&shown)),
    )
}

#[test]
fn a_redeliver_sends_the_receipts_named_in_order_and_stops_where_the_outbox_would() {
    let f = Fixture::seeded();
    // A second receipt waits on the settled call.
    let settled = f.call(SETTLED);
    f.commit(vec![Change::AddReceipt(receipt(
        &settled,
        ReceiptKind::Progress,
        2,
        ReceiptStatus::Pending,
        json!({"progress": {"message": "late", "fraction": 1.0, "data": null}}),
    ))]);
    // A platform nobody answers for.
    let s = serve(
        f.db(),
        &["--base-url", "http://127.0.0.1:9", "--token", "t"],
    );
    let page = "/calls/run_2/call_settled";
    let path = "/calls/run_2/call_settled/redeliver";
    let evidence = "who=ops&evidence=the%20network%20is%20back&confirm=yes";
    let notes = |f: &Fixture| {
        f.events(SETTLED)
            .iter()
            .filter(|e| e.what() == "operator_redelivered")
            .count()
    };
    // Refused, nothing written: no receipt named, another call's receipt,
    // one that waits no more.
    for (receipts, why) in [
        ("", "name the receipts"),
        ("rcp_call_recon_1", "has no receipt"),
        ("rcp_call_settled_0", "an accepted"),
    ] {
        let (status, _, body) =
            post_with_token(&s, page, path, &format!("{evidence}&receipts={receipts}"));
        assert_eq!(status, 422, "receipts={receipts}: {body}");
        assert!(body.contains(why), "receipts={receipts}: {body}");
    }
    assert_eq!(notes(&f), 0, "a refused redeliver wrote to the timeline");
    // Named twice and out of order: sent once each, by sequence; the
    // first is not taken (nobody answers), so the second is not tried.
    let (status, _, body) = post_with_token(
        &s,
        page,
        path,
        &format!("{evidence}&receipts=rcp_call_settled_2,rcp_call_settled_1,rcp_call_settled_2"),
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("Sent, not all delivered"), "{body}");
    assert_eq!(
        body.matches("<li><code>rcp_call_settled_2</code>").count(),
        1,
        "{body}"
    );
    let receipts = f.receipts(SETTLED);
    let attempts = |id: &str| {
        receipts
            .iter()
            .find(|r| r.receipt_id == id)
            .map(|r| r.attempts)
            .unwrap_or_else(|| panic!("no {id}"))
    };
    assert!(
        attempts("rcp_call_settled_1") > 3,
        "the completed receipt was not tried"
    );
    assert_eq!(
        attempts("rcp_call_settled_2"),
        0,
        "sent on after the platform did not take the first"
    );
    assert_eq!(notes(&f), 1);
}

#[test]
fn a_redeliver_of_receipts_that_wait_no_more_sends_and_writes_nothing() {
    let f = Fixture::seeded();
    let s = serve(
        f.db(),
        &["--base-url", "http://127.0.0.1:9", "--token", "t"],
    );
    // (A delivered call's page has no form: the outbox's carries the token.)
    let (status, _, body) = post_with_token(
        &s,
        "/outbox",
        "/calls/run_2/call_delivered/redeliver",
        "who=ops&evidence=again&confirm=yes&receipts=rcp_call_delivered_1",
    );
    assert_eq!(status, 422, "{body}");
    assert!(body.contains("waits any more"), "{body}");
    assert!(
        !f.events(DELIVERED)
            .iter()
            .any(|e| e.what() == "operator_redelivered"),
        "a redeliver of nothing wrote to the timeline"
    );
}

#[test]
fn previews_are_checked_by_the_reconcilers_rules() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &[]);
    // A compensation of a call that was not rejected, a close of one that
    // is not orphaned: refused at the preview, nothing promised.
    for (action, why) in [
        ("compensated", "only rejected calls"),
        ("close", "only orphaned calls"),
    ] {
        let (status, _, body) = post_with_token(
            &s,
            "/calls/run_1/call_recon",
            &format!("/calls/run_1/call_recon/{action}"),
            "who=ops&evidence=checked",
        );
        assert_eq!(status, 422, "{action}: {body}");
        assert!(
            body.contains(why) && !body.contains("id=\"confirm-form\""),
            "{action}: {body}"
        );
    }
}

#[test]
fn an_orphaned_call_of_unknown_outcome_needs_a_person_until_it_is_closed() {
    let f = Fixture::seeded();
    for (call_id, closed) in [("call_lost", false), ("call_lost_closed", true)] {
        let call = local_call(None, "run_9", call_id, TOOL, LocalState::Orphaned, 0);
        let note = |what: &str| Change::Note {
            run_id: "run_9".into(),
            call_id: call_id.into(),
            what: what.into(),
            detail: None,
        };
        let mut changes = vec![Change::InsertCall(call), note("orphaned_outcome_unknown")];
        if closed {
            changes.push(note("operator_closed"));
        }
        f.commit(changes);
    }
    let s = serve(f.db(), &[]);
    let (_, _, list) = http(&s.addr, "GET", "/calls?needs=person", &[], "");
    assert!(list.contains("data-call-id=\"call_lost\""), "{list}");
    assert!(
        !list.contains("data-call-id=\"call_lost_closed\""),
        "{list}"
    );
    // reconciliation_required, rejected, and the orphaned one.
    let (_, _, overview) = http(&s.addr, "GET", "/", &[], "");
    assert!(
        overview.contains("id=\"total-needs-person\" href=\"/calls?needs=person\">3<"),
        "{overview}"
    );
    let (_, _, page) = http(&s.addr, "GET", "/calls/run_9/call_lost", &[], "");
    assert!(page.contains("id=\"close-form\""), "{page}");
    let (_, _, page) = http(&s.addr, "GET", "/calls/run_9/call_lost_closed", &[], "");
    assert!(!page.contains("id=\"close-form\""), "{page}");
}

#[test]
fn every_answer_keeps_out_of_frames_and_caches() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &["--read-only"]);
    let port = s.addr.rsplit(':').next().unwrap_or_default().to_owned();
    for (method, path, host) in [
        ("GET", "/", format!("127.0.0.5:{port}")),
        ("POST", "/calls/run_1/call_recon/resolve", s.addr.clone()),
        ("GET", "/", format!("elsewhere.example:{port}")),
    ] {
        let (_, head, _) = http(&s.addr, method, path, &[("Host", &host)], "csrf=x");
        for header in [
            "x-frame-options: deny",
            "cache-control: no-store",
            "content-security-policy: default-src 'none'",
        ] {
            assert!(
                head.contains(header),
                "{method} {path} (Host {host}) lacks {header}: {head}"
            );
        }
    }
    // Another loopback address is a loopback host name too.
    let (status, _, _) = http(
        &s.addr,
        "GET",
        "/",
        &[("Host", &format!("127.0.0.5:{port}"))],
        "",
    );
    assert_eq!(status, 200);
}

#[test]
fn sign_out_needs_the_session_itself() {
    let f = Fixture::seeded();
    let s = serve(f.db(), &["--auth-token", "tok-d"]);
    let (_, _, login) = http(&s.addr, "GET", "/login", &[], "");
    let (status, head, _) = http(
        &s.addr,
        "POST",
        "/logout",
        &[],
        &format!("csrf={}", csrf(&login)),
    );
    assert_eq!(status, 401, "{head}");
    assert!(!head.contains("set-cookie"), "{head}");
}
