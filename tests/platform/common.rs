//! Shared setup for the platform conformance tests: a server per test, raw
//! HTTP helpers, error-envelope checks and a `Fixture` that builds an agent,
//! bindings and a version through the real endpoints.

use std::path::PathBuf;
use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};
use toolrunner::platform::Platform;
use toolrunner_devserver::{DevServer, Faults};

// ---------------------------------------------------------------- tokens

/// Token with `*`.
pub const ADMIN: &str = "t-admin";
/// Token with `executors:connect,tools:execute` (what an executor gets).
pub const EXEC: &str = "t-exec";
/// Token with only `executors:connect`.
pub const CONNECT_ONLY: &str = "t-connect-only";
/// Token with only `tools:execute`.
pub const EXECUTE_ONLY: &str = "t-execute-only";
/// Token with only `runtime:read`.
pub const RUNTIME_READ: &str = "t-runtime-read";
/// Token with only `configuration:read`.
pub const CONFIG_READ: &str = "t-config-read";
/// Token with only `configuration:write`.
pub const CONFIG_WRITE: &str = "t-config-write";
/// Token with only `runs:write`.
pub const RUNS_WRITE: &str = "t-runs-write";
/// Token naming every listed scope explicitly, but not `*`.
pub const ALL_LISTED: &str = "t-all-listed";
/// Every scope of §1, comma-separated.
pub const ALL_SCOPES: &str = "executors:connect,tools:execute,runtime:read,configuration:read,configuration:write,runs:write";

// ---------------------------------------------------------------- tools

/// Read tool of binding `main` (output schema: any object).
pub const READ: &str = "tasks.read";
/// Write tool of binding `main` (output schema requires `charge_id`).
pub const CHARGE: &str = "payments.charge";
/// Tool of binding `main` without output schema and a 1024-byte budget.
pub const NOTE: &str = "notes.write";
/// Tool of binding `side`.
pub const SIDE: &str = "side.run";

/// Arguments that match `payments.charge`.
pub fn charge_args() -> Value {
    json!({"amount": 1200, "currency": "EUR"})
}

/// `sha256:` + hex of the canonical JSON of [`charge_args`] (computed
/// independently with Python's `json.dumps(..., sort_keys=True, separators=(",", ":"))`).
pub const CHARGE_ARGS_DIGEST: &str =
    "sha256:cc4d9f720c2753fb36eb4c6fc4d5b44d9ea4845d71cf1fbfe2cd4da669f98555";

pub fn read_tool(binding_id: &str) -> Value {
    json!({
        "name": READ, "description": "Read tasks page by page", "binding_id": binding_id,
        "input_schema": {"type": "object", "properties": {"cursor": {"type": "string"}},
                          "additionalProperties": false},
        "output_schema": {"type": "object"}
    })
}

pub fn charge_tool(binding_id: &str) -> Value {
    json!({
        "name": CHARGE, "description": "Charge a card", "binding_id": binding_id,
        "input_schema": {
            "type": "object",
            "properties": {
                "amount": {"type": "integer"},
                "currency": {"type": "string"},
                "meta": {"type": "object", "properties": {
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "a/b~c": {"type": "integer"}
                }}
            },
            "required": ["amount", "currency"],
            "additionalProperties": false
        },
        "output_schema": {"type": "object", "properties": {"charge_id": {"type": "string"}},
                           "required": ["charge_id"]}
    })
}

pub fn note_tool(binding_id: &str) -> Value {
    json!({
        "name": NOTE, "description": "Write a note", "binding_id": binding_id,
        "input_schema": {"type": "object"},
        "max_result_context_bytes": 1024
    })
}

pub fn side_tool(binding_id: &str) -> Value {
    json!({
        "name": SIDE, "description": "Runs on the side binding", "binding_id": binding_id,
        "input_schema": {"type": "object"}
    })
}

// ---------------------------------------------------------------- ids

static COUNTER: AtomicU64 = AtomicU64::new(1);

/// A fresh identifier valid as `receipt_id` / `operation_key` / `executor_id`.
pub fn uid(prefix: &str) -> String {
    format!("{prefix}_{}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

// ---------------------------------------------------------------- server

/// How a test server is configured.
#[derive(Clone)]
pub struct Opts {
    pub lease_ttl_ms: u64,
    pub heartbeat_interval_ms: u64,
    pub run_ttl_ms: u64,
    pub db_path: Option<PathBuf>,
    pub faults: Option<Faults>,
    /// Give no `.token(..)` at all (the documented default tokens apply).
    pub default_tokens: bool,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            lease_ttl_ms: 15_000,
            heartbeat_interval_ms: 5_000,
            run_ttl_ms: 0,
            db_path: None,
            faults: None,
            default_tokens: false,
        }
    }
}

