//! hybridserve-core: the bookkeeping of a paged, continuously batched engine.
//!
//! * [`allocator`]: lock-free KV block allocator (Treiber stack + atomic refcounts).
//! * [`block_table`]: one sequence's logical -> physical block map.
//! * [`prefix_cache`]: chained block hashes, verified hits, LRU of parked blocks.
//! * [`kv_cache`]: [`KvCacheManager`], what the scheduler talks to.
//! * [`state_pool`]: DeltaNet state slots.
//!
//! No Python here; the bindings live in `rust/python`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub type BlockId = u32;
pub type SlotId = u32;

mod sync;

pub mod allocator;
pub mod block_table;
pub mod error;
pub mod kv_cache;
pub mod prefix_cache;
pub mod state_pool;
pub mod scheduler;

pub use allocator::BlockAllocator;
pub use block_table::BlockTable;
pub use error::CoreError;
pub use kv_cache::{KvCacheManager, KvStats};
pub use state_pool::{SlotUse, StatePool};
