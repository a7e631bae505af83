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
//! # Memory and eviction: one order over parked blocks and checkpoints
//! Parked KV blocks and checkpoints are both reclaimable: admission and
//! growth count their pages as available, and when the free list is short
//! [`super::cache_manager::CacheManager`] evicts them in one order, by one
//! cost model. A checkpoint pins nothing, but it is dropped the moment any KV
//! entry of its chain is evicted (unreachable and unverifiable from then on),
//! so evicting a parked block that a checkpoint's chain holds costs that
//! checkpoint too.
//!
//! Each candidate eviction is scored by the prefill compute it loses per page
//! it frees (tokens per page; smallest evicted first), in the spirit of
//! Marconi's FLOP-efficiency score (Pan et al., MLSys 2025). The candidates:
//! * a non-busy checkpoint of `t` tokens: loses `t` (a hit on it skips `t`
//!   prompt tokens), frees `state_pages` pages: `t / state_pages` (its
//!   "value");
//! * a parked block that no checkpoint's chain holds: loses nothing a
//!   DeltaNet model can use (a KV-only hit still recomputes the state over its
//!   tokens; only their KV write is saved), frees 1 page: score 0;
//! * a parked block that ends a checkpoint's chain, held by the chains of
//!   checkpoints `C`: loses `sum t(c)`, frees `1 + state_pages * |C|` (busy
//!   members of `C` give their pages back once the plan reading them ran):
//!   `sum t(c) / (1 + state_pages * |C|)`. Other parked chain blocks are not
//!   candidates: each scores at least as much as some chain-ending block after
//!   it (its dependents are the union of theirs), and it becomes a plain
//!   block once its checkpoints are gone.
//!
//! A checkpoint write (plan assembly) evicts only candidates whose eviction
//! removes no checkpoint worth more per page than the one it writes, and only
//! when those give it room (else the write is skipped, nothing evicted). An
//! allocation that would not fit even after evicting everything evicts
//! nothing (see the transactions in [`super::cache_manager`]).
//! `tests/scheduler_model` checks every eviction against this order,
//! recomputed from a snapshot of the candidates.

use crate::block_table::ChainLink;
use crate::{BlockId, KvCacheManager, StateId, StatePages};
use std::collections::HashMap;

/// What one eviction takes: a parked KV block (with the checkpoints whose
/// chain holds it) or a checkpoint (its key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Victim {
    Block(BlockId),
    Checkpoint(u64),
}

/// The order's key, smallest evicted first: score (tokens of prefill compute
/// lost per page freed), then parked blocks before checkpoints, then least
/// recently used (a block's park stamp, a checkpoint's last step of use), then
/// the block id / the checkpoint's write order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvictKey {
    pub score: f64,
    pub kind: u8,
    pub recency: u64,
    pub id: u64,
}

impl EvictKey {
    pub fn order(&self, o: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&o.score)
            .then(self.kind.cmp(&o.kind))
            .then(self.recency.cmp(&o.recency))
            .then(self.id.cmp(&o.id))
    }
}

