//! The KV cache manager: block allocator + per-sequence block tables + prefix
//! cache. This is what the scheduler talks to. Single-threaded (`&mut self`);
//! the allocator underneath is lock-free for callers that need that.
//!
//! # Block life cycle
//! ```text
//!   free --allocate--> referenced (count >= 1) --last ref dropped--> free      (uncached)
//!                                               \-> parked (cached, count 0, LRU)
//!   parked --prefix hit--> referenced;   parked --evicted (no free block left)--> referenced by the allocating table
//! ```
//! Invariants held after every call (checked by `tests/prop_kv_cache.rs`):
//! 1. Each block's refcount equals the number of (table, position) pairs holding
//!    it; cached blocks with count 0 are exactly the LRU contents.
//! 2. `num_free_blocks() == free-list length + parked blocks`, and
//!    `num_used_blocks() == num_blocks() - num_free_blocks()`.
//! 3. A table's `blocks.len() == ceil(num_tokens / block_size)`.
//! 4. A block written by `append_slots` (the tail being filled) is referenced by
//!    that table only: a shared partly-filled tail is copied first.
//! 5. A prefix hit returns blocks whose registered token ids equal the prompt's,
//!    whole prefix included (see [`crate::prefix_cache`]).

use crate::allocator::BlockAllocator;
use crate::block_table::{BlockTable, ChainLink};
use crate::error::CoreError;
use crate::prefix_cache::{hash_block, Lookup, PrefixCache, ROOT_GENERATION, ROOT_HASH};
use crate::BlockId;

/// Cumulative counters since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvStats {
    /// `match_prefix` calls (with prefix caching enabled).
    pub prefix_queries: u64,
    /// Prompt tokens offered to `match_prefix`.
    pub prefix_query_tokens: u64,
    /// Tokens covered by hits.
    pub prefix_hit_tokens: u64,
    /// Queries that hit at least one block.
    pub prefix_hits: u64,
    /// `append_slots` calls refused for lack of blocks.
    pub alloc_failures: u64,
    /// Parked cached blocks reclaimed for a new use.
    pub evictions: u64,
    /// Copy-on-write copies of shared partly-filled tails.
    pub cow_copies: u64,
}

pub struct KvCacheManager {
    alloc: BlockAllocator,
    block_size: u32,
    cache: Option<PrefixCache>,
    stats: KvStats,
    /// Reused buffer: chained hashes of the blocks `cache_full_blocks` registers.
    hash_scratch: Vec<u64>,
    /// Whether `fork` was ever called. Only a fork shares a partly-filled tail
    /// (prefix hits share full blocks only), so until then no tail can need a
    /// copy and `append_slots` skips reading the tail's refcount (a cache miss
    /// per decoding sequence per step).
    forked: bool,
    /// Generations of evicted entries that DeltaNet checkpoints depended on,
    /// until the scheduler drains them (`take_dropped_generations`).
    dropped_generations: Vec<u64>,
    /// Blocks with refcount >= 2 (held by more than one table), kept at each
    /// refcount change so the stats read a counter instead of walking tables.
    shared_blocks: u32,
    /// Sum of [`Self::tail_waste`] over every table this manager has filled and
    /// not freed, kept at each append, fork and free (same reason).
    tail_waste: u64,
}

impl KvCacheManager {
    /// `num_blocks` blocks of `block_size` token slots each. Slot ids
    /// (`block * block_size + offset`) must fit an `int32`.
    pub fn new(num_blocks: u32, block_size: u32, enable_prefix_caching: bool) -> Result<Self, CoreError> {
        if num_blocks == 0 {
            return Err(CoreError::InvalidArgument(
                "num_blocks must be >= 1; give the KV cache more memory or lower block_size".into(),
            ));
        }
        if block_size == 0 {
            return Err(CoreError::InvalidArgument("block_size must be >= 1 (16 is the usual choice)".into()));
        }
        if num_blocks as u64 * block_size as u64 > i32::MAX as u64 {
            return Err(CoreError::InvalidArgument(format!(
                "num_blocks * block_size = {} exceeds the int32 slot-id range ({}); lower num_blocks or block_size",
                num_blocks as u64 * block_size as u64,
                i32::MAX
            )));
        }
        Ok(KvCacheManager {
            alloc: BlockAllocator::new(num_blocks),
            block_size,
            cache: enable_prefix_caching.then(|| PrefixCache::new(num_blocks, block_size)),
            stats: KvStats::default(),
            hash_scratch: Vec::new(),
            forked: false,
            dropped_generations: Vec::new(),
            shared_blocks: 0,
            tail_waste: 0,
        })
    }

