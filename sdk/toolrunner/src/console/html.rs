//! The console's page frame and the small pieces every page uses: links,
//! times, ages and JSON, all escaped by maud (a call's arguments may hold
//! markup; it is shown as text).
use axum::http::StatusCode;
use axum::response::{Html, IntoResponse, Response};
use maud::{DOCTYPE, Markup, PreEscaped, html};

use super::security::Visitor;
use crate::store::Timestamp;

/// The console's one stylesheet (no build step, no outside request).
const STYLE: &str = r#"
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1f2328;background:#f6f8fa}
header{background:#24292f;color:#fff;padding:.6em 1.2em;display:flex;gap:1.4em;align-items:center}
header a{color:#fff;text-decoration:none}header strong{margin-right:1em}
main{padding:1em 1.4em;max-width:1200px}
h1{font-size:1.35em;margin:.3em 0 .6em}h2{font-size:1.1em;margin:1.2em 0 .4em}
table{border-collapse:collapse;background:#fff;margin:.4em 0 1em;min-width:40%}
th,td{border:1px solid #d0d7de;padding:.3em .6em;text-align:left;vertical-align:top}
th{background:#eaeef2}
pre{background:#fff;border:1px solid #d0d7de;padding:.6em;overflow:auto;max-height:28em;white-space:pre-wrap;word-break:break-all}
.banner{padding:.5em 1em;margin:0 0 1em;border-radius:4px}
.warn{background:#fff8c5;border:1px solid #d4a72c}.info{background:#ddf4ff;border:1px solid #54aeff}
.error{background:#ffebe9;border:1px solid #ff8182;padding:.6em 1em;border-radius:4px}
.done{background:#dafbe1;border:1px solid #4ac26b;padding:.6em 1em;border-radius:4px}
.state{font-family:ui-monospace,monospace;padding:.1em .4em;border-radius:3px;background:#eaeef2}
.state-reconciliation_required,.state-rejected{background:#ffebe9;color:#82071e}
.state-delivered,.state-compensated{background:#dafbe1}
form.action{background:#fff;border:1px solid #d0d7de;padding:.8em 1em;margin:.6em 0;max-width:46em}
form.action label{display:block;margin:.3em 0}
input[type=text],input[type=password],textarea,select{font:inherit;padding:.2em .4em;min-width:22em}
textarea{width:95%;min-height:4em;font-family:ui-monospace,monospace}
button{font:inherit;padding:.3em 1em;cursor:pointer}
#timeline li{margin:.3em 0}.muted{color:#57606a}
.key{font-family:ui-monospace,monospace;min-width:30em}
.identity{background:#fff;border:1px solid #d0d7de;padding:.4em 1em;margin:.6em 0}
.grid{display:flex;flex-wrap:wrap;gap:1.2em;align-items:flex-start}
"#;

/// A whole page, `200`.
pub(super) fn page(v: &Visitor, title: &str, refresh: bool, body: Markup) -> Response {
    page_with(v, StatusCode::OK, title, refresh, body)
}

/// A whole page with `status`.
pub(super) fn page_with(
    v: &Visitor,
    status: StatusCode,
    title: &str,
    refresh: bool,
    body: Markup,
) -> Response {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                @if refresh { meta http-equiv="refresh" content="15"; }
                title { (title) " · toolrunner console" }
                style { (PreEscaped(STYLE)) }
            }
            body {
                header {
                    strong { "toolrunner console" }
                    a href=(v.home()) { "Overview" }
                    a href=(v.link("/calls")) { "Calls" }
                    a href=(v.link("/calls?needs=person")) { "Needs a person" }
                    a href=(v.link("/outbox")) { "Outbox" }
                    a href=(v.link("/approvals")) { "Approvals" }
                    @if v.signed_in {
                        form #logout method="post" action=(v.link("/logout")) style="margin-left:auto" {
                            input type="hidden" name="csrf" value=(v.csrf);
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                main {
                    @if v.plain_http {
                        p #plain-http .banner.warn {
                            "This console is served over plain HTTP: its token and session cookie cross the network unencrypted. Put it behind TLS (a reverse proxy that sets X-Forwarded-Proto: https)."
                        }
                    }
                    @if v.read_only {
                        p #read-only .banner.info { "Read-only: this console shows calls and takes no action." }
                    }
                    (body)
                }
            }
        }
    };
    (status, Html(markup.into_string())).into_response()
}

/// Who acts, in a form: the signed-in operator's name shown (the form
/// asks for none), or else a name to type (`label`: "Operator",
/// "Approver").
pub(super) fn operator_field(v: &Visitor, label: &str) -> Markup {
    html! {
        @if let Some(name) = &v.operator {
            p .operator { (label) ": " strong { (name) } " (signed in)" }
        } @else {
            label { (label) " " input type="text" name="who" required placeholder="your name"; }
        }
    }
}

/// A refusal outside any page (no CSRF token, read-only, no login):
/// `status` with the reason in `#error`.
pub(super) fn refusal(status: StatusCode, why: &str) -> Response {
    let markup = html! {
        (DOCTYPE)
        html lang="en" {
            head { meta charset="utf-8"; title { "refused · toolrunner console" } style { (PreEscaped(STYLE)) } }
            body { main {
                h1 { "Refused (" (status.as_u16()) ")" }
                div #error .error { (why) }
            } }
        }
    };
    (status, Html(markup.into_string())).into_response()
}

/// The login form.
pub(super) fn login(v: &Visitor, status: StatusCode, error: Option<&str>) -> Response {
    let body = html! {
        h1 { "Sign in" }
        @if let Some(e) = error { div #error .error { (e) } }
        form #login-form .action method="post" action=(v.link("/login")) {
            input type="hidden" name="csrf" value=(v.csrf);
            label { "Console token " input type="password" name="token" autocomplete="current-password" autofocus; }
            button type="submit" { "Sign in" }
        }
    };
    page_with(v, status, "Sign in", false, body)
}

/// An error page: `status`, with the reason in `#error` and a way back.
pub(super) fn error(
    v: &Visitor,
    status: StatusCode,
    why: &str,
    back: Option<(&str, String)>,
) -> Response {
    let body = html! {
        h1 { "Not done" }
        div #error .error { (why) }
        @if let Some((label, href)) = back { p { a href=(href) { (label) } } }
    };
    page_with(v, status, "Not done", false, body)
}

/// What could not be read, above a page's content (nothing when all was).
pub(super) fn problems(problems: &[String]) -> Markup {
    html! {
        @if !problems.is_empty() {
            div #store-problems .banner.warn {
                p { strong { "Not every store could be read; what is shown leaves them out:" } }
                ul { @for p in problems { li { (p) } } }
            }
        }
    }
}

/// A time as the pages show it (UTC, seconds).
pub(super) fn stamp(t: &Timestamp) -> String {
    t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
}

/// How long ago `t` was, in words (`3m 20s`).
pub(super) fn age(t: &Timestamp) -> String {
    let secs = (chrono::Utc::now() - *t).num_seconds().max(0);
    let (d, h, m, s) = (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{s}s"),
        (0, 0, _) => format!("{m}m {s}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

/// JSON indented for reading, with the characters that reorder or hide
/// text (bidirectional controls, zero-width and invisible characters)
/// written as `\uXXXX` escapes: still JSON, and what the model wrote is
/// what a person reads.
pub(super) fn pretty(v: &serde_json::Value) -> String {
    let text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    if !text.chars().any(hides_text) {
        return text;
    }
    text.chars()
        .map(|c| {
            if hides_text(c) {
                format!("\\u{:04x}", u32::from(c))
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A character that reorders or hides the text around it.
fn hides_text(c: char) -> bool {
    matches!(
        c,
        '\u{061c}'
            | '\u{200b}'..='\u{200f}'
            | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2069}'
            | '\u{feff}'
    )
}

/// Text laid out as JSON when it is JSON, as it is otherwise.
pub(super) fn pretty_text(s: &str) -> String {
    serde_json::from_str::<serde_json::Value>(s).map_or_else(|_| s.to_owned(), |v| pretty(&v))
}

/// A state with its colour.
pub(super) fn state(s: &str) -> Markup {
    html! { span class={ "state state-" (s) } { (s) } }
}

/// A path segment or query value, percent-encoded (RFC 3986 unreserved
/// characters stay).
pub(super) fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// What [`encode`] encoded (a malformed escape stays as it is).
pub(super) fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `path?k=v&…` with the non-empty pairs encoded.
pub(super) fn with_query(path: &str, pairs: &[(&str, &str)]) -> String {
    let query: Vec<String> = pairs
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", encode(v)))
        .collect();
    if query.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", query.join("&"))
    }
}

/// A call's page, within the console.
pub(super) fn call_path(run_id: &str, call_id: &str, identity: &str) -> String {
    with_query(
        &format!("/calls/{}/{}", encode(run_id), encode(call_id)),
        &[("identity", identity)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_values_are_encoded_in_links() {
        assert_eq!(encode("run_1"), "run_1");
        assert_eq!(encode("a/b c&d"), "a%2Fb%20c%26d");
        assert_eq!(
            call_path("r/1", "c 2", "exec a"),
            "/calls/r%2F1/c%202?identity=exec%20a"
        );
        assert_eq!(
            with_query("/calls", &[("state", ""), ("tool", "x")]),
            "/calls?tool=x"
        );
    }

    /// Text a model wrote may hold characters that reorder or hide what an
    /// approver reads (a right-to-left override, a zero-width space): the
    /// pages show them as escapes.
    #[test]
    fn invisible_and_bidi_characters_show_as_escapes() {
        let shown = pretty(&serde_json::json!({"payee": "ab\u{202e}cd\u{200b}e"}));
        assert!(shown.contains("ab\\u202ecd\\u200be"), "shown as {shown:?}");
        assert!(!shown.contains('\u{202e}') && !shown.contains('\u{200b}'));
        // Still JSON, with the same value.
        let back: serde_json::Value = serde_json::from_str(&shown).expect("JSON");
        assert_eq!(back["payee"], "ab\u{202e}cd\u{200b}e");
    }
}
