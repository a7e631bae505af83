//! Prefix cache: full KV blocks keyed by a chained content hash, plus an LRU list
//! of the cached blocks that nobody references ("parked").
//!
//! # Keys and collision safety
//! Block `i` of a sequence is keyed by `h_i = hash_block(h_{i-1}, tokens_i,
//! extra_key)` with `h_{-1} = ROOT_HASH`. The 64-bit hash only *locates* an entry;
//! a hit is accepted only after verifying, against the entry, (a) the block's
//! token ids, (b) the extra key and (c) the generation of the parent entry, which
//! must be exactly the entry verified for block `i-1` of the same lookup.
//! Generations are unique and never reused, so by induction a hit proves that
//! the whole prefix `tokens[..(i+1)*block_size]` equals the one the block was
//! computed from: a collision can cost a cache miss, never wrong KV.
//!
//! Known, deliberate miss: when two sequences computed the same prefix at once,
//! the second one's later blocks chain onto the first one's entries; if those
//! are evicted and the prefix is registered again while the second sequence
//! still lives, its (referenced) descendants no longer verify and that branch
//! stays uncached until it is freed. Adopting them would mean trusting a 64-bit
//! parent hash, which this cache never does.
//!
//! # Costs
//! `hash_block` is a wyhash-style multiply-fold, 16 bytes per 64x64->128-bit
//! multiply; lookup/insert/remove are O(block_size) (the verification), through
//! a fixed-size open-addressing index; LRU operations are O(1) amortized (a
//! FIFO of park stamps with lazy removal). Each block's entry data is one
//! 64-byte record, and the batch paths prefetch, because at scale these
//! operations are bound by cache misses on random blocks, not by instructions.

use crate::BlockId;
use std::collections::VecDeque;

/// Parent hash of a sequence's first block.
pub const ROOT_HASH: u64 = 0x6a09_e667_f3bc_c908;
/// Parent generation of a sequence's first block (real generations start at 1).
pub const ROOT_GENERATION: u64 = 0;

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;

