//! Property test of `KvCacheManager` against a brute-force model.
//!
//! The model simulates the KV *content*: every block holds the token ids written
//! into its slots (by `append_slots` through the returned slot ids, and by
//! performing the returned copy-on-write copies), exactly as the model runner
//! would. Random sequences of new-sequence-with-prefix-lookup / append / fork /
//! cache_full_blocks / free are applied and after every step we check:
//!
//! 1. **Integrity** — every live table reads back its own tokens through its
//!    block table (so sharing, CoW, eviction and reuse never corrupt anybody);
//! 2. **Prefix-hit soundness** — the blocks a hit returns already hold the
//!    prompt's tokens, the hit is block-aligned and leaves >= 1 token to compute;
//! 3. **Refcounts** — each block's count equals the number of (table, position)
//!    pairs holding it (brute-force count);
//! 4. **Counts** — `num_free_blocks = num_blocks - distinct referenced blocks`;
//!    parked (LRU) and free-list blocks partition the unreferenced ones; cached
//!    count = parked count;
//! 5. **blocks_needed / all-or-nothing** — predicted by the model (new blocks +
//!    CoW of a shared partly-filled tail); `append_slots` fails iff that exceeds
//!    the free count, and then changes nothing; on success the free count drops
//!    by exactly that; slot ids are `block * block_size + offset` of the table's
//!    positions; a copy is reported iff the tail was shared and partly filled;
//! 6. **Stats** — counters equal the model's tallies.
//!
//! Deterministic tests below cover completeness (a registered prefix hits),
//! LRU eviction order (tail first, oldest first) and eviction only when the
//! free list is empty.

#![allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; the MSRV is 1.80

use hybridserve_core::{BlockTable, CoreError, KvCacheManager};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    /// New sequence: prompt = PROMPTS[p][..len], extra key, then match_prefix.
    New { p: usize, len: usize, extra: u64 },
    Append { t: usize, n: usize, seed: u32 },
    CacheFull { t: usize },
    Fork { t: usize },
    Free { t: usize },
}

struct Seq {
    table: BlockTable,
    tokens: Vec<u32>, // all tokens known: prompt + generated; first num_tokens are written
    extra: u64,
}

const BS: usize = 4;

fn prompts() -> Vec<Vec<u32>> {
    // Shared prefixes on purpose: 1 and 2 extend 0; 3 diverges from 0 inside block 1.
    let base: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 11).collect();
    let mut p3 = base.clone();
    p3[5] = 99;
    vec![base.clone(), base[..30].to_vec(), base.iter().chain([5u32, 6, 7].iter()).copied().collect(), p3]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..4, 0usize..24, 0u64..2).prop_map(|(p, len, extra)| Op::New { p, len, extra }),
        5 => (0usize..8, 1usize..10, any::<u32>()).prop_map(|(t, n, seed)| Op::Append { t, n, seed }),
        3 => (0usize..8).prop_map(|t| Op::CacheFull { t }),
        2 => (0usize..8).prop_map(|t| Op::Fork { t }),
        2 => (0usize..8).prop_map(|t| Op::Free { t }),
    ]
}

#[derive(Default)]
struct Tally {
    queries: u64,
    query_tokens: u64,
    hit_tokens: u64,
    hits: u64,
    failures: u64,
    cows: u64,
}

fn refcounts(seqs: &[Seq], n: u32) -> Vec<u32> {
    let mut rc = vec![0u32; n as usize];
    for s in seqs {
        for &b in s.table.blocks() {
            rc[b as usize] += 1;
        }
    }
    rc
}

