//! The waiting queue: requests ordered by a static key, smallest first.
//!
//! Aging without re-sorting: with effective priority `p - w / A` (w = steps
//! waited since arrival at step s, A = aging interval), comparing two requests at
//! any common time `now` compares `p - (now - s) / A`, i.e. `p * A + s` up to the
//! shared term `now / A`. So the order never changes while they wait and a
//! BTreeMap keyed by `(p * A + s, arrival_seq)` is exact. A preempted request
//! keeps its key, so it re-enters ahead of everything that arrived after it with
//! the same priority (the front of its queue).

use std::collections::BTreeMap;

#[derive(Debug, Default)]
pub(crate) struct WaitingQueue {
    map: BTreeMap<(i128, u64), u32>,
}

impl WaitingQueue {
    pub fn insert(&mut self, key: (i128, u64), req: u32) {
        let old = self.map.insert(key, req);
        debug_assert!(old.is_none(), "waiting keys are unique (arrival_seq)");
    }
    pub fn remove(&mut self, key: &(i128, u64)) -> Option<u32> {
        self.map.remove(key)
    }
    pub fn first(&self) -> Option<u32> {
        self.map.first_key_value().map(|(_, &r)| r)
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    /// Requests in scheduling order (tests, debugging).
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.map.values().copied()
    }
}

/// The ordering key of a request (see the module doc).
pub(crate) fn order_key(priority: i32, arrival_step: u64, arrival_seq: u64, aging_interval_steps: u32) -> (i128, u64) {
    let primary = if aging_interval_steps == 0 {
        priority as i128
    } else {
        priority as i128 * aging_interval_steps as i128 + arrival_step as i128
    };
    (primary, arrival_seq)
}
