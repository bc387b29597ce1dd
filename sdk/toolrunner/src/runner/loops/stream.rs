//! The WebSocket stream wakes the claimer and delivers cancellations.
//! Polling alone must also work: a platform without a stream (`404`) is
//! used by polling only.
use std::sync::Arc;
use std::time::Duration;

use toolrunner_protocol::wire::StreamFrame;

use super::super::{CallKey, Core};
use crate::net::client::{Frame, UpgradeError};

pub(crate) async fn stream_loop(core: Arc<Core>) {
    let mut attempt = 0u32;
    loop {
        if core.life.is_stopping() {
            return;
        }
        match listen(&core).await {
            Ok(()) => attempt = 0,
            Err(Stop::NoStream) => {
                tracing::info!("the platform has no stream; polling only");
                return;
            }
            Err(Stop::Failed(e)) => {
                tracing::debug!(error = %e, "stream lost; polling continues");
                attempt += 1;
            }
        }
        // After any reconnect the claimer reads `pending` again.
        core.calls.wake.notify_one();
        tokio::select! {
            _ = core.life.stopping() => return,
            _ = tokio::time::sleep(super::super::retry_delay(&core, attempt.min(6)).max(Duration::from_millis(100))) => {}
        }
    }
}

enum Stop {
    NoStream,
    Failed(String),
}

async fn listen(core: &Arc<Core>) -> Result<(), Stop> {
    let conn = core
        .link
        .conn
        .read()
        .await
        .clone()
        .ok_or_else(|| Stop::Failed("not connected".into()))?;
    let path = format!("{}?connection_id={}", conn.stream_path, conn.connection_id);
    let mut frames = match core.client.stream(&path).await {
        Ok(f) => f,
        Err(UpgradeError::NotFound) => return Err(Stop::NoStream),
        Err(UpgradeError::Failed(e)) => return Err(Stop::Failed(e)),
    };
    core.calls.wake.notify_one();
    loop {
        let frame = tokio::select! {
            _ = core.life.stopping() => return Ok(()),
            f = frames.next() => f,
        };
        let text = match frame {
            Ok(Frame::Text(t)) => t,
            Ok(Frame::Closed) => return Ok(()),
            Ok(Frame::Other) => continue,
            Err(e) => return Err(Stop::Failed(e)),
        };
        match serde_json::from_str::<StreamFrame>(&text) {
            Ok(StreamFrame::CallPending { .. }) => core.calls.wake.notify_one(),
            Ok(StreamFrame::CancelRequested { run_id, call_id }) => {
                core.cancel_call(&CallKey { run_id, call_id })
            }
            Ok(StreamFrame::Ping) => {}
            Ok(_) | Err(_) => tracing::debug!("ignoring an unknown stream frame"),
        }
    }
}
