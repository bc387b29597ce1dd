//! The executor's WebSocket stream: live `call.pending` and
//! `call.cancel_requested` frames plus `ping`s. It never replays.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use tokio::sync::{broadcast, watch};
use toolrunner_protocol::wire::StreamFrame;

use crate::engine::Notice;
use crate::http::auth::{Auth, Scope};
use crate::http::query;
use crate::http::respond::Failure;
use crate::http::shared::Shared;

/// `GET /v1/executors/{executor_id}/stream?connection_id=`.
pub(crate) async fn stream(
    State(sh): State<Arc<Shared>>,
    auth: Auth,
    Path(executor_id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    ws: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> Result<Response, Failure> {
    auth.require(&[Scope::ExecutorsConnect])?;
    query::only(&q, &["connection_id"])?;
    let connection_id = query::required(&q, "connection_id")?.to_owned();
    sh.apply(|s, _| s.live_connection(&executor_id, &connection_id).map(|_| ()))
        .await?;
    let Ok(ws) = ws else {
        return Err(toolrunner_protocol::ApiError::invalid(
            "websocket_required",
            "this endpoint speaks WebSocket: send an Upgrade request",
        )
        .into());
    };
    let notices = sh.notices.subscribe();
    let shutdown = sh.shutdown.subscribe();
    Ok(ws
        .on_upgrade(move |socket| serve(socket, sh, executor_id, connection_id, notices, shutdown))
        .into_response())
}

async fn serve(
    mut socket: WebSocket,
    sh: Arc<Shared>,
    executor_id: String,
    connection_id: String,
    mut notices: broadcast::Receiver<Notice>,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut ping = tokio::time::interval(Duration::from_millis(
        sh.limits.heartbeat_interval_ms.max(100),
    ));
    loop {
        let frame = tokio::select! {
            _ = shutdown.changed() => break,
            _ = ping.tick() => {
                let live = sh.apply(|s, _| s.live_connection(&executor_id, &connection_id).map(|_| ())).await;
                if live.is_err() {
                    break;
                }
                Some(StreamFrame::Ping)
            }
            notice = notices.recv() => match notice {
                Ok(n) => match relevant(&sh, &executor_id, &connection_id, n).await {
                    Relevance::Send(frame) => Some(frame),
                    Relevance::Skip => None,
                    Relevance::Close => break,
                },
                Err(broadcast::error::RecvError::Lagged(_)) => None,
                Err(broadcast::error::RecvError::Closed) => break,
            },
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => break,
                Some(Ok(_)) => None,
            },
        };
        let Some(frame) = frame else { continue };
        let text = serde_json::to_string(&frame).unwrap_or_default();
        if socket.send(Message::Text(text.into())).await.is_err() {
            break;
        }
    }
    let _ = socket.send(Message::Close(None)).await;
}

/// What to do with a notice.
enum Relevance {
    Send(StreamFrame),
    Skip,
    /// The stream's connection is no longer live.
    Close,
}

/// The frame for this stream, if the notice concerns its executor and the
/// stream's connection is still the live one.
async fn relevant(
    sh: &Shared,
    executor_id: &str,
    connection_id: &str,
    notice: Notice,
) -> Relevance {
    let engine = sh.engine.lock().await;
    let Ok(exec) = engine.state.live_connection(executor_id, connection_id) else {
        return Relevance::Close;
    };
    let wanted = match &notice {
        Notice::Cancel {
            executor_id: to, ..
        } => to == executor_id,
        Notice::Pending { binding_id, frame } => match frame {
            StreamFrame::CallPending { tool_name, .. } => {
                exec.binding_id == *binding_id && exec.tools.contains(tool_name)
            }
            _ => false,
        },
    };
    match notice {
        Notice::Cancel { frame, .. } | Notice::Pending { frame, .. } if wanted => {
            Relevance::Send(frame)
        }
        _ => Relevance::Skip,
    }
}
