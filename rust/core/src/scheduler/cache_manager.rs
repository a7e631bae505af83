//! The scheduler's one memory side: the arena's pages as KV blocks (block
//! tables, prefix cache), DeltaNet states (state page tables) and state
//! checkpoints, behind one free count (vLLM keeps its policy in the scheduler
//! and its memory behind a `KVCacheManager`; this is that split).
//!
//! What "room" means everywhere in the policy: [`CacheManager::available_pages`]
//! = pages on the free list + parked cached blocks + pages of checkpoints that
//! could be evicted now. Taking pages draws from the free list, then evicts
//! parked blocks and checkpoints in one order, by compute saved per page (see
//! [`super::checkpoints`] for the order); nothing is refused or preempted
//! while any of these is left.
//!
//! # Transactions
//! Policy code (admission, preemption, forking, checkpoint writes) reaches the
//! memory only through the methods here, never the KV, state or checkpoint
//! parts. Every allocation is all or nothing and decides before it evicts:
//! [`CacheManager::make_room`] compares what it needs with
//! [`CacheManager::available_pages`] first and, when it would not fit, evicts
//! nothing and reports the shortfall. An admission (several tables and states
//! at once) first asks [`CacheManager::reserve`] for its whole need: a
//! [`Shortfall`] (nothing evicted, nothing changed), or a [`Reservation`] that
//! its appends and state allocations then draw on and that cannot fail.

use super::checkpoints::{free_state, CheckpointStats, CheckpointView, Checkpoints, Victim};
use crate::block_table::{BlockTable, ChainLink};
use crate::{BlockId, CoreError, KvCacheManager, StateId, StatePages};

/// What an admission lacked: pages it needed and pages that could have been
/// had (free + parked + evictable checkpoints, before anything was evicted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shortfall {
    pub needed: u64,
    pub available: u64,
}

/// Pages promised to one admission by [`CacheManager::reserve`]: its appends
/// and state allocations draw on it (evicting reclaimable pages as they go)
/// and cannot fail while it lasts. Nothing else allocates in between (the
/// scheduler is single-threaded and the admission holds `&mut`).
#[derive(Debug)]
#[must_use = "a reservation is drawn on by the admission's allocations"]
pub struct Reservation {
    left: u64,
}

impl Reservation {
    /// Pages still promised.
    pub fn left(&self) -> u64 {
        self.left
    }

    fn draw(&mut self, pages: u64) {
        debug_assert!(pages <= self.left, "admission drew {pages} pages past its reservation ({} left)", self.left);
        self.left = self.left.saturating_sub(pages);
    }
}

/// One eviction and what the order saw when it chose it (tests: recorded
/// only after [`CacheManager::record_evictions`]).
#[derive(Debug, Clone)]
pub struct EvictionRecord {
    pub victim: Victim,
    /// The value cap of a checkpoint write (infinite otherwise).
    pub limit: f64,
    pub guard: u64,
    /// Parked blocks: `(block, generation, park stamp)`.
    pub parked: Vec<(BlockId, u64, u64)>,
    pub checkpoints: Vec<CheckpointView>,
    pub pages_per_state: u32,
}

pub struct CacheManager {
    log: Option<Vec<EvictionRecord>>,
    kv: KvCacheManager,
    states: StatePages,
    ckpts: Checkpoints,
    pages_per_state: u32,
    scratch: Vec<BlockId>,
}

impl CacheManager {
    pub fn new(num_pages: u32, block_size: u32, pages_per_state: u32, enable_prefix_caching: bool) -> Result<Self, CoreError> {
        Ok(CacheManager {
            log: None,
            kv: KvCacheManager::new(num_pages, block_size, enable_prefix_caching)?,
            states: StatePages::new(pages_per_state),
            ckpts: Checkpoints::new(block_size, pages_per_state),
            pages_per_state,
            scratch: Vec::new(),
        })
    }

    #[inline]
    pub fn pages_per_state(&self) -> u32 {
        self.pages_per_state
    }

    #[inline]
    pub fn num_pages(&self) -> u32 {
        self.kv.num_blocks()
    }

    /// Pages that could be handed out now (`guard`: the first step whose plan
    /// has not run): free + parked cached + evictable checkpoints'.
    pub fn available_pages(&self, guard: u64) -> u64 {
        self.kv.num_free_blocks() as u64 + self.ckpts.num_evictable(guard) as u64 * self.pages_per_state as u64
    }

