//! Fault injection on executor endpoints: errors, lost answers, latency.
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use toolrunner_protocol::ApiError;

use crate::http::respond::Failure;
use crate::http::shared::Shared;

/// Fault injection settings.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// Share (0–1) of executor requests answered `503` before doing anything.
    pub error_rate: f64,
    /// Share (0–1) of executor requests done and committed, then left
    /// unanswered (the connection is closed).
    pub drop_response_rate: f64,
    /// Latency added to every executor request.
    pub latency_ms: u64,
    /// Seed of the random draws.
    pub seed: u64,
}

impl Faults {
    /// Parses `error_rate=0.1,drop_response_rate=0.1,latency_ms=5,seed=7`.
    ///
    /// # Errors
    /// An unknown key, a value that does not parse, or a rate outside 0–1.
    pub fn parse(spec: &str) -> Result<Faults, String> {
        let mut f = Faults::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("fault {part:?} must look like key=value"))?;
            match key.trim() {
                "error_rate" => f.error_rate = number(key, value)?,
                "drop_response_rate" => f.drop_response_rate = number(key, value)?,
                "latency_ms" => f.latency_ms = number(key, value)?,
                "seed" => f.seed = number(key, value)?,
                other => return Err(format!("unknown fault {other:?}")),
            }
        }
        f.check()?;
        Ok(f)
    }

    /// Checks that both rates lie in 0–1.
    ///
    /// # Errors
    /// Which rate is out of range.
    pub fn check(&self) -> Result<(), String> {
        for (name, rate) in [
            ("error_rate", self.error_rate),
            ("drop_response_rate", self.drop_response_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(format!("{name} must be between 0 and 1"));
            }
        }
        Ok(())
    }
}

fn number<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, String> {
    value
        .trim()
        .parse()
        .map_err(|_| format!("fault {key} has an invalid value {value:?}"))
}

/// Settings plus the random source they draw from.
pub(crate) struct FaultState {
    pub(crate) faults: Faults,
    rng: StdRng,
}

impl FaultState {
    pub(crate) fn new(faults: Faults) -> Self {
        let rng = StdRng::seed_from_u64(faults.seed);
        FaultState { faults, rng }
    }

    /// Decides this request's fate: `(fail, drop, latency)`.
    fn draw(&mut self) -> (bool, bool, u64) {
        let f = &self.faults;
        let (error_rate, drop_rate, latency) = (f.error_rate, f.drop_response_rate, f.latency_ms);
        let fail = error_rate > 0.0 && self.rng.random::<f64>() < error_rate;
        let drop = !fail && drop_rate > 0.0 && self.rng.random::<f64>() < drop_rate;
        (fail, drop, latency)
    }
}

/// Marks a response whose connection must be closed without answering.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DropConnection;

/// The middleware on executor endpoints.
pub(crate) async fn inject(
    State(shared): State<Arc<Shared>>,
    req: Request,
    next: Next,
) -> Response {
    let req = match (&shared.receipt_log, &shared.connect_log) {
        (Some(log), _) if req.uri().path().ends_with("/receipts") => record(log, req).await,
        (_, Some(log)) if req.uri().path().ends_with("/executors/connect") => {
            record_connect(log, req).await
        }
        _ => req,
    };
    let (fail, drop, latency) = shared
        .faults
        .lock()
        .map(|mut f| f.draw())
        .unwrap_or_default();
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency)).await;
    }
    if fail {
        let err = ApiError::new(
            503,
            toolrunner_protocol::ErrorType::ApiError,
            "injected_fault",
            "injected fault: retry with backoff",
        );
        return Failure(err).into_response();
    }
    let mut response = next.run(req).await;
    if drop {
        response.extensions_mut().insert(DropConnection);
    }
    response
}

/// Keeps a connect request's executor and instance ids (before any fault
/// decides its fate) and hands the request on unchanged.
async fn record_connect(log: &std::sync::Mutex<Vec<ReceivedConnect>>, req: Request) -> Request {
    let (parts, body) = req.into_parts();
    let limit = toolrunner_protocol::json::MAX_BODY_BYTES * 2;
    let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
        return Request::from_parts(parts, axum::body::Body::empty());
    };
    let v = serde_json::from_slice::<serde_json::Value>(&bytes).unwrap_or_default();
    let field = |name: &str| v.get(name).and_then(|x| x.as_str()).map(str::to_owned);
    if let Ok(mut log) = log.lock() {
        log.push(ReceivedConnect {
            executor_id: field("executor_id"),
            instance_id: field("instance_id"),
        });
    }
    Request::from_parts(parts, axum::body::Body::from(bytes))
}

/// Keeps a receipt request's body (before any fault decides its fate) and
/// hands the request on unchanged. A body too large to keep goes on as is.
async fn record(log: &std::sync::Mutex<Vec<ReceivedReceipt>>, req: Request) -> Request {
    let (parts, body) = req.into_parts();
    let limit = toolrunner_protocol::json::MAX_BODY_BYTES * 2;
    let Ok(bytes) = axum::body::to_bytes(body, limit).await else {
        return Request::from_parts(parts, axum::body::Body::empty());
    };
    let receipt_id = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| {
            v.get("receipt_id")
                .and_then(|r| r.as_str())
                .map(str::to_owned)
        });
    if let Ok(mut log) = log.lock() {
        log.push(ReceivedReceipt {
            receipt_id,
            path: parts.uri.path().to_owned(),
            body: bytes.to_vec(),
        });
    }
    Request::from_parts(parts, axum::body::Body::from(bytes))
}

/// One receipt request as it reached the platform.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceivedReceipt {
    /// The body's `receipt_id`, if it has one.
    pub receipt_id: Option<String>,
    /// The request path (names the run and the call).
    pub path: String,
    /// The body, byte for byte.
    pub body: Vec<u8>,
}

/// A connect request as it reached the platform.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReceivedConnect {
    /// The body's `executor_id`, if it has one.
    pub executor_id: Option<String>,
    /// The body's `instance_id`, if it has one.
    pub instance_id: Option<String>,
}
