//! One sequence's logical -> physical block map.
//!
//! Invariant (kept by [`crate::kv_cache::KvCacheManager`], the only writer):
//! `blocks.len() == ceil(num_tokens / block_size)`, so only the last block can be
//! partly filled, and a sequence wastes at most `block_size - 1` slots.

use crate::BlockId;

/// One link of a table's prefix-cache hash chain: the chained hash of a full
/// block and the generation of the cache entry holding that content (possibly a
/// different physical block, when another sequence registered it first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainLink {
    pub hash: u64,
    pub generation: u64,
}

#[derive(Debug, Default, Clone)]
pub struct BlockTable {
    pub(crate) blocks: Vec<BlockId>,
    pub(crate) num_tokens: usize,
    /// Hash chain of the leading full blocks already looked up or registered in the
    /// prefix cache, so `cache_full_blocks` hashes each block once.
    pub(crate) chain: Vec<ChainLink>,
    /// A real 64-bit hash collision with a live entry stopped registration; the
    /// rest of this sequence is simply not cached.
    pub(crate) chain_broken: bool,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Physical block ids in logical order.
    #[inline]
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Tokens whose KV slots are reserved (not necessarily computed yet).
    #[inline]
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Number of leading full blocks whose chained hash is known.
    #[inline]
    pub fn num_hashed_blocks(&self) -> usize {
        self.chain.len()
    }

    /// Chained content hash of full block `i` (the key a DeltaNet state
    /// checkpoint at that block boundary would use), if it was hashed.
    #[inline]
    pub fn block_hash(&self, i: usize) -> Option<u64> {
        self.chain.get(i).map(|l| l.hash)
    }
}