    /// Evicts, in the one order, until `need` pages are on the free list;
    /// whether they are. Decides first: when even evicting everything it may
    /// (under `limit`, see [`Checkpoints::next_victim`]) would not give `need`
    /// pages, nothing is evicted.
    fn make_room(&mut self, need: u32, guard: u64, limit: f64) -> bool {
        if self.kv.num_free_list() >= need {
            return true;
        }
        let obtainable = if limit.is_infinite() {
            self.available_pages(guard)
        } else {
            self.kv.num_free_list() as u64 + self.ckpts.obtainable_under(&self.kv, guard, limit)
        };
        if need as u64 > obtainable {
            return false;
        }
        loop {
            // Dropped checkpoints (their chain lost a block) give pages back first.
            self.ckpts.reconcile(&mut self.kv, &mut self.states, guard);
            if self.kv.num_free_list() >= need {
                return true;
            }
            let Some(v) = self.ckpts.next_victim(&self.kv, guard, limit) else {
                debug_assert!(false, "counted {obtainable} obtainable pages but ran out");
                return false;
            };
            if let Some(log) = self.log.as_mut() {
                let parked = self
                    .kv
                    .lru_order()
                    .into_iter()
                    .map(|b| (b, self.kv.cache_generation(b).unwrap_or(0), self.kv.park_stamp(b)))
                    .collect();
                log.push(EvictionRecord {
                    victim: v,
                    limit,
                    guard,
                    parked,
                    checkpoints: self.ckpts.views(),
                    pages_per_state: self.pages_per_state,
                });
            }
            match v {
                Victim::Block(b) => self.kv.evict_parked(b),
                Victim::Checkpoint(key) => self.ckpts.evict(&mut self.kv, &mut self.states, key),
            }
        }
    }

    /// Starts (or stops) recording every eviction with the candidates the
    /// order saw (tests; off by default, it costs a snapshot per eviction).
    pub fn record_evictions(&mut self, on: bool) {
        self.log = on.then(Vec::new);
    }

    /// The evictions recorded since the last call.
    pub fn take_eviction_log(&mut self) -> Vec<EvictionRecord> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// [`KvCacheManager::append_slots`], evicting checkpoints first if the free
    /// list and the parked blocks are short. All or nothing.
    pub fn append_slots(
        &mut self,
        table: &mut BlockTable,
        n: usize,
        slots: &mut Vec<i32>,
        copies: &mut Vec<(BlockId, BlockId)>,
        guard: u64,
    ) -> Result<(), CoreError> {
        let need = self.kv.blocks_needed(table, n);
        if !self.make_room(need, guard, f64::INFINITY) {
            // What the KV manager reports (and counts) when short.
            return self.kv.append_slots(table, n, slots, copies);
        }
        self.kv.append_slots(table, n, slots, copies)
    }

    /// Asks for `need` pages at once (an admission's blocks and states), with
    /// `adoptable` more pages it could take over from the checkpoints it
    /// restores from. A [`Shortfall`] when they are not there, computed before
    /// anything is evicted (so nothing changed); else a [`Reservation`] for the
    /// admission's allocations to draw on.
    pub fn reserve(&self, need: u64, adoptable: u64, guard: u64) -> Result<Reservation, Shortfall> {
        let available = self.available_pages(guard) + adoptable;
        if need > available {
            return Err(Shortfall { needed: need, available });
        }
        Ok(Reservation { left: need })
    }

    /// [`Self::append_slots`] under a reservation (cannot be short).
    pub fn append_slots_reserved(
        &mut self,
        res: &mut Reservation,
        table: &mut BlockTable,
        n: usize,
        slots: &mut Vec<i32>,
        copies: &mut Vec<(BlockId, BlockId)>,
        guard: u64,
    ) -> Result<(), CoreError> {
        res.draw(self.kv.blocks_needed(table, n) as u64);
        self.append_slots(table, n, slots, copies, guard)
    }

    /// [`Self::alloc_state`] under a reservation.
    pub fn alloc_state_reserved(&mut self, res: &mut Reservation, guard: u64) -> Option<StateId> {
        let st = self.alloc_state(guard)?;
        res.draw(self.pages_per_state as u64);
        Some(st)
    }

    /// Blocks `append_slots(table, n)` would take now (O(1)).
    #[inline]
    pub fn blocks_needed(&self, table: &BlockTable, n: usize) -> u32 {
        self.kv.blocks_needed(table, n)
    }

    #[inline]
    pub fn prefix_caching_enabled(&self) -> bool {
        self.kv.prefix_caching_enabled()
    }

    /// [`KvCacheManager::match_prefix`].
    pub fn match_prefix(&mut self, table: &mut BlockTable, tokens: &[u32], extra_key: u64) -> usize {
        self.kv.match_prefix(table, tokens, extra_key)
    }

    /// [`KvCacheManager::truncate_match`].
    pub fn truncate_match(&mut self, table: &mut BlockTable, keep: usize) {
        self.kv.truncate_match(table, keep)
    }

    /// [`KvCacheManager::cache_full_blocks`].
    pub fn cache_full_blocks(&mut self, table: &mut BlockTable, tokens: &[u32], extra_key: u64) {
        self.kv.cache_full_blocks(table, tokens, extra_key)
    }

    /// [`KvCacheManager::fork`].
    pub fn fork_table(&mut self, parent: &BlockTable) -> BlockTable {
        self.kv.fork(parent)
    }

    /// [`KvCacheManager::truncate_slots`].
    pub fn truncate_slots(&mut self, table: &mut BlockTable, n: usize) {
        self.kv.truncate_slots(table, n)
    }

