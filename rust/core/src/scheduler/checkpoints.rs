//! DeltaNet state checkpoints: the half of prefix caching that lets a hit on
//! the hybrid model skip compute instead of only skipping KV writes.
//!
//! # What a checkpoint is
//! A copy of one sequence's DeltaNet state (conv + recurrent, every DeltaNet
//! layer) after exactly the first `tokens` tokens, `tokens` a multiple of the
//! block size, held in a slot of the state pool (`SlotUse::Checkpoint`). It is
//! keyed by the prefix cache's entry for the block that ends at that boundary
//! (its generation: unique, never reused, and a verified prefix-cache hit on
//! that entry proves the whole prefix equal, see [`crate::prefix_cache`]). So a
//! checkpoint is found only through a KV match that reaches its boundary, and
//! holds exactly the state of the matched tokens.
//!
//! # Where they are written (scheduler side)
//! * At the end of a prompt's last full block that leaves one token to compute
//!   (`((prompt_len - 1) / block_size) * block_size`): a repeat of the prompt,
//!   or the next turn of a chat that extends it, resumes there. (A prefix-cache
//!   match never covers the last prompt token, because its logits are needed;
//!   a checkpoint at the prompt's very end could never be used.)
//! * At the branch point: when a new request's KV match is longer than its
//!   state match (by at least 4 blocks: shorter gains, such as a chat's
//!   previous answer cached past its prompt checkpoint, are not worth the extra
//!   chunk boundary), at the end of the KV match, so the third and later
//!   requests sharing that prefix skip it.
//! * Optionally every `prefix_checkpoint_interval` tokens of a prompt (off by
//!   default): long shared documents then resume at the last interval boundary
//!   even when nobody branched there yet. Memory: the state pool is fixed, so
//!   the cost is cache capacity, not bytes: a prompt of L tokens takes up to
//!   L / interval slots (each `bytes_per_state_slot`, e.g. 146.8 MiB for the
//!   Qwen3.5-27B shape) away from other checkpoints until evicted, plus one
//!   slot copy and one chunk boundary per interval.
//!
//! The scheduler ends a prefill chunk exactly at such a boundary; `update()`
//! then registers the checkpoint and the NEXT plan carries the copy
//! `(sequence slot, checkpoint slot)` in `state_copies`, performed before that
//! plan's forward advances the sequence. Cost: a prompt that needs a boundary
//! takes one extra step for the tokens after it (sub-block tokens of the
//! prompt end; the rest of the prompt after a branch point), and the copy of
//! one state slot.
//!
//! # Hits
//! At admission the scheduler takes the longest KV match, then the longest
//! prefix of it that ends at a checkpoint; the sequence gets its own slot, the
//! plan copies the checkpoint into it, and prefill starts there
//! (`num_computed_tokens` = hit length, so the runner continues from the
//! slot). KV-matched tokens past the checkpoint are fed again (their KV is not
//! rewritten: slot -1) to rebuild the state; they are counted as "lost for want
//! of a checkpoint".
//!
//! # Copy ordering contract (runner side)
//! The runner performs all of a plan's state copies as one gather then one
//! scatter: every source is read before any destination is written. The
//! scheduler relies on it and never emits a pair whose source is a destination
//! of the same plan: a hit on a checkpoint whose write copy is in the same
//! plan reads from the write's source (the sequence slot, which holds the same
//! state until the forward). A slot that a copy of the current plan writes or
//! reads is "busy" and is neither evicted nor freed until that plan ran.
//!
//! # Memory and eviction
//! Checkpoints are reclaimable: admission counts their slots as available and
//! evicts them when a sequence needs a slot; a new checkpoint may evict an
//! older one when no slot is free. Cached KV blocks stay in the prefix cache's
//! LRU (tail of a chain parked first, so chains are evicted from their ends).
//! A checkpoint pins nothing, but it is dropped the moment any KV entry of its
//! chain is evicted (unreachable and unverifiable from then on); conversely a
//! dropped checkpoint leaves its blocks to the LRU, where they still serve KV
//! hits and mark branch points.
//!
//! Eviction order (the contract): among non-busy checkpoints, evict the one
//! with the lowest `value / max_value + recency`, where
//! `value = tokens / (slot_cost_blocks + tokens / block_size)` is the prefill
//! compute a hit skips per byte it holds (tokens skipped over the slot's bytes
//! plus its blocks', in units of one KV block's bytes; per-token cost taken as
//! constant), `max_value` the largest among the candidates, and `recency =
//! 1 - age / (max_age + 1)` with `age` the steps since the checkpoint was
//! written or last hit. Ties: the least recently used, then the oldest entry.
//! This is Marconi's mix of FLOP efficiency and recency (Pan et al., MLSys
//! 2025) with equal weights. O(checkpoints) per eviction; checkpoints are at
//! most the slot count.