    #[inline]
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    #[inline]
    pub fn num_blocks(&self) -> u32 {
        self.alloc.num_blocks()
    }

    #[inline]
    pub fn prefix_caching_enabled(&self) -> bool {
        self.cache.is_some()
    }

    /// Blocks allocatable now: the free list plus parked (evictable) cached blocks.
    #[inline]
    pub fn num_free_blocks(&self) -> u32 {
        self.alloc.num_free() + self.num_cached_blocks()
    }

    #[inline]
    pub fn num_used_blocks(&self) -> u32 {
        self.num_blocks() - self.num_free_blocks()
    }

    /// Unreferenced cached blocks kept for reuse (they count as free).
    #[inline]
    pub fn num_cached_blocks(&self) -> u32 {
        self.cache.as_ref().map_or(0, |c| c.num_parked())
    }

    /// Blocks registered in the prefix cache, referenced or not.
    pub fn num_cache_entries(&self) -> u32 {
        self.cache.as_ref().map_or(0, |c| c.num_entries())
    }

    /// Current refcount of block `b` (0 for free or parked).
    #[inline]
    pub fn refcount(&self, b: BlockId) -> u32 {
        self.alloc.refcount(b)
    }

    /// Whether block `b` holds a prefix-cache entry.
    pub fn is_cached(&self, b: BlockId) -> bool {
        self.cache.as_ref().is_some_and(|c| (b as usize) < self.alloc.num_blocks() as usize && c.is_cached(b))
    }

    /// Parked blocks, next eviction first (O(parked); tests and debugging).
    pub fn lru_order(&self) -> Vec<BlockId> {
        self.cache.as_ref().map_or_else(Vec::new, |c| c.lru_order())
    }

    /// The least recently parked block no DeltaNet checkpoint depends on.
    pub fn oldest_plain_parked(&self) -> Option<BlockId> {
        self.cache.as_ref().and_then(|c| c.oldest_plain_parked())
    }

    /// `(checkpoints whose chain holds b, the sum of their tokens)`.
    pub fn checkpoint_deps(&self, b: BlockId) -> (u32, u64) {
        self.cache.as_ref().map_or((0, 0), |c| c.ckpt_deps(b))
    }

    /// Parked blocks that no checkpoint's chain holds.
    pub fn num_plain_parked(&self) -> u32 {
        self.cache.as_ref().map_or(0, |c| c.num_parked() - c.num_parked_chain())
    }

    /// Whether block `b` is parked holding the entry of `generation`.
    pub fn is_parked_entry(&self, b: BlockId, generation: u64) -> bool {
        self.cache.as_ref().is_some_and(|c| c.holds(b, generation) && c.is_parked(b))
    }

    /// `b`'s park stamp: a larger one was parked later (its LRU rank).
    pub fn park_stamp(&self, b: BlockId) -> u64 {
        self.cache.as_ref().map_or(0, |c| c.park_stamp(b))
    }

    /// The generation of `b`'s prefix-cache entry, if it holds one.
    pub fn cache_generation(&self, b: BlockId) -> Option<u64> {
        let c = self.cache.as_ref()?;
        ((b as usize) < self.alloc.num_blocks() as usize && c.is_cached(b)).then(|| c.generation(b))
    }

    /// Evicts parked block `b` to the free list: its entry is dropped (the
    /// generation reported through [`Self::take_dropped_generations`] when a
    /// checkpoint depended on it). The caller chose `b` by its own order.
    pub fn evict_parked(&mut self, b: BlockId) {
        let cache = self.cache.as_mut().expect("a parked block implies a prefix cache");
        cache.unpark(b);
        if let Some(g) = cache.remove(b) {
            self.dropped_generations.push(g);
        }
        self.alloc.release_mut(b).expect("parked block has count 0");
        self.stats.evictions += 1;
    }

