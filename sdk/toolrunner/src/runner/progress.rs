//! Progress receipts: stored, then sent (a handler's
//! `CallContext::progress`, through the runner's `CallHost`).
use std::sync::Arc;

use serde_json::{Value, json};

use super::{CallKey, Core, outbox};
use crate::api::context::ProgressError;
use crate::lifecycle::{Advanced, Event, Reads};
use crate::store::LocalState;

/// Stores, then sends, a progress receipt (`CallContext::progress`).
pub(crate) async fn progress(
    core: &Arc<Core>,
    key: &CallKey,
    assignment_id: &str,
    message: &str,
    fraction: Option<f64>,
    data: Value,
) -> Result<(), ProgressError> {
    let event = Event::ProgressSaved {
        progress: json!({"message": message, "fraction": fraction, "data": data}),
    };
    let moved = core
        .advance(key, Reads::Row, |s| {
            s.call
                .as_ref()
                .filter(|c| {
                    matches!(
                        c.state,
                        LocalState::Running | LocalState::ReconciliationRequired
                    ) && c
                        .assignment
                        .as_ref()
                        .is_some_and(|a| a.assignment_id == assignment_id)
                })
                .map(|_| event.clone())
        })
        .await
        .map_err(|e| ProgressError::Store(e.into()))?;
    match moved {
        Advanced::Moved {
            receipt: Some(r), ..
        } => {
            outbox::deliver_one(core, &r, None).await;
            Ok(())
        }
        Advanced::Moved { .. } => Err(ProgressError::Store(crate::Error::new(
            crate::error::Kind::Store,
            "the store answered without the progress receipt it was to write",
        ))),
        Advanced::Stayed(now) => Err(ProgressError::NotRunning {
            state: now.map(|c| c.state),
        }),
    }
}
