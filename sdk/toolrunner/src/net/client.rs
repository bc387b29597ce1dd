//! The HTTP client: the only module that talks to the platform over HTTP.
//!
//! `429`, `5xx`, timeouts and lost connections are retried with the same
//! bytes, exponential backoff and full jitter; every other answer goes back
//! to the caller, which applies the protocol's reaction table.
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use toolrunner_protocol::ErrorType;

use crate::gate::{self, Gate, Reach};
use toolrunner_protocol::error::{ApiError, ErrorEnvelope};
use toolrunner_protocol::wire::{
    Claim, Claimed, Connect, Connected, Disconnect, Disconnected, Grant, Heartbeat,
    HeartbeatAnswer, List, PendingCall, ReceiptAnswer, Report, ReportAnswer,
};

/// How a request ended when it did not succeed.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum ClientError {
    /// The platform answered with an error envelope (never retried here).
    #[error("{0}")]
    Api(ApiError),
    /// No usable answer after the retries (network, 5xx, 429, timeouts).
    #[error("platform unreachable: {0}")]
    Unreachable(String),
    /// Not sent: right before an attempt went out, its caller's `ready`
    /// said no (the executor's lease is not live). Names the request.
    #[error("{0}: not sent, the executor's lease is not live (it could not be renewed)")]
    NotReady(String),
}

impl ClientError {
    /// The error code, for answered errors.
    pub(crate) fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api(e) => Some(e.code()),
            ClientError::Unreachable(_) | ClientError::NotReady(_) => None,
        }
    }

    /// The HTTP status, for answered errors.
    pub(crate) fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api(e) => Some(e.status),
            ClientError::Unreachable(_) | ClientError::NotReady(_) => None,
        }
    }
}

/// Why an HTTP client could not be built.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub(crate) struct ClientBuildError(String);

/// Backoff for transient failures.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Backoff {
    pub(crate) initial: Duration,
    pub(crate) max: Duration,
    pub(crate) attempts: u32,
}

impl Backoff {
    /// The wait before attempt `n` (0-based): full jitter over an
    /// exponentially growing ceiling.
    pub(crate) fn delay(&self, n: u32) -> Duration {
        let ceiling = self.initial.saturating_mul(1u32 << n.min(16)).min(self.max);
        let millis = u64::try_from(ceiling.as_millis())
            .unwrap_or(u64::MAX)
            .max(1);
        Duration::from_millis(rand::random_range(millis / 2..=millis))
    }
}

/// Connections kept alive to the platform while idle.
const IDLE_CONNECTIONS: usize = 32;

/// Claims and receipts in flight at once. A burst of claims (a thousand
/// calls pending on a new executor) queues here instead of opening a
/// connection each; the platform serves them one at a time anyway.
/// Heartbeats, `pending`, reports and the connection's own requests never
/// wait here.
const CALL_REQUESTS: usize = 64;