    /// Free-list contents (O(free); tests and debugging).
    pub fn free_list(&self) -> Vec<BlockId> {
        self.alloc.free_list_snapshot()
    }

    /// Blocks `append_slots(table, n)` would take now: new blocks past the
    /// reserved capacity plus one copy-on-write of a shared partly-filled tail. O(1).
    pub fn blocks_needed(&self, table: &BlockTable, num_new_tokens: usize) -> u32 {
        if num_new_tokens == 0 {
            return 0;
        }
        let bs = self.block_size as usize;
        let cap = table.blocks.len() * bs;
        let total = table.num_tokens + num_new_tokens;
        let new = if total > cap { (total - cap).div_ceil(bs) } else { 0 };
        (new + self.tail_needs_copy(table) as usize) as u32
    }

    #[inline]
    #[allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; the MSRV is 1.80
    fn tail_needs_copy(&self, table: &BlockTable) -> bool {
        self.forked
            && table.num_tokens % self.block_size as usize != 0
            && table.blocks.last().is_some_and(|&b| self.alloc.refcount(b) > 1)
    }

    /// One block with refcount 1: from the free list, else by evicting the least
    /// recently parked cached block. Callers check capacity first.
    fn take_block(&mut self) -> BlockId {
        if let Ok(b) = self.alloc.allocate_mut() {
            return b;
        }
        let cache = self.cache.as_mut().expect("capacity was checked: a parked block must exist");
        let b = cache.oldest_parked().expect("capacity was checked: a parked block must exist");
        if let Some(next) = cache.prefetch_eviction_successors() {
            self.alloc.prefetch_state(next);
        }
        cache.unpark(b);
        if let Some(g) = cache.remove(b) {
            self.dropped_generations.push(g);
        }
        self.alloc.revive_mut(b).expect("parked block has count 0");
        self.stats.evictions += 1;
        b
    }

    /// Appends `n` pages (refcount 1, never cached) to `out` for a DeltaNet state
    /// or checkpoint: from the free list, else by evicting the least recently
    /// parked cached blocks, exactly as KV blocks are taken. All or nothing:
    /// `OutOfBlocks` (nothing changed) when fewer than `n` are allocatable.
    /// O(n).
    pub fn take_pages(&mut self, n: usize, out: &mut Vec<BlockId>) -> Result<(), CoreError> {
        let free = self.num_free_blocks();
        if n > free as usize {
            return Err(CoreError::OutOfBlocks { needed: n.min(u32::MAX as usize) as u32, free });
        }
        out.reserve(n);
        for _ in 0..n {
            let b = self.take_block();
            out.push(b);
        }
        Ok(())
    }

    /// Returns a page taken by [`Self::take_pages`] to the free list (state
    /// pages have one owner and no cache entry).
    pub fn free_page(&mut self, b: BlockId) {
        debug_assert!(!self.is_cached(b), "state page {b} is in the prefix cache");
        self.alloc.decref_mut(b, true).expect("state page held");
    }

    /// Pages on the free list (not counting parked cached blocks).
    #[inline]
    pub fn num_free_list(&self) -> u32 {
        self.alloc.num_free()
    }

    /// Drops one reference; a cached block reaching 0 is parked (most recent end
    /// of the LRU), any other goes back to the free list.
    fn drop_ref(&mut self, b: BlockId) {
        let left = match self.cache.as_mut() {
            Some(cache) if cache.is_cached(b) => {
                let left = self.alloc.decref_mut(b, false).expect("table held a dead block");
                if left == 0 {
                    cache.park(b);
                }
                left
            }
            _ => self.alloc.decref_mut(b, true).expect("table held a dead block"),
        };
        if left == 1 {
            self.shared_blocks -= 1;
        }
    }