impl Opts {
    pub fn lease(ms: u64) -> Opts {
        Opts {
            lease_ttl_ms: ms,
            ..Opts::default()
        }
    }
    pub fn run_ttl(ms: u64) -> Opts {
        Opts {
            run_ttl_ms: ms,
            ..Opts::default()
        }
    }
}

fn install_crypto() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The typed client of the platform at `base` (no token of its own: each
/// request names one). Loopback: no proxy, no automatic retry.
pub fn api(base: &str) -> Platform {
    Platform::new(base, "").expect("platform client")
}

/// A running development platform plus a client for it.
pub struct Srv {
    server: Option<DevServer>,
    pub base: String,
    pub http: Platform,
}

impl Srv {
    pub async fn start() -> Srv {
        Srv::start_with(Opts::default()).await
    }

    pub async fn start_with(o: Opts) -> Srv {
        install_crypto();
        let mut b = DevServer::builder()
            .listen("127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap())
            .lease_ttl_ms(o.lease_ttl_ms)
            .heartbeat_interval_ms(o.heartbeat_interval_ms)
            .run_ttl_ms(o.run_ttl_ms);
        if !o.default_tokens {
            b = b
                .token(ADMIN, "*")
                .token(EXEC, "executors:connect,tools:execute")
                .token(CONNECT_ONLY, "executors:connect")
                .token(EXECUTE_ONLY, "tools:execute")
                .token(RUNTIME_READ, "runtime:read")
                .token(CONFIG_READ, "configuration:read")
                .token(CONFIG_WRITE, "configuration:write")
                .token(RUNS_WRITE, "runs:write")
                .token(ALL_LISTED, ALL_SCOPES);
        }
        if let Some(p) = o.db_path.clone() {
            b = b.db_path(p);
        }
        if let Some(f) = o.faults.clone() {
            b = b.faults(f);
        }
        let server = b.start().await.expect("devserver starts");
        let base = server.base_url();
        Srv {
            server: Some(server),
            http: api(&base),
            base,
        }
    }

    /// Graceful stop (frees the port).
    pub async fn stop(&mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown().await;
        }
    }

    /// Forgets a run as a platform whose own retention deleted it.
    pub async fn forget_run(&self, run_id: &str) -> Result<(), toolrunner_devserver::Error> {
        self.server
            .as_ref()
            .expect("the server is running")
            .forget_run(run_id)
            .await
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}/v1{}", self.base, path)
    }

    /// Sends `req` through the typed client's raw requests; a transport
    /// error is returned as `Err`.
    pub async fn try_send(&self, req: Req) -> Result<Resp, toolrunner::Error> {
        let mut rb = if req.absolute {
            self.http.request_to(req.method.clone(), &req.path)
        } else {
            self.http.request(req.method.clone(), &req.path)
        }
        .token(req.token.as_deref());
        if let Some(ct) = &req.content_type {
            rb = rb.header("content-type", ct.as_str());
        }
        for (k, v) in &req.headers {
            rb = rb.header(k.as_str(), v.as_str());
        }
        if let Some(b) = req.body {
            rb = rb.body(b);
        }
        let r = rb.send().await?;
        let mut headers = reqwest::header::HeaderMap::new();
        for (k, v) in &r.headers {
            if let (Ok(k), Ok(v)) = (
                reqwest::header::HeaderName::from_bytes(k.as_bytes()),
                reqwest::header::HeaderValue::from_str(v),
            ) {
                headers.append(k, v);
            }
        }
        let json = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
        Ok(Resp {
            status: r.status,
            headers,
            raw: r.body,
            json,
        })
    }

    /// Sends `req`; panics on a transport error.
    pub async fn send(&self, req: Req) -> Resp {
        let what = format!("{} {}", req.method, req.path);
        match self.try_send(req).await {
            Ok(r) => r,
            Err(e) => panic!("{what}: transport error {e:?}"),
        }
    }

    pub async fn get(&self, token: &str, path: &str) -> Resp {
        self.send(Req::get(path).token(token)).await
    }

    pub async fn post(&self, token: &str, path: &str, body: Value) -> Resp {
        self.send(Req::post(path).token(token).json(&body)).await
    }

    pub async fn put(&self, token: &str, path: &str, body: Value) -> Resp {
        self.send(Req::put(path).token(token).json(&body)).await
    }

    /// `PUT /dev/faults` with the admin token; asserts 200.
    pub async fn set_faults(&self, error_rate: f64, drop_response_rate: f64, latency_ms: u64) {
        let r = self
            .put(
                ADMIN,
                "/dev/faults",
                json!({"error_rate": error_rate, "drop_response_rate": drop_response_rate,
                       "latency_ms": latency_ms, "seed": 7}),
            )
            .await;
        r.ok();
    }
}

