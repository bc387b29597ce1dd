//! Who may see the console and what a request may change: the auth token
//! (a bearer header, or a session cookie set once by the login form), the
//! CSRF token every POST carries, and the read-only mode. One middleware,
//! [`guard`], runs before every page and action.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Form;
use axum::body::Body;
use axum::extract::{FromRequest, OriginalUri, Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use serde::Deserialize;

use super::Inner;
use super::html;

/// The session cookie's name.
const COOKIE: &str = "toolrunner_console";
/// How long a login lasts.
const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// At most this many live sessions (the oldest go first).
const MAX_SESSIONS: usize = 1024;
/// The largest form a POST may carry.
const MAX_FORM_BYTES: usize = 1 << 20;

/// The console's secrets: the auth token, the CSRF token of visitors
/// without a session, and the sessions of the login form.
pub(super) struct Security {
    token: Option<String>,
    csrf: String,
    sessions: Mutex<HashMap<String, Session>>,
}

/// One login.
struct Session {
    csrf: String,
    since: Instant,
}

/// What a page needs to know of the request it answers: its CSRF token,
/// where the console is mounted, and what to warn about.
#[derive(Clone)]
pub(super) struct Visitor {
    /// The token the page's forms carry.
    pub(super) csrf: String,
    /// The path the console is mounted at (`""` at the root).
    pub(super) base: String,
    /// Actions are hidden.
    pub(super) read_only: bool,
    /// A token is needed and the request did not come over HTTPS.
    pub(super) plain_http: bool,
}

impl Visitor {
    /// `path` (absolute within the console) where the console is mounted.
    pub(super) fn link(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Security {
    pub(super) fn new(token: Option<String>) -> Security {
        Security {
            token,
            csrf: random_token(),
            sessions: Mutex::default(),
        }
    }

    /// Whether pages need a token.
    pub(super) fn authenticates(&self) -> bool {
        self.token.is_some()
    }

    /// The CSRF token of a live session named by the request's cookie.
    fn session_csrf(&self, headers: &HeaderMap) -> Option<String> {
        let id = cookie(headers, COOKIE)?;
        let sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions
            .iter()
            .find(|(sid, s)| same(sid, &id) && s.since.elapsed() < SESSION_TTL)
            .map(|(_, s)| s.csrf.clone())
    }

    /// Whether the request may see the console, and the CSRF token its
    /// forms carry.
    fn admit(&self, headers: &HeaderMap) -> Option<String> {
        let Some(token) = &self.token else {
            return Some(self.csrf.clone());
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if bearer.is_some_and(|b| same(b.trim(), token)) {
            return Some(self.csrf.clone());
        }
        self.session_csrf(headers)
    }

    /// A new session's cookie value and CSRF token.
    fn open_session(&self) -> String {
        let id = random_token();
        let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
        sessions.retain(|_, s| s.since.elapsed() < SESSION_TTL);
        if sessions.len() >= MAX_SESSIONS
            && let Some(oldest) = sessions
                .iter()
                .min_by_key(|(_, s)| s.since)
                .map(|(k, _)| k.clone())
        {
            sessions.remove(&oldest);
        }
        sessions.insert(
            id.clone(),
            Session {
                csrf: random_token(),
                since: Instant::now(),
            },
        );
        id
    }
}

/// The one field every POST must carry.
#[derive(Deserialize)]
struct Csrf {
    #[serde(default)]
    csrf: String,
}

/// Before every request: a POST is refused in read-only mode; a request
/// without the token (when one is set) goes to the login form; a POST
/// whose form lacks the page's CSRF token is refused (403, nothing
/// changed). Pages get their [`Visitor`].
pub(super) async fn guard(
    State(state): State<Arc<Inner>>,
    request: Request,
    next: Next,
) -> Response {
    let post = request.method() == Method::POST;
    let path = request.uri().path().to_owned();
    let base = request
        .extensions()
        .get::<OriginalUri>()
        .and_then(|o| o.path().strip_suffix(path.as_str()).map(str::to_owned))
        .unwrap_or_default();
    let base = base.trim_end_matches('/').to_owned();
    if post && state.read_only {
        return html::refusal(
            StatusCode::FORBIDDEN,
            "this console is read-only: no action is taken (start it without --read-only to act)",
        );
    }
    let forwarded_https = request
        .headers()
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("https"));
    let login = path == "/login";
    let csrf = match state.security.admit(request.headers()) {
        Some(csrf) => csrf,
        None if login => state.security.csrf.clone(),
        None if request.method() == Method::GET => {
            return Redirect::to(&format!("{base}/login")).into_response();
        }
        None => {
            return html::refusal(
                StatusCode::UNAUTHORIZED,
                "this console needs its token: sign in, or send Authorization: Bearer TOKEN",
            );
        }
    };
    let mut request = if post {
        let (parts, body) = request.into_parts();
        let bytes = match axum::body::to_bytes(body, MAX_FORM_BYTES).await {
            Ok(bytes) => bytes,
            Err(_) => {
                return html::refusal(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "the form is larger than 1 MiB: nothing was changed",
                );
            }
        };
        let copy = Request::from_parts(parts.clone(), Body::from(bytes.clone()));
        let given = Form::<Csrf>::from_request(copy, &())
            .await
            .map(|Form(c)| c.csrf)
            .unwrap_or_default();
        if given.is_empty() || !same(&given, &csrf) {
            return html::refusal(
                StatusCode::FORBIDDEN,
                "this request does not carry the console's CSRF token: nothing was changed (send the form from the console's own page)",
            );
        }
        Request::from_parts(parts, Body::from(bytes))
    } else {
        request
    };
    request.extensions_mut().insert(Visitor {
        csrf,
        base,
        read_only: state.read_only,
        plain_http: state.security.authenticates() && !forwarded_https,
    });
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    headers.insert("x-frame-options", header::HeaderValue::from_static("DENY"));
    headers.insert(
        "content-security-policy",
        header::HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    response
}

/// `GET /login`: the token form.
pub(super) async fn login_page(axum::Extension(v): axum::Extension<Visitor>) -> Response {
    html::login(&v, StatusCode::OK, None)
}

/// The login form's fields.
#[derive(Deserialize)]
pub(super) struct Login {
    #[serde(default)]
    token: String,
}

/// `POST /login`: a session cookie for the right token.
pub(super) async fn login(
    State(state): State<Arc<Inner>>,
    axum::Extension(v): axum::Extension<Visitor>,
    headers: HeaderMap,
    Form(form): Form<Login>,
) -> Response {
    let Some(token) = &state.security.token else {
        return Redirect::to(&v.link("/")).into_response();
    };
    if !same(form.token.trim(), token) {
        return html::login(
            &v,
            StatusCode::UNAUTHORIZED,
            Some("that is not the console's token"),
        );
    }
    let id = state.security.open_session();
    let secure = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .is_some_and(|p| p.eq_ignore_ascii_case("https"));
    let path = if v.base.is_empty() {
        "/"
    } else {
        v.base.as_str()
    };
    let cookie = format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path={path}{}",
        if secure { "; Secure" } else { "" }
    );
    let mut response = Redirect::to(&v.link("/")).into_response();
    if let Ok(value) = header::HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// The value of the cookie `name`, if the request carries it.
fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_owned())
}

/// 32 random bytes in hex.
fn random_token() -> String {
    rand::random::<[u8; 32]>()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Equal, in a time that does not depend on where they differ.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "ab"));
        assert_eq!(random_token().len(), 64);
        assert_ne!(random_token(), random_token());
    }

    #[test]
    fn the_session_cookie_is_read_among_others() {
        let mut h = HeaderMap::new();
        h.insert(
            header::COOKIE,
            header::HeaderValue::from_static("a=1; toolrunner_console=xyz; b=2"),
        );
        assert_eq!(cookie(&h, COOKIE).as_deref(), Some("xyz"));
        assert_eq!(cookie(&h, "c"), None);
    }
}
