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
    waiting: Mutex<HashMap<(String, String), VecDeque<CallKey>>>,
    woken: Mutex<HashSet<CallKey>>,
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
        let next = super::lock(&self.slots.waiting)
            .get_mut(&self.at)
            .and_then(VecDeque::pop_front);
        if let Some(call) = next {
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

    /// `call` waits for a slot of `key` of `tool` (once).
    pub(super) fn wait(&self, tool: &str, key: &str, call: &CallKey) {
        let mut waiting = super::lock(&self.waiting);
        let queue = waiting
            .entry((tool.to_owned(), key.to_owned()))
            .or_default();
        if !queue.contains(call) {
            queue.push_back(call.clone());
        }
    }

    /// `call` took a slot of its key: it waits no more.
    pub(super) fn waited(&self, call: &CallKey) {
        let mut waiting = super::lock(&self.waiting);
        for queue in waiting.values_mut() {
            queue.retain(|c| c != call);
        }
        waiting.retain(|_, q| !q.is_empty());
        super::lock(&self.woken).remove(call);
    }

    /// Whether `call` was woken (taken out: it is claimed again now).
    pub(super) fn take_woken(&self, call: &CallKey) -> bool {
        super::lock(&self.woken).remove(call)
    }

    /// Forgets the waits of calls no longer in `keep`.
    pub(super) fn retain(&self, keep: impl Fn(&CallKey) -> bool) {
        let mut waiting = super::lock(&self.waiting);
        for queue in waiting.values_mut() {
            queue.retain(&keep);
        }
        waiting.retain(|_, q| !q.is_empty());
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