/// One request, built step by step.
#[derive(Clone)]
pub struct Req {
    pub method: toolrunner::platform::Method,
    pub path: String,
    pub absolute: bool,
    pub token: Option<String>,
    pub content_type: Option<String>,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
}

impl Req {
    pub fn new(method: toolrunner::platform::Method, path: &str) -> Req {
        Req {
            method,
            path: path.to_string(),
            absolute: false,
            token: None,
            content_type: None,
            headers: vec![],
            body: None,
        }
    }
    pub fn get(path: &str) -> Req {
        Req::new(toolrunner::platform::Method::GET, path)
    }
    pub fn post(path: &str) -> Req {
        Req::new(toolrunner::platform::Method::POST, path)
    }
    pub fn put(path: &str) -> Req {
        Req::new(toolrunner::platform::Method::PUT, path)
    }
    /// `path` is taken relative to the base URL, not to `/v1`.
    pub fn absolute(mut self) -> Req {
        self.absolute = true;
        self
    }
    pub fn token(mut self, t: &str) -> Req {
        self.token = Some(t.to_string());
        self
    }
    pub fn json(mut self, v: &Value) -> Req {
        self.body = Some(serde_json::to_vec(v).unwrap());
        self.content_type = Some("application/json".into());
        self
    }
    /// Raw bytes sent as `application/json`.
    pub fn raw(mut self, b: impl Into<Vec<u8>>) -> Req {
        self.body = Some(b.into());
        self.content_type = Some("application/json".into());
        self
    }
    pub fn content_type(mut self, ct: Option<&str>) -> Req {
        self.content_type = ct.map(str::to_string);
        self
    }
    pub fn header(mut self, k: &str, v: &str) -> Req {
        self.headers.push((k.to_string(), v.to_string()));
        self
    }
}

/// An answer.
pub struct Resp {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub raw: Vec<u8>,
    pub json: Value,
}

impl std::fmt::Debug for Resp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let text = String::from_utf8_lossy(&self.raw);
        let text: String = text.chars().take(2000).collect();
        write!(f, "HTTP {} {}", self.status, text)
    }
}

/// The error `type` for each status of the §1 table.
pub fn type_for_status(status: u16) -> &'static str {
    match status {
        400 | 405 | 413 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        409 => "conflict_error",
        429 => "rate_limit_error",
        _ => "api_error",
    }
}

impl Resp {
    pub fn code(&self) -> &str {
        self.json["error"]["code"].as_str().unwrap_or("")
    }

    pub fn param(&self) -> &Value {
        &self.json["error"]["param"]
    }

    pub fn request_id(&self) -> Option<String> {
        self.headers
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }

    /// Asserts `200` and returns the body.
    #[track_caller]
    pub fn ok(&self) -> &Value {
        assert_eq!(self.status, 200, "expected 200, got {self:?}");
        assert!(
            self.request_id().is_some_and(|s| !s.is_empty()),
            "no x-request-id on {self:?}"
        );
        &self.json
    }

    /// What is wrong with this answer as a §1 error, if anything.
    pub fn envelope_issue(&self) -> Option<String> {
        if self.status < 400 {
            return Some("not an error status".into());
        }
        if self.request_id().is_none_or(|s| s.is_empty()) {
            return Some("no x-request-id".into());
        }
        let ct = self
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !ct.starts_with("application/json") {
            return Some(format!("error content-type {ct:?}"));
        }
        let Some(e) = self.json.get("error").and_then(Value::as_object) else {
            return Some("no error object".into());
        };
        for k in ["type", "code", "message", "param"] {
            if !e.contains_key(k) {
                return Some(format!("error envelope lacks {k:?}"));
            }
        }
        let allowed = [
            "invalid_request_error",
            "unsupported_or_invalid_configuration",
            "authentication_error",
            "permission_error",
            "not_found_error",
            "conflict_error",
            "rate_limit_error",
            "api_error",
        ];
        match e["type"].as_str() {
            Some(t) if allowed.contains(&t) => {}
            _ => return Some(format!("unknown error type {}", e["type"])),
        }
        if !e["message"].is_string() {
            return Some("message not a string".into());
        }
        if !(e["param"].is_null() || e["param"].is_string()) {
            return Some("param neither null nor string".into());
        }
        if self.status < 500 && e["code"].as_str().is_none_or(str::is_empty) {
            return Some("4xx without a machine-readable code".into());
        }
        if self.status == 429 && self.headers.get("retry-after").is_none() {
            return Some("429 without Retry-After".into());
        }
        if self.status >= 500 && e["type"] != "api_error" {
            return Some("5xx type is not api_error".into());
        }
        None
    }