    /// For an EMPTY table: pushes the longest run of cached full blocks matching
    /// `tokens` (chained hash of parent hash, block token ids, `extra_key`,
    /// verified on hit), leaving at least one token to compute, i.e. at most
    /// `(tokens.len() - 1) / block_size` blocks. Hit blocks gain a reference
    /// (parked ones are revived). Returns the tokens covered, now
    /// `table.num_tokens()`. O(hit blocks * block_size). A non-empty table or a
    /// disabled cache returns 0 and changes nothing.
    pub fn match_prefix(&mut self, table: &mut BlockTable, tokens: &[u32], extra_key: u64) -> usize {
        let Some(cache) = self.cache.as_mut() else { return 0 };
        if !table.blocks.is_empty() || table.num_tokens != 0 {
            return 0;
        }
        self.stats.prefix_queries += 1;
        self.stats.prefix_query_tokens += tokens.len() as u64;
        let bs = self.block_size as usize;
        let max_blocks = tokens.len().saturating_sub(1) / bs;
        let (mut parent_hash, mut parent_gen) = (ROOT_HASH, ROOT_GENERATION);
        table.chain.clear();
        table.chain_broken = false;
        for i in 0..max_blocks {
            let blk = &tokens[i * bs..(i + 1) * bs];
            let h = hash_block(parent_hash, blk, extra_key);
            let Lookup::Hit(b, g) = cache.lookup(h, parent_gen, blk, extra_key) else { break };
            if cache.is_parked(b) {
                cache.unpark(b);
                self.alloc.revive_mut(b).expect("parked block has count 0");
            } else if self.alloc.incref_mut(b).expect("cached unparked block is referenced") == 2 {
                self.shared_blocks += 1;
            }
            table.blocks.push(b);
            table.chain.push(ChainLink { hash: h, generation: g });
            (parent_hash, parent_gen) = (h, g);
        }
        let hit = table.blocks.len() * bs;
        table.num_tokens = hit;
        self.stats.prefix_hit_tokens += hit as u64;
        self.stats.prefix_hits += (hit > 0) as u64;
        hit
    }

    /// Shortens a table that holds only matched (cached, full) blocks to its
    /// first `keep` blocks, dropping the references of the rest (parked again
    /// when no one else holds them). Admission uses it when a match is longer
    /// than the first chunk and the arena is short: those tokens are recomputed
    /// past the restored checkpoint anyway, only their KV write was saved.
    pub fn truncate_match(&mut self, table: &mut BlockTable, keep: usize) {
        let bs = self.block_size as usize;
        debug_assert_eq!(table.num_tokens, table.blocks.len() * bs, "only a matched table");
        while table.blocks.len() > keep {
            let b = table.blocks.pop().expect("non-empty");
            self.drop_ref(b);
        }
        table.chain.truncate(keep);
        table.num_tokens = table.blocks.len() * bs;
    }

    /// Reserves KV slots for the next `n` tokens of `table`: copies a shared
    /// partly-filled tail first (pushing `(src, dst)` onto `copies`), then
    /// allocates blocks as the last one fills. Appends the `n` slot ids
    /// (`block * block_size + offset`, in token order) to `slots`. All or nothing:
    /// on `Err(OutOfBlocks)` nothing changed except `alloc_failures += 1`.
    /// O(n / block_size + 1) plus the pushes.
    pub fn append_slots(
        &mut self,
        table: &mut BlockTable,
        n: usize,
        slots: &mut Vec<i32>,
        copies: &mut Vec<(BlockId, BlockId)>,
    ) -> Result<(), CoreError> {
        if n == 0 {
            return Ok(());
        }
        let needed = self.blocks_needed(table, n);
        let free = self.num_free_blocks();
        if needed > free {
            self.stats.alloc_failures += 1;
            return Err(CoreError::OutOfBlocks { needed, free });
        }
        let bs = self.block_size as usize;
        self.tail_waste -= self.tail_waste(table) as u64;
        if self.tail_needs_copy(table) {
            let src = *table.blocks.last().unwrap();
            let dst = self.take_block();
            // src stays referenced by the other sharers (its count was > 1).
            self.drop_ref(src);
            *table.blocks.last_mut().unwrap() = dst;
            copies.push((src, dst));
            self.stats.cow_copies += 1;
        }
        let total = table.num_tokens + n;
        let num_blocks = total.div_ceil(bs);
        if num_blocks > table.blocks.len() {
            table.blocks.reserve(num_blocks - table.blocks.len());
            while table.blocks.len() < num_blocks {
                let b = self.take_block();
                table.blocks.push(b);
            }
        }
        // Slot ids, one run of consecutive ids per block touched.
        slots.reserve(n);
        let bs32 = self.block_size;
        let mut t = table.num_tokens;
        let mut bi = t / bs;
        let mut off = t - bi * bs;
        while t < total {
            let run = (bs - off).min(total - t);
            let first = table.blocks[bi] * bs32 + off as u32;
            slots.extend((first..first + run as u32).map(|x| x as i32));
            t += run;
            bi += 1;
            off = 0;
        }
        table.num_tokens = total;
        self.tail_waste += self.tail_waste(table) as u64;
        Ok(())
    }

