//! Time-driven rules: lease expiry and run expiry. Run before every
//! operation (so a lapsed lease counts at once, swept or not) and on a timer.
use toolrunner_protocol::wire::{CallState, RunStatus};

use super::model::{ExecutorMode, Table};
use super::{Limits, State};

impl State {
    pub(crate) fn sweep(&mut self, now: i64, limits: &Limits) {
        self.expire_leases(now);
        if limits.run_ttl_ms > 0 {
            self.expire_runs(now, i64::try_from(limits.run_ttl_ms).unwrap_or(i64::MAX));
        }
    }

    fn expire_leases(&mut self, now: i64) {
        let lapsed: Vec<String> = self
            .executors
            .values()
            .filter(|e| matches!(e.mode, ExecutorMode::Active | ExecutorMode::Draining))
            .filter(|e| e.lease_expires_ms <= now)
            .map(|e| e.executor_id.clone())
            .collect();
        for id in lapsed {
            let exec = self.executors.get_mut(&id).expect("listed above");
            exec.mode = ExecutorMode::Expired;
            let conn = exec.connection_id.clone();
            if let Some(c) = self.connections.get_mut(&conn) {
                c.ended = true;
            }
            self.touch(Table::Connections, &conn);
            self.touch(Table::Executors, &id);
            self.release_all_claims(&id, now);
        }
    }

    fn expire_runs(&mut self, now: i64, ttl: i64) {
        let stale: Vec<String> = self
            .runs
            .values()
            .filter(|r| {
                r.status == RunStatus::Active && now.saturating_sub(r.last_change_ms) >= ttl
            })
            .filter(|r| {
                !r.call_ids
                    .iter()
                    .any(|id| self.delivery_pending_live(id, now))
            })
            .map(|r| r.run_id.clone())
            .collect();
        for id in stale {
            self.end_run(&id, RunStatus::Expired, now);
        }
    }

    /// A bound call flagged `pending_delivery` by an executor whose lease holds.
    fn delivery_pending_live(&self, call_id: &str, now: i64) -> bool {
        let call = &self.calls[call_id];
        call.pending_delivery
            && call.state != CallState::Pending
            && call
                .executor_id
                .as_ref()
                .and_then(|e| self.executors.get(e))
                .is_some_and(|e| {
                    matches!(e.mode, ExecutorMode::Active | ExecutorMode::Draining)
                        && e.lease_expires_ms > now
                })
    }
}
