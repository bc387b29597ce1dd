//! The runner's side of the handler API's [`CallHost`]: what a
//! [`CallContext`](crate::CallContext) asks of the executor running its
//! call.

use std::sync::Arc;

use crate::api::context::{CallHost, CallKey, CommitPointError, ProgressError};
use crate::store::{StoreError, StoreTransaction};

use super::Core;

#[async_trait::async_trait]
impl CallHost for Arc<Core> {
    async fn progress(
        &self,
        key: &CallKey,
        assignment_id: &str,
        message: &str,
        fraction: Option<f64>,
        data: serde_json::Value,
    ) -> Result<(), ProgressError> {
        super::progress::progress(self, key, assignment_id, message, fraction, data).await
    }

    fn crashes_at(&self, point: &str) -> bool {
        self.crash_point(point).is_err()
    }

    fn lease_live(&self) -> bool {
        self.lease.live()
    }

    async fn lease_check(&self) -> Result<(), CommitPointError> {
        super::connection::lease_check(self).await
    }

    fn fencing_token(&self) -> Option<u64> {
        self.lease.fencing_token()
    }

    async fn begin(&self) -> Result<StoreTransaction, StoreError> {
        self.store.begin().await
    }

    fn sqlite_transaction_timeout(&self) -> std::time::Duration {
        self.cfg.timing.sqlite_transaction_timeout
    }
}

/// The context of a call that `core` runs.
pub(crate) fn context_of(
    core: &Arc<Core>,
    call: &crate::store::LocalCall,
    asg: &toolrunner_protocol::wire::Assignment,
    cancel: tokio_util::sync::CancellationToken,
) -> crate::CallContext {
    let transactional = core
        .tools
        .get(&call.tool_name)
        .is_some_and(|t| t.effect() == crate::Effect::Transactional);
    crate::CallContext::new(Arc::new(core.clone()), transactional, call, asg, cancel)
}
