//! Model-based test of the scheduler: random workloads (adds, steps with random
//! samples, aborts, finishes) checked against an independent oracle that keeps
//!   * each sample's true token stream (prompt + the tokens this test sampled),
//!   * a simulated KV memory (slot -> the token prefix whose KV was written there),
//!     fed by the plan's slot mapping and block copies and read through the
//!     caller-side block-table buffer built from the incremental row updates,
//!   * a simulated DeltaNet state per arena page (the tokens the state it holds
//!     has consumed), read and written through the caller-side state page
//!     table built from the incremental row updates, fed by the plan, its page
//!     copies and its mid-chunk checkpoint writes,
//!   * the stop rule and the admission rule, re-implemented here.
//!   * DeltaNet checkpoints: each live one's pages hold (in the simulated state
//!     memory) exactly the token prefix that the simulated KV of its chain's last
//!     block was computed from, and no entry runs on a checkpoint's pages;
//!     prefix-cache hits may start a sequence at any block boundary, and the
//!     state it starts from must then be exactly its prefix.
//!
//!   * priorities: admission in key order (priority with aging, then arrival),
//!     every priority-preemption victim outranked by the waiting head (strictly
//!     larger priority, key larger by more than the threshold), at most the
//!     per-step bound, none among equal priorities, and no waiting head left
//!     out while outranked requests hold the room it needs (checked where
//!     sequences are the only scarce resource).
//!
//! So "attention would read the right KV", "the recurrent state is the right
//! one", "a preempted request resumes with the same tokens", "the budget is never
//! exceeded", "FCFS within a priority" and "everything finishes and every page
//! comes back" are all checked against things the scheduler did not compute.
//!
//! The arena (one pool of pages): after every schedule() each page is exactly
//! one of free, parked cached block, referenced KV block (refcount = the
//! number of block tables holding it), a running state's page or a
//! checkpoint's page (no page used twice, none leaked); the stats' per-use
//! counts agree; and when admission stops at the waiting head for pages, the
//! pages that could still be handed out are fewer than what the head would
//! need without any prefix hit (it refuses only when the bytes are gone).

mod arena;
mod eviction;
mod oracle;
mod starvation;
mod step;

