//! Lock-free KV block allocator: a Treiber stack of free block ids plus one atomic
//! state word per block.
//!
//! # Design
//! * The free list is an intrusive stack: `next[b]` links free blocks and `head`
//!   packs `(tag << 32) | top` into one `AtomicU64`. Every successful push or pop
//!   bumps the 32-bit tag, so a pop that read `head` and `next[top]` and then
//!   stalled while `top` was popped and pushed back fails its CAS instead of
//!   installing a stale `next` (the ABA problem). The tag would have to wrap (2^32
//!   operations during one stalled CAS) to fool it.
//! * `state[b]` is the block's reference count, or the [`ON_FREE_LIST`] flag while
//!   the block sits in the stack. Count 0 without the flag means *parked*: no owner,
//!   not allocatable; the prefix cache keeps such blocks for reuse
//!   ([`BlockAllocator::decref_retain`], then [`BlockAllocator::release`] or
//!   [`BlockAllocator::revive`]).
//! * Transitions are single CASes on `state[b]`, so two threads racing to free the
//!   same block cannot both win: exactly one sees `1 -> 0` and pushes it.
//!
//! # Invariants (checked by the loom, stress and property tests)
//! 1. A block is in exactly one of: on the free list (once), parked, referenced.
//! 2. `allocate` never returns a block that is referenced or parked, so no block
//!    ever has two owners; a block reaching count 0 through `decref` is pushed
//!    exactly once, so none is lost.
//! 3. `num_free()` equals the free-list length whenever no call is in flight.
//!
//! All operations are O(1) except `allocate_n` (O(n)); none blocks or allocates.

use crate::error::CoreError;
use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crate::BlockId;

/// `state[b]` while block `b` is on the free list (above any legal refcount).
pub const ON_FREE_LIST: u32 = 1 << 31;
const NIL: u32 = u32::MAX;
/// Refcounts saturate below the flag; reaching this is a caller bug (a leak loop).
const MAX_REFCOUNT: u32 = ON_FREE_LIST - 1;

#[inline]
fn pack(tag: u32, top: u32) -> u64 {
    ((tag as u64) << 32) | top as u64
}

/// Keeps the contended head word off the cache line of the read-mostly fields.
#[repr(align(64))]
struct Padded<T>(T);

pub struct BlockAllocator {
    head: Padded<AtomicU64>,
    /// Upper bound of the free-list length, exact when quiescent: incremented
    /// before a push and decremented after a pop so it can never underflow.
    free: Padded<AtomicU32>,
    next: Box<[AtomicU32]>,
    state: Box<[AtomicU32]>,
}

impl std::fmt::Debug for BlockAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockAllocator")
            .field("num_blocks", &self.num_blocks())
            .field("num_free", &self.num_free())
            .finish()
    }
}

impl BlockAllocator {
    /// A pool of `num_blocks` free blocks; `allocate` hands them out in id order
    /// first (0, 1, 2, ...), then most-recently-freed first.
    ///
    /// # Panics
    /// If `num_blocks >= 2^31` (ids must stay below the free-list sentinel and fit
    /// an `int32` slot mapping); callers validate sizes before (see
    /// [`crate::kv_cache::KvCacheManager::new`]).
    pub fn new(num_blocks: u32) -> Self {
        assert!(num_blocks < ON_FREE_LIST, "num_blocks must be below 2^31");
        let next = (0..num_blocks)
            .map(|b| AtomicU32::new(if b + 1 < num_blocks { b + 1 } else { NIL }))
            .collect();
        let state = (0..num_blocks).map(|_| AtomicU32::new(ON_FREE_LIST)).collect();
        let top = if num_blocks > 0 { 0 } else { NIL };
        BlockAllocator {
            head: Padded(AtomicU64::new(pack(0, top))),
            free: Padded(AtomicU32::new(num_blocks)),
            next,
            state,
        }
    }

    #[inline]
    pub fn num_blocks(&self) -> u32 {
        self.state.len() as u32
    }

    /// Free-list length; exact when no call is in flight, an upper bound otherwise.
    #[inline]
    pub fn num_free(&self) -> u32 {
        self.free.0.load(Ordering::Acquire)
    }

