//! DeltaNet state checkpoints: the half of prefix caching that lets a hit on
//! the hybrid model skip compute instead of only skipping KV writes.
//!
//! # What a checkpoint is
//! A copy of one sequence's DeltaNet state (conv + recurrent, every DeltaNet
//! layer) after exactly the first `tokens` tokens, `tokens` a multiple of the
//! block size, held in `pages_per_state` arena pages of its own (a
//! [`StateId`]). It is keyed by the prefix cache's entry for the block that
//! ends at that boundary (its generation: unique, never reused, and a verified
//! prefix-cache hit on that entry proves the whole prefix equal, see
//! [`crate::prefix_cache`]). So a checkpoint is found only through a KV match
//! that reaches its boundary, and holds exactly the state of the matched tokens.
//!
//! # Where they are written (scheduler side)
//! * At the end of a prompt's last full block that leaves one token to compute
//!   (`((prompt_len - 1) / block_size) * block_size`): a repeat of the prompt,
//!   or the next turn of a chat that extends it, resumes there. (A prefix-cache
//!   match never covers the last prompt token, because its logits are needed;
//!   a checkpoint at the prompt's very end could never be used.)
//! * At the branch point: when a new request's KV match is longer than its
//!   state match (by at least 4 blocks), at the end of the KV match, so the
//!   third and later requests sharing that prefix skip it.
//! * Optionally every `prefix_checkpoint_interval` tokens of a prompt (off by
//!   default). Each kept checkpoint holds `pages_per_state` pages of the arena
//!   (e.g. 147 MiB at the Qwen3.5-27B shape) until evicted.
//!
//! **No extra step.** The plan asks the forward to write the state as it is
//! after the entry's first `checkpoint_positions[b]` tokens into fresh pages
//! (`checkpoint_pages`), in the middle of the chunk; pages are taken at plan
//! assembly, after every sequence and admission got its room, and only from
//! what is free or reclaimable (a write never preempts anything; with no
//! room it is skipped). `update()` then registers the checkpoint under its
//! block's prefix-cache entry (registered by the same update). A chunk holds
//! at most one checkpoint: only when two boundaries fall in one chunk (a branch
//! point and the prompt end, or the interval option) does the chunk end just
//! before the second one.
//!
//! # Hits
//! At admission the scheduler takes the longest KV match, then the longest
//! prefix of it that ends at a checkpoint; the sequence gets its own state
//! pages, the plan copies the checkpoint's pages into them (`state_copies`,
//! page pairs), and prefill starts there (`num_computed_tokens` = hit length).
//! KV-matched tokens past the checkpoint are fed again (their KV is not
//! rewritten: slot -1) to rebuild the state; they are counted as "lost for
//! want of a checkpoint". When the arena has no pages for the sequence's own
//! state, it takes over (adopts) the checkpoint's pages instead of copying.
//!
//! # Copy ordering contract (runner side)
//! The runner performs all of a plan's page copies as one gather then one
//! scatter. Checkpoint pages are written by the forward only (never a copy
//! destination), and a checkpoint a copy of the current plan reads is "busy":
//! neither evicted nor freed until that plan ran.
//!
//! # Memory and eviction
//! Checkpoints are reclaimable: admission and growth count their pages as
//! available and evict them when the free list and the parked cached blocks
//! (LRU, taken first: a parked block is one page, a checkpoint many) are not
//! enough. A checkpoint pins nothing, but it is dropped the moment any KV
//! entry of its chain is evicted (unreachable and unverifiable from then on).
//!
//! Eviction order (the contract): among non-busy checkpoints, evict the one
//! with the lowest `value / max_value + recency`, where
//! `value = tokens / (state_pages + tokens / block_size)` is the prefill
//! compute a hit skips per page it holds (its state pages plus its blocks),
//! `max_value` the largest among the candidates, and `recency =
//! 1 - age / (max_age + 1)` with `age` the steps since the checkpoint was
//! written or last hit. Ties: the least recently used, then the oldest entry.
//! This is Marconi's mix of FLOP efficiency and recency (Pan et al., MLSys
//! 2025) with equal weights. O(checkpoints) per eviction.

use crate::block_table::ChainLink;
use crate::{BlockId, KvCacheManager, StateId, StatePages};
use std::collections::HashMap;

