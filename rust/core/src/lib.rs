//! hybridserve-core: the bookkeeping of a paged, continuously batched engine.
//!
//! * [`allocator`]: lock-free KV block allocator (Treiber stack + atomic refcounts).
//! * [`block_table`]: one sequence's logical -> physical block map.
//! * [`prefix_cache`]: chained block hashes, verified hits, LRU of parked blocks.
//! * [`kv_cache`]: [`KvCacheManager`], what the scheduler talks to.
//! * [`state_pages`]: DeltaNet state page tables (states live in arena pages).
//!
//! # The arena
//! One pool of equal pages (the block allocator's blocks) holds everything:
//! KV blocks, running sequences' DeltaNet state (`pages_per_state` pages each,
//! addressed through a per-sequence state page table), state checkpoints and
//! parked prefix-cache blocks, with one free count. Why grouped pages (a page
//! is one 16-token KV block of all attention layers; state items never
//! straddle a page): see `python/hybridserve/memory/layout.py`.
//!
//! No Python here; the bindings live in `rust/python`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub type BlockId = u32;

mod sync;

/// A hint that `p`'s cache line is needed soon: lets the cache misses of a
/// batch of random blocks (a table being freed, blocks being registered, the
/// next eviction victims) overlap instead of being paid one after another.
/// No effect on results; a no-op where the architecture has no such hint.
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(all(target_arch = "x86_64", target_feature = "sse"))]
    // SAFETY: a prefetch never faults and reads nothing visible: any address is fine.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0)
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "sse")))]
    let _ = p;
}

pub mod allocator;
pub mod block_table;
pub mod error;
pub mod kv_cache;
pub mod prefix_cache;
pub mod state_pages;
pub mod scheduler;

pub use allocator::BlockAllocator;
pub use block_table::BlockTable;
pub use error::CoreError;
pub use kv_cache::{KvCacheManager, KvStats};
pub use state_pages::{StateId, StatePages};