    /// Appends the slot ids of positions `start..start + n` of `table` (all
    /// reserved already) to `slots`. O(n).
    pub fn push_slots(&self, table: &BlockTable, start: usize, n: usize, slots: &mut Vec<i32>) {
        let bs = self.kv.block_size() as usize;
        debug_assert!(start + n <= table.num_tokens(), "slots past the reserved ones");
        let blocks = table.blocks();
        slots.extend((start..start + n).map(|p| (blocks[p / bs] as usize * bs + p % bs) as i32));
    }

    /// Drops every block reference of `table` ([`KvCacheManager::free`]).
    pub fn free_table(&mut self, table: &mut BlockTable) {
        self.kv.free(table)
    }

    #[inline]
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.kv.refcount(b)
    }

    /// The longest checkpoint ending inside `chain[..max_blocks]` (see
    /// [`Checkpoints::lookup`]); it is busy in the plan of `step`.
    pub fn lookup_checkpoint(&mut self, chain: &[ChainLink], max_blocks: usize, step: u64) -> Option<(usize, StateId, u64)> {
        self.ckpts.lookup(chain, max_blocks, step)
    }

    /// Hands checkpoint `key`'s state to a sequence resuming from it.
    pub fn adopt_checkpoint(&mut self, key: u64) -> Option<StateId> {
        self.ckpts.adopt(&mut self.kv, key)
    }

    /// Counts admission lookups: `(matched, restored)` tokens per sequence.
    pub fn note_checkpoint_queries(&mut self, seqs: impl Iterator<Item = (usize, usize)>) {
        let st = &mut self.ckpts.stats;
        for (matched, hit) in seqs {
            st.queries += 1;
            st.hits += (hit > 0) as u64;
            st.skipped_tokens += hit as u64;
            st.lost_tokens += (matched.max(hit) - hit) as u64;
        }
    }

    /// Counts a checkpoint write skipped for want of room.
    pub fn note_checkpoint_write_skipped(&mut self) {
        self.ckpts.stats.writes_skipped += 1;
    }

    /// Registers a checkpoint written by the plan of `step` (see
    /// [`Checkpoints::register`]).
    pub fn register_checkpoint(&mut self, chain: &[ChainLink], state: StateId, step: u64) -> bool {
        self.ckpts.register(&mut self.kv, &mut self.states, chain, state, step)
    }

    /// The KV side, read only (stats, tests).
    #[inline]
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Pages of live states (sequences' and checkpoints').
    #[inline]
    pub fn num_live_state_pages(&self) -> u32 {
        self.states.num_live() * self.pages_per_state
    }

    /// Live checkpoints (see [`Checkpoints::list`]).
    pub fn list_checkpoints(&self) -> Vec<(StateId, usize, BlockId, u64)> {
        self.ckpts.list()
    }

    /// Evictable checkpoints counted from scratch (the counters' oracle).
    #[cfg(test)]
    pub(crate) fn num_evictable_checkpoints(&self, guard: u64, scan: bool) -> u32 {
        if scan {
            self.ckpts.num_evictable_scan(guard)
        } else {
            self.ckpts.num_evictable(guard)
        }
    }

    /// A fresh state (`pages_per_state` pages), or `None` when even evicting
    /// every reclaimable page would not make room (nothing then changes except
    /// evictions).
    pub fn alloc_state(&mut self, guard: u64) -> Option<StateId> {
        self.alloc_state_under(guard, f64::INFINITY)
    }

    /// A state for a checkpoint of `tokens` tokens, written by the plan: it
    /// evicts nothing worth more per page than itself (see
    /// [`super::checkpoints`]); `None` (nothing evicted) when that leaves no room.
    pub fn alloc_checkpoint_state(&mut self, tokens: usize, guard: u64) -> Option<StateId> {
        self.alloc_state_under(guard, self.ckpts.value(tokens))
    }

    fn alloc_state_under(&mut self, guard: u64, limit: f64) -> Option<StateId> {
        if !self.make_room(self.pages_per_state, guard, limit) {
            return None;
        }
        self.scratch.clear();
        self.kv.take_pages(self.pages_per_state as usize, &mut self.scratch).ok()?;
        Some(self.states.insert(&self.scratch))
    }

    /// Returns a sequence's (or an unregistered checkpoint's) state to the arena.
    pub fn free_state(&mut self, id: StateId) {
        free_state(&mut self.kv, &mut self.states, id);
    }

    /// The page table of live state `id`.
    #[inline]
    pub fn state_pages(&self, id: StateId) -> &[BlockId] {
        self.states.pages(id)
    }

    /// Checkpoint bookkeeping after allocations that may have evicted blocks.
    pub fn reconcile(&mut self, guard: u64) {
        self.ckpts.reconcile(&mut self.kv, &mut self.states, guard);
    }

    pub fn checkpoint_stats(&self) -> CheckpointStats {
        self.ckpts.stats()
    }

    /// Pages held by checkpoints (live or waiting for their plan to run).
    pub fn checkpoint_pages(&self) -> u64 {
        self.ckpts.stats().states as u64 * self.pages_per_state as u64
    }
}
