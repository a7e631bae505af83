//! Oracle of the O(1) stats: random workloads (adds with shared prefixes, n > 1,
//! beams re-parented at random, steps with random tokens, aborts, finishes)
//! on small arenas (preemption, prefix hits, evictions, checkpoints), and after
//! EVERY call the counters `stats()` reads are compared with a recomputation
//! from scratch over the scheduler's requests: the running sequences, their
//! tail waste, the blocks more than one table holds (counted from the tables,
//! not from the allocator's refcounts) and the evictable checkpoints (scanned).

use super::request::ReqState;
use super::{FinishReason, RequestParams, Scheduler, SchedulerConfig};
use proptest::prelude::*;
use std::collections::HashMap;

/// `(tail waste, shared blocks, running sequences)` from scratch.
fn recount(s: &Scheduler) -> (u64, u32, u32) {
    let bs = s.cfg.block_size as usize;
    let mut holders: HashMap<u32, u32> = HashMap::new();
    let (mut waste, mut seqs) = (0u64, 0u32);
    for req in s.requests.iter().flatten() {
        let running = req.state == ReqState::Running;
        for q in &req.seqs {
            if !q.table.blocks().is_empty() {
                // What lets the KV manager's totals stand for the running ones.
                assert!(running && q.is_live(), "a table holds blocks outside a live running sequence");
            }
            for &b in q.table.blocks() {
                *holders.entry(b).or_default() += 1;
            }
            if running && q.is_live() {
                seqs += 1;
                waste += (q.table.blocks().len() * bs - q.table.num_tokens()) as u64;
            }
        }
    }
    for (&b, &n) in &holders {
        assert_eq!(s.cache.refcount(b), n, "block {b}: refcount differs from the tables holding it");
    }
    let shared = holders.values().filter(|&&n| n > 1).count() as u32;
    (waste, shared, seqs)
}

fn check(s: &Scheduler, when: &str) {
    let st = s.stats();
    let (waste, shared, seqs) = recount(s);
    assert_eq!(st.tail_waste, waste, "tail_waste after {when}");
    assert_eq!(st.shared_blocks, shared, "shared_blocks after {when}");
    assert_eq!(st.num_running_seqs, seqs, "num_running_seqs after {when}");
    for guard in [s.step, s.step + 1] {
        assert_eq!(
            s.cache.num_evictable_checkpoints(guard, false),
            s.cache.num_evictable_checkpoints(guard, true),
            "evictable checkpoints (guard {guard}) after {when}"
        );
    }
    let guard = s.step + !s.plan_pending as u64;
    let avail = s.cache.kv().num_free_blocks() as u64
        + s.cache.num_evictable_checkpoints(guard, true) as u64 * s.cfg.state_pages as u64;
    assert_eq!(st.available_pages, avail, "available_pages after {when}");
}

#[derive(Debug, Clone)]
enum Op {
    Add { prefix: usize, tail: Vec<u32>, max_tokens: u32, n: u32, beam: bool },
    Step,
    Abort(usize),
    Finish(usize, u32),
}

const PREFIX: [u32; 20] = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59];
const EOS: u32 = 7;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..20, prop::collection::vec(0u32..12, 0..10), 1u32..10, 1u32..4, prop::bool::weighted(0.3))
            .prop_map(|(prefix, tail, max_tokens, n, beam)| Op::Add { prefix, tail, max_tokens, n, beam }),
        6 => Just(Op::Step),
        1 => (0usize..30).prop_map(Op::Abort),
        1 => (0usize..30, 0u32..3).prop_map(|(i, s)| Op::Finish(i, s)),
    ]
}