    /// Asserts the §1 error envelope with any 4xx/5xx status.
    #[track_caller]
    pub fn envelope(&self) {
        if let Some(issue) = self.envelope_issue() {
            panic!("{issue}: {self:?}");
        }
    }

    /// Asserts a 4xx/5xx error with exactly this status and code; the
    /// type is the one the §1 table gives for the status.
    #[track_caller]
    pub fn err(&self, status: u16, code: &str) {
        self.envelope();
        assert_eq!(
            self.status, status,
            "status; expected {status} {code}, got {self:?}"
        );
        assert_eq!(
            self.code(),
            code,
            "code; expected {status} {code}, got {self:?}"
        );
        if status != 400 {
            assert_eq!(
                self.json["error"]["type"],
                type_for_status(status),
                "type: {self:?}"
            );
        }
    }

    /// Asserts an error with this status and the §1 type for it (any code).
    #[track_caller]
    pub fn is(&self, status: u16) {
        self.envelope();
        assert_eq!(
            self.status, status,
            "status; expected {status}, got {self:?}"
        );
        if status != 400 {
            assert_eq!(
                self.json["error"]["type"],
                type_for_status(status),
                "type: {self:?}"
            );
        }
    }

    /// Asserts an error with this status, type and code.
    #[track_caller]
    pub fn err_typed(&self, status: u16, ty: &str, code: &str) {
        self.envelope();
        assert_eq!(
            self.status, status,
            "status; expected {status} {ty} {code}, got {self:?}"
        );
        assert_eq!(self.json["error"]["type"], ty, "type: {self:?}");
        assert_eq!(self.code(), code, "code: {self:?}");
    }

    /// `400 invalid_request_error` with this code.
    #[track_caller]
    pub fn bad(&self, code: &str) {
        self.err_typed(400, "invalid_request_error", code);
    }

    /// `400 unsupported_or_invalid_configuration` (any code).
    #[track_caller]
    pub fn unsupported_config(&self) {
        self.envelope();
        assert_eq!(self.status, 400, "{self:?}");
        assert_eq!(
            self.json["error"]["type"], "unsupported_or_invalid_configuration",
            "{self:?}"
        );
    }

    /// Asserts the `param` of the error.
    #[track_caller]
    pub fn param_is(&self, p: &str) {
        assert_eq!(self.param(), &json!(p), "param: {self:?}");
    }
}

// ---------------------------------------------------------------- json helpers

/// RFC 8785 serialization for values without floating-point numbers and
/// without keys outside the Basic Multilingual Plane (what the tests use).
pub fn canon(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let parts: Vec<String> = keys
                .into_iter()
                .map(|k| format!("{}:{}", serde_json::to_string(k).unwrap(), canon(&m[k])))
                .collect();
            format!("{{{}}}", parts.join(","))
        }
        Value::Array(a) => format!("[{}]", a.iter().map(canon).collect::<Vec<_>>().join(",")),
        other => serde_json::to_string(other).unwrap(),
    }
}

/// `n` nested arrays: `[[...]]`.
pub fn nest(n: usize) -> String {
    format!("{}{}", "[".repeat(n), "]".repeat(n))
}

/// Whether `s` is an RFC 3339 timestamp in UTC.
pub fn is_rfc3339_utc(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() < 20 {
        return false;
    }
    let digits = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_digit);
    let head = digits(0..4)
        && b[4] == b'-'
        && digits(5..7)
        && b[7] == b'-'
        && digits(8..10)
        && (b[10] == b'T' || b[10] == b't')
        && digits(11..13)
        && b[13] == b':'
        && digits(14..16)
        && b[16] == b':'
        && digits(17..19);
    if !head {
        return false;
    }
    let mut rest = &s[19..];
    if let Some(frac) = rest.strip_prefix('.') {
        let n = frac.bytes().take_while(u8::is_ascii_digit).count();
        if n == 0 {
            return false;
        }
        rest = &frac[n..];
    }
    matches!(rest, "Z" | "z" | "+00:00")
}