fn check_invariants(m: &KvCacheManager, seqs: &[Seq], content: &[Vec<Option<u32>>], tally: &Tally) -> Result<(), TestCaseError> {
    let n = m.num_blocks();
    let rc = refcounts(seqs, n);
    for b in 0..n {
        prop_assert_eq!(m.refcount(b), rc[b as usize], "refcount of block {}", b);
    }
    let referenced = rc.iter().filter(|&&c| c > 0).count() as u32;
    prop_assert_eq!(m.num_free_blocks(), n - referenced);
    prop_assert_eq!(m.num_used_blocks(), referenced);
    let lru = m.lru_order();
    let free = m.free_list();
    prop_assert_eq!(m.num_cached_blocks() as usize, lru.len());
    let mut unref: Vec<u32> = lru.iter().chain(free.iter()).copied().collect();
    unref.sort_unstable();
    let expect: Vec<u32> = (0..n).filter(|&b| rc[b as usize] == 0).collect();
    prop_assert_eq!(unref, expect, "free list + parked must partition the unreferenced blocks");
    for &b in &lru {
        prop_assert!(m.is_cached(b), "parked block {} is not cached", b);
    }
    for s in seqs {
        let t = &s.table;
        prop_assert_eq!(t.num_blocks(), t.num_tokens().div_ceil(BS));
        prop_assert_eq!(m.tail_waste(t), t.num_blocks() * BS - t.num_tokens());
        for i in 0..t.num_tokens() {
            let got = content[t.blocks()[i / BS] as usize][i % BS];
            prop_assert_eq!(got, Some(s.tokens[i]), "token {} of a table reads wrong KV", i);
        }
    }
    let st = m.stats();
    prop_assert_eq!(st.prefix_queries, tally.queries);
    prop_assert_eq!(st.prefix_query_tokens, tally.query_tokens);
    prop_assert_eq!(st.prefix_hit_tokens, tally.hit_tokens);
    prop_assert_eq!(st.prefix_hits, tally.hits);
    prop_assert_eq!(st.alloc_failures, tally.failures);
    prop_assert_eq!(st.cow_copies, tally.cows);
    Ok(())
}

fn run(num_blocks: u32, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let prompts = prompts();
    let mut m = KvCacheManager::new(num_blocks, BS as u32, true).unwrap();
    let mut seqs: Vec<Seq> = Vec::new();
    let mut content: Vec<Vec<Option<u32>>> = vec![vec![None; BS]; num_blocks as usize];
    let mut tally = Tally::default();
    for op in ops {
        match op {
            Op::New { p, len, extra } => {
                let tokens = prompts[p][..len].to_vec();
                let mut table = BlockTable::new();
                let free_before = m.num_free_blocks();
                let hit = m.match_prefix(&mut table, &tokens, extra);
                tally.queries += 1;
                tally.query_tokens += len as u64;
                tally.hit_tokens += hit as u64;
                tally.hits += (hit > 0) as u64;
                prop_assert_eq!(hit % BS, 0);
                prop_assert!(hit <= len.saturating_sub(1) / BS * BS, "hit {} leaves nothing to compute", hit);
                prop_assert_eq!(table.num_tokens(), hit);
                prop_assert_eq!(table.num_blocks(), hit / BS);
                for i in 0..hit {
                    prop_assert_eq!(content[table.blocks()[i / BS] as usize][i % BS], Some(tokens[i]), "unsound prefix hit at token {}", i);
                }
                // Revived parked blocks leave the free count; shared ones do not.
                let rc_before = refcounts(&seqs, num_blocks);
                let revived = table.blocks().iter().filter(|&&b| rc_before[b as usize] == 0).count() as u32;
                prop_assert_eq!(m.num_free_blocks(), free_before - revived);
                seqs.push(Seq { table, tokens, extra });
            }
            Op::Append { t, n, seed } => {
                if seqs.is_empty() { continue; }
                let i = t % seqs.len();
                let rc = refcounts(&seqs, num_blocks);
                let s = &mut seqs[i];
                let nt = s.table.num_tokens();
                while s.tokens.len() < nt + n {
                    let k = s.tokens.len() as u32;
                    s.tokens.push(seed.wrapping_mul(2654435761).wrapping_add(k * 40503) % 13);
                }
                let new_blocks = (nt + n).div_ceil(BS) - s.table.num_blocks();
                let cow = nt % BS != 0 && rc[*s.table.blocks().last().unwrap() as usize] > 1;
                let predicted = (new_blocks + cow as usize) as u32;
                prop_assert_eq!(m.blocks_needed(&s.table, n), predicted);
                let free_before = m.num_free_blocks();
                let blocks_before = s.table.blocks().to_vec();
                let (mut slots, mut copies) = (vec![-7], vec![]);
                let r = m.append_slots(&mut s.table, n, &mut slots, &mut copies);
                if predicted > free_before {
                    prop_assert_eq!(r, Err(CoreError::OutOfBlocks { needed: predicted, free: free_before }));
                    tally.failures += 1;
                    prop_assert_eq!(s.table.blocks(), &blocks_before[..]);
                    prop_assert_eq!(s.table.num_tokens(), nt);
                    prop_assert_eq!(slots, vec![-7]);
                    prop_assert!(copies.is_empty());
                    s.tokens.truncate(nt.max(s.tokens.len().min(nt)));
                } else {
                    prop_assert!(r.is_ok());
                    prop_assert_eq!(m.num_free_blocks(), free_before - predicted);
                    if cow {
                        tally.cows += 1;
                        let src = *blocks_before.last().unwrap();
                        let dst = s.table.blocks()[blocks_before.len() - 1];
                        prop_assert_eq!(&copies, &vec![(src, dst)]);
                        content[dst as usize] = content[src as usize].clone();
                    } else {
                        prop_assert!(copies.is_empty());
                        prop_assert_eq!(&s.table.blocks()[..blocks_before.len()], &blocks_before[..]);
                    }
                    prop_assert_eq!(slots.len(), n + 1);
                    for (j, &slot) in slots[1..].iter().enumerate() {
                        let pos = nt + j;
                        let b = s.table.blocks()[pos / BS];
                        prop_assert_eq!(slot, (b as usize * BS + pos % BS) as i32);
                        content[b as usize][pos % BS] = Some(s.tokens[pos]);
                    }
                }
            }
            Op::CacheFull { t } => {
                if seqs.is_empty() { continue; }
                let i = t % seqs.len();
                let before = (m.num_free_blocks(), m.num_cached_blocks());
                let s = &mut seqs[i];
                let nt = s.table.num_tokens();
                m.cache_full_blocks(&mut s.table, &s.tokens[..nt], s.extra);
                prop_assert_eq!((m.num_free_blocks(), m.num_cached_blocks() <= before.1), (before.0, true));
            }
            Op::Fork { t } => {
                if seqs.is_empty() { continue; }
                let i = t % seqs.len();
                let free_before = m.num_free_blocks();
                let child = m.fork(&seqs[i].table);
                prop_assert_eq!(child.blocks(), seqs[i].table.blocks());
                prop_assert_eq!(m.num_free_blocks(), free_before);
                let s = &seqs[i];
                seqs.push(Seq { table: child, tokens: s.tokens[..s.table.num_tokens()].to_vec(), extra: s.extra });
            }
            Op::Free { t } => {
                if seqs.is_empty() { continue; }
                let i = t % seqs.len();
                let mut s = seqs.swap_remove(i);
                m.free(&mut s.table);
                prop_assert_eq!(s.table.num_blocks(), 0);
                prop_assert_eq!(s.table.num_tokens(), 0);
            }
        }
        check_invariants(&m, &seqs, &content, &tally)?;
    }
    for mut s in seqs.drain(..) {
        m.free(&mut s.table);
    }
    check_invariants(&m, &seqs, &content, &tally)?;
    prop_assert_eq!(m.num_free_blocks(), num_blocks);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(384))]
    #[test]
    fn kv_cache_matches_model(num_blocks in 2u32..20, ops in proptest::collection::vec(op_strategy(), 1..60)) {
        run(num_blocks, ops)?;
    }
}

