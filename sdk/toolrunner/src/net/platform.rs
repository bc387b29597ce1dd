//! A typed client for the platform's configuration and run endpoints
//! (protocol §2 and, on the development platform, §7): publish the tools an
//! executor serves, start runs, read them, cancel them.
//!
//! ```rust,no_run
//! # async fn demo(executor: &toolrunner::Executor) -> toolrunner::Result<()> {
//! use toolrunner::platform::{NewToolCall, Platform};
//!
//! let platform = Platform::new("http://127.0.0.1:8700", "dev-admin")?;
//! let agent = platform.create_agent("support-bot").await?;
//! let binding = platform
//!     .create_binding(&agent.agent_id, "payments", &["payments.charge"])
//!     .await?;
//! // Build the executor with `binding.binding_id`, then publish what it serves:
//! let version = platform
//!     .publish(&agent.agent_id, executor.tool_definitions())
//!     .await?;
//! let run = platform
//!     .create_run(&version.agent_version, "user_42", vec![NewToolCall::new(
//!         "payments.charge",
//!         serde_json::json!({"amount": 1200}),
//!     )])
//!     .await?;
//! let run = platform
//!     .wait_settled(&run.run_id, std::time::Duration::from_secs(30))
//!     .await?;
//! # let _ = (binding, run); Ok(()) }
//! ```
//!
//! The executor's own endpoints are the executor's business; this client
//! is for setting up, testing and operating. [`Platform::request`] sends a
//! request of your own (a test that needs a malformed body, say) through
//! the same client.
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

pub use toolrunner_protocol::tooldef::ToolDefinition;
pub use toolrunner_protocol::wire::{
    Agent, AgentVersion, Binding, CallState, Diagnostics, DryRun, DryRunAnswer, FaultSettings,
    List, NewToolCall, Run, RunCall, RunStatus, StoredReceipt,
};

use crate::error::{Error, Kind, Result};
use toolrunner_protocol::error::{ApiError, ErrorEnvelope};

/// The method of a request of your own ([`Platform::request`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Method(reqwest::Method);

impl Method {
    /// `GET`.
    pub const GET: Method = Method(reqwest::Method::GET);
    /// `POST`.
    pub const POST: Method = Method(reqwest::Method::POST);
    /// `PUT`.
    pub const PUT: Method = Method(reqwest::Method::PUT);
    /// `PATCH`.
    pub const PATCH: Method = Method(reqwest::Method::PATCH);
    /// `DELETE`.
    pub const DELETE: Method = Method(reqwest::Method::DELETE);
    /// `HEAD`.
    pub const HEAD: Method = Method(reqwest::Method::HEAD);
    /// `OPTIONS`.
    pub const OPTIONS: Method = Method(reqwest::Method::OPTIONS);

    /// The method named `name` (any HTTP token, case-sensitive as HTTP
    /// methods are), or `None` if it is not a valid method name.
    pub fn parse(name: &str) -> Option<Method> {
        reqwest::Method::from_bytes(name.as_bytes())
            .ok()
            .map(Method)
    }

    /// Its name, as sent (`GET`, `POST`, …).
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The platform's configuration and run endpoints.
#[derive(Clone)]
pub struct Platform {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl std::fmt::Debug for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Platform")
            .field("base", &self.base)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// An answer to [`Platform::request`], whatever its status. Its `Debug`
/// shows the status and the sizes of the headers and the body.
#[derive(Clone)]
#[non_exhaustive]
pub struct RawResponse {
    /// HTTP status.
    pub status: u16,
    /// Headers, names lower-case.
    pub headers: Vec<(String, String)>,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

toolrunner_protocol::debug_without_payloads!(RawResponse { status } hiding { headers, body });

impl RawResponse {
    /// The body as JSON (`Null` if it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// A request of your own, sent by [`RawRequest::send`]. Its `Debug` shows
/// neither the token nor the headers nor the body, only their sizes.
#[must_use = "a request does nothing until it is sent"]
pub struct RawRequest {
    http: reqwest::Client,
    method: reqwest::Method,
    url: String,
    token: Option<String>,
    headers: Vec<(String, String)>,
    body: Option<Vec<u8>>,
}

toolrunner_protocol::debug_without_payloads!(RawRequest { http, method, url } hiding { token, headers, body });

impl RawRequest {
    /// Replaces the bearer token, or sends none with `None`.
    pub fn token(mut self, token: Option<&str>) -> RawRequest {
        self.token = token.map(str::to_owned);
        self
    }

    /// A JSON body, with `Content-Type: application/json`.
    pub fn json(self, body: &Value) -> RawRequest {
        self.header("content-type", "application/json")
            .body(serde_json::to_vec(body).unwrap_or_default())
    }