use crate::block_table::ChainLink;
use crate::{BlockId, KvCacheManager, SlotId, StatePool};
use std::collections::HashMap;

#[derive(Debug)]
struct Checkpoint {
    slot: SlotId,
    tokens: usize,
    /// The prefix-cache entries of its chain, `(block, generation)`.
    chain: Vec<(BlockId, u64)>,
    last_used: u64,
    /// The last step whose plan copies into or out of `slot`.
    busy_step: u64,
    /// The step whose plan carries the write copy, and its source slot.
    write_step: u64,
    write_src: SlotId,
    seq_no: u64,
}

/// Cumulative counters and the gauge of checkpoint slots.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CheckpointStats {
    /// Admissions (and readmissions) that looked for a checkpoint.
    pub queries: u64,
    /// ... and found one.
    pub hits: u64,
    /// Prompt tokens not computed thanks to a hit.
    pub skipped_tokens: u64,
    /// KV-matched tokens recomputed because no checkpoint ended there.
    pub lost_tokens: u64,
    pub writes: u64,
    /// Writes not done: no free slot and nothing evictable.
    pub writes_skipped: u64,
    /// Evicted to make room (for a sequence or a newer checkpoint).
    pub evictions: u64,
    /// Dropped because a KV entry of the chain was evicted.
    pub drops: u64,
    /// Checkpoint slots held now (live ones and dropped ones whose copy is
    /// still in flight).
    pub slots: u32,
}

pub(crate) struct Checkpoints {
    by_gen: HashMap<u64, Checkpoint>,
    /// Write copies for the next plan.
    pending: Vec<(SlotId, SlotId)>,
    /// Slots of dropped checkpoints still busy: `(slot, busy_step)`.
    deferred_free: Vec<(SlotId, u64)>,
    scratch: Vec<u64>,
    block_size: usize,
    slot_cost_blocks: f64,
    next_seq_no: u64,
    pub(crate) stats: CheckpointStats,
}

impl Checkpoints {
    pub(crate) fn new(block_size: u32, slot_cost_blocks: f64) -> Self {
        Checkpoints {
            by_gen: HashMap::new(),
            pending: Vec::new(),
            deferred_free: Vec::new(),
            scratch: Vec::new(),
            block_size: block_size as usize,
            slot_cost_blocks: slot_cost_blocks.max(0.0),
            next_seq_no: 0,
            stats: CheckpointStats::default(),
        }
    }

    /// Slots that eviction could hand out now (`guard`: the first step whose
    /// plan has not run yet).
    pub(crate) fn num_evictable(&self, guard: u64) -> u32 {
        self.by_gen.values().filter(|c| c.busy_step < guard).count() as u32
    }

    /// The longest checkpoint ending inside `chain[..max_blocks]`: `(tokens,
    /// slot to copy from in the plan of step `step`, its key)`. Marks it used
    /// and busy.
    pub(crate) fn lookup(&mut self, chain: &[ChainLink], max_blocks: usize, step: u64) -> Option<(usize, SlotId, u64)> {
        if self.by_gen.is_empty() {
            return None;
        }
        for i in (0..max_blocks.min(chain.len())).rev() {
            if let Some(c) = self.by_gen.get_mut(&chain[i].generation) {
                c.last_used = step;
                c.busy_step = c.busy_step.max(step);
                let src = if c.write_step == step { c.write_src } else { c.slot };
                return Some((c.tokens, src, chain[i].generation));
            }
        }
        None
    }

    /// Registers a checkpoint of `seq_slot` after the blocks of `chain` (all of
    /// them), to be copied in the plan of step `plan_step`. A checkpoint already
    /// at that entry is only refreshed. `guard` as in `num_evictable`.
    pub(crate) fn write(
        &mut self,
        kv: &mut KvCacheManager,
        pool: &mut StatePool,
        chain: &[ChainLink],
        seq_slot: SlotId,
        plan_step: u64,
        guard: u64,
    ) {
        let Some(last) = chain.last() else { return };
        if let Some(c) = self.by_gen.get_mut(&last.generation) {
            c.last_used = plan_step;
            return;
        }
        let Some(refs) = kv.ref_checkpoint_chain(chain) else { return };
        if pool.num_free() == 0 && !self.evict_one(kv, pool, guard) {
            kv.unref_checkpoint_chain(&refs);
            self.stats.writes_skipped += 1;
            return;
        }
        let slot = pool.allocate_checkpoint(last.hash).expect("a slot was freed or free");
        self.by_gen.insert(
            last.generation,
            Checkpoint {
                slot,
                tokens: chain.len() * self.block_size,
                chain: refs,
                last_used: plan_step,
                busy_step: plan_step,
                write_step: plan_step,
                write_src: seq_slot,
                seq_no: self.next_seq_no,
            },
        );
        self.next_seq_no += 1;
        self.pending.push((seq_slot, slot));
        self.stats.writes += 1;
    }