#[derive(Debug)]
struct Checkpoint {
    state: StateId,
    tokens: usize,
    /// The prefix-cache entries of its chain, `(block, generation)`.
    chain: Vec<(BlockId, u64)>,
    last_used: u64,
    /// The last step whose plan reads or writes its pages.
    busy_step: u64,
    seq_no: u64,
}

/// Returns a state's pages to the arena.
pub(crate) fn free_state(kv: &mut KvCacheManager, states: &mut StatePages, id: StateId) {
    states.remove(id, |p| kv.free_page(p));
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
    /// Writes not done: no free page and nothing evictable.
    pub writes_skipped: u64,
    /// Evicted to make room (for a sequence or a newer checkpoint).
    pub evictions: u64,
    /// Dropped because a KV entry of the chain was evicted.
    pub drops: u64,
    /// Checkpoints holding pages now (live ones and dropped ones whose copy
    /// is still in flight); each holds `pages_per_state` pages.
    pub states: u32,
}

pub(crate) struct Checkpoints {
    by_gen: HashMap<u64, Checkpoint>,
    /// States of dropped checkpoints still busy: `(state, busy_step)`.
    deferred_free: Vec<(StateId, u64)>,
    scratch: Vec<u64>,
    block_size: usize,
    state_cost_blocks: f64,
    next_seq_no: u64,
    /// The latest busy step of any live checkpoint and how many live ones have
    /// it: the guards callers pass are that step or later, so these two give
    /// `num_evictable` in O(1) (the stats and admission read it every step).
    busy_top: u64,
    busy_at_top: u32,
    pub(crate) stats: CheckpointStats,
}

impl Checkpoints {
    pub(crate) fn new(block_size: u32, state_pages: u32) -> Self {
        Checkpoints {
            by_gen: HashMap::new(),
            deferred_free: Vec::new(),
            scratch: Vec::new(),
            block_size: block_size as usize,
            state_cost_blocks: state_pages as f64,
            next_seq_no: 0,
            busy_top: 0,
            busy_at_top: 0,
            stats: CheckpointStats::default(),
        }
    }

    /// Checkpoints that eviction could reclaim now (`guard`: the first step
    /// whose plan has not run yet).
    pub(crate) fn num_evictable(&self, guard: u64) -> u32 {
        match guard.cmp(&self.busy_top) {
            std::cmp::Ordering::Greater => self.by_gen.len() as u32,
            std::cmp::Ordering::Equal => self.by_gen.len() as u32 - self.busy_at_top,
            // No caller looks back past a plan it already made; kept exact anyway.
            std::cmp::Ordering::Less => self.num_evictable_scan(guard),
        }
    }

    /// [`Self::num_evictable`] from scratch, O(checkpoints) (the oracle of the
    /// counters, and the rare backward guard).
    pub(crate) fn num_evictable_scan(&self, guard: u64) -> u32 {
        self.by_gen.values().filter(|c| c.busy_step < guard).count() as u32
    }

    /// Keeps `busy_top`/`busy_at_top` when a live checkpoint's busy step goes
    /// from `old` (None: it is new) to `new`.
    fn note_busy(&mut self, old: Option<u64>, new: u64) {
        if old == Some(self.busy_top) {
            self.busy_at_top -= 1;
        }
        if new > self.busy_top {
            self.busy_top = new;
            self.busy_at_top = 1;
        } else if new == self.busy_top {
            self.busy_at_top += 1;
        }
    }

    /// Keeps the busy counters when a checkpoint leaves `by_gen`.
    fn note_removed(&mut self, c: &Checkpoint) {
        if c.busy_step == self.busy_top {
            self.busy_at_top -= 1;
        }
    }

    /// The longest checkpoint ending inside `chain[..max_blocks]`: `(tokens,
    /// its state, its key)`. Marks it used and busy in the plan of `step`.
    pub(crate) fn lookup(&mut self, chain: &[ChainLink], max_blocks: usize, step: u64) -> Option<(usize, StateId, u64)> {
        if self.by_gen.is_empty() {
            return None;
        }
        for i in (0..max_blocks.min(chain.len())).rev() {
            if let Some(c) = self.by_gen.get_mut(&chain[i].generation) {
                c.last_used = step;
                let old = c.busy_step;
                c.busy_step = old.max(step);
                let (new, found) = (c.busy_step, (c.tokens, c.state, chain[i].generation));
                self.note_busy(Some(old), new);
                return Some(found);
            }
        }
        None
    }

