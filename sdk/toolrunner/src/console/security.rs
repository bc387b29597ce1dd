//! Who may see the console and what a request may change: the auth token
//! (a bearer header, or a session cookie set once by the login form), the
//! CSRF token every POST carries, the read-only mode, and the signed-in
//! operator (an [`Operator`] the product's own authentication put on the
//! request, or the header an authenticating proxy sets). One middleware,
//! [`guard`], runs before every page and action.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Form;
use axum::body::Body;
use axum::extract::{FromRequest, OriginalUri, Request, State};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode, header};
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
    /// The CSRF token of admitted visitors without a session.
    csrf: String,
    /// The CSRF token of the login form (shown to anyone; it admits
    /// nothing but a login).
    login_csrf: String,
    sessions: Mutex<HashMap<String, Session>>,
    /// The host names requests may name; `None`: any (a token guards the
    /// console). Without a token, loopback names by default, so that a
    /// page of another site whose name was rebound to 127.0.0.1 cannot
    /// read or act (DNS rebinding).
    hosts: Option<Vec<String>>,
    /// The header an authenticating proxy sets to the signed-in operator's
    /// name: every request must carry it.
    operator_header: Option<HeaderName>,
}

/// The operator the product's own authentication signed in: every action
/// and decision of the console records them as its operator or approver
/// (the page asks for no name). The product's authentication middleware
/// puts one on each request it admits, before the console's router:
///
/// ```
/// use axum::extract::Request;
/// use axum::middleware::{self, Next};
/// use toolrunner::console::{Console, Operator};
///
/// fn mounted(console: &Console) -> axum::Router {
///     axum::Router::new()
///         .nest("/admin/toolrunner", console.router())
///         .layer(middleware::from_fn(|mut request: Request, next: Next| async move {
///             // The product's own sign-in decides who this is.
///             request.extensions_mut().insert(Operator::new("alice@example.com"));
///             next.run(request).await
///         }))
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator(String);

impl Operator {
    /// The operator named `name` (as the product's sign-in knows them).
    pub fn new(name: impl Into<String>) -> Operator {
        Operator(name.into())
    }

    /// The operator's name.
    pub fn name(&self) -> &str {
        &self.0
    }
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
    /// The request came with a session cookie (the page offers a logout).
    pub(super) signed_in: bool,
    /// The operator the product's authentication signed in (an
    /// [`Operator`] or the proxy's header): the name every action and
    /// decision records, in place of a name typed into the form.
    pub(super) operator: Option<String>,
}

impl Visitor {
    /// `path` (absolute within the console) where the console is mounted.
    pub(super) fn link(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The console's first page.
    pub(super) fn home(&self) -> String {
        if self.base.is_empty() {
            "/".to_owned()
        } else {
            self.base.clone()
        }
    }
}

impl Security {
    pub(super) fn new(
        token: Option<String>,
        allowed_hosts: Vec<String>,
        operator_header: Option<HeaderName>,
    ) -> Security {
        let hosts = match (&token, allowed_hosts.is_empty()) {
            (_, false) => Some(allowed_hosts),
            (None, true) => Some(
                ["localhost", "127.0.0.1", "[::1]"]
                    .map(str::to_owned)
                    .to_vec(),
            ),
            (Some(_), true) => None,
        };
        Security {
            token,
            csrf: random_token(),
            login_csrf: random_token(),
            sessions: Mutex::default(),
            hosts,
            operator_header,
        }
    }

    /// The signed-in operator of the request: the product's [`Operator`],
    /// or else the proxy's header (when one is configured). `Err` says
    /// why the request names nobody for sure: a blank [`Operator`], or
    /// the header missing, blank or given more than once (a proxy that
    /// appends to the client's own).
    fn operator(&self, request: &Request) -> Result<Option<String>, String> {
        if let Some(operator) = request.extensions().get::<Operator>() {
            let name = operator.name().trim();
            if name.is_empty() {
                return Err("the product's sign-in named a blank operator: nothing was done (the console acts only for a named operator)".to_owned());
            }
            return Ok(Some(name.to_owned()));
        }
        let Some(header) = &self.operator_header else {
            return Ok(None);
        };
        let mut values = request.headers().get_all(header).iter();
        match (values.next(), values.next()) {
            (Some(value), None) => match value.to_str().map(str::trim) {
                // One name: a list (a proxy that merged the client's
                // header with its own) names no one.
                Ok(name) if !name.is_empty() && !name.contains(',') => Ok(Some(name.to_owned())),
                _ => Err(format!(
                    "this console takes its operator from the {header} header its authenticating proxy sets, and this request's is blank, a list or not text: nothing was done"
                )),
            },
            (None, _) => Err(format!(
                "this console takes its operator from the {header} header its authenticating proxy sets, and this request has none: nothing was done (reach the console through the proxy)"
            )),
            (Some(_), Some(_)) => Err(format!(
                "this request carries the {header} header more than once, so it names no one operator: nothing was done (the proxy must replace the header a client sends, not add to it)"
            )),
        }
    }

