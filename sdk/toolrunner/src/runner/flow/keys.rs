//! Per-key concurrency in this process: how many calls with one
//! concurrency key of a tool are held now, and the calls given back for a
//! key at its limit, woken one by one as the key's slots come back.
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use super::CallKey;

/// Every tool's keys with calls held, and how many; the calls waiting for
/// a key, oldest first; the calls woken (a slot of their key came back).
#[derive(Debug, Default)]
pub(super) struct KeySlots {
    held: Mutex<HashMap<(String, String), u32>>,
    waiting: Mutex<Waiting>,
    woken: Mutex<HashSet<CallKey>>,
}

/// The calls waiting for a key: by key, oldest first, and the key each
/// waits for.
#[derive(Debug, Default)]
struct Waiting {
    queues: HashMap<(String, String), VecDeque<CallKey>>,
    of: HashMap<CallKey, (String, String)>,
}

impl Waiting {
    /// `call` waits no more (its one queue, found by the index).
    fn remove(&mut self, call: &CallKey) {
        let Some(at) = self.of.remove(call) else {
            return;
        };
        if let Some(queue) = self.queues.get_mut(&at) {
            queue.retain(|c| c != call);
            if queue.is_empty() {
                self.queues.remove(&at);
            }
        }
    }

    /// Keeps the waits of the calls `keep` keeps.
    fn retain(&mut self, keep: impl Fn(&CallKey) -> bool) {
        for queue in self.queues.values_mut() {
            queue.retain(&keep);
        }
        self.queues.retain(|_, q| !q.is_empty());
        self.of.retain(|c, _| keep(c));
    }
}

/// Wakes the oldest call waiting for a key when dropped (a call of the
/// key is done with its slot, wherever it was held).
#[derive(Debug)]
pub(super) struct KeyWake {
    slots: Arc<KeySlots>,
    at: (String, String),
}

impl Drop for KeyWake {
    fn drop(&mut self) {
        let mut waiting = super::lock(&self.slots.waiting);
        let next = waiting
            .queues
            .get_mut(&self.at)
            .and_then(VecDeque::pop_front);
        if let Some(call) = next {
            waiting.of.remove(&call);
            super::lock(&self.slots.woken).insert(call);
        }
    }
}

/// One call's slot of its key, given back when dropped.
#[derive(Debug)]
pub(super) struct KeySlot {
    slots: Arc<KeySlots>,
    at: (String, String),
}

/// A concurrency key as it is held and logged: the first 32 hex digits
/// of the SHA-256 of its canonical JSON, never the key itself (a merchant
/// id, an email: the arguments' data stays out of logs, metrics and the
/// shared store, and any byte of it is fine).
pub(crate) fn key_digest(key: &str) -> String {
    let digest =
        toolrunner_protocol::json::arguments_digest(&serde_json::Value::String(key.to_owned()));
    let hex = digest.strip_prefix("sha256:").unwrap_or(&digest);
    hex.chars().take(32).collect()
}

impl KeySlots {
    /// A slot of `key` of `tool`, only below `limit`.
    pub(super) fn take(self: &Arc<Self>, tool: &str, key: &str, limit: u32) -> Option<KeySlot> {
        let at = (tool.to_owned(), key.to_owned());
        let mut held = super::lock(&self.held);
        let n = held.entry(at.clone()).or_default();
        if *n >= limit {
            return None;
        }
        *n += 1;
        Some(KeySlot {
            slots: self.clone(),
            at,
        })
    }

    /// A waker for a call that holds a slot of `key` of `tool`.
    pub(super) fn wake_on_drop(self: &Arc<Self>, tool: &str, key: &str) -> KeyWake {
        KeyWake {
            slots: self.clone(),
            at: (tool.to_owned(), key.to_owned()),
        }
    }

    /// `call` waits for a slot of `key` of `tool` (once). A wake it got
    /// before (while its claim was in flight) is spent: the claim found the
    /// key full.
    pub(super) fn wait(&self, tool: &str, key: &str, call: &CallKey) {
        let mut waiting = super::lock(&self.waiting);
        super::lock(&self.woken).remove(call);
        let at = (tool.to_owned(), key.to_owned());
        if waiting.of.get(call) == Some(&at) {
            return;
        }
        waiting.remove(call);
        waiting
            .queues
            .entry(at.clone())
            .or_default()
            .push_back(call.clone());
        waiting.of.insert(call.clone(), at);
    }

    /// Whether `call` waits for a key whose calls held in this process
    /// are at its limit (`limit`, by tool): claimed now, it would only be
    /// given back. Only this process's holds are counted here (on a store
    /// shared by replicas they are the store's: never full here).
    pub(super) fn waits_for_full(
        &self,
        call: &CallKey,
        limit: impl Fn(&str) -> Option<u32>,
    ) -> bool {
        let waiting = super::lock(&self.waiting);
        let Some(at) = waiting.of.get(call) else {
            return false;
        };
        let Some(limit) = limit(&at.0) else {
            return false;
        };
        super::lock(&self.held).get(at).is_some_and(|n| *n >= limit)
    }

    /// `call` took a slot of its key: it waits no more.
    pub(super) fn waited(&self, call: &CallKey) {
        super::lock(&self.waiting).remove(call);
        super::lock(&self.woken).remove(call);
    }

    /// Whether `call` was woken (taken out: it is claimed again now).
    pub(super) fn take_woken(&self, call: &CallKey) -> bool {
        super::lock(&self.woken).remove(call)
    }

    /// Forgets the waits of calls no longer in `keep`.
    pub(super) fn retain(&self, keep: impl Fn(&CallKey) -> bool) {
        super::lock(&self.waiting).retain(&keep);
        super::lock(&self.woken).retain(|c| keep(c));
    }

    /// The calls of `key` of `tool` held now.
    #[cfg(test)]
    pub(super) fn held(&self, tool: &str, key: &str) -> u32 {
        super::lock(&self.held)
            .get(&(tool.to_owned(), key.to_owned()))
            .copied()
            .unwrap_or(0)
    }
}

impl Drop for KeySlot {
    fn drop(&mut self) {
        let mut held = super::lock(&self.slots.held);
        if let Some(n) = held.get_mut(&self.at) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.remove(&self.at);
            }
        }
    }
}