    /// Gives back the reserved slots of `table` past its first `n` tokens
    /// (speculative decoding: rejected draft positions and lookahead no longer
    /// needed), dropping the blocks past `ceil(n / block_size)`. Those slots were
    /// never hashed (only computed, committed tokens are), so the hash chain
    /// stays. A no-op when `n >= num_tokens`. O(blocks dropped).
    pub fn truncate_slots(&mut self, table: &mut BlockTable, n: usize) {
        if n >= table.num_tokens {
            return;
        }
        let bs = self.block_size as usize;
        debug_assert!(table.chain.len() * bs <= n, "truncating into hashed (committed) blocks");
        self.tail_waste -= self.tail_waste(table) as u64;
        let keep = n.div_ceil(bs);
        while table.blocks.len() > keep {
            let b = table.blocks.pop().expect("non-empty");
            self.drop_ref(b);
        }
        table.num_tokens = n;
        self.tail_waste += self.tail_waste(table) as u64;
    }

    /// Registers the table's FULL blocks not yet in its hash chain. `tokens` holds
    /// the sequence's token ids at least up to `table.num_tokens()` (fewer: only
    /// the blocks they cover). Call it once their KV is computed. Incremental:
    /// each block is hashed once over the table's life. A block whose content is
    /// already cached under another physical block is not registered twice (the
    /// table keeps its copy; later blocks chain onto the existing entry).
    pub fn cache_full_blocks(&mut self, table: &mut BlockTable, tokens: &[u32], extra_key: u64) {
        let Some(cache) = self.cache.as_mut() else { return };
        if table.chain_broken {
            return;
        }
        let bs = self.block_size as usize;
        let full = table.num_tokens.min(tokens.len()) / bs;
        let first = table.chain.len();
        if first >= full {
            return;
        }
        // Pass 1: the chained hashes (they depend on the previous hash only) and
        // prefetches of what pass 2 touches, so its cache misses overlap.
        let hashes = &mut self.hash_scratch;
        hashes.clear();
        let mut parent_hash = table.chain.last().map_or(ROOT_HASH, |l| l.hash);
        for i in first..full {
            parent_hash = hash_block(parent_hash, &tokens[i * bs..(i + 1) * bs], extra_key);
            hashes.push(parent_hash);
            cache.prefetch_hash(parent_hash);
            cache.prefetch_block(table.blocks[i]);
        }
        table.chain.reserve(full - first);
        for i in first..full {
            let parent_gen = table.chain.last().map_or(ROOT_GENERATION, |l| l.generation);
            let blk = &tokens[i * bs..(i + 1) * bs];
            let h = hashes[i - first];
            let g = match cache.lookup(h, parent_gen, blk, extra_key) {
                Lookup::Hit(_, g) => g,
                Lookup::Miss => cache.insert(table.blocks[i], h, parent_gen, blk, extra_key),
                Lookup::Conflict(old) => {
                    if cache.is_parked(old) {
                        // An orphan (its parent entry was evicted) or a collision
                        // nobody uses: drop it so live content can be cached.
                        cache.unpark(old);
                        if let Some(g) = cache.remove(old) {
                            self.dropped_generations.push(g);
                        }
                        self.alloc.release_mut(old).expect("parked block has count 0");
                        cache.insert(table.blocks[i], h, parent_gen, blk, extra_key)
                    } else {
                        table.chain_broken = true;
                        return;
                    }
                }
            };
            table.chain.push(ChainLink { hash: h, generation: g });
        }
    }

