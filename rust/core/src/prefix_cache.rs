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
//! multiply; lookup/insert/remove are O(block_size) (the verification); LRU
//! operations are O(1) through an intrusive doubly linked list over block ids.

use crate::BlockId;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

/// The keys are already uniformly mixed hashes: hashing them again is waste.
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);
impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

const NIL: u32 = u32::MAX;

pub(crate) enum Lookup {
    /// Verified hit: the block and its entry generation.
    Hit(BlockId, u64),
    /// The hash is taken by an entry with different content or parent.
    Conflict(BlockId),
    Miss,
}

/// Entry data lives in per-block arrays (a block holds at most one entry).
pub(crate) struct PrefixCache {
    block_size: usize,
    map: HashMap<u64, BlockId, BuildHasherDefault<IdentityHasher>>,
    generation: Vec<u64>, // 0: block not cached
    hash: Vec<u64>,
    parent_generation: Vec<u64>,
    extra_key: Vec<u64>,
    tokens: Vec<u32>, // block b's ids at [b*block_size, (b+1)*block_size)
    next_generation: u64,
    // LRU of parked blocks: head = least recently parked = next to evict.
    lru_prev: Vec<u32>,
    lru_next: Vec<u32>,
    in_lru: Vec<bool>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: u32,
    num_entries: u32,
}

impl PrefixCache {
    pub(crate) fn new(num_blocks: u32, block_size: u32) -> Self {
        let n = num_blocks as usize;
        PrefixCache {
            block_size: block_size as usize,
            // At most one entry per block: reserving up front keeps rehashing
            // (a latency spike inside a scheduler step) out of the hot path.
            map: HashMap::with_capacity_and_hasher(n, Default::default()),
            generation: vec![0; n],
            hash: vec![0; n],
            parent_generation: vec![0; n],
            extra_key: vec![0; n],
            tokens: vec![0; n * block_size as usize],
            next_generation: 1,
            lru_prev: vec![NIL; n],
            lru_next: vec![NIL; n],
            in_lru: vec![false; n],
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            num_entries: 0,
        }
    }

    #[inline]
    pub(crate) fn is_cached(&self, b: BlockId) -> bool {
        self.generation[b as usize] != 0
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
        self.in_lru[b as usize]
    }

    /// Finds `h` and verifies the entry against (tokens, extra key, parent generation).
    pub(crate) fn lookup(&self, h: u64, parent_generation: u64, tokens: &[u32], extra_key: u64) -> Lookup {
        let Some(&b) = self.map.get(&h) else { return Lookup::Miss };
        let i = b as usize;
        let bs = self.block_size;
        if self.parent_generation[i] == parent_generation
            && self.extra_key[i] == extra_key
            && self.tokens[i * bs..(i + 1) * bs] == *tokens
        {
            Lookup::Hit(b, self.generation[i])
        } else {
            Lookup::Conflict(b)
        }
    }

    /// Registers block `b` (not cached, hash `h` free); returns its generation.
    pub(crate) fn insert(&mut self, b: BlockId, h: u64, parent_generation: u64, tokens: &[u32], extra_key: u64) -> u64 {
        let i = b as usize;
        debug_assert_eq!(self.generation[i], 0, "block already cached");
        let g = self.next_generation;
        self.next_generation += 1;
        self.generation[i] = g;
        self.hash[i] = h;
        self.parent_generation[i] = parent_generation;
        self.extra_key[i] = extra_key;
        let bs = self.block_size;
        self.tokens[i * bs..(i + 1) * bs].copy_from_slice(tokens);
        let old = self.map.insert(h, b);
        debug_assert!(old.is_none(), "hash slot was taken");
        self.num_entries += 1;
        g
    }

    /// Drops block `b`'s entry (eviction). The block must not be in the LRU.
    pub(crate) fn remove(&mut self, b: BlockId) {
        let i = b as usize;
        debug_assert!(self.generation[i] != 0 && !self.in_lru[i]);
        let removed = self.map.remove(&self.hash[i]);
        debug_assert_eq!(removed, Some(b));
        self.generation[i] = 0;
        self.num_entries -= 1;
    }

    /// Appends an unreferenced cached block at the most-recent end.
    pub(crate) fn park(&mut self, b: BlockId) {
        let i = b as usize;
        debug_assert!(!self.in_lru[i] && self.generation[i] != 0);
        self.in_lru[i] = true;
        self.lru_prev[i] = self.lru_tail;
        self.lru_next[i] = NIL;
        if self.lru_tail == NIL {
            self.lru_head = b;
        } else {
            self.lru_next[self.lru_tail as usize] = b;
        }
        self.lru_tail = b;
        self.lru_len += 1;
    }

    /// Takes `b` out of the LRU (a hit revived it, or it is being evicted).
    pub(crate) fn unpark(&mut self, b: BlockId) {
        let i = b as usize;
        debug_assert!(self.in_lru[i]);
        let (p, n) = (self.lru_prev[i], self.lru_next[i]);
        if p == NIL { self.lru_head = n } else { self.lru_next[p as usize] = n }
        if n == NIL { self.lru_tail = p } else { self.lru_prev[n as usize] = p }
        self.in_lru[i] = false;
        self.lru_len -= 1;
    }

    /// Least recently parked block, still parked and cached.
    #[inline]
    pub(crate) fn oldest_parked(&self) -> Option<BlockId> {
        (self.lru_head != NIL).then_some(self.lru_head)
    }

    /// Parked blocks from least to most recently parked (tests, debugging).
    pub(crate) fn lru_order(&self) -> Vec<BlockId> {
        let mut v = Vec::with_capacity(self.lru_len as usize);
        let mut b = self.lru_head;
        while b != NIL {
            v.push(b);
            b = self.lru_next[b as usize];
        }
        v
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