#[allow(clippy::too_many_arguments)]
fn run(num_pages: u32, block_size: u32, state_pages: u32, prefix: bool, interval: u32, spec: u32, ops: Vec<Op>, mut rng: u64) {
    let mut cfg = SchedulerConfig::new(num_pages, block_size, state_pages, 4, 24, 40);
    cfg.num_speculative_tokens = spec;
    cfg.enable_prefix_caching = prefix;
    cfg.prefix_checkpoint_interval = interval * block_size;
    cfg.max_waiting_tokens = 1000;
    let mut s = Scheduler::new(cfg).unwrap();
    let mut rand = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut ids: Vec<String> = Vec::new();
    let mut now = 0.0;
    check(&s, "construction");
    for op in ops {
        match op {
            Op::Add { prefix, tail, max_tokens, n, beam } => {
                let mut prompt = PREFIX[..prefix].to_vec();
                prompt.extend(tail);
                if prompt.is_empty() {
                    prompt.push(1);
                }
                let params = RequestParams {
                    max_tokens,
                    n,
                    ignore_eos: beam,
                    eos_token_ids: vec![EOS],
                    beam_search: beam,
                    ..Default::default()
                };
                let id = format!("r{}", ids.len());
                if s.add_request(&id, &prompt, params).is_ok() {
                    ids.push(id);
                }
                check(&s, "add_request");
            }
            Op::Step => {
                now += 1.0;
                let out = s.schedule(now).expect("schedule").clone();
                check(&s, "schedule");
                // Re-parent every fully decoded beam request at random.
                let mut handles: Vec<u32> = out.req_indices.clone();
                handles.dedup();
                for h in handles {
                    let id = s.request_id(h).expect("planned").to_string();
                    let w = s.requests[h as usize].as_ref().expect("planned").seqs.len();
                    let parents: Vec<u32> = (0..w).map(|_| (rand() % w as u64) as u32).collect();
                    if s.reorder_beams(&id, &parents).is_ok() {
                        check(&s, "reorder_beams");
                    }
                }
                // Speculative decoding: a random accepted count per drafted entry
                // (its accepted drafts, then a token), random drafts for the next step.
                let (mut sampled, mut accepted, mut drafts) = (Vec::new(), Vec::new(), Vec::new());
                for e in 0..out.num_seqs() {
                    let nd = out.num_draft_tokens[e] as usize;
                    let ns = out.num_samples[e] as usize;
                    if nd > 0 {
                        let a = 1 + (rand() % (nd as u64 + 1)) as usize;
                        let q0 = out.query_start_loc[e] as usize;
                        sampled.extend_from_slice(&out.input_ids[q0 + 1..q0 + a]);
                        sampled.push((rand() % 9) as i32);
                        accepted.push(a as i32);
                    } else {
                        sampled.extend((0..ns).map(|_| (rand() % 9) as i32));
                        accepted.push(ns as i32);
                    }
                    let beam = s.requests[out.req_indices[e] as usize].as_ref().is_some_and(|r| r.params.beam_search);
                    let nd_next = if ns == 0 || beam { 0 } else { (rand() % (spec as u64 + 1)) as usize };
                    drafts.push((0..nd_next).map(|_| (rand() % 9) as u32).collect::<Vec<u32>>());
                }
                if spec == 0 {
                    s.update(&sampled).expect("update");
                } else {
                    s.update_spec(&sampled, Some(&accepted), Some(&drafts)).expect("update");
                }
                check(&s, "update");
            }
            Op::Abort(i) if !ids.is_empty() => {
                let _ = s.abort(&ids[i % ids.len()]);
                check(&s, "abort");
            }
            Op::Finish(i, sm) if !ids.is_empty() => {
                let _ = s.finish(&ids[i % ids.len()], sm, FinishReason::Stop);
                check(&s, "finish");
            }
            _ => {}
        }
    }
    let mut steps = 0;
    while s.has_unfinished() {
        now += 1.0;
        let total: i32 = s.schedule(now).expect("schedule").num_samples.iter().sum();
        check(&s, "schedule (drain)");
        s.update(&vec![1; total as usize]).expect("update");
        check(&s, "update (drain)");
        steps += 1;
        assert!(steps < 2000, "did not drain");
    }
    let st = s.stats();
    assert_eq!((st.tail_waste, st.shared_blocks, st.num_running_seqs), (0, 0, 0));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]
    #[test]
    fn o1_stats_match_a_recount_after_every_call(
        num_pages in prop_oneof![2 => 8u32..30, 1 => 60u32..120],
        block_size in prop::sample::select(vec![1u32, 2, 4]),
        state_pages in 0u32..3,
        prefix in any::<bool>(),
        interval in prop::sample::select(vec![0u32, 1, 2]),
        spec in prop::sample::select(vec![0u32, 0, 1, 3]),
        ops in prop::collection::vec(op(), 1..60),
        seed in any::<u64>(),
    ) {
        run(num_pages.max(state_pages + 1), block_size, state_pages, prefix, interval, spec, ops, seed | 1);
    }
}