    /// Registers `state` (written by the forward of step `step`) as the
    /// checkpoint after the blocks of `chain` (all of them). When a checkpoint
    /// already sits at that entry (it is only refreshed) or the chain is no
    /// longer cached, frees `state` instead. Returns whether it was kept.
    pub(crate) fn register(
        &mut self,
        kv: &mut KvCacheManager,
        states: &mut StatePages,
        chain: &[ChainLink],
        state: StateId,
        step: u64,
    ) -> bool {
        let refs = match chain.last() {
            Some(last) if !self.by_gen.contains_key(&last.generation) => kv.ref_checkpoint_chain(chain),
            Some(last) => {
                self.by_gen.get_mut(&last.generation).expect("present").last_used = step;
                None
            }
            None => None,
        };
        let Some(refs) = refs else {
            free_state(kv, states, state);
            return false;
        };
        let last = chain.last().expect("non-empty");
        self.by_gen.insert(
            last.generation,
            Checkpoint {
                state,
                tokens: chain.len() * self.block_size,
                chain: refs,
                last_used: step,
                busy_step: step,
                seq_no: self.next_seq_no,
            },
        );
        self.next_seq_no += 1;
        self.note_busy(None, step);
        self.stats.writes += 1;
        true
    }

    /// Removes checkpoint `key` and hands its state to a sequence resuming
    /// from it (when the arena has no other pages for that sequence). Safe
    /// even when this plan reads its pages: every copy runs before the forward
    /// that advances the sequence.
    pub(crate) fn adopt(&mut self, kv: &mut KvCacheManager, key: u64) -> Option<StateId> {
        let c = self.by_gen.remove(&key)?;
        self.note_removed(&c);
        kv.unref_checkpoint_chain(&c.chain);
        Some(c.state)
    }

    /// Evicts the lowest-scored non-busy checkpoint (see the module docs);
    /// false if none can go.
    pub(crate) fn evict_one(&mut self, kv: &mut KvCacheManager, states: &mut StatePages, guard: u64) -> bool {
        let bs = self.block_size as f64;
        let value = |c: &Checkpoint| c.tokens as f64 / (self.state_cost_blocks + c.tokens as f64 / bs);
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
        self.note_removed(&c);
        kv.unref_checkpoint_chain(&c.chain);
        free_state(kv, states, c.state);
        self.stats.evictions += 1;
        true
    }

    /// Drops the checkpoints whose chain lost an entry (KV evicted) and frees
    /// the pages of dropped ones that are no longer busy. O(checkpoints x chain)
    /// only when an entry with checkpoints was evicted, else O(deferred).
    pub(crate) fn reconcile(&mut self, kv: &mut KvCacheManager, states: &mut StatePages, guard: u64) {
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
                self.note_removed(&c);
                kv.unref_checkpoint_chain(&c.chain);
                self.stats.drops += 1;
                if c.busy_step < guard {
                    free_state(kv, states, c.state);
                } else {
                    self.deferred_free.push((c.state, c.busy_step));
                }
            }
        }
        if !self.deferred_free.is_empty() {
            self.deferred_free.retain(|&(st, busy)| {
                if busy < guard {
                    free_state(kv, states, st);
                    false
                } else {
                    true
                }
            });
        }
    }

    pub(crate) fn stats(&self) -> CheckpointStats {
        CheckpointStats { states: (self.by_gen.len() + self.deferred_free.len()) as u32, ..self.stats }
    }

    /// `(state, tokens, last block of the chain, generation of that block's
    /// entry)` of every live checkpoint (tests and debugging).
    pub(crate) fn list(&self) -> Vec<(StateId, usize, BlockId, u64)> {
        let mut v: Vec<_> = self
            .by_gen
            .iter()
            .map(|(&g, c)| (c.state, c.tokens, c.chain.last().map_or(0, |&(b, _)| b), g))
            .collect();
        v.sort_unstable();
        v
    }
}
