//! The one eviction order (see `hybridserve_core::scheduler::checkpoints`),
//! recomputed by brute force: for every eviction the scheduler made, the
//! candidates it saw (parked blocks, live checkpoints with their chains) are
//! scored here from scratch (each block's dependents found by walking every
//! chain, not from the prefix cache's counters), and the victim must be the
//! smallest. Plus the
//! transactional rule: a step that planned nothing evicted nothing.

use super::oracle::Harness;
use hybridserve_core::scheduler::{EvictionRecord, SchedulerOutput, Victim};
use std::collections::HashMap;

/// (score, kind, recency, id) of each allowed candidate, from the snapshot alone.
fn model_candidates(r: &EvictionRecord) -> Vec<((f64, u8, u64, u64), Victim)> {
    let pps = r.pages_per_state.max(1) as f64;
    let value = |t: usize| t as f64 / pps;
    let mut out = Vec::new();
    // Which live checkpoints each parked entry's eviction would drop.
    let parked: HashMap<(u32, u64), u64> = r.parked.iter().map(|&(b, g, stamp)| ((b, g), stamp)).collect();
    let mut dependents: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, c) in r.checkpoints.iter().enumerate() {
        for &(b, g) in &c.chain {
            if parked.contains_key(&(b, g)) {
                dependents.entry(b).or_default().push(i);
            }
        }
    }
    // Chain-ending parked blocks (the last entry of some live checkpoint's chain).
    let ends: std::collections::HashSet<(u32, u64)> = r.checkpoints.iter().filter_map(|c| c.chain.last().copied()).collect();
    for &(b, g, stamp) in &r.parked {
        let deps = dependents.get(&b).cloned().unwrap_or_default();
        if deps.is_empty() {
            out.push(((0.0, 0, stamp, b as u64), Victim::Block(b)));
            continue;
        }
        if !ends.contains(&(b, g)) {
            continue;
        }
        let lost: usize = deps.iter().map(|&i| r.checkpoints[i].tokens).sum();
        if r.limit.is_finite() && (deps.len() != 1 || value(r.checkpoints[deps[0]].tokens) > r.limit) {
            continue;
        }
        out.push(((lost as f64 / (1.0 + pps * deps.len() as f64), 0, stamp, b as u64), Victim::Block(b)));
    }
    for c in r.checkpoints.iter().filter(|c| c.busy_step < r.guard) {
        if value(c.tokens) <= r.limit {
            out.push(((value(c.tokens), 1, c.last_used, c.seq_no), Victim::Checkpoint(c.key)));
        }
    }
    // Nothing allowed, and no value cap: the least recently parked block (every parked
    // block is counted available, so one must be reachable).
    if out.is_empty() && r.limit.is_infinite() {
        if let Some(&(b, _, stamp)) = r.parked.iter().min_by_key(|p| p.2) {
            out.push(((0.0, 0, stamp, b as u64), Victim::Block(b)));
        }
    }
    out
}

impl Harness {
    pub(crate) fn check_evictions(&mut self, out: &SchedulerOutput) {
        let log = self.s.take_eviction_log();
        if out.num_seqs() == 0 {
            assert!(log.is_empty(), "a step that planned nothing evicted {} things", log.len());
        }
        for r in &log {
            let cands = model_candidates(r);
            let best = cands
                .iter()
                .min_by(|a, b| {
                    a.0 .0.total_cmp(&b.0 .0).then(a.0 .1.cmp(&b.0 .1)).then(a.0 .2.cmp(&b.0 .2)).then(a.0 .3.cmp(&b.0 .3))
                })
                .expect("an eviction with no candidate");
            assert_eq!(r.victim, best.1, "evicted {:?}, the order says {:?} (candidates {cands:?})", r.victim, best.1);
            self.evictions_checked += 1;
        }
    }
}