    /// A body of raw bytes, exactly as given (no content type is added).
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> RawRequest {
        self.body = Some(body.into());
        self
    }

    /// A header (added as given, after any of the same name).
    pub fn header(mut self, name: &str, value: &str) -> RawRequest {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Sends it once (no retries) and returns whatever came back.
    ///
    /// # Errors
    /// No answer at all (connection refused, timeout).
    pub async fn send(self) -> Result<RawResponse> {
        let mut req = self.http.request(self.method, &self.url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        for (k, v) in &self.headers {
            req = req.header(k.as_str(), v.as_str());
        }
        if let Some(b) = self.body {
            req = req.body(b);
        }
        let resp = req.send().await.map_err(|e| unreachable(&e.to_string()))?;
        let status = resp.status().as_u16();
        let headers = resp
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap_or("").to_owned()))
            .collect();
        let body = resp
            .bytes()
            .await
            .map_err(|e| unreachable(&e.to_string()))?
            .to_vec();
        Ok(RawResponse {
            status,
            headers,
            body,
        })
    }
}

fn unreachable(detail: &str) -> Error {
    Error::new(
        Kind::Unreachable,
        format!(
            "cannot reach the platform: {detail}; check that it runs and that the URL points at it"
        ),
    )
}

/// Refuses a base URL that ends in `/v1` (or `/v1/`): every path is put
/// under `/v1` by toolrunner itself, so such a URL would ask for
/// `/v1/v1/…`, which no platform serves. The message says what to set
/// instead.
///
/// # Errors
/// The URL ends in `/v1`; the message names it and the URL without it.
pub(crate) fn check_base_url_path(url: &str) -> std::result::Result<(), String> {
    let trimmed = url.trim_end_matches('/');
    match trimmed.strip_suffix("/v1") {
        Some(without) if without.contains("://") => Err(format!(
            "the base URL `{url}` ends in /v1: remove it; toolrunner adds /v1 to every path (TOOLRUNNER_BASE_URL={without})"
        )),
        _ => Ok(()),
    }
}

/// The scope a request of this client needs (protocol §5.2 and §6), for
/// the message of a `403 missing_scope`.
fn scope_needed(method: &Method, path: &str) -> &'static str {
    let path = path.split('?').next().unwrap_or(path);
    let first = path.trim_start_matches('/').split('/').next().unwrap_or("");
    match (method.as_str(), first) {
        ("POST", "agents" | "executor-bindings") => "configuration:write",
        ("GET", "agents" | "executor-bindings") => "configuration:read",
        ("POST", "tools") => "runtime:read, configuration:read or tools:execute",
        ("POST", "runs") => "runs:write",
        ("GET", "runs") => "runtime:read",
        ("PUT", "dev") => "every scope (a token given `*`)",
        _ => "the scope of this endpoint (docs/protocol.md, section 6)",
    }
}

impl Platform {
    /// A client for the platform at `base_url` (paths go under `/v1`) with
    /// `token`, which needs the scopes of the endpoints used
    /// (`configuration:write` to publish, `runs:write` to start runs, …).
    ///
    /// # Errors
    /// The base URL ends in `/v1` (toolrunner adds it to every path), or
    /// the HTTP client cannot be built.
    pub fn new(base_url: &str, token: &str) -> Result<Platform> {
        check_base_url_path(base_url).map_err(|m| Error::new(Kind::Builder, m))?;
        let builder = crate::net::tls::http_builder(base_url)
            .map_err(|e| Error::new(Kind::Builder, e))?
            .timeout(Duration::from_secs(30))
            .retry(reqwest::retry::never());
        let http = builder
            .build()
            .map_err(|e| Error::new(Kind::Builder, format!("cannot build the HTTP client: {e}")))?;
        Ok(Platform {
            http,
            base: base_url.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
        })
    }

    /// The base URL.
    pub fn base_url(&self) -> &str {
        &self.base
    }

    /// A request of your own to `path` (under `/v1`, e.g. `/runs`), with
    /// this client's token.
    pub fn request(&self, method: Method, path: &str) -> RawRequest {
        self.request_to(method, &format!("/v1{path}"))
    }

    /// A request of your own to `path` taken from the base URL itself (not
    /// under `/v1`), with this client's token.
    pub fn request_to(&self, method: Method, path: &str) -> RawRequest {
        RawRequest {
            http: self.http.clone(),
            method: method.0,
            url: format!("{}{path}", self.base),
            token: Some(self.token.clone()),
            headers: Vec::new(),
            body: None,
        }
    }