    fn pop(&self) -> Option<BlockId> {
        let mut head = self.head.0.load(Ordering::Acquire);
        loop {
            let top = head as u32;
            if top == NIL {
                return None;
            }
            // May be stale if `top` is popped and re-pushed meanwhile; the tag then
            // differs and the CAS below fails, so a stale value is never installed.
            let next = self.next[top as usize].load(Ordering::Acquire);
            let new = pack(((head >> 32) as u32).wrapping_add(1), next);
            match self.head.0.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.free.0.fetch_sub(1, Ordering::AcqRel);
                    return Some(top);
                }
                Err(h) => head = h,
            }
        }
    }

    /// Pushes `b`, whose state the caller has already set to `ON_FREE_LIST`.
    fn push(&self, b: BlockId) {
        self.free.0.fetch_add(1, Ordering::AcqRel);
        let mut head = self.head.0.load(Ordering::Acquire);
        loop {
            self.next[b as usize].store(head as u32, Ordering::Release);
            let new = pack(((head >> 32) as u32).wrapping_add(1), b);
            match self.head.0.compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(h) => head = h,
            }
        }
    }

    #[inline]
    fn state_of(&self, b: BlockId) -> Result<&AtomicU32, CoreError> {
        self.state.get(b as usize).ok_or(CoreError::InvalidBlock {
            block: b,
            reason: "id out of range",
        })
    }

    /// One free block, refcount 1. O(1), lock-free.
    pub fn allocate(&self) -> Result<BlockId, CoreError> {
        match self.pop() {
            Some(b) => {
                // We own `b` exclusively now: no other thread may touch a free block.
                self.state[b as usize].store(1, Ordering::Release);
                Ok(b)
            }
            None => Err(CoreError::OutOfBlocks { needed: 1, free: 0 }),
        }
    }

    /// Appends `n` fresh blocks (refcount 1) to `out`, or none at all. O(n).
    /// Under contention a failed attempt briefly holds (then returns) some blocks,
    /// which can make a concurrent allocation fail spuriously; never lose one.
    pub fn allocate_n(&self, n: usize, out: &mut Vec<BlockId>) -> Result<(), CoreError> {
        let free = self.num_free();
        if n > free as usize {
            return Err(CoreError::OutOfBlocks { needed: n.min(u32::MAX as usize) as u32, free });
        }
        let start = out.len();
        out.reserve(n);
        for _ in 0..n {
            match self.pop() {
                Some(b) => out.push(b),
                None => {
                    // Popped blocks still carry ON_FREE_LIST: push them straight back.
                    for b in out.drain(start..).rev() {
                        self.push(b);
                    }
                    return Err(CoreError::OutOfBlocks { needed: n as u32, free: self.num_free() });
                }
            }
        }
        for &b in &out[start..] {
            self.state[b as usize].store(1, Ordering::Release);
        }
        Ok(())
    }

    /// Adds a reference to a referenced block; returns the new count.
    pub fn incref(&self, b: BlockId) -> Result<u32, CoreError> {
        let st = self.state_of(b)?;
        let mut c = st.load(Ordering::Acquire);
        loop {
            if c == 0 || c & ON_FREE_LIST != 0 {
                return Err(CoreError::InvalidBlock { block: b, reason: "incref of a block with refcount 0 (free or parked)" });
            }
            if c >= MAX_REFCOUNT {
                return Err(CoreError::InvalidBlock { block: b, reason: "refcount overflow" });
            }
            match st.compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Ok(c + 1),
                Err(now) => c = now,
            }
        }
    }

    /// Drops a reference; returns the new count. At 0 the block goes back to the
    /// free list (exactly once, whichever thread dropped the last reference).
    pub fn decref(&self, b: BlockId) -> Result<u32, CoreError> {
        self.decref_impl(b, true)
    }

    /// Like [`decref`](Self::decref), but a block reaching 0 is *parked* (not
    /// allocatable) for the caller to [`release`](Self::release) or
    /// [`revive`](Self::revive) later.
    pub fn decref_retain(&self, b: BlockId) -> Result<u32, CoreError> {
        self.decref_impl(b, false)
    }

    #[inline]
    fn decref_impl(&self, b: BlockId, free_at_zero: bool) -> Result<u32, CoreError> {
        let st = self.state_of(b)?;
        let mut c = st.load(Ordering::Acquire);
        loop {
            if c == 0 || c & ON_FREE_LIST != 0 {
                return Err(CoreError::InvalidBlock { block: b, reason: "decref of a block with refcount 0 (double free?)" });
            }
            let new = if c == 1 && free_at_zero { ON_FREE_LIST } else { c - 1 };
            match st.compare_exchange_weak(c, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    if new == ON_FREE_LIST {
                        self.push(b);
                    }
                    return Ok(c - 1);
                }
                Err(now) => c = now,
            }
        }
    }

    /// Returns a parked block (count 0, off the free list) to the free list.
    pub fn release(&self, b: BlockId) -> Result<(), CoreError> {
        let st = self.state_of(b)?;
        st.compare_exchange(0, ON_FREE_LIST, Ordering::AcqRel, Ordering::Acquire)
            .map_err(|_| CoreError::InvalidBlock { block: b, reason: "release of a block that is not parked" })?;
        self.push(b);
        Ok(())
    }

    /// Gives a parked block an owner again: count 0 -> 1.
    pub fn revive(&self, b: BlockId) -> Result<(), CoreError> {
        let st = self.state_of(b)?;
        st.compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .map(|_| ())
            .map_err(|_| CoreError::InvalidBlock { block: b, reason: "revive of a block that is not parked" })
    }

    // ---- Exclusive fast paths -------------------------------------------------
    //
    // The same transitions, with the same checks and errors, for an owner that
    // holds `&mut self` (the single-threaded `KvCacheManager`). Exclusive access
    // rules out any concurrent call, so plain relaxed loads and stores replace
    // the CAS loops: no locked instructions, each of which is a full fence on
    // x86 that stops the cache misses of neighbouring blocks from overlapping.

    fn pop_mut(&mut self) -> Option<BlockId> {
        let head = self.head.0.load(Ordering::Relaxed);
        let top = head as u32;
        if top == NIL {
            return None;
        }
        let next = self.next[top as usize].load(Ordering::Relaxed);
        self.head.0.store(pack(((head >> 32) as u32).wrapping_add(1), next), Ordering::Relaxed);
        self.free.0.store(self.free.0.load(Ordering::Relaxed) - 1, Ordering::Relaxed);
        Some(top)
    }

    fn push_mut(&mut self, b: BlockId) {
        self.free.0.store(self.free.0.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        let head = self.head.0.load(Ordering::Relaxed);
        self.next[b as usize].store(head as u32, Ordering::Relaxed);
        self.head.0.store(pack(((head >> 32) as u32).wrapping_add(1), b), Ordering::Relaxed);
    }

    #[inline]
    fn state_mut(&self, b: BlockId) -> Result<(&AtomicU32, u32), CoreError> {
        let st = self.state_of(b)?;
        let c = st.load(Ordering::Relaxed);
        Ok((st, c))
    }

    /// Prefetch hint for block `b`'s state word (see [`crate::prefetch`]).
    #[inline]
    pub(crate) fn prefetch_state(&self, b: BlockId) {
        if let Some(st) = self.state.get(b as usize) {
            crate::prefetch(st);
        }
    }

    /// [`allocate`](Self::allocate) for an exclusive owner.
    pub(crate) fn allocate_mut(&mut self) -> Result<BlockId, CoreError> {
        match self.pop_mut() {
            Some(b) => {
                self.state[b as usize].store(1, Ordering::Relaxed);
                Ok(b)
            }
            None => Err(CoreError::OutOfBlocks { needed: 1, free: 0 }),
        }
    }

    /// [`incref`](Self::incref) for an exclusive owner.
    pub(crate) fn incref_mut(&mut self, b: BlockId) -> Result<u32, CoreError> {
        let (st, c) = self.state_mut(b)?;
        if c == 0 || c & ON_FREE_LIST != 0 {
            return Err(CoreError::InvalidBlock { block: b, reason: "incref of a block with refcount 0 (free or parked)" });
        }
        if c >= MAX_REFCOUNT {
            return Err(CoreError::InvalidBlock { block: b, reason: "refcount overflow" });
        }
        st.store(c + 1, Ordering::Relaxed);
        Ok(c + 1)
    }

    /// [`decref`](Self::decref) (`free_at_zero`) or
    /// [`decref_retain`](Self::decref_retain) for an exclusive owner.
    pub(crate) fn decref_mut(&mut self, b: BlockId, free_at_zero: bool) -> Result<u32, CoreError> {
        let (st, c) = self.state_mut(b)?;
        if c == 0 || c & ON_FREE_LIST != 0 {
            return Err(CoreError::InvalidBlock { block: b, reason: "decref of a block with refcount 0 (double free?)" });
        }
        let new = if c == 1 && free_at_zero { ON_FREE_LIST } else { c - 1 };
        st.store(new, Ordering::Relaxed);
        if new == ON_FREE_LIST {
            self.push_mut(b);
        }
        Ok(c - 1)
    }

    /// [`release`](Self::release) for an exclusive owner.
    pub(crate) fn release_mut(&mut self, b: BlockId) -> Result<(), CoreError> {
        let (st, c) = self.state_mut(b)?;
        if c != 0 {
            return Err(CoreError::InvalidBlock { block: b, reason: "release of a block that is not parked" });
        }
        st.store(ON_FREE_LIST, Ordering::Relaxed);
        self.push_mut(b);
        Ok(())
    }

    /// [`revive`](Self::revive) for an exclusive owner.
    pub(crate) fn revive_mut(&mut self, b: BlockId) -> Result<(), CoreError> {
        let (st, c) = self.state_mut(b)?;
        if c != 0 {
            return Err(CoreError::InvalidBlock { block: b, reason: "revive of a block that is not parked" });
        }
        st.store(1, Ordering::Relaxed);
        Ok(())
    }

    /// Current reference count: 0 for free, parked or out-of-range blocks.
    #[inline]
    pub fn refcount(&self, b: BlockId) -> u32 {
        match self.state.get(b as usize) {
            Some(st) => {
                let c = st.load(Ordering::Acquire);
                if c & ON_FREE_LIST != 0 { 0 } else { c }
            }
            None => 0,
        }
    }

    /// Whether `b` sits on the free list (as opposed to parked or referenced).
    #[inline]
    pub fn is_free(&self, b: BlockId) -> bool {
        self.state.get(b as usize).is_some_and(|st| st.load(Ordering::Acquire) & ON_FREE_LIST != 0)
    }

    /// Walks the free list (O(num_free)); for tests and debugging only, and only
    /// meaningful when no call is in flight.
    pub fn free_list_snapshot(&self) -> Vec<BlockId> {
        let mut out = Vec::new();
        let mut top = self.head.0.load(Ordering::Acquire) as u32;
        while top != NIL && out.len() <= self.state.len() {
            out.push(top);
            top = self.next[top as usize].load(Ordering::Acquire);
        }
        out
    }
}