#[track_caller]
pub fn assert_ts(v: &Value) {
    let s = v
        .as_str()
        .unwrap_or_else(|| panic!("timestamp is not a string: {v}"));
    assert!(is_rfc3339_utc(s), "not an RFC 3339 UTC timestamp: {s:?}");
}

/// Asserts `id` is a string with `prefix` and an opaque rest of URL-safe
/// characters. Identifiers (not grants, which are credentials) also have the
/// owner's documented form, prefix + a UUIDv7's 32 hex digits (choices 23).
#[track_caller]
pub fn assert_id(v: &Value, prefix: &str) {
    let s = v
        .as_str()
        .unwrap_or_else(|| panic!("id is not a string: {v}"));
    let rest = s
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("id {s:?} lacks prefix {prefix:?}"));
    assert!(
        !rest.is_empty()
            && rest
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-'),
        "id {s:?}: opaque rest must be non-empty and URL-safe"
    );
    if prefix != "grt_" {
        assert!(
            rest.len() == 32 && rest.bytes().all(|c| c.is_ascii_hexdigit()),
            "id {s:?}: not {prefix} + 32 hex digits"
        );
    }
}

/// Whether the `{run_id, call_id}` list contains this pair.
pub fn has_pair(list: &Value, run_id: &str, call_id: &str) -> bool {
    list.as_array()
        .map(|a| {
            a.iter()
                .any(|x| x["run_id"] == run_id && x["call_id"] == call_id)
        })
        .unwrap_or(false)
}

/// The call object of `call_id` in a run object.
#[track_caller]
pub fn call_in<'a>(run: &'a Value, call_id: &str) -> &'a Value {
    run["tool_calls"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["call_id"] == call_id))
        .unwrap_or_else(|| panic!("call {call_id} not in run {run}"))
}

