//! The scheduler's one memory side: the arena's pages as KV blocks (block
//! tables, prefix cache), DeltaNet states (state page tables) and state
//! checkpoints, behind one free count (vLLM keeps its policy in the scheduler
//! and its memory behind a `KVCacheManager`; this is that split).
//!
//! What "room" means everywhere in the policy: [`CacheManager::available_pages`]
//! = pages on the free list + parked cached blocks + pages of checkpoints that
//! could be evicted now. Taking pages draws from the free list, then evicts
//! parked cached blocks (LRU), then checkpoints (their compute-saved-per-page
//! order, see [`super::checkpoints`]); nothing is refused or preempted while
//! any of these is left.

use super::checkpoints::{free_state, CheckpointStats, Checkpoints};
use crate::block_table::BlockTable;
use crate::{BlockId, CoreError, KvCacheManager, StateId, StatePages};

pub struct CacheManager {
    pub(crate) kv: KvCacheManager,
    pub(crate) states: StatePages,
    pub(crate) ckpts: Checkpoints,
    pages_per_state: u32,
    scratch: Vec<BlockId>,
}

impl CacheManager {
    pub fn new(num_pages: u32, block_size: u32, pages_per_state: u32, enable_prefix_caching: bool) -> Result<Self, CoreError> {
        Ok(CacheManager {
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

    /// Evicts checkpoints until `need` pages are free or parked; whether they are.
    fn make_room(&mut self, need: u32, guard: u64) -> bool {
        loop {
            if self.kv.num_free_blocks() >= need {
                return true;
            }
            // Dropped checkpoints (their chain lost a block) give pages back first.
            self.ckpts.reconcile(&mut self.kv, &mut self.states, guard);
            if self.kv.num_free_blocks() >= need {
                return true;
            }
            if !self.ckpts.evict_one(&mut self.kv, &mut self.states, guard) {
                return false;
            }
        }
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
        self.make_room(need, guard);
        self.kv.append_slots(table, n, slots, copies)
    }

    /// A fresh state (`pages_per_state` pages), or `None` when even evicting
    /// every reclaimable page would not make room (nothing then changes except
    /// evictions).
    pub fn alloc_state(&mut self, guard: u64) -> Option<StateId> {
        if !self.make_room(self.pages_per_state, guard) {
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
