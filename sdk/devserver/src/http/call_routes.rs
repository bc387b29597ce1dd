//! Claim and receipts (protocol §5).
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use toolrunner_protocol::wire::{Claim, Claimed, ReceiptAnswer};

use super::auth::{Auth, Scope};
use super::decode::Body;
use super::respond::{Answer, ok};
use super::shared::Shared;
use crate::engine::ReceiptInput;

type S = State<Arc<Shared>>;

pub(crate) async fn claim(
    State(sh): S,
    auth: Auth,
    Path((run_id, call_id)): Path<(String, String)>,
    body: Body,
) -> Answer<Claimed> {
    auth.require(&[Scope::ToolsExecute])?;
    // Judged after the run and call in the path are found.
    let req: Result<Claim, _> = body.json();
    ok(sh
        .apply(|s, now| s.claim(&run_id, &call_id, req, now))
        .await)
}

pub(crate) async fn receipt(
    State(sh): S,
    auth: Auth,
    Path((run_id, call_id)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Answer<ReceiptAnswer> {
    auth.require(&[Scope::ToolsExecute])?;
    let bytes = body.bytes()?;
    let grant = headers
        .get("tool-grant")
        .and_then(|v| v.to_str().ok())
        .map(str::trim);
    let raw = std::str::from_utf8(bytes).unwrap_or_default();
    let input = ReceiptInput {
        grant,
        raw,
        parsed: super::decode::parse(bytes),
    };
    ok(sh
        .apply(|s, now| s.receipt(&run_id, &call_id, input, now))
        .await)
}
