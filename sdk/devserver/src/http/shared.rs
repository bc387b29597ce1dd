//! State shared by every handler.
use std::sync::{Arc, Mutex as StdMutex};

use tokio::sync::{Mutex, broadcast, watch};
use toolrunner_protocol::ApiError;

use super::auth::{HasTokens, Tokens};
use crate::engine::{Limits, Notice, State, now_ms};
use crate::http::faults::FaultState;
use crate::store::Store;

/// The state and its store, changed together under one lock.
pub(crate) struct Engine {
    pub(crate) state: State,
    pub(crate) store: Store,
}

/// Everything handlers need.
pub(crate) struct Shared {
    pub(crate) engine: Arc<Mutex<Engine>>,
    pub(crate) limits: Limits,
    pub(crate) tokens: Tokens,
    pub(crate) faults: StdMutex<FaultState>,
    pub(crate) notices: broadcast::Sender<Notice>,
    /// Flips to `true` when the server stops.
    pub(crate) shutdown: watch::Sender<bool>,
    /// Added to the wall clock (tests move the platform's time forward).
    pub(crate) clock_offset_ms: std::sync::atomic::AtomicI64,
    /// Every receipt request body that reached the platform, when recorded.
    pub(crate) receipt_log: Option<StdMutex<Vec<super::faults::ReceivedReceipt>>>,
    /// Every connect request that reached the platform, when recorded.
    pub(crate) connect_log: Option<StdMutex<Vec<super::faults::ReceivedConnect>>>,
}

impl HasTokens for Arc<Shared> {
    fn tokens(&self) -> &Tokens {
        &self.tokens
    }
}

impl Shared {
    /// Runs one operation: sweep what time has changed, apply the
    /// operation, write every record it changed (also when it answers an
    /// error: late receipts are kept), then publish stream notices.
    pub(crate) async fn apply<T>(
        &self,
        op: impl FnOnce(&mut State, i64) -> Result<T, ApiError>,
    ) -> Result<T, ApiError> {
        let mut engine = self.engine.clone().lock_owned().await;
        let now = now_ms().saturating_add(
            self.clock_offset_ms
                .load(std::sync::atomic::Ordering::SeqCst),
        );
        engine.state.sweep(now, &self.limits);
        let result = op(&mut engine.state, now);
        let dirty = engine.state.take_dirty();
        // The write runs on its own task: a client that disconnects cancels
        // this future, and a write cancelled half-way would lose the
        // connection (and an in-memory database with it).
        let notices = self.notices.clone();
        let saved = tokio::spawn(async move {
            let Engine { state, store } = &mut *engine;
            let saved = store.save(state, dirty).await;
            if saved.is_ok() {
                for notice in state.take_notices() {
                    // No subscriber is fine: the stream is live only.
                    let _ = notices.send(notice);
                }
            }
            saved.map_err(|e| e.to_string())
        })
        .await
        .unwrap_or_else(|e| Err(e.to_string()));
        if let Err(e) = saved {
            tracing::error!(error = %e, "could not write the platform's state");
            return Err(ApiError::new(
                500,
                toolrunner_protocol::ErrorType::ApiError,
                "storage_failure",
                "the platform could not store the change; retry with backoff",
            ));
        }
        result
    }
}