    /// Whether the request's `Host` is one the console answers to.
    fn host_allowed(&self, headers: &HeaderMap) -> bool {
        let Some(hosts) = &self.hosts else {
            return true;
        };
        let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
            return false;
        };
        // Without the port: `name:port`, `[v6]:port`.
        let name = match host.rfind(':') {
            Some(i) if !host[i..].contains(']') => &host[..i],
            _ => host,
        };
        let name = name.to_ascii_lowercase();
        hosts.iter().any(|h| h.eq_ignore_ascii_case(&name))
            || (name.starts_with("127.")
                && name.parse::<std::net::Ipv4Addr>().is_ok()
                && hosts.iter().any(|h| h == "127.0.0.1"))
    }

    /// Ends the session the request's cookie names.
    fn close_session(&self, headers: &HeaderMap) {
        if let Some(id) = cookie(headers, COOKIE) {
            let mut sessions = self.sessions.lock().unwrap_or_else(|e| e.into_inner());
            sessions.retain(|sid, _| !same(sid, &id));
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
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t);
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

/// Before every request: a request naming a host the console does not
/// answer to is refused; a POST is refused in read-only mode (but the
/// login); a request without the token (when one is set) goes to the login
/// form; a POST whose form lacks the page's CSRF token is refused (403,
/// nothing changed). Pages get their [`Visitor`]; every answer gets
/// headers that keep it out of caches and frames.
pub(super) async fn guard(
    State(state): State<Arc<Inner>>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = admit(&state, request, next).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    headers.insert("x-frame-options", header::HeaderValue::from_static("DENY"));
    headers.insert(
        "x-content-type-options",
        header::HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        "content-security-policy",
        header::HeaderValue::from_static(
            "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    response
}

/// Where the console is mounted: the original path without the path the
/// console sees (`""` at the root).
fn mount_point(request: &Request) -> String {
    let path = request.uri().path();
    let Some(original) = request.extensions().get::<OriginalUri>() else {
        return String::new();
    };
    let original = original.path();
    let base = original
        .strip_suffix(path)
        .or_else(|| (path == "/").then_some(original))
        .unwrap_or_default();
    base.trim_end_matches('/').to_owned()
}

async fn admit(state: &Inner, request: Request, next: Next) -> Response {
    let post = request.method() == Method::POST;
    let path = request.uri().path().to_owned();
    let base = mount_point(&request);
    if !state.security.host_allowed(request.headers()) {
        return html::refusal(
            StatusCode::FORBIDDEN,
            "this console answers only to its own host names (without --auth-token: localhost and 127.0.0.1); a page of another site may have been rebound to it: nothing was done",
        );
    }
    let operator = match state.security.operator(&request) {
        Ok(operator) => operator,
        Err(why) => return html::refusal(StatusCode::FORBIDDEN, &why),
    };
    let signing = path == "/login" || path == "/logout";
    if post && state.read_only && !(signing && state.security.authenticates()) {
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
    let csrf = match state.security.admit(request.headers()) {
        Some(csrf) => csrf,
        None if path == "/login" => state.security.login_csrf.clone(),
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
    let signed_in = state.security.session_csrf(request.headers()).is_some();
    request.extensions_mut().insert(Visitor {
        csrf,
        base,
        read_only: state.read_only,
        plain_http: state.security.authenticates() && !forwarded_https,
        signed_in,
        operator,
    });
    next.run(request).await
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
        return Redirect::to(&v.home()).into_response();
    };
    if !same(form.token.trim(), token) {
        // Slows a guessing loop down.
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
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
    let cookie = format!(
        "{COOKIE}={id}; HttpOnly; SameSite=Strict; Path={}{}",
        v.home(),
        if secure { "; Secure" } else { "" }
    );
    let mut response = Redirect::to(&v.home()).into_response();
    if let Ok(value) = header::HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, value);
    }
    response
}

/// `POST /logout`: ends the session and clears its cookie.
pub(super) async fn logout(
    State(state): State<Arc<Inner>>,
    axum::Extension(v): axum::Extension<Visitor>,
    headers: HeaderMap,
) -> Response {
    state.security.close_session(&headers);
    let mut response = Redirect::to(&v.link("/login")).into_response();
    let cookie = format!(
        "{COOKIE}=; HttpOnly; SameSite=Strict; Path={}; Max-Age=0",
        v.home()
    );
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