    /// A child sharing every block of `parent` (each refcount +1) and its hash
    /// chain. The child's or parent's next append into a shared partly-filled
    /// tail copies it. O(blocks).
    pub fn fork(&mut self, parent: &BlockTable) -> BlockTable {
        self.forked = true;
        for &b in &parent.blocks {
            if self.alloc.incref_mut(b).expect("forked table held a dead block") == 2 {
                self.shared_blocks += 1;
            }
        }
        self.tail_waste += self.tail_waste(parent) as u64;
        parent.clone()
    }

    /// Drops every block reference, tail first: cached blocks reaching 0 are
    /// parked in that order (so a chain is evicted from its end), others freed.
    /// Leaves `table` empty and reusable. O(blocks).
    pub fn free(&mut self, table: &mut BlockTable) {
        self.tail_waste -= self.tail_waste(table) as u64;
        if let Some(cache) = self.cache.as_ref() {
            for &b in table.blocks.iter().rev() {
                cache.prefetch_block_record(b);
                self.alloc.prefetch_state(b);
            }
        }
        while let Some(b) = table.blocks.pop() {
            self.drop_ref(b);
        }
        table.num_tokens = 0;
        table.chain.clear();
        table.chain_broken = false;
    }

    /// Pins a DeltaNet checkpoint's dependency on the cached entries of
    /// `chain` (a table's leading links): each entry's block gains a checkpoint
    /// reference, so evicting it reports its generation through
    /// [`Self::take_dropped_generations`]. Returns the `(block, generation)`
    /// pairs to pass to [`Self::unref_checkpoint_chain`] later, or `None` (and
    /// changes nothing) if an entry is no longer cached. O(chain).
    pub fn ref_checkpoint_chain(&mut self, chain: &[ChainLink], tokens: u64) -> Option<Vec<(BlockId, u64)>> {
        let cache = self.cache.as_mut()?;
        let mut out = Vec::with_capacity(chain.len());
        for l in chain {
            out.push((cache.block_of(l.hash, l.generation)?, l.generation));
        }
        for &(b, _) in &out {
            cache.ckpt_ref(b, true, tokens);
        }
        Some(out)
    }

    /// Undoes [`Self::ref_checkpoint_chain`] for the entries still cached.
    pub fn unref_checkpoint_chain(&mut self, chain: &[(BlockId, u64)], tokens: u64) {
        let Some(cache) = self.cache.as_mut() else { return };
        for &(b, g) in chain {
            if cache.holds(b, g) {
                cache.ckpt_ref(b, false, tokens);
            }
        }
    }

    /// Generations of checkpoint-referenced entries evicted since the last call.
    pub fn take_dropped_generations(&mut self, out: &mut Vec<u64>) {
        out.append(&mut self.dropped_generations);
    }

    /// Whether any checkpoint-referenced entry was evicted since the last drain.
    #[inline]
    pub fn has_dropped_generations(&self) -> bool {
        !self.dropped_generations.is_empty()
    }

    /// Unused slots in the table's last block.
    #[inline]
    pub fn tail_waste(&self, table: &BlockTable) -> usize {
        table.blocks.len() * self.block_size as usize - table.num_tokens
    }

    /// Blocks held by more than one table (refcount >= 2). O(1): a counter.
    #[inline]
    pub fn num_shared_blocks(&self) -> u32 {
        self.shared_blocks
    }

    /// Unused slots in the last blocks of every table holding blocks (the sum
    /// of [`Self::tail_waste`] over them). O(1): a counter.
    #[inline]
    pub fn total_tail_waste(&self) -> u64 {
        self.tail_waste
    }

    #[inline]
    pub fn stats(&self) -> KvStats {
        self.stats
    }
}
