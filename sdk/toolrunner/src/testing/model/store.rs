//! The store as the runner relies on it: a plan's changes commit together
//! or not at all, a row changes only by compare-and-set on its version,
//! receipt ids are unique, and what was committed survives a crash (what
//! was not is lost with the process). Identities that share a database
//! are fenced: a process holds its identity with a token, and a commit
//! under an older token than the identity's current one is refused.

use std::collections::BTreeMap;

use crate::store::{Change, LocalCall, OutboxReceipt, ReceiptStatus};

/// Why a commit was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The identity moved on to a newer token.
    Fenced,
    /// A row's version moved on, a row existed, or a receipt id was taken.
    Conflict,
}

/// One database.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct StoreModel {
    pub(crate) calls: BTreeMap<String, LocalCall>,
    pub(crate) receipts: BTreeMap<String, Vec<OutboxReceipt>>,
    /// identity → the token of the process that holds it now.
    pub(crate) holders: BTreeMap<String, u32>,
}

impl StoreModel {
    /// Takes `identity` over: the next token, which fences every older one.
    pub(crate) fn take(&mut self, identity: &str) -> u32 {
        let t = self.holders.entry(identity.to_owned()).or_insert(0);
        *t += 1;
        *t
    }

    /// Whether `token` still holds `identity`.
    pub(crate) fn holds(&self, identity: &str, token: u32) -> bool {
        self.holders.get(identity) == Some(&token)
    }

    /// The call's receipts.
    pub(crate) fn receipts_of(&self, call_id: &str) -> &[OutboxReceipt] {
        self.receipts.get(call_id).map_or(&[], Vec::as_slice)
    }

    /// Commits `changes` all together, or nothing.
    pub(crate) fn commit(
        &mut self,
        identity: &str,
        token: u32,
        changes: &[Change],
    ) -> Result<(), Refused> {
        if !self.holds(identity, token) {
            return Err(Refused::Fenced);
        }
        let mut next = self.clone();
        for change in changes {
            next.apply(change)?;
        }
        *self = next;
        Ok(())
    }

    fn apply(&mut self, change: &Change) -> Result<(), Refused> {
        match change {
            Change::InsertCall(c) => {
                if self.calls.contains_key(&c.call_id) {
                    return Err(Refused::Conflict);
                }
                self.calls.insert(c.call_id.clone(), c.clone());
            }
            Change::UpdateCall {
                expect_version,
                call,
            } => match self.calls.get_mut(&call.call_id) {
                Some(c) if c.version == *expect_version => *c = call.clone(),
                _ => return Err(Refused::Conflict),
            },
            Change::AddReceipt(r) => {
                let all = self.receipts.entry(r.call_id.clone()).or_default();
                if all.iter().any(|x| x.receipt_id == r.receipt_id) {
                    return Err(Refused::Conflict);
                }
                all.push(r.clone());
            }
            Change::ReceiptStatus {
                receipt_id, status, ..
            } => {
                for r in self.receipts.values_mut().flatten() {
                    if r.receipt_id == *receipt_id && r.status == ReceiptStatus::Pending {
                        r.status = *status;
                    }
                }
            }
            Change::SettlePending {
                call_id,
                keep,
                only_kind,
                status,
                ..
            } => {
                for r in self.receipts.entry(call_id.clone()).or_default() {
                    let kept = keep.as_deref() == Some(r.assignment_id.as_str());
                    let kind = only_kind.is_none_or(|k| k == r.kind);
                    if r.status == ReceiptStatus::Pending && !kept && kind {
                        r.status = *status;
                    }
                }
            }
            // Attempts, the timeline and housekeeping decide nothing here.
            _ => {}
        }
        Ok(())
    }
}