    /// The same client with another token.
    pub fn with_token(&self, token: &str) -> Platform {
        Platform {
            token: token.to_owned(),
            ..self.clone()
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<T> {
        let mut req = self.request(method.clone(), path);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await?;
        if (200..300).contains(&resp.status) {
            return serde_json::from_slice(&resp.body).map_err(|e| {
                Error::new(
                    Kind::Platform,
                    format!("{method} {path}: the answer does not parse: {e}"),
                )
            });
        }
        let api = match serde_json::from_slice::<ErrorEnvelope>(&resp.body) {
            Ok(env) => ApiError {
                status: resp.status,
                body: env.error,
            },
            Err(_) => ApiError::new(
                resp.status,
                toolrunner_protocol::ErrorType::ApiError,
                "unexpected_answer",
                String::from_utf8_lossy(&resp.body).into_owned(),
            ),
        };
        if api.code() == "missing_scope" {
            // The token's scopes are the caller's to fix, and which one is
            // missing depends on the endpoint, not on an executor's needs.
            let needed = scope_needed(&method, path);
            return Err(Error::new(
                Kind::Configuration,
                format!(
                    "{method} {path}: the token lacks the scope {needed} ({api}): give it {needed}"
                ),
            )
            .with_api(api));
        }
        Err(Error::from(crate::net::client::ClientError::Api(api))
            .context(&format!("{method} {path}")))
    }

    fn json<B: Serialize>(body: &B) -> Value {
        serde_json::to_value(body).unwrap_or(Value::Null)
    }

    /// `POST /agents`.
    ///
    /// # Errors
    /// The platform refused it (the error carries its status and code).
    pub async fn create_agent(&self, name: &str) -> Result<Agent> {
        self.call(Method::POST, "/agents", Some(json!({"name": name})))
            .await
    }

    /// `POST /executor-bindings`: the tools an executor may serve for an
    /// agent.
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn create_binding(
        &self,
        agent_id: &str,
        name: &str,
        tool_names: &[&str],
    ) -> Result<Binding> {
        let body = json!({"agent_id": agent_id, "name": name, "tool_names": tool_names});
        self.call(Method::POST, "/executor-bindings", Some(body))
            .await
    }

    /// `GET /executor-bindings?agent_id=`.
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn bindings(&self, agent_id: &str) -> Result<Vec<Binding>> {
        let list: List<Binding> = self
            .call(
                Method::GET,
                &format!("/executor-bindings?agent_id={agent_id}"),
                None,
            )
            .await?;
        Ok(list.data)
    }

    /// `POST /agents/{agent_id}/versions` with these tool definitions (for
    /// example [`Executor::tool_definitions`](crate::Executor::tool_definitions)).
    ///
    /// # Errors
    /// The platform refused the version (the message names the field).
    pub async fn publish(&self, agent_id: &str, tools: &[ToolDefinition]) -> Result<AgentVersion> {
        let body = json!({"tools": Self::json(&tools)});
        self.call(
            Method::POST,
            &format!("/agents/{agent_id}/versions"),
            Some(body),
        )
        .await
    }

    /// `GET /agents/{agent_id}/versions` (the development platform): the
    /// agent's published versions, oldest first (the last is the latest).
    ///
    /// # Errors
    /// The platform refused it (an unknown agent is `404`).
    pub async fn versions(&self, agent_id: &str) -> Result<Vec<AgentVersion>> {
        let list: List<AgentVersion> = self
            .call(Method::GET, &format!("/agents/{agent_id}/versions"), None)
            .await?;
        Ok(list.data)
    }

    /// `GET /agents/{agent_id}/versions/{agent_version}`.
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn version(&self, agent_id: &str, agent_version: &str) -> Result<AgentVersion> {
        self.call(
            Method::GET,
            &format!("/agents/{agent_id}/versions/{agent_version}"),
            None,
        )
        .await
    }

    /// A binding's diagnostics: its executors and its calls by state.
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn diagnostics(&self, agent_id: &str, binding_id: &str) -> Result<Diagnostics> {
        self.call(
            Method::GET,
            &format!("/agents/{agent_id}/executor-bindings/{binding_id}/diagnostics"),
            None,
        )
        .await
    }

    /// `POST /tools/dry-run`.
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn dry_run(&self, body: &DryRun) -> Result<DryRunAnswer> {
        self.call(Method::POST, "/tools/dry-run", Some(Self::json(body)))
            .await
    }

    /// `POST /runs` (the development platform): a run whose model asked
    /// for these calls.
    ///
    /// # Errors
    /// The platform refused it (arguments that fail a tool's schema, an
    /// unknown version, …).
    pub async fn create_run(
        &self,
        agent_version: &str,
        subject: &str,
        calls: Vec<NewToolCall>,
    ) -> Result<Run> {
        let body = json!({"agent_version": agent_version, "subject": subject,
                          "tool_calls": Self::json(&calls)});
        self.call(Method::POST, "/runs", Some(body)).await
    }

    /// `POST /runs/{run_id}/tool-calls` (the development platform).
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn add_calls(&self, run_id: &str, calls: Vec<NewToolCall>) -> Result<Run> {
        let body = json!({"tool_calls": Self::json(&calls)});
        self.call(
            Method::POST,
            &format!("/runs/{run_id}/tool-calls"),
            Some(body),
        )
        .await
    }

    /// `GET /runs/{run_id}`.
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn run(&self, run_id: &str) -> Result<Run> {
        self.call(Method::GET, &format!("/runs/{run_id}"), None)
            .await
    }

    /// `POST /runs/{run_id}/cancel` (the development platform).
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn cancel_run(&self, run_id: &str) -> Result<Run> {
        self.call(
            Method::POST,
            &format!("/runs/{run_id}/cancel"),
            Some(json!({})),
        )
        .await
    }

    /// `PUT /dev/faults` (the development platform).
    ///
    /// # Errors
    /// The platform refused it.
    pub async fn set_faults(&self, faults: &FaultSettings) -> Result<FaultSettings> {
        self.call(Method::PUT, "/dev/faults", Some(Self::json(faults)))
            .await
    }

    /// Polls the run until `done` holds, every 25 ms, for at most `within`.
    ///
    /// # Errors
    /// The run could not be read, or `done` did not hold in time (the
    /// message shows the run as last seen).
    pub async fn wait_for(
        &self,
        run_id: &str,
        within: Duration,
        what: &str,
        done: impl Fn(&Run) -> bool,
    ) -> Result<Run> {
        let end = Instant::now() + within;
        loop {
            let run = self.run(run_id).await?;
            if done(&run) {
                return Ok(run);
            }
            if Instant::now() >= end {
                let states: Vec<String> = run
                    .tool_calls
                    .iter()
                    .map(|c| format!("{} {}", c.tool_name, c.state.as_str()))
                    .collect();
                return Err(Error::new(
                    Kind::Platform,
                    format!(
                        "run {run_id} was not {what} within {within:?}; its calls: {}",
                        states.join(", ")
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits until every call of the run is settled: `completed`,
    /// `failed`, `cancelled`, `terminated` or `reconciliation_required`.
    ///
    /// # Errors
    /// As [`wait_for`](Self::wait_for).
    pub async fn wait_settled(&self, run_id: &str, within: Duration) -> Result<Run> {
        self.wait_for(run_id, within, "settled", |run| {
            run.tool_calls.iter().all(|c| settled(c.state))
        })
        .await
    }
}

/// Whether a call will not change any more without an operator.
pub fn settled(state: CallState) -> bool {
    state.is_terminal() || state == CallState::ReconciliationRequired
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_url_ending_in_v1_is_refused_with_the_url_to_use() {
        for url in [
            "http://127.0.0.1:8700/v1",
            "http://127.0.0.1:8700/v1/",
            "http://127.0.0.1:8700/v1//",
        ] {
            let message = check_base_url_path(url).expect_err(url);
            assert_eq!(
                message,
                format!(
                    "the base URL `{url}` ends in /v1: remove it; toolrunner adds /v1 to every path (TOOLRUNNER_BASE_URL=http://127.0.0.1:8700)"
                )
            );
        }
        let message = check_base_url_path("https://platform.example/api/v1").expect_err("v1");
        assert!(message.contains("(TOOLRUNNER_BASE_URL=https://platform.example/api)"));
        for url in [
            "http://127.0.0.1:8700",
            "http://127.0.0.1:8700/",
            "https://platform.example/api",
            "https://platform.example/v10",
            "https://platform.example/xv1",
            "https://v1",
        ] {
            assert_eq!(check_base_url_path(url), Ok(()), "{url}");
        }
        let e = Platform::new("http://127.0.0.1:8700/v1", "t").expect_err("refused");
        assert!(e.is_builder() && e.to_string().contains("ends in /v1: remove it"));
    }

    #[test]
    fn a_missing_scope_names_the_scope_of_the_endpoint() {
        let cases = [
            (Method::POST, "/agents", "configuration:write"),
            (Method::POST, "/executor-bindings", "configuration:write"),
            (
                Method::POST,
                "/agents/agt_1/versions",
                "configuration:write",
            ),
            (Method::GET, "/agents/agt_1/versions", "configuration:read"),
            (
                Method::GET,
                "/executor-bindings?agent_id=agt_1",
                "configuration:read",
            ),
            (Method::POST, "/runs", "runs:write"),
            (Method::POST, "/runs/run_1/cancel", "runs:write"),
            (Method::GET, "/runs/run_1", "runtime:read"),
        ];
        for (method, path, want) in cases {
            assert_eq!(scope_needed(&method, path), want, "{method} {path}");
        }
    }
}