fn append(m: &mut KvCacheManager, t: &mut BlockTable, n: usize) -> Result<Vec<i32>, CoreError> {
    let (mut slots, mut copies) = (vec![], vec![]);
    m.append_slots(t, n, &mut slots, &mut copies)?;
    Ok(slots)
}

#[test]
fn registered_prefix_hits_and_survives_free() {
    let mut m = KvCacheManager::new(16, 4, true).unwrap();
    let prompt: Vec<u32> = (100..114).collect(); // 3 full blocks + 2
    let mut a = BlockTable::new();
    assert_eq!(m.match_prefix(&mut a, &prompt, 0), 0);
    append(&mut m, &mut a, prompt.len()).unwrap();
    m.cache_full_blocks(&mut a, &prompt, 0);
    let a_blocks = a.blocks().to_vec();
    // live hit: shares the 3 full blocks
    let mut b = BlockTable::new();
    assert_eq!(m.match_prefix(&mut b, &prompt, 0), 12);
    assert_eq!(b.blocks(), &a_blocks[..3]);
    assert_eq!(m.refcount(a_blocks[0]), 2);
    // another extra key (e.g. a LoRA or cache salt) must not hit
    let mut c = BlockTable::new();
    assert_eq!(m.match_prefix(&mut c, &prompt, 7), 0);
    // a prompt of exactly 12 tokens may reuse only 2 blocks (one token left to compute)
    let mut d = BlockTable::new();
    assert_eq!(m.match_prefix(&mut d, &prompt[..12], 0), 8);
    m.free(&mut b);
    m.free(&mut d);
    m.free(&mut a);
    // all 3 cached blocks parked, still hit after the owners left
    assert_eq!(m.num_cached_blocks(), 3);
    assert_eq!(m.num_free_blocks(), 16);
    let mut e = BlockTable::new();
    assert_eq!(m.match_prefix(&mut e, &prompt, 0), 12);
    assert_eq!(m.num_cached_blocks(), 0);
    assert_eq!(m.stats().prefix_hits, 3);
    assert_eq!(m.stats().prefix_queries, 5);
}