use hybridserve_core::scheduler::{FinishReason, RequestParams, Scheduler, SchedulerConfig};
use oracle::{Harness, EOS, SHARED, STOP};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone)]
pub(crate) enum Op {
    Add { prefix: usize, tail: Vec<u32>, max_tokens: u32, min_tokens: u32, n: u32, priority: i32, ignore_eos: bool, beam: bool },
    Dup(usize),
    Step,
    Abort(usize),
    Finish(usize, u32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum St {
    Waiting,
    Running,
    Done,
}

fn ops_strategy() -> impl Strategy<Value = Vec<Op>> {
    let add = (0usize..25, prop::collection::vec(0u32..40, 0..20), 1u32..12, 0u32..4, 1u32..4, -3i32..3, any::<bool>(), prop::bool::weighted(0.25))
        .prop_map(|(prefix, tail, max_tokens, min_tokens, n, priority, ignore_eos, beam)| Op::Add {
            prefix,
            tail,
            max_tokens,
            min_tokens,
            n,
            priority,
            ignore_eos,
            beam,
        });
    let op = prop_oneof![
        4 => add,
        6 => Just(Op::Step),
        1 => (0usize..40).prop_map(Op::Abort),
        1 => (0usize..40, 0u32..3).prop_map(|(i, s)| Op::Finish(i, s)),
        1 => (0usize..40).prop_map(Op::Dup),
    ];
    prop::collection::vec(op, 1..80)
}

#[derive(Debug, Clone)]
struct Cfg {
    num_pages: u32,
    block_size: u32,
    state_pages: u32,
    max_num_seqs: u32,
    extra_budget: u32,
    prefix: bool,
    thresh: u32,
    aging: u32,
    max_waiting: u32,
    reserve: bool,
    /// prefix_checkpoint_interval in blocks (0 = off).
    interval_blocks: u32,
    prio_threshold: u32,
    prio_bound: u32,
    /// num_speculative_tokens.
    spec: u32,
}

fn cfg_strategy() -> impl Strategy<Value = Cfg> {
    let prio = (prop::sample::select(vec![0u32, 1, 2]), prop::sample::select(vec![0u32, 1, 4]), prop::sample::select(vec![0u32, 0, 1, 2, 3]));
    ((prop_oneof![3 => 6u32..60, 1 => 200u32..260], prop::sample::select(vec![1u32, 2, 4]), 1u32..4, 1u32..6, 0u32..24, any::<bool>(), prop::sample::select(vec![0u32, 3, 8]), prop::sample::select(vec![0u32, 2]), 2u32..12, prop::bool::weighted(0.2), prop::sample::select(vec![0u32, 0, 1, 3])), prio)
        .prop_map(|((num_pages, block_size, state_pages, max_num_seqs, extra_budget, prefix, thresh, aging, max_waiting, reserve, interval_blocks), (prio_threshold, prio_bound, spec))| Cfg {
            num_pages,
            block_size,
            state_pages,
            max_num_seqs,
            extra_budget,
            prefix,
            thresh,
            aging,
            max_waiting,
            reserve,
            interval_blocks,
            prio_threshold,
            prio_bound,
            spec,
        })
}

fn run(c: Cfg, ops: Vec<Op>, seed: u64) {
    let mut cfg = SchedulerConfig::new(c.num_pages.max(c.state_pages + 1), c.block_size, c.state_pages, c.max_num_seqs, c.max_num_seqs + c.extra_budget, 40);
    cfg.enable_prefix_caching = c.prefix;
    cfg.long_prefill_token_threshold = c.thresh;
    cfg.aging_interval_steps = c.aging;
    cfg.max_waiting_requests = c.max_waiting;
    cfg.max_waiting_tokens = 120;
    cfg.reserve_max_context = c.reserve;
    cfg.prefix_checkpoint_interval = c.interval_blocks * c.block_size;
    cfg.priority_preemption_threshold = c.prio_threshold;
    cfg.max_priority_preemptions_per_step = c.prio_bound;
    cfg.num_speculative_tokens = c.spec;
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    s.record_evictions(true);
    let mbps = cfg.max_blocks_per_seq() as usize;
    let mut h = Harness {
        s,
        rows: vec![vec![-7; mbps]; cfg.max_num_seqs as usize],
        st_rows: vec![vec![-7; cfg.state_pages as usize]; cfg.max_num_seqs as usize],
        cfg,
        reqs: vec![],
        by_handle: HashMap::new(),
        kv_mem: HashMap::new(),
        state_mem: HashMap::new(),
        outside: HashSet::new(),
        rng: seed | 1,
        step: 0,
        beam_reorders: 0,
        evictions_checked: 0,
        spec_drafts: 0,
        spec_accepted: 0,
        spec_by_pos: vec![0; c.spec as usize],
    };
    let mut next = 0;
    for op in ops {
        match op {
            Op::Add { prefix, tail, max_tokens, min_tokens, n, priority, ignore_eos, beam } => {
                let mut prompt = SHARED[..prefix].to_vec();
                prompt.extend(tail);
                if prompt.is_empty() {
                    prompt.push(1);
                }
                // Beams stop only at max_tokens (the caller handles EOS).
                let params = RequestParams {
                    max_tokens,
                    min_tokens,
                    n,
                    priority,
                    ignore_eos: ignore_eos || beam,
                    eos_token_ids: vec![EOS],
                    stop_token_ids: if beam { vec![] } else { vec![STOP] },
                    arrival_time: h.step as f64,
                    beam_search: beam,
                    ..Default::default()
                };
                h.add(format!("r{next}"), prompt, params);
                next += 1;
            }
            Op::Dup(i) if !h.reqs.is_empty() => {
                let r = &h.reqs[i % h.reqs.len()];
                let (id, prompt, params) = (r.id.clone(), r.prompt.clone(), r.params.clone());
                h.add(id, prompt, params);
            }
            Op::Step => h.do_step(),
            Op::Abort(i) if !h.reqs.is_empty() => {
                let i = i % h.reqs.len();
                h.finish_outside(i, None, FinishReason::Abort);
            }
            Op::Finish(i, sm) if !h.reqs.is_empty() => {
                let i = i % h.reqs.len();
                let sm = sm % h.reqs[i].params.n;
                h.finish_outside(i, Some(sm), FinishReason::Stop);
            }
            _ => {}
        }
    }
    // Drain: every admitted request finishes, within a bounded number of steps.
    let mut steps = 0;
    while h.s.has_unfinished() {
        h.do_step();
        steps += 1;
        assert!(steps < 5000, "workload did not drain: livelock");
    }
    // Nothing is held once nothing is unfinished, before any further step.
    let st = h.s.stats();
    assert_eq!((st.kv_pages, st.running_state_pages), (0, 0), "pages held after the last request ended");
    h.do_step(); // reports any outstanding finished-outside entries
    assert!(h.reqs.iter().all(|r| r.st == St::Done), "a request never finished");
    let st = h.s.stats();
    assert_eq!(st.kv_pages, 0, "KV pages leaked");
    assert_eq!(st.running_state_pages, 0, "state pages leaked");
    assert_eq!(st.free_pages + st.cached_pages + st.checkpoint_pages, st.num_pages, "pages leaked");
    assert_eq!(st.checkpoint_pages as usize, h.s.checkpoints().len() * h.cfg.state_pages as usize);
    assert_eq!(st.available_pages, st.num_pages as u64, "a page is not reclaimable after the drain");
    assert_eq!(st.reserved_pages, 0);
    assert_eq!(
        (st.spec_draft_tokens, st.spec_accepted_tokens, &st.spec_accepted_by_position),
        (h.spec_drafts, h.spec_accepted, &h.spec_by_pos),
        "speculative decoding counters"
    );
    if std::env::var("SCHED_COVERAGE").is_ok() {
        eprintln!(
            "COV spec_drafts={} spec_accepted={} evictions_checked={} reorders={} steps={} preempt={} prio={} hit_tokens={} cow={} forks={} reqs={} aborted={} evict={} ck_hits={} skipped={} ck_writes={} ck_evict={} ck_drops={}",
            h.spec_drafts, h.spec_accepted, h.evictions_checked, h.beam_reorders, h.step, st.preemptions, st.preemptions_priority, st.prefix_hit_tokens, st.cow_copies,
            h.reqs.iter().filter(|r| r.forked).count(), h.reqs.len(), st.aborted_requests, st.evictions,
            st.checkpoint_hits, st.prefix_skipped_tokens, st.checkpoint_writes, st.checkpoint_evictions, st.checkpoint_drops
        );
    }
    // FCFS within a priority (no aging): first-scheduled order follows arrival order.
    if h.cfg.aging_interval_steps == 0 {
        for a in &h.reqs {
            for b in &h.reqs {
                if a.order < b.order && a.params.priority == b.params.priority {
                    if let (Some(fa), Some(fb)) = (a.first_step, b.first_step) {
                        assert!(fa <= fb, "FCFS broken: {} first ran at step {fa}, later {} at {fb}", a.id, b.id);
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]
    #[test]
    fn scheduler_matches_model(c in cfg_strategy(), ops in ops_strategy(), seed in any::<u64>()) {
        run(c, ops, seed);
    }
}