/// The platform's executor API.
#[derive(Clone)]
pub(crate) struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
    pub(crate) backoff: Backoff,
    /// Once cancelled, no request goes out any more: the executor has
    /// stopped as a lost process would (a crash, a detach).
    fence: tokio_util::sync::CancellationToken,
    /// Room for claims and receipts in flight (see [`CALL_REQUESTS`]).
    call_requests: Arc<tokio::sync::Semaphore>,
    /// A test's faults of this process (frozen, platform cut off).
    gate: Option<Arc<Gate>>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.base)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl Client {
    pub(crate) fn new(
        base: &str,
        token: &str,
        timeout: Duration,
        backoff: Backoff,
    ) -> Result<Client, ClientBuildError> {
        // TLS of this client only (also for http URLs: without it reqwest
        // would look for a process-wide provider).
        let http = crate::net::tls::http_builder(base)
            .map_err(ClientBuildError)?
            .timeout(timeout)
            .connect_timeout(timeout)
            // A burst of claims opens many connections; past it, a few
            // kept alive serve the steady traffic, and the rest (with
            // their buffers) are closed instead of idling in the pool.
            .pool_max_idle_per_host(IDLE_CONNECTIONS)
            .build()
            .map_err(|e| ClientBuildError(e.to_string()))?;
        Ok(Client {
            http,
            base: base.trim_end_matches('/').to_owned(),
            token: token.to_owned(),
            backoff,
            fence: tokio_util::sync::CancellationToken::new(),
            call_requests: Arc::new(tokio::sync::Semaphore::new(CALL_REQUESTS)),
            gate: None,
        })
    }

    /// The same client under a test's faults of its process.
    pub(crate) fn with_gate(self, gate: Option<Arc<Gate>>) -> Client {
        Client { gate, ..self }
    }

    /// The same client for another executor of this process: the
    /// connection pool is shared, the fence and the room for requests are
    /// its own.
    #[cfg(feature = "postgres")]
    pub(crate) fn fresh(&self) -> Client {
        Client {
            fence: tokio_util::sync::CancellationToken::new(),
            call_requests: Arc::new(tokio::sync::Semaphore::new(CALL_REQUESTS)),
            ..self.clone()
        }
    }

    /// The platform's base URL (never the token).
    pub(crate) fn base(&self) -> &str {
        &self.base
    }

    /// Stops every request from now on (they answer `Unreachable`).
    pub(crate) fn fence(&self) {
        self.fence.cancel();
    }

    /// Sends one request, retrying transient failures with the same bytes.
    async fn send<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
        grant: Option<&Grant>,
    ) -> Result<T, ClientError> {
        self.send_if(method, path, body, grant, &|| true).await
    }

    /// [`send`](Self::send), each attempt only if `ready` says so right
    /// before it goes out.
    async fn send_if<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
        grant: Option<&Grant>,
        ready: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<T, ClientError> {
        let url = format!("{}/v1{path}", self.base);
        let mut last = String::new();
        for attempt in 0..self.backoff.attempts.max(1) {
            if attempt > 0 {
                tokio::time::sleep(self.backoff.delay(attempt - 1)).await;
            }
            if let Err(cut) = gate::before(self.gate.as_deref(), Reach::Platform).await {
                last = format!("{method} {path}: {cut}");
                continue;
            }
            if self.fence.is_cancelled() {
                return Err(ClientError::Unreachable(format!(
                    "{method} {path}: the executor has stopped"
                )));
            }
            if !ready() {
                return Err(ClientError::NotReady(format!("{method} {path}")));
            }
            let mut req = self
                .http
                .request(method.clone(), &url)
                .bearer_auth(&self.token);
            if let Some(b) = &body {
                req = req
                    .header("Content-Type", "application/json")
                    .body(b.clone());
            }
            if let Some(g) = grant {
                req = req.header("Tool-Grant", g.expose());
            }
            let resp = match req.send().await {
                Ok(r) => r,
                Err(e) => {
                    last = format!("{method} {path}: {}", without_url(&e));
                    tracing::debug!(attempt, error = %last, "transient failure, retrying");
                    continue;
                }
            };
            let status = resp.status().as_u16();
            let retry_after = resp
                .headers()
                .get("retry-after")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            let bytes = match resp.bytes().await {
                Ok(b) => b,
                Err(e) => {
                    last = format!("{method} {path}: answer lost: {}", without_url(&e));
                    continue;
                }
            };
            // A frozen process takes its answers in only once thawed.
            gate::thawed(self.gate.as_deref()).await;
            if status == 429 || status >= 500 {
                last = format!("{method} {path}: {status}");
                if let Some(secs) = retry_after {
                    tokio::time::sleep(Duration::from_secs(secs.min(60))).await;
                }
                continue;
            }
            if (200..300).contains(&status) {
                return serde_json::from_slice(&bytes).map_err(|e| {
                    ClientError::Unreachable(format!(
                        "{method} {path}: the answer does not parse: {e}"
                    ))
                });
            }
            return Err(ClientError::Api(api_error(status, &bytes)));
        }
        Err(ClientError::Unreachable(last))
    }

    async fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let bytes =
            serde_json::to_vec(body).map_err(|e| ClientError::Unreachable(e.to_string()))?;
        self.send(reqwest::Method::POST, path, Some(bytes), None)
            .await
    }

    /// Connects, each attempt only if `ready` says so right before it goes
    /// out (the executor's lease is live).
    pub(crate) async fn connect(
        &self,
        body: &Connect,
        ready: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<Connected, ClientError> {
        let bytes =
            serde_json::to_vec(body).map_err(|e| ClientError::Unreachable(e.to_string()))?;
        self.send_if(
            reqwest::Method::POST,
            "/executors/connect",
            Some(bytes),
            None,
            ready,
        )
        .await
    }

    pub(crate) async fn heartbeat(
        &self,
        executor_id: &str,
        body: &Heartbeat,
    ) -> Result<HeartbeatAnswer, ClientError> {
        self.post(&format!("/executors/{executor_id}/heartbeat"), body)
            .await
    }

    pub(crate) async fn pending(
        &self,
        executor_id: &str,
        connection_id: &str,
        limit: usize,
        cursor: Option<&str>,
    ) -> Result<List<PendingCall>, ClientError> {
        let mut path =
            format!("/executors/{executor_id}/pending?connection_id={connection_id}&limit={limit}");
        if let Some(cursor) = cursor {
            path.push_str("&cursor=");
            path.extend(percent_encoding::utf8_percent_encode(
                cursor,
                percent_encoding::NON_ALPHANUMERIC,
            ));
        }
        self.send(reqwest::Method::GET, &path, None, None).await
    }

    pub(crate) async fn report(
        &self,
        executor_id: &str,
        body: &Report,
    ) -> Result<ReportAnswer, ClientError> {
        self.post(&format!("/executors/{executor_id}/calls/report"), body)
            .await
    }

    pub(crate) async fn disconnect(
        &self,
        executor_id: &str,
        body: &Disconnect,
    ) -> Result<Disconnected, ClientError> {
        // The last word of a stopping executor goes out past the fence.
        let last_word = Client {
            fence: tokio_util::sync::CancellationToken::new(),
            ..self.clone()
        };
        last_word
            .post(&format!("/executors/{executor_id}/disconnect"), body)
            .await
    }

    /// Claims, each attempt only if `ready` says so right before it goes
    /// out (the executor may take work).
    pub(crate) async fn claim(
        &self,
        run_id: &str,
        call_id: &str,
        body: &Claim,
        ready: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<Claimed, ClientError> {
        let bytes =
            serde_json::to_vec(body).map_err(|e| ClientError::Unreachable(e.to_string()))?;
        // Never closed: a permit always comes.
        let _room = self.call_requests.acquire().await.ok();
        let path = format!("/runs/{run_id}/tool-calls/{call_id}/claim");
        self.send_if(reqwest::Method::POST, &path, Some(bytes), None, ready)
            .await
    }

    /// Sends a stored receipt body exactly as stored.
    pub(crate) async fn receipt(
        &self,
        run_id: &str,
        call_id: &str,
        grant: &Grant,
        body: &str,
    ) -> Result<ReceiptAnswer, ClientError> {
        self.receipt_if(run_id, call_id, grant, body, &|| true)
            .await
    }

    /// [`receipt`](Self::receipt), each attempt only if `ready` says so
    /// right before it goes out (an `accepted`: the executor may start the
    /// handler).
    pub(crate) async fn receipt_if(
        &self,
        run_id: &str,
        call_id: &str,
        grant: &Grant,
        body: &str,
        ready: &(dyn Fn() -> bool + Send + Sync),
    ) -> Result<ReceiptAnswer, ClientError> {
        let path = format!("/runs/{run_id}/tool-calls/{call_id}/receipts");
        // Never closed: a permit always comes.
        let _room = self.call_requests.acquire().await.ok();
        self.send_if(
            reqwest::Method::POST,
            &path,
            Some(body.as_bytes().to_vec()),
            Some(grant),
            ready,
        )
        .await
    }
}

/// How a WebSocket upgrade ended when it did not succeed.
#[derive(Debug)]
pub(crate) enum UpgradeError {
    /// The platform serves no stream here (`404`).
    NotFound,
    /// Anything else.
    Failed(String),
}

impl Client {
    /// Opens the WebSocket stream at `path` (under the base URL, not `/v1`).
    ///
    /// The handshake goes through reqwest rather than tungstenite's client,
    /// whose trace log prints the whole request, bearer token included.
    pub(crate) async fn websocket(&self, path: &str) -> Result<reqwest::Upgraded, UpgradeError> {
        use tokio_tungstenite::tungstenite::handshake::client::generate_key;
        use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
        gate::before(self.gate.as_deref(), Reach::Platform)
            .await
            .map_err(UpgradeError::Failed)?;
        let key = generate_key();
        let resp = self
            .http
            .get(format!("{}{path}", self.base))
            .bearer_auth(&self.token)
            .header("Connection", "Upgrade")
            .header("Upgrade", "websocket")
            .header("Sec-WebSocket-Version", "13")
            .header("Sec-WebSocket-Key", &key)
            .timeout(Duration::from_secs(3600 * 24 * 365))
            .send()
            .await
            .map_err(|e| UpgradeError::Failed(without_url(&e)))?;
        match resp.status().as_u16() {
            101 => {}
            404 => return Err(UpgradeError::NotFound),
            s => return Err(UpgradeError::Failed(format!("stream refused with {s}"))),
        }
        let accept = resp
            .headers()
            .get("sec-websocket-accept")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if accept != derive_accept_key(key.as_bytes()) {
            return Err(UpgradeError::Failed(
                "the stream's handshake answer does not match".into(),
            ));
        }
        resp.upgrade()
            .await
            .map_err(|e| UpgradeError::Failed(without_url(&e)))
    }
}

/// A reqwest error without its URL (which may carry query parameters).
fn without_url(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else if e.is_body() || e.is_decode() {
        "the answer was cut"
    } else {
        "request failed"
    };
    kind.to_owned()
}

fn api_error(status: u16, bytes: &[u8]) -> ApiError {
    match serde_json::from_slice::<ErrorEnvelope>(bytes) {
        Ok(env) => ApiError {
            status,
            body: env.error,
        },
        Err(_) => ApiError::new(
            status,
            ErrorType::ApiError,
            "unparsable_error",
            format!("status {status} without an error envelope"),
        ),
    }
}

impl From<ClientError> for crate::Error {
    fn from(e: ClientError) -> Self {
        match e {
            ClientError::Api(api) => crate::error::from_api(api),
            ClientError::Unreachable(m) => crate::Error::new(
                crate::error::Kind::Unreachable,
                format!("{m}; check that the platform runs and that base_url points at it"),
            ),
            e @ ClientError::NotReady(_) => {
                crate::Error::new(crate::error::Kind::Unreachable, e.to_string())
            }
        }
    }
}

/// The platform's WebSocket stream of one connection, frame by frame.
pub(crate) struct Frames(tokio_tungstenite::WebSocketStream<reqwest::Upgraded>);

/// One frame of the stream, as the runner needs it.
pub(crate) enum Frame {
    /// A text frame (the protocol's JSON notices).
    Text(String),
    /// The platform closed the stream.
    Closed,
    /// A frame of another kind (ping, binary): nothing to do.
    Other,
}

impl Frames {
    /// The next frame; `Err` when the stream broke.
    pub(crate) async fn next(&mut self) -> Result<Frame, String> {
        use futures_util::StreamExt;
        use tokio_tungstenite::tungstenite::Message;
        match self.0.next().await {
            Some(Ok(Message::Text(t))) => Ok(Frame::Text(t.to_string())),
            Some(Ok(Message::Close(_))) | None => Ok(Frame::Closed),
            Some(Ok(_)) => Ok(Frame::Other),
            Some(Err(e)) => Err(e.to_string()),
        }
    }
}

impl Client {
    /// Opens the stream at `path` (the upgrade of
    /// [`websocket`](Self::websocket)) as frames.
    pub(crate) async fn stream(&self, path: &str) -> Result<Frames, UpgradeError> {
        let upgraded = self.websocket(path).await?;
        let socket = tokio_tungstenite::WebSocketStream::from_raw_socket(
            upgraded,
            tokio_tungstenite::tungstenite::protocol::Role::Client,
            None,
        )
        .await;
        Ok(Frames(socket))
    }
}
