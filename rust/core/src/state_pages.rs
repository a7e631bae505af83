//! DeltaNet state page tables: which arena pages hold each live state.
//!
//! A sequence's DeltaNet state (conv + recurrent, every DeltaNet layer), and a
//! checkpoint of one, is `pages_per_state` pages of the one arena (see
//! `python/hybridserve/memory/layout.py` for what lives where inside them). The
//! pages themselves come from the arena's allocator (the KV cache manager's
//! [`crate::BlockAllocator`]), so state and KV share one free count; this
//! registry only remembers, per [`StateId`], the page ids in page-table order.
//! A `StateId` is a handle, never sent to the runner: the runner sees page ids
//! (its per-row state page table and the page-pair copies).
//!
//! Invariants (checked by the scheduler model tests): a handle is live xor
//! free; the pages of live handles are pairwise distinct (they come from the
//! allocator with refcount 1). Every operation is O(pages_per_state).

use crate::BlockId;

/// Handle of one live state (a sequence's or a checkpoint's).
pub type StateId = u32;

#[derive(Debug, Clone)]
pub struct StatePages {
    per_state: usize,
    /// `pages[id * per_state..(id + 1) * per_state]`: state `id`'s page table.
    pages: Vec<BlockId>,
    live: Vec<bool>,
    free: Vec<StateId>,
    num_live: u32,
}

impl StatePages {
    pub fn new(pages_per_state: u32) -> Self {
        StatePages { per_state: pages_per_state as usize, pages: Vec::new(), live: Vec::new(), free: Vec::new(), num_live: 0 }
    }

    #[inline]
    pub fn pages_per_state(&self) -> u32 {
        self.per_state as u32
    }

    /// Live states (sequences' and checkpoints').
    #[inline]
    pub fn num_live(&self) -> u32 {
        self.num_live
    }

    /// Registers a state held in `pages` (exactly `pages_per_state` of them).
    pub fn insert(&mut self, pages: &[BlockId]) -> StateId {
        assert_eq!(pages.len(), self.per_state, "a state is pages_per_state pages");
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                self.live.push(false);
                self.pages.resize(self.live.len() * self.per_state, 0);
                (self.live.len() - 1) as StateId
            }
        };
        let i = id as usize;
        debug_assert!(!self.live[i]);
        self.live[i] = true;
        self.pages[i * self.per_state..(i + 1) * self.per_state].copy_from_slice(pages);
        self.num_live += 1;
        id
    }

    /// The page table of live state `id`.
    #[inline]
    pub fn pages(&self, id: StateId) -> &[BlockId] {
        let i = id as usize;
        assert!(self.live.get(i).copied().unwrap_or(false), "state {id} is not live");
        &self.pages[i * self.per_state..(i + 1) * self.per_state]
    }

    #[inline]
    pub fn is_live(&self, id: StateId) -> bool {
        self.live.get(id as usize).copied().unwrap_or(false)
    }

    /// Forgets state `id`, handing each of its pages to `free` (the caller
    /// returns them to the allocator).
    pub fn remove(&mut self, id: StateId, mut free: impl FnMut(BlockId)) {
        for &p in self.pages(id) {
            free(p);
        }
        self.live[id as usize] = false;
        self.free.push(id);
        self.num_live -= 1;
    }
}