/// A live checkpoint as the eviction order sees it (the eviction log).
#[derive(Debug, Clone, PartialEq)]
pub struct CheckpointView {
    pub key: u64,
    pub tokens: usize,
    /// `(block, generation)` of each prefix-cache entry of its chain.
    pub chain: Vec<(BlockId, u64)>,
    pub busy_step: u64,
    pub last_used: u64,
    pub seq_no: u64,
}

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
    /// Pages per state, as a float (the order's arithmetic).
    state_pages: f64,
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
            state_pages: state_pages.max(1) as f64,
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
            Some(last) if !self.by_gen.contains_key(&last.generation) => kv.ref_checkpoint_chain(chain, (chain.len() * self.block_size) as u64),
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
        kv.unref_checkpoint_chain(&c.chain, c.tokens as u64);
        Some(c.state)
    }

    /// The value of a checkpoint of `tokens` tokens: prefill tokens a hit on
    /// it skips per page it holds (see the module docs).
    #[inline]
    pub(crate) fn value(&self, tokens: usize) -> f64 {
        tokens as f64 / self.state_pages
    }

    /// The next victim of the one eviction order (module docs) among parked
    /// KV blocks and non-busy checkpoints, leaving out any whose eviction would
    /// remove a checkpoint worth more than `limit` tokens per page (a
    /// checkpoint write passes its own value; anything else infinity). None
    /// when nothing qualifies. O(1) (amortised) while a parked block outside
    /// every checkpoint's chain exists, else O(checkpoints): each candidate's
    /// cost is kept per block by the prefix cache.
    pub(crate) fn next_victim(&self, kv: &KvCacheManager, guard: u64, limit: f64) -> Option<Victim> {
        if let Some(b) = kv.oldest_plain_parked() {
            return Some(Victim::Block(b));
        }
        let mut best: Option<(EvictKey, Victim)> = None;
        let mut consider = |k: EvictKey, v: Victim| {
            if !best.as_ref().is_some_and(|(bk, _)| k.order(bk).is_ge()) {
                best = Some((k, v));
            }
        };
        for (&g, c) in self.by_gen.iter() {
            let v = self.value(c.tokens);
            if c.busy_step < guard && v <= limit {
                consider(EvictKey { score: v, kind: 1, recency: c.last_used, id: c.seq_no }, Victim::Checkpoint(g));
            }
            // The block that ends its chain, when parked. A chain's parked blocks are
            // usually a suffix of it (a table holding a block holds those before it),
            // but not always: see the fallback below.
            let Some(&(b, bg)) = c.chain.last() else { continue };
            if !kv.is_parked_entry(b, bg) {
                continue;
            }
            let (n, lost) = kv.checkpoint_deps(b);
            // Evicting it drops every checkpoint whose chain holds it. Under a
            // value cap (a checkpoint write) only a block that c's chain alone
            // holds, so nothing worth more than the cap is lost.
            if limit.is_finite() && (n != 1 || v > limit) {
                continue;
            }
            let score = lost as f64 / (1.0 + self.state_pages * n as f64);
            consider(EvictKey { score, kind: 0, recency: kv.park_stamp(b), id: b as u64 }, Victim::Block(b));
        }
        if best.is_none() && limit.is_infinite() {
            // Every parked block counts as available (`available_pages`), so one must be
            // reachable: a chain's parked blocks can sit before blocks a table still holds
            // (the random model test found such a chain; likely a table that computed
            // blocks already cached elsewhere, whose chain links to those entries, see
            // `KvCacheManager::cache_full_blocks`), and then no chain end above is parked.
            // The least recently parked block goes (dropping the checkpoints whose chains
            // hold it).
            return kv.lru_order().first().map(|&b| Victim::Block(b));
        }
        best.map(|(_, v)| v)
    }

    /// Pages that evicting, in the one order, only what [`Self::next_victim`]
    /// allows under `limit` gives at least: parked blocks outside every
    /// chain, and the non-busy checkpoints worth at most `limit` (whatever
    /// the order takes first, these stay eligible until taken).
    pub(crate) fn obtainable_under(&self, kv: &KvCacheManager, guard: u64, limit: f64) -> u64 {
        let ckpts = self.by_gen.values().filter(|c| c.busy_step < guard && self.value(c.tokens) <= limit).count() as u64;
        kv.num_plain_parked() as u64 + ckpts * self.state_pages as u64
    }

    /// Evicts live checkpoint `key` (chosen by [`Self::next_victim`]).
    pub(crate) fn evict(&mut self, kv: &mut KvCacheManager, states: &mut StatePages, key: u64) {
        let c = self.by_gen.remove(&key).expect("victim present");
        self.note_removed(&c);
        kv.unref_checkpoint_chain(&c.chain, c.tokens as u64);
        free_state(kv, states, c.state);
        self.stats.evictions += 1;
    }

    /// Every live checkpoint as the eviction order sees it (tests: the
    /// eviction log's snapshots).
    pub(crate) fn views(&self) -> Vec<CheckpointView> {
        let mut v: Vec<_> = self
            .by_gen
            .iter()
            .map(|(&g, c)| CheckpointView {
                key: g,
                tokens: c.tokens,
                chain: c.chain.clone(),
                busy_step: c.busy_step,
                last_used: c.last_used,
                seq_no: c.seq_no,
            })
            .collect();
        v.sort_unstable_by_key(|c| c.key);
        v
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
                kv.unref_checkpoint_chain(&c.chain, c.tokens as u64);
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