pub async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// A deadline `ms` from now.
pub fn deadline(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

// ---------------------------------------------------------------- fixture

/// A connection as `POST /executors/connect` answered it.
#[derive(Clone, Debug)]
pub struct Conn {
    pub executor_id: String,
    pub connection_id: String,
    pub answer: Value,
}

/// An assignment as a claim answered it.
#[derive(Clone, Debug)]
pub struct Asg {
    pub run_id: String,
    pub call_id: String,
    pub executor_id: String,
    pub assignment_id: String,
    pub grant: String,
    pub operation_key: String,
    pub answer: Value,
}

/// A run and its call ids in order.
#[derive(Clone, Debug)]
pub struct Run {
    pub run_id: String,
    pub calls: Vec<String>,
}

pub type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// A server with agent `agt`, binding `main` (tasks.read, payments.charge,
/// notes.write), binding `side` (side.run), and version `agv` with all four.
pub struct Fixture {
    pub srv: Srv,
    pub agent_id: String,
    pub binding_id: String,
    pub side_binding_id: String,
    pub agent_version: String,
    pub version: Value,
}

impl Fixture {
    pub async fn new() -> Fixture {
        Fixture::with(Opts::default()).await
    }

    pub async fn with(o: Opts) -> Fixture {
        let srv = Srv::start_with(o).await;
        Fixture::on(srv).await
    }

    /// Builds the configuration on an already running server.
    pub async fn on(srv: Srv) -> Fixture {
        let agent = srv
            .post(ADMIN, "/agents", json!({"name": "support-agent"}))
            .await;
        let agent_id = agent.ok()["agent_id"].as_str().unwrap().to_string();
        let main = srv
            .post(
                ADMIN,
                "/executor-bindings",
                json!({"agent_id": agent_id, "name": "main", "tool_names": [READ, CHARGE, NOTE]}),
            )
            .await;
        let binding_id = main.ok()["binding_id"].as_str().unwrap().to_string();
        let side = srv
            .post(
                ADMIN,
                "/executor-bindings",
                json!({"agent_id": agent_id, "name": "side", "tool_names": [SIDE]}),
            )
            .await;
        let side_binding_id = side.ok()["binding_id"].as_str().unwrap().to_string();
        let v = srv
            .post(
                ADMIN,
                &format!("/agents/{agent_id}/versions"),
                json!({"tools": [read_tool(&binding_id), charge_tool(&binding_id), note_tool(&binding_id),
                                 side_tool(&side_binding_id)]}),
            )
            .await;
        let version = v.ok().clone();
        let agent_version = version["agent_version"].as_str().unwrap().to_string();
        Fixture {
            srv,
            agent_id,
            binding_id,
            side_binding_id,
            agent_version,
            version,
        }
    }

    // ---- runs

    pub async fn post_run(&self, calls: Value) -> Resp {
        self.srv
            .post(
                ADMIN,
                "/runs",
                json!({"agent_version": self.agent_version, "subject": "user_42", "tool_calls": calls}),
            )
            .await
    }

    /// Starts a run with `(tool_name, arguments)` calls.
    pub async fn run(&self, calls: &[(&str, Value)]) -> Run {
        let body: Vec<Value> = calls
            .iter()
            .map(|(t, a)| json!({"tool_name": t, "arguments": a}))
            .collect();
        let r = self.post_run(Value::Array(body)).await;
        let run_id = r.ok()["run_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no run_id in {r:?}"))
            .to_string();
        let run = self.get_run(&run_id).await;
        let ids: Vec<String> = run["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["call_id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(ids.len(), calls.len(), "run {run}");
        Run { run_id, calls: ids }
    }

    /// A run with one call; answers `(run_id, call_id)`.
    pub async fn run1(&self, tool: &str, args: Value) -> (String, String) {
        let r = self.run(&[(tool, args)]).await;
        (r.run_id, r.calls[0].clone())
    }

    /// A run with one `tasks.read` call.
    pub async fn read_call(&self) -> (String, String) {
        self.run1(READ, json!({})).await
    }

    /// Adds calls to a run; answers the new call ids in order.
    pub async fn add_calls(&self, run_id: &str, calls: &[(&str, Value)]) -> Vec<String> {
        let before = self.get_run(run_id).await;
        let known: Vec<Value> = before["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["call_id"].clone())
            .collect();
        let body: Vec<Value> = calls
            .iter()
            .map(|(t, a)| json!({"tool_name": t, "arguments": a}))
            .collect();
        self.srv
            .post(
                ADMIN,
                &format!("/runs/{run_id}/tool-calls"),
                json!({"tool_calls": body}),
            )
            .await
            .ok();
        let after = self.get_run(run_id).await;
        after["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| !known.contains(&c["call_id"]))
            .map(|c| c["call_id"].as_str().unwrap().to_string())
            .collect()
    }

    pub async fn get_run_resp(&self, run_id: &str) -> Resp {
        self.srv.get(ADMIN, &format!("/runs/{run_id}")).await
    }

    pub async fn get_run(&self, run_id: &str) -> Value {
        self.get_run_resp(run_id).await.ok().clone()
    }

    /// State of one call.
    pub async fn state(&self, run_id: &str, call_id: &str) -> String {
        let run = self.get_run(run_id).await;
        call_in(&run, call_id)["state"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    pub async fn cancel(&self, run_id: &str) -> Resp {
        self.srv
            .send(Req::post(&format!("/runs/{run_id}/cancel")).token(ADMIN))
            .await
    }

    // ---- executors

    pub fn connect_body(&self, executor_id: &str, tools: &[&str], capacity: u64) -> Value {
        json!({"executor_id": executor_id, "instance_id": uid("ins"), "binding_id": self.binding_id,
               "tools": tools, "capacity": capacity, "sdk": {"name": "toolrunner-tests", "version": "0.0.1"}})
    }

    pub async fn connect_raw(&self, body: Value) -> Resp {
        self.srv.post(EXEC, "/executors/connect", body).await
    }

    pub async fn connect_with(&self, executor_id: &str, tools: &[&str], capacity: u64) -> Conn {
        let r = self
            .connect_raw(self.connect_body(executor_id, tools, capacity))
            .await;
        let answer = r.ok().clone();
        Conn {
            executor_id: executor_id.to_string(),
            connection_id: answer["connection_id"].as_str().unwrap().to_string(),
            answer,
        }
    }

    /// Connects `executor_id` for all three tools of binding `main`, capacity 8.
    pub async fn connect(&self, executor_id: &str) -> Conn {
        self.connect_with(executor_id, &[READ, CHARGE, NOTE], 8)
            .await
    }

    pub async fn heartbeat(&self, c: &Conn, in_flight: Value) -> Resp {
        self.srv
            .post(
                EXEC,
                &format!("/executors/{}/heartbeat", c.executor_id),
                json!({"connection_id": c.connection_id, "in_flight": in_flight}),
            )
            .await
    }

    pub async fn pending(&self, c: &Conn, extra_query: &str) -> Resp {
        self.srv
            .get(
                EXEC,
                &format!(
                    "/executors/{}/pending?connection_id={}{}",
                    c.executor_id, c.connection_id, extra_query
                ),
            )
            .await
    }

    pub async fn report(&self, c: &Conn, calls: Value) -> Resp {
        self.srv
            .post(
                EXEC,
                &format!("/executors/{}/calls/report", c.executor_id),
                json!({"connection_id": c.connection_id, "calls": calls}),
            )
            .await
    }

    /// Reports one call; asserts 200 and answers its outcome.
    pub async fn report1(&self, c: &Conn, run_id: &str, call_id: &str, state: &str) -> String {
        let r = self
            .report(
                c,
                json!([{"run_id": run_id, "call_id": call_id, "state": state}]),
            )
            .await;
        r.ok()["results"][0]["outcome"]
            .as_str()
            .unwrap_or("")
            .to_string()
    }

    pub async fn disconnect(&self, c: &Conn, mode: &str) -> Resp {
        self.srv
            .post(
                EXEC,
                &format!("/executors/{}/disconnect", c.executor_id),
                json!({"connection_id": c.connection_id, "mode": mode}),
            )
            .await
    }

    pub async fn diagnostics(&self) -> Value {
        self.srv
            .get(
                ADMIN,
                &format!(
                    "/agents/{}/executor-bindings/{}/diagnostics",
                    self.agent_id, self.binding_id
                ),
            )
            .await
            .ok()
            .clone()
    }

    /// The diagnostics entry of one executor.
    pub async fn exec_diag(&self, executor_id: &str) -> Value {
        let d = self.diagnostics().await;
        d["executors"]
            .as_array()
            .and_then(|a| a.iter().find(|e| e["executor_id"] == executor_id).cloned())
            .unwrap_or_else(|| panic!("executor {executor_id} not in diagnostics {d}"))
    }

    // ---- claims

    pub async fn claim_as(
        &self,
        executor_id: &str,
        connection_id: &str,
        run_id: &str,
        call_id: &str,
        key: &str,
    ) -> Resp {
        self.srv
            .post(
                EXEC,
                &format!("/runs/{run_id}/tool-calls/{call_id}/claim"),
                json!({"executor_id": executor_id, "connection_id": connection_id, "operation_key": key}),
            )
            .await
    }

    pub async fn claim(&self, c: &Conn, run_id: &str, call_id: &str, key: &str) -> Resp {
        self.claim_as(&c.executor_id, &c.connection_id, run_id, call_id, key)
            .await
    }

    /// Claims with a fresh key; asserts success.
    pub async fn claim_ok(&self, c: &Conn, run_id: &str, call_id: &str) -> Asg {
        let key = uid("op");
        let r = self.claim(c, run_id, call_id, &key).await;
        asg_from(&r, &c.executor_id, &key)
    }

    /// Claims and sends `accepted`; the call is then `running`.
    pub async fn running(&self, c: &Conn, run_id: &str, call_id: &str) -> Asg {
        let a = self.claim_ok(c, run_id, call_id).await;
        let r = self.receipt(&a, accepted(&a)).await;
        assert_eq!(r.ok()["accepted"], true, "{r:?}");
        a
    }

    // ---- receipts

    pub async fn receipt_with(
        &self,
        run_id: &str,
        call_id: &str,
        grant: Option<&str>,
        body: &Value,
    ) -> Resp {
        let mut req = Req::post(&format!("/runs/{run_id}/tool-calls/{call_id}/receipts"))
            .token(EXEC)
            .json(body);
        if let Some(g) = grant {
            req = req.header("tool-grant", g);
        }
        self.srv.send(req).await
    }

    /// Sends `body` for this assignment with its grant.
    pub async fn receipt(&self, a: &Asg, body: Value) -> Resp {
        self.receipt_with(&a.run_id, &a.call_id, Some(&a.grant), &body)
            .await
    }

    /// Accepts and completes (sequence 1) with `result`.
    pub async fn complete(&self, a: &Asg, result: Value) -> Resp {
        self.receipt(a, completed(a, 1, result)).await
    }

    // ---- stream

    pub async fn open_stream(&self, c: &Conn) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
        self.open_stream_raw(
            &c.executor_id,
            &format!("connection_id={}", c.connection_id),
            Some(EXEC),
        )
        .await
    }

    pub async fn open_stream_raw(
        &self,
        executor_id: &str,
        query: &str,
        token: Option<&str>,
    ) -> Result<Ws, tokio_tungstenite::tungstenite::Error> {
        let url = format!(
            "{}/executors/{executor_id}/stream?{query}",
            self.srv.url("").replacen("http://", "ws://", 1)
        );
        let mut req = url.into_client_request()?;
        if let Some(t) = token {
            req.headers_mut()
                .insert("authorization", format!("Bearer {t}").parse().unwrap());
        }
        let (ws, _) = tokio_tungstenite::connect_async(req).await?;
        Ok(ws)
    }
}

/// Turns a claim answer into an [`Asg`]; asserts success.
#[track_caller]
pub fn asg_from(r: &Resp, executor_id: &str, key: &str) -> Asg {
    let v = r.ok();
    let a = &v["assignment"];
    Asg {
        run_id: a["run_id"]
            .as_str()
            .unwrap_or_else(|| panic!("no assignment in {r:?}"))
            .to_string(),
        call_id: a["call_id"].as_str().unwrap().to_string(),
        executor_id: executor_id.to_string(),
        assignment_id: a["assignment_id"].as_str().unwrap().to_string(),
        grant: a["grant"].as_str().unwrap().to_string(),
        operation_key: key.to_string(),
        answer: v.clone(),
    }
}

/// Next JSON text frame that is not a ping, within `ms`.
pub async fn next_frame(ws: &mut Ws, ms: u64) -> Option<Value> {
    let end = deadline(ms);
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        match tokio::time::timeout(left, ws.next()).await {
            Err(_) => return None,
            Ok(None) => return None,
            Ok(Some(Err(e))) => panic!("stream error {e:?}"),
            Ok(Some(Ok(Message::Text(t)))) => {
                let v: Value = serde_json::from_str(t.as_str())
                    .unwrap_or_else(|_| panic!("frame is not JSON: {t}"));
                assert!(v.is_object(), "frame is not an object: {v}");
                if v["type"] == "ping" {
                    continue;
                }
                return Some(v);
            }
            Ok(Some(Ok(Message::Close(_)))) => return None,
            Ok(Some(Ok(_))) => continue,
        }
    }
}

/// Waits for a frame of `ty` about `call_id`, skipping others.
pub async fn frame_for(ws: &mut Ws, ty: &str, call_id: &str, ms: u64) -> Option<Value> {
    let end = deadline(ms);
    loop {
        let left = end.saturating_duration_since(Instant::now()).as_millis() as u64;
        if left == 0 {
            return None;
        }
        let f = next_frame(ws, left).await?;
        if f["type"] == ty && f["call_id"] == call_id {
            return Some(f);
        }
    }
}

// ---------------------------------------------------------------- receipt bodies

pub fn accepted(a: &Asg) -> Value {
    accepted_id(a, &uid("rcp"))
}

pub fn accepted_id(a: &Asg, rid: &str) -> Value {
    json!({"receipt_id": rid, "executor_id": a.executor_id, "assignment_id": a.assignment_id,
           "sequence": 0, "kind": "accepted"})
}

pub fn progress(a: &Asg, seq: u64) -> Value {
    json!({"receipt_id": uid("rcp"), "executor_id": a.executor_id, "assignment_id": a.assignment_id,
           "sequence": seq, "kind": "progress",
           "progress": {"message": format!("step {seq}"), "fraction": null, "data": null}})
}

pub fn completed(a: &Asg, seq: u64, result: Value) -> Value {
    json!({"receipt_id": uid("rcp"), "executor_id": a.executor_id, "assignment_id": a.assignment_id,
           "sequence": seq, "kind": "completed", "result": result})
}

pub fn failed(a: &Asg, seq: u64, code: &str) -> Value {
    json!({"receipt_id": uid("rcp"), "executor_id": a.executor_id, "assignment_id": a.assignment_id,
           "sequence": seq, "kind": "failed", "error": {"code": code, "message": "the product refused"}})
}

pub fn cancelled(a: &Asg, seq: u64) -> Value {
    json!({"receipt_id": uid("rcp"), "executor_id": a.executor_id, "assignment_id": a.assignment_id,
           "sequence": seq, "kind": "cancelled", "reason": "customer withdrew"})
}

/// A `completed` result valid for `payments.charge`.
pub fn charge_result() -> Value {
    json!({"charge_id": "ch_9", "status": "succeeded"})
}