    /// Removes checkpoint `key` and hands its slot to a sequence resuming
    /// from it (when the pool has no other slot for that sequence). Safe even
    /// when copies of this plan read or write the slot: they all run before
    /// the forward that advances the sequence.
    pub(crate) fn adopt(&mut self, kv: &mut KvCacheManager, pool: &mut StatePool, key: u64) -> Option<SlotId> {
        let c = self.by_gen.remove(&key)?;
        kv.unref_checkpoint_chain(&c.chain);
        pool.checkpoint_to_sequence(c.slot).expect("checkpoint slot");
        Some(c.slot)
    }

    /// Appends the pending write copies (flattened pairs) to a plan.
    pub(crate) fn emit_writes(&mut self, state_copies: &mut Vec<i32>) {
        for (s, d) in self.pending.drain(..) {
            state_copies.push(s as i32);
            state_copies.push(d as i32);
        }
    }

    /// Evicts the lowest-scored non-busy checkpoint (see the module docs);
    /// false if none can go.
    pub(crate) fn evict_one(&mut self, kv: &mut KvCacheManager, pool: &mut StatePool, guard: u64) -> bool {
        let bs = self.block_size as f64;
        let value = |c: &Checkpoint| c.tokens as f64 / (self.slot_cost_blocks + c.tokens as f64 / bs);
        let mut max_value = 0f64;
        let mut oldest = u64::MAX;
        let mut newest = 0u64;
        for c in self.by_gen.values().filter(|c| c.busy_step < guard) {
            max_value = max_value.max(value(c));
            oldest = oldest.min(c.last_used);
            newest = newest.max(c.last_used);
        }
        if oldest == u64::MAX {
            return false;
        }
        let max_age = (newest - oldest) as f64;
        let score = |c: &Checkpoint| value(c) / max_value + 1.0 - (newest - c.last_used) as f64 / (max_age + 1.0);
        let victim = self
            .by_gen
            .iter()
            .filter(|(_, c)| c.busy_step < guard)
            .min_by(|(_, a), (_, b)| {
                score(a)
                    .total_cmp(&score(b))
                    .then(a.last_used.cmp(&b.last_used))
                    .then(a.seq_no.cmp(&b.seq_no))
            })
            .map(|(&g, _)| g)
            .expect("a candidate exists");
        let c = self.by_gen.remove(&victim).expect("victim present");
        kv.unref_checkpoint_chain(&c.chain);
        pool.free(c.slot).expect("checkpoint slot held");
        self.stats.evictions += 1;
        true
    }

    /// Drops the checkpoints whose chain lost an entry (KV evicted) and frees
    /// the slots of dropped ones that are no longer busy. O(checkpoints x chain)
    /// only when an entry with checkpoints was evicted, else O(deferred).
    pub(crate) fn reconcile(&mut self, kv: &mut KvCacheManager, pool: &mut StatePool, guard: u64) {
        if kv.has_dropped_generations() {
            self.scratch.clear();
            kv.take_dropped_generations(&mut self.scratch);
            let dropped = &self.scratch;
            let gone: Vec<u64> = self
                .by_gen
                .iter()
                .filter(|(_, c)| c.chain.iter().any(|(_, g)| dropped.contains(g)))
                .map(|(&g, _)| g)
                .collect();
            for g in gone {
                let c = self.by_gen.remove(&g).expect("present");
                kv.unref_checkpoint_chain(&c.chain);
                self.stats.drops += 1;
                if c.busy_step < guard {
                    pool.free(c.slot).expect("checkpoint slot held");
                } else {
                    self.deferred_free.push((c.slot, c.busy_step));
                }
            }
        }
        if !self.deferred_free.is_empty() {
            self.deferred_free.retain(|&(slot, busy)| {
                if busy < guard {
                    pool.free(slot).expect("deferred checkpoint slot held");
                    false
                } else {
                    true
                }
            });
        }
    }

    pub(crate) fn stats(&self) -> CheckpointStats {
        CheckpointStats { slots: (self.by_gen.len() + self.deferred_free.len()) as u32, ..self.stats }
    }

    /// `(slot, tokens, last block of the chain)` of every live checkpoint
    /// (tests and debugging).
    pub(crate) fn list(&self) -> Vec<(SlotId, usize, BlockId)> {
        let mut v: Vec<_> = self
            .by_gen
            .values()
            .map(|c| (c.slot, c.tokens, c.chain.last().map_or(0, |&(b, _)| b)))
            .collect();
        v.sort_unstable();
        v
    }
}