#[test]
fn eviction_is_lru_tail_first_and_only_when_free_list_is_empty() {
    let mut m = KvCacheManager::new(6, 2, true).unwrap();
    let p: Vec<u32> = vec![1, 2, 3, 4, 5, 6, 7];
    let mut a = BlockTable::new();
    append(&mut m, &mut a, 7).unwrap();
    m.cache_full_blocks(&mut a, &p, 0);
    let ab = a.blocks().to_vec(); // 4 blocks, 3 full and cached
    m.free(&mut a);
    // tail first: the partly filled tail is freed, then blocks 2, 1, 0 parked in that order
    assert_eq!(m.lru_order(), vec![ab[2], ab[1], ab[0]]);
    assert_eq!(m.free_list().len(), 3);
    // 3 new blocks come from the free list: nothing evicted yet
    let mut x = BlockTable::new();
    append(&mut m, &mut x, 6).unwrap();
    assert_eq!(m.stats().evictions, 0);
    assert_eq!(m.num_cached_blocks(), 3);
    // the next block must evict the chain's end first
    append(&mut m, &mut x, 1).unwrap();
    assert_eq!(m.stats().evictions, 1);
    assert_eq!(x.blocks()[3], ab[2]);
    assert_eq!(m.lru_order(), vec![ab[1], ab[0]]);
    // the surviving chain head still hits
    let mut y = BlockTable::new();
    assert_eq!(m.match_prefix(&mut y, &p, 0), 4);
    assert_eq!(y.blocks(), &ab[..2]);
    // and the pool refuses what it does not have, changing nothing
    let before = (x.blocks().to_vec(), m.num_free_blocks());
    assert_eq!(append(&mut m, &mut x, 9), Err(CoreError::OutOfBlocks { needed: 4, free: 0 }));
    assert_eq!((x.blocks().to_vec(), m.num_free_blocks()), before);
    assert_eq!(m.stats().alloc_failures, 1);
}

#[test]
fn fork_then_append_copies_the_shared_tail_once() {
    let mut m = KvCacheManager::new(8, 4, false).unwrap();
    let mut p = BlockTable::new();
    append(&mut m, &mut p, 6).unwrap();
    let mut c = m.fork(&p);
    assert_eq!(m.blocks_needed(&c, 1), 1);
    let (mut slots, mut copies) = (vec![], vec![]);
    m.append_slots(&mut c, 1, &mut slots, &mut copies).unwrap();
    assert_eq!(copies, vec![(p.blocks()[1], c.blocks()[1])]);
    assert_ne!(p.blocks()[1], c.blocks()[1]);
    assert_eq!(slots, vec![(c.blocks()[1] * 4 + 2) as i32]);
    // the parent's tail is now exclusively its own: no second copy
    assert_eq!(m.blocks_needed(&p, 1), 0);
    assert_eq!(m.tail_waste(&p), 2);
    assert_eq!(m.tail_waste(&c), 1);
    m.free(&mut c);
    m.free(&mut p);
    assert_eq!(m.num_free_blocks(), 8);
    assert_eq!(m.num_cached_blocks(), 0);
}

#[test]
fn constructor_rejects_bad_sizes_with_advice() {
    for (n, bs) in [(0, 16), (16, 0), (1 << 28, 16)] {
        match KvCacheManager::new(n, bs, true) {
            Err(CoreError::InvalidArgument(msg)) => assert!(msg.contains("num_blocks") || msg.contains("block_size"), "{msg}"),
            Ok(_) => panic!("accepted num_blocks={n} block_size={bs}"),
            Err(e) => panic!("{e:?}"),
        }
    }
}