#[inline(always)]
fn mum(a: u64, b: u64) -> u64 {
    let p = (a as u128).wrapping_mul(b as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

/// Chained hash of one block: (parent hash, token ids, extra key). Fast and
/// well-mixed but not cryptographic: safety comes from verification on hit.
#[inline]
pub fn hash_block(parent: u64, tokens: &[u32], extra_key: u64) -> u64 {
    let mut h = mum(parent ^ P0, extra_key ^ P1);
    let mut quads = tokens.chunks_exact(4);
    for q in &mut quads {
        let a = q[0] as u64 | (q[1] as u64) << 32;
        let b = q[2] as u64 | (q[3] as u64) << 32;
        h = mum(a ^ h ^ P1, b ^ P2);
    }
    for &t in quads.remainder() {
        h = mum(h ^ t as u64 ^ P1, P2);
    }
    mum(h ^ P0, tokens.len() as u64 ^ P2)
}


pub(crate) enum Lookup {
    /// Verified hit: the block and its entry generation.
    Hit(BlockId, u64),
    /// The hash is taken by an entry with different content or parent.
    Conflict(BlockId),
    Miss,
}

/// Everything the cache keeps about one block, in one cache line: a lookup,
/// an insert, an eviction or an LRU move of block `b` touches `meta[b]` (and
/// the token ids) only, instead of one line per field array.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct BlockMeta {
    hash: u64,
    /// 0: block not cached.
    generation: u64,
    parent_generation: u64,
    extra_key: u64,
    /// Stamp of the park that put this block in the LRU (see `PrefixCache::lru`).
    park_stamp: u64,
    in_lru: bool,
    /// DeltaNet state checkpoints whose block chain includes this entry: its
    /// eviction must drop them (see `KvCacheManager::take_dropped_generations`).
    ckpt_refs: u32,
    /// Sum of the tokens of those checkpoints (the eviction order's cost).
    ckpt_tokens: u64,
    /// While parked with no checkpoint reference: the stamp it is listed under
    /// in `lru_plain` (or `late_plain` when `late`); 0 otherwise.
    plain_stamp: u64,
    late: bool,
}

const EMPTY_META: BlockMeta = BlockMeta {
    hash: 0,
    generation: 0,
    parent_generation: 0,
    extra_key: 0,
    park_stamp: 0,
    in_lru: false,
    ckpt_refs: 0,
    ckpt_tokens: 0,
    plain_stamp: 0,
    late: false,
};

/// Entry data lives in per-block records (a block holds at most one entry).
pub(crate) struct PrefixCache {
    block_size: usize,
    /// hash -> block index (see [`HashIndex`]).
    index: HashIndex,
    meta: Vec<BlockMeta>,
    tokens: Vec<u32>, // block b's ids at [b*block_size, (b+1)*block_size)
    next_generation: u64,
    /// LRU of parked blocks, least recently parked (next to evict) first: a
    /// FIFO of `(block, park stamp)`. Unparking a block in the middle (a prefix
    /// hit) only clears its `in_lru`, leaving a stale entry (its stamp no
    /// longer matches) that is dropped when it reaches the front or at the next
    /// compaction. The front entry is always live. An array rather than a
    /// linked list: the next victims are known without chasing pointers, so
    /// their records can be prefetched.
    lru: VecDeque<(BlockId, u64)>,
    /// The parked blocks no checkpoint's chain holds, oldest park first: those
    /// parked so (a FIFO like `lru`, stale entries skipped) and those that
    /// became so while parked (`late_plain`, by park stamp). The eviction
    /// order takes the oldest of the two fronts in O(1) amortised (O(log n)
    /// for a late one) however many chain blocks are parked.
    lru_plain: VecDeque<(BlockId, u64)>,
    late_plain: std::collections::BTreeSet<(u64, BlockId)>,
    /// Parked blocks that some checkpoint's chain holds.
    parked_chain: u32,
    next_park_stamp: u64,
    lru_len: u32,
    num_entries: u32,
}

impl PrefixCache {
    pub(crate) fn new(num_blocks: u32, block_size: u32) -> Self {
        let n = num_blocks as usize;
        PrefixCache {
            block_size: block_size as usize,
            index: HashIndex::new(num_blocks),
            meta: vec![EMPTY_META; n],
            tokens: vec![0; n * block_size as usize],
            next_generation: 1,
            // Holds every parked block without growing (stale entries may
            // still make it grow, amortized, up to twice that).
            lru: VecDeque::with_capacity(n),
            lru_plain: VecDeque::with_capacity(n),
            late_plain: std::collections::BTreeSet::new(),
            parked_chain: 0,
            next_park_stamp: 1,
            lru_len: 0,
            num_entries: 0,
        }
    }

    #[inline]
    pub(crate) fn is_cached(&self, b: BlockId) -> bool {
        self.meta[b as usize].generation != 0
    }

    #[inline]
    pub(crate) fn num_parked(&self) -> u32 {
        self.lru_len
    }

    #[inline]
    pub(crate) fn num_entries(&self) -> u32 {
        self.num_entries
    }

    #[inline]
    pub(crate) fn is_parked(&self, b: BlockId) -> bool {
        self.meta[b as usize].in_lru
    }

    /// Finds `h` and verifies the entry against (tokens, extra key, parent generation).
    #[inline]
    pub(crate) fn lookup(&self, h: u64, parent_generation: u64, tokens: &[u32], extra_key: u64) -> Lookup {
        let meta = &self.meta;
        let Some(b) = self.index.find(h, |b| meta[b as usize].hash == h) else { return Lookup::Miss };
        let i = b as usize;
        let m = &self.meta[i];
        let bs = self.block_size;
        if m.parent_generation == parent_generation
            && m.extra_key == extra_key
            && self.tokens[i * bs..(i + 1) * bs] == *tokens
        {
            Lookup::Hit(b, m.generation)
        } else {
            Lookup::Conflict(b)
        }
    }

    /// Registers block `b` (not cached, hash `h` free); returns its generation.
    #[inline]
    pub(crate) fn insert(&mut self, b: BlockId, h: u64, parent_generation: u64, tokens: &[u32], extra_key: u64) -> u64 {
        let i = b as usize;
        let g = self.next_generation;
        self.next_generation += 1;
        let m = &mut self.meta[i];
        debug_assert_eq!(m.generation, 0, "block already cached");
        m.generation = g;
        m.hash = h;
        m.parent_generation = parent_generation;
        m.extra_key = extra_key;
        let bs = self.block_size;
        self.tokens[i * bs..(i + 1) * bs].copy_from_slice(tokens);
        debug_assert!(self.index.find(h, |x| self.meta[x as usize].hash == h).is_none(), "hash slot was taken");
        self.index.insert(h, b);
        self.num_entries += 1;
        g
    }

    /// The block holding the entry `(h, generation)`, if it is still cached.
    #[inline]
    pub(crate) fn block_of(&self, h: u64, generation: u64) -> Option<BlockId> {
        let meta = &self.meta;
        let b = self.index.find(h, |b| meta[b as usize].hash == h)?;
        (meta[b as usize].generation == generation).then_some(b)
    }

    /// Whether block `b` still holds the entry of `generation`.
    #[inline]
    pub(crate) fn holds(&self, b: BlockId, generation: u64) -> bool {
        self.meta[b as usize].generation == generation
    }

    /// One checkpoint of `tokens` tokens more (`up`) or less depending on `b`.
    #[inline]
    pub(crate) fn ckpt_ref(&mut self, b: BlockId, up: bool, tokens: u64) {
        let m = &mut self.meta[b as usize];
        if m.in_lru && up && m.ckpt_refs == 0 {
            // Plain -> chain while parked: leaves the plain lists.
            self.parked_chain += 1;
            if m.late {
                self.late_plain.remove(&(m.plain_stamp, b));
            }
            m.plain_stamp = 0;
            m.late = false;
        } else if m.in_lru && !up && m.ckpt_refs == 1 {
            // Chain -> plain while parked: listed by its park stamp.
            self.parked_chain -= 1;
            m.plain_stamp = m.park_stamp;
            m.late = true;
            self.late_plain.insert((m.park_stamp, b));
        }
        if up {
            m.ckpt_refs += 1;
            m.ckpt_tokens += tokens;
        } else {
            m.ckpt_refs -= 1;
            m.ckpt_tokens -= tokens;
        }
    }

    /// `(checkpoints depending on b, their tokens)`.
    #[inline]
    pub(crate) fn ckpt_deps(&self, b: BlockId) -> (u32, u64) {
        let m = &self.meta[b as usize];
        (m.ckpt_refs, m.ckpt_tokens)
    }

    /// Parked blocks that some checkpoint's chain holds.
    #[inline]
    pub(crate) fn num_parked_chain(&self) -> u32 {
        self.parked_chain
    }

    #[inline]
    fn plain_entry_live(meta: &[BlockMeta], (b, stamp): (BlockId, u64)) -> bool {
        let m = &meta[b as usize];
        m.in_lru && m.plain_stamp == stamp && !m.late
    }

    /// Drops block `b`'s entry (eviction). The block must not be in the LRU.
    /// Returns the entry's generation if checkpoints depended on it.
    #[inline]
    pub(crate) fn remove(&mut self, b: BlockId) -> Option<u64> {
        let m = &mut self.meta[b as usize];
        debug_assert!(m.generation != 0 && !m.in_lru);
        let dropped = (m.ckpt_refs > 0).then_some(m.generation);
        m.ckpt_refs = 0;
        m.ckpt_tokens = 0;
        m.generation = 0;
        let h = m.hash;
        self.index.remove(h, b);
        self.num_entries -= 1;
        dropped
    }

    #[inline]
    fn lru_entry_live(meta: &[BlockMeta], (b, stamp): (BlockId, u64)) -> bool {
        let m = &meta[b as usize];
        m.in_lru && m.park_stamp == stamp
    }

    /// Appends an unreferenced cached block at the most-recent end.
    #[inline]
    pub(crate) fn park(&mut self, b: BlockId) {
        let stamp = self.next_park_stamp;
        self.next_park_stamp += 1;
        let m = &mut self.meta[b as usize];
        debug_assert!(!m.in_lru && m.generation != 0);
        m.in_lru = true;
        m.park_stamp = stamp;
        if m.ckpt_refs == 0 {
            m.plain_stamp = stamp;
            m.late = false;
            self.lru_plain.push_back((b, stamp));
        } else {
            self.parked_chain += 1;
        }
        self.lru.push_back((b, stamp));
        self.lru_len += 1;
        // Stale entries are at most half: compaction (O(entries)) is paid for
        // by the parks that made them stale.
        if self.lru.len() > 2 * self.lru_len as usize + 64 {
            let meta = &self.meta;
            self.lru.retain(|&e| Self::lru_entry_live(meta, e));
        }
        if self.lru_plain.len() > 2 * self.lru_len as usize + 64 {
            let meta = &self.meta;
            self.lru_plain.retain(|&e| Self::plain_entry_live(meta, e));
        }
    }

    /// Takes `b` out of the LRU (a hit revived it, or it is being evicted).
    #[inline]
    pub(crate) fn unpark(&mut self, b: BlockId) {
        let m = &mut self.meta[b as usize];
        debug_assert!(m.in_lru);
        m.in_lru = false;
        if m.ckpt_refs > 0 {
            self.parked_chain -= 1;
        } else if m.late {
            self.late_plain.remove(&(m.plain_stamp, b));
        }
        m.plain_stamp = 0;
        m.late = false;
        self.lru_len -= 1;
        while let Some(&e) = self.lru_plain.front() {
            if Self::plain_entry_live(&self.meta, e) {
                break;
            }
            self.lru_plain.pop_front();
        }
        if self.lru.front().is_some_and(|&(f, _)| f == b) {
            self.lru.pop_front();
            while let Some(&e) = self.lru.front() {
                if Self::lru_entry_live(&self.meta, e) {
                    break;
                }
                self.lru.pop_front();
            }
        }
    }

    /// Prefetch hints for a coming lookup or insert of hash `h`.
    #[inline]
    pub(crate) fn prefetch_hash(&self, h: u64) {
        self.index.prefetch(h);
    }

    /// Prefetch hints for registering block `b` (its record and token ids).
    #[inline]
    pub(crate) fn prefetch_block(&self, b: BlockId) {
        let i = b as usize;
        crate::prefetch(&self.meta[i]);
        crate::prefetch(self.tokens[i * self.block_size..].as_ptr());
    }

    /// Prefetch hint for block `b`'s record only (freeing: `is_cached`, `park`).
    #[inline]
    pub(crate) fn prefetch_block_record(&self, b: BlockId) {
        crate::prefetch(&self.meta[b as usize]);
    }

    /// While evicting the LRU front: prefetches the records of the victims a
    /// few evictions ahead and the index slot of a nearer one (whose record the
    /// same call prefetched a few evictions ago), so evictions in a row overlap
    /// their cache misses. Entries may be stale: then a hint is merely wasted.
    #[inline]
    pub(crate) fn prefetch_eviction_successors(&self) -> Option<BlockId> {
        if let Some(&(far, _)) = self.lru.get(8) {
            crate::prefetch(&self.meta[far as usize]);
        }
        let &(near, _) = self.lru.get(4)?;
        self.index.prefetch(self.meta[near as usize].hash);
        Some(near)
    }

    /// Least recently parked block, still parked and cached.
    #[inline]
    pub(crate) fn oldest_parked(&self) -> Option<BlockId> {
        self.lru.front().map(|&(b, _)| b)
    }

    /// The least recently parked block that no checkpoint's chain holds
    /// (O(1) unless parked chain blocks sit at the front of the LRU: they are
    /// stepped over).
    pub(crate) fn oldest_plain_parked(&self) -> Option<BlockId> {
        let meta = &self.meta;
        // The FIFO's front is live after every unpark (stale ones are popped there);
        // entries made stale by a checkpoint reference while parked are stepped over.
        let fifo = self.lru_plain.iter().copied().find(|&e| Self::plain_entry_live(meta, e));
        let late = self.late_plain.first().map(|&(s, b)| (b, s));
        match (fifo, late) {
            (Some(f), Some(l)) => Some(if f.1 < l.1 { f.0 } else { l.0 }),
            (f, l) => f.or(l).map(|(b, _)| b),
        }
    }

    /// The stamp of the park that put `b` in the LRU (larger: parked later).
    #[inline]
    pub(crate) fn park_stamp(&self, b: BlockId) -> u64 {
        self.meta[b as usize].park_stamp
    }

    /// The generation of `b`'s entry (0: not cached).
    #[inline]
    pub(crate) fn generation(&self, b: BlockId) -> u64 {
        self.meta[b as usize].generation
    }

    /// Parked blocks from least to most recently parked (tests, debugging).
    pub(crate) fn lru_order(&self) -> Vec<BlockId> {
        let meta = &self.meta;
        self.lru.iter().filter(|&&e| Self::lru_entry_live(meta, e)).map(|&(b, _)| b).collect()
    }
}

const EMPTY_SLOT: u64 = u64::MAX;

/// The hash -> block map: open addressing with linear probing over one array
/// of 8-byte slots `(block << 32) | (hash as u32)`, at most one entry per block,
/// sized once for `num_blocks` entries (load <= 2/3: never grows, never
/// rehashes inside a step). A slot's home is `hash & mask`, recomputable from
/// the 32 stored hash bits, so removal shifts later entries back (no
/// tombstones). One probe touches one cache line (8 slots) almost always,
/// where a general map touches a control word and a bucket; the stored bits
/// settle nearly every mismatch without reading the block's record, and the
/// caller's full 64-bit comparison settles the rest.
struct HashIndex {
    slots: Vec<u64>,
    mask: usize,
}

impl HashIndex {
    fn new(num_blocks: u32) -> Self {
        let n = num_blocks as usize;
        // Block ids are below 2^31, so the capacity stays <= 2^32 and the mask
        // fits the stored 32 hash bits.
        let cap = (n + n / 2 + 1).next_power_of_two().max(8);
        HashIndex { slots: vec![EMPTY_SLOT; cap], mask: cap - 1 }
    }

    #[inline]
    fn home(&self, low: u32) -> usize {
        low as usize & self.mask
    }

    /// The block stored under `h`; `is_h(b)` confirms the full 64-bit hash.
    #[inline]
    fn find(&self, h: u64, is_h: impl Fn(BlockId) -> bool) -> Option<BlockId> {
        let low = h as u32;
        let mut i = self.home(low);
        loop {
            let s = self.slots[i];
            if s == EMPTY_SLOT {
                return None;
            }
            if s as u32 == low && is_h((s >> 32) as u32) {
                return Some((s >> 32) as u32);
            }
            i = (i + 1) & self.mask;
        }
    }

    #[inline]
    fn prefetch(&self, h: u64) {
        crate::prefetch(&self.slots[self.home(h as u32)]);
    }

    /// Adds `h -> b`; `h` must not be present.
    #[inline]
    fn insert(&mut self, h: u64, b: BlockId) {
        let low = h as u32;
        let mut i = self.home(low);
        while self.slots[i] != EMPTY_SLOT {
            i = (i + 1) & self.mask;
        }
        self.slots[i] = (b as u64) << 32 | low as u64;
    }

    /// Removes the entry `h -> b` (present), shifting back the entries after it
    /// that would otherwise become unreachable.
    #[inline]
    fn remove(&mut self, h: u64, b: BlockId) {
        let want = (b as u64) << 32 | (h as u32) as u64;
        let mut i = self.home(h as u32);
        while self.slots[i] != want {
            debug_assert!(self.slots[i] != EMPTY_SLOT, "removed hash not in the index");
            i = (i + 1) & self.mask;
        }
        // Backward-shift deletion: `i` is the hole.
        let mut j = i;
        loop {
            j = (j + 1) & self.mask;
            let s = self.slots[j];
            if s == EMPTY_SLOT {
                break;
            }
            // An entry may fill the hole unless its home lies cyclically in (i, j].
            let home = self.home(s as u32);
            if (j.wrapping_sub(home) & self.mask) >= (j.wrapping_sub(i) & self.mask) {
                self.slots[i] = s;
                i = j;
            }
        }
        self.slots[i] = EMPTY_SLOT;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_depends_on_every_input() {
        let t: Vec<u32> = (0..16).collect();
        let h = hash_block(ROOT_HASH, &t, 0);
        assert_ne!(h, hash_block(ROOT_HASH ^ 1, &t, 0));
        assert_ne!(h, hash_block(ROOT_HASH, &t, 1));
        for i in 0..16 {
            let mut u = t.clone();
            u[i] ^= 1;
            assert_ne!(h, hash_block(ROOT_HASH, &u, 0), "token {i} ignored");
        }
        let odd: Vec<u32> = (0..5).collect();
        assert_ne!(hash_block(ROOT_HASH, &odd, 0), hash_block(ROOT_HASH, &odd[..4], 0));
    }
}

#[cfg(test)]
mod index_tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts/removes/finds against a HashMap, with hashes drawn from a
    /// tiny range of home slots (long clusters, wrap-around) and shared low bits.
    #[test]
    fn hash_index_matches_a_map() {
        let n = 40u32;
        let mut idx = HashIndex::new(n);
        let mut model: HashMap<u64, BlockId> = HashMap::new();
        let mut hash_of: Vec<Option<u64>> = vec![None; n as usize];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for step in 0..200_000 {
            let r = rnd();
            let b = (r % n as u64) as u32;
            // Few distinct low parts near the top of the table (wrap-around),
            // high parts that differ (same stored bits, different full hash).
            let low = (idx.mask as u64 - 3 + (r >> 8) % 6) & 0xffff_ffff;
            let h = ((r >> 20) % 5) << 32 | low;
            match hash_of[b as usize] {
                Some(old) => {
                    idx.remove(old, b);
                    model.remove(&old);
                    hash_of[b as usize] = None;
                }
                None if !model.contains_key(&h) => {
                    idx.insert(h, b);
                    model.insert(h, b);
                    hash_of[b as usize] = Some(h);
                }
                None => {}
            }
            if step % 7 == 0 {
                for hi in 0..5u64 {
                    for l in 0..8u64 {
                        let q = hi << 32 | ((idx.mask as u64 - 3 + l) & 0xffff_ffff);
                        let got = idx.find(q, |b| hash_of[b as usize] == Some(q));
                        assert_eq!(got, model.get(&q).copied(), "step {step} hash {q:#x}");
                    }
                }
            }
        }
    }
}
