//! Model-based test of the scheduler: random workloads (adds, steps with random
//! samples, aborts, finishes) checked against an independent oracle that keeps
//!   * each sample's true token stream (prompt + the tokens this test sampled),
//!   * a simulated KV memory (slot -> the token prefix whose KV was written there),
//!     fed by the plan's slot mapping and block copies and read through the
//!     caller-side block-table buffer built from the incremental row updates,
//!   * a simulated DeltaNet state per slot (the tokens it has consumed), fed by
//!     the plan and its state copies,
//!   * the stop rule and the admission rule, re-implemented here.
//!   * DeltaNet checkpoints: each live one's slot holds (in the simulated state
//!     memory) exactly the token prefix that the simulated KV of its chain's last
//!     block was computed from, and no entry runs on a checkpoint slot;
//!     prefix-cache hits may start a sequence at any block boundary, and the
//!     state it starts from must then be exactly its prefix.
//!
//! So "attention would read the right KV", "the recurrent state is the right
//! one", "a preempted request resumes with the same tokens", "the budget is never
//! exceeded", "FCFS within a priority" and "everything finishes and every block
//! and slot comes back" are all checked against things the scheduler did not compute.

use hybridserve_core::scheduler::{FinishReason, RequestParams, SchedError, Scheduler, SchedulerConfig};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone)]
enum Op {
    Add { prefix: usize, tail: Vec<u32>, max_tokens: u32, min_tokens: u32, n: u32, priority: i32, ignore_eos: bool },
    Dup(usize),
    Step,
    Abort(usize),
    Finish(usize, u32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum St {
    Waiting,
    Running,
    Done,
}

struct OReq {
    id: String,
    prompt: Vec<u32>,
    params: RequestParams,
    handle: u32,
    st: St,
    forked: bool,
    out: Vec<Vec<u32>>,
    done: Vec<bool>,
    computed: Vec<usize>,
    first_step: Option<u64>,
    order: usize,
}

impl OReq {
    fn tokens(&self, s: usize) -> Vec<u32> {
        let mut t = self.prompt.clone();
        t.extend_from_slice(&self.out[s]);
        t
    }
    fn live(&self) -> Vec<usize> {
        if self.forked { (0..self.out.len()).filter(|&i| !self.done[i]).collect() } else if self.done[0] { vec![] } else { vec![0] }
    }
}

const EOS: u32 = 7;
const STOP: u32 = 5;
const SHARED: [u32; 24] = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34];

struct Harness {
    s: Scheduler,
    cfg: SchedulerConfig,
    reqs: Vec<OReq>,
    by_handle: HashMap<u32, usize>,
    kv_mem: HashMap<i32, Vec<u32>>,
    state_mem: HashMap<i32, Vec<u32>>,
    rows: Vec<Vec<i32>>,
    outside: HashSet<(String, u32, FinishReason)>,
    rng: u64,
    step: u64,
}

impl Harness {
    fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn stop_rule(p: &RequestParams, n_out: usize, t: u32) -> Option<FinishReason> {
        let stop_tok = (!p.ignore_eos && p.eos_token_ids.contains(&t)) || p.stop_token_ids.contains(&t);
        if n_out >= p.min_tokens as usize && stop_tok {
            Some(FinishReason::Stop)
        } else if n_out >= p.max_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    fn add(&mut self, id: String, prompt: Vec<u32>, params: RequestParams) {
        let c = &self.cfg;
        let total = prompt.len() as u64 + params.max_tokens as u64;
        let dup = self.reqs.iter().any(|r| r.id == id && r.st != St::Done);
        let invalid = dup
            || total > c.max_model_len as u64
            || params.n > c.num_state_slots
            || params.n > c.max_num_seqs
            || params.n as u64 * total.div_ceil(c.block_size as u64) > c.num_blocks as u64
            || params.min_tokens > params.max_tokens
            || (c.reserve_max_context
                && params.n as u64 * (c.max_model_len as u64).div_ceil(c.block_size as u64) > c.num_blocks as u64);
        let waiting: Vec<&OReq> = self.reqs.iter().filter(|r| r.st == St::Waiting).collect();
        let wtok: u64 = waiting.iter().map(|r| r.live().iter().map(|&i| r.tokens(i).len() as u64).sum::<u64>()).sum();
        let full = waiting.len() as u64 >= c.max_waiting_requests as u64 || wtok + prompt.len() as u64 > c.max_waiting_tokens;
        let res = self.s.add_request(&id, &prompt, params.clone());
        match res {
            Ok(h) => {
                assert!(!invalid && !full, "accepted a request the rules refuse: {id}");
                let n = params.n as usize;
                self.by_handle.insert(h, self.reqs.len());
                let order = self.reqs.len();
                self.reqs.push(OReq {
                    id,
                    prompt,
                    params,
                    handle: h,
                    st: St::Waiting,
                    forked: false,
                    out: vec![vec![]; n],
                    done: vec![false; n],
                    computed: vec![0; n],
                    first_step: None,
                    order,
                });
            }
            Err(SchedError::InvalidRequest(_)) => assert!(invalid, "refused a valid request {id}: {res:?}"),
            Err(SchedError::QueueFull(_)) => assert!(!invalid && full, "QueueFull wrongly: {res:?}"),
            Err(e) => panic!("unexpected {e:?}"),
        }
    }

    fn finish_outside(&mut self, i: usize, sample: Option<u32>, reason: FinishReason) {
        // Ids are per live request: a re-added id names the newest request.
        let id = self.reqs[i].id.clone();
        let i = self.reqs.iter().rposition(|r| r.id == id).unwrap();
        let r = &mut self.reqs[i];
        let res = match sample {
            None => self.s.abort(&r.id),
            Some(sm) => self.s.finish(&r.id, sm, reason),
        };
        if r.st == St::Done {
            assert_eq!(res, Ok(false));
            return;
        }
        let targets: Vec<usize> = if !r.forked {
            (0..r.out.len()).collect()
        } else {
            match sample {
                None => r.live(),
                Some(sm) => {
                    if r.done[sm as usize] {
                        assert_eq!(res, Ok(false));
                        return;
                    }
                    vec![sm as usize]
                }
            }
        };
        assert_eq!(res, Ok(true));
        for t in targets {
            r.done[t] = true;
            self.outside.insert((r.id.clone(), t as u32, reason));
        }
        if r.done.iter().all(|&d| d) {
            r.st = St::Done;
        }
    }

    fn do_step(&mut self) {
        self.step += 1;
        let cfg = self.cfg.clone();
        let bs = cfg.block_size as usize;
        let out = self.s.schedule(self.step as f64).expect("schedule").clone();
        // Sequences finished outside update() since the last plan.
        let got: HashSet<_> = out.finished.iter().cloned().collect();
        assert_eq!(got, std::mem::take(&mut self.outside), "finished-outside report");
        for &h in &out.preempted {
            let r = &mut self.reqs[self.by_handle[&h]];
            assert_eq!(r.st, St::Running, "preempted a request that was not running");
            r.st = St::Waiting;
            r.computed.iter_mut().for_each(|c| *c = 0);
        }
        // Budget.
        let b = out.num_seqs();
        assert!(b <= cfg.max_num_seqs as usize);
        assert!(out.num_tokens() <= cfg.max_num_batched_tokens as usize, "token budget exceeded");
        assert_eq!(out.query_start_loc.len(), b + 1);
        assert_eq!(out.slot_mapping.len(), out.num_tokens());
        // Copies first, then the block-table buffer.
        for c in out.block_copies.chunks(2) {
            for o in 0..bs as i32 {
                match self.kv_mem.get(&(c[0] * bs as i32 + o)).cloned() {
                    Some(v) => self.kv_mem.insert(c[1] * bs as i32 + o, v),
                    None => self.kv_mem.remove(&(c[1] * bs as i32 + o)),
                };
            }
        }
        let snapshot = self.state_mem.clone();
        for c in out.state_copies.chunks(2) {
            self.state_mem.insert(c[1], snapshot.get(&c[0]).cloned().unwrap_or_default());
        }
        let ckpts = self.s.checkpoints();
        let ckpt_slots: HashSet<i32> = ckpts.iter().map(|c| c.0 as i32).collect();
        assert_eq!(ckpt_slots.len(), ckpts.len(), "two checkpoints in one slot");
        for &(slot, tokens, last_block) in &ckpts {
            assert!(tokens > 0 && tokens % bs == 0, "checkpoint off a block boundary");
            let st = self.state_mem.get(&(slot as i32)).cloned().unwrap_or_default();
            assert_eq!(st.len(), tokens, "checkpoint slot {slot} holds a state of {} tokens, keyed at {tokens}", st.len());
            let kv = self.kv_mem.get(&(last_block as i32 * bs as i32 + bs as i32 - 1)).cloned().unwrap_or_default();
            assert_eq!(kv, st, "checkpoint state is not the prefix its key (block chain) stands for");
        }
        for k in 0..out.bt_update_rows.len() {
            let row = &mut self.rows[out.bt_update_rows[k] as usize];
            row[out.bt_update_cols[k] as usize] = out.bt_update_values[k];
        }
        let mut seen_slots = HashSet::new();
        let mut seen_rows = HashSet::new();
        let mut seen_seq = HashSet::new();
        let mut in_prefill_part = false;
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let sm = out.sample_indices[e] as usize;
            let r = &mut self.reqs[i];
            if r.st == St::Waiting {
                r.st = St::Running;
                r.first_step.get_or_insert(self.step);
            }
            assert_eq!(r.st, St::Running);
            assert!(!r.done[sm], "scheduled a finished sample");
            let toks = r.tokens(sm);
            let (start, k) = (out.num_computed_tokens[e] as usize, out.num_scheduled_tokens[e] as usize);
            let q0 = out.query_start_loc[e] as usize;
            assert_eq!(out.query_start_loc[e + 1] as usize, q0 + k);
            assert!(k >= 1);
            if r.computed[sm] == 0 && start > 0 {
                // A checkpoint hit: the state check below verifies the restored state.
                assert!(cfg.enable_prefix_caching && start % bs == 0 && start < toks.len(), "bad hit start {start}");
                r.computed[sm] = start;
            }
            assert_eq!(start, r.computed[sm], "num_computed_tokens disagrees with what was computed");
            assert!(!ckpt_slots.contains(&out.state_slots[e]), "a sequence runs on a checkpoint slot");
            assert_eq!(out.seq_lens[e] as usize, start + k);
            assert!(start + k <= toks.len());
            let is_decode = k == 1 && start >= r.prompt.len() && start + 1 == toks.len();
            if e < out.num_decodes {
                assert!(is_decode, "a non-decode among the decodes");
            } else {
                in_prefill_part = true;
            }
            let _ = in_prefill_part;
            if !is_decode && cfg.long_prefill_token_threshold > 0 {
                assert!(k <= cfg.long_prefill_token_threshold as usize);
            }
            let want_samples = if start + k == toks.len() { if r.forked { 1 } else { r.params.n as i32 } } else { 0 };
            assert_eq!(out.num_samples[e], want_samples);
            assert!(seen_slots.insert(out.state_slots[e]), "state slot shared by two entries");
            assert!(seen_rows.insert(out.block_table_rows[e]), "buffer row shared by two entries");
            assert!(seen_seq.insert((i, sm)), "sequence scheduled twice");
            for j in 0..k {
                assert_eq!(out.input_ids[q0 + j] as u32, toks[start + j], "fed the wrong token");
                assert_eq!(out.positions[q0 + j] as usize, start + j);
            }
            // Recurrent state: zeros at start 0, else exactly what this sample consumed.
            let slot = out.state_slots[e];
            if start == 0 {
                self.state_mem.insert(slot, vec![]);
            } else {
                assert_eq!(self.state_mem.get(&slot).map(|v| v.as_slice()), Some(&toks[..start]), "wrong DeltaNet state");
            }
            self.state_mem.insert(slot, toks[..start + k].to_vec());
        }
        // KV writes of the whole step, then every entry reads its full context.
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let toks = self.reqs[i].tokens(out.sample_indices[e] as usize);
            let (start, k, q0) = (out.num_computed_tokens[e] as usize, out.num_scheduled_tokens[e] as usize, out.query_start_loc[e] as usize);
            for j in 0..k {
                let s = out.slot_mapping[q0 + j];
                if s >= 0 {
                    self.kv_mem.insert(s, toks[..=start + j].to_vec());
                }
            }
        }
        let (width, dense) = self.s.block_tables();
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let toks = self.reqs[i].tokens(out.sample_indices[e] as usize);
            let row = &self.rows[out.block_table_rows[e] as usize];
            let len = out.seq_lens[e] as usize;
            for p in 0..len {
                let blk = row[p / bs];
                assert_eq!(blk, dense[e * width + p / bs], "buffer row differs from the block table");
                let slot = blk * bs as i32 + (p % bs) as i32;
                assert_eq!(self.kv_mem.get(&slot).map(|v| v.as_slice()), Some(&toks[..=p]), "attention would read wrong KV at pos {p}");
            }
        }
        // Sample and update.
        let mut sampled = Vec::new();
        for e in 0..b {
            for _ in 0..out.num_samples[e] {
                let t = (self.rand() % 9) as i32; // 0..8: EOS (7) and STOP (5) happen
                sampled.push(t);
            }
        }
        let upd = self.s.update(&sampled).expect("update").clone();
        let mut want_rows = Vec::new();
        let mut want_fin = HashSet::new();
        let mut off = 0;
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let r = &mut self.reqs[i];
            let sm = out.sample_indices[e] as usize;
            let ns = out.num_samples[e] as usize;
            let k = out.num_scheduled_tokens[e] as usize;
            let toks = &sampled[off..off + ns];
            off += ns;
            if ns > 1 {
                r.forked = true;
                let c = r.computed[0] + k;
                for (j, &t) in toks.iter().enumerate() {
                    r.computed[j] = c;
                    r.out[j].push(t as u32);
                    want_rows.push((out.req_indices[e], j as i32, t));
                    if let Some(why) = Self::stop_rule(&r.params, r.out[j].len(), t as u32) {
                        r.done[j] = true;
                        want_fin.insert((out.req_indices[e], j as u32, why));
                    }
                }
            } else {
                r.computed[sm] += k;
                if ns == 1 {
                    let t = toks[0];
                    r.out[sm].push(t as u32);
                    want_rows.push((out.req_indices[e], sm as i32, t));
                    if let Some(why) = Self::stop_rule(&r.params, r.out[sm].len(), t as u32) {
                        r.done[sm] = true;
                        want_fin.insert((out.req_indices[e], sm as u32, why));
                    }
                }
            }
            if r.done.iter().all(|&d| d) {
                r.st = St::Done;
            }
        }
        let got_rows: Vec<_> = (0..upd.tokens.len()).map(|j| (upd.req_indices[j], upd.sample_indices[j], upd.tokens[j])).collect();
        assert_eq!(got_rows, want_rows);
        let got_fin: HashSet<_> = upd.finished.iter().cloned().collect();
        assert_eq!(got_fin, want_fin, "finished set");
        // Output tokens readable through the API agree.
        for r in self.reqs.iter().filter(|r| r.st != St::Done) {
            for sm in 0..r.out.len() {
                assert_eq!(self.s.output_tokens(&r.id, sm as u32).unwrap(), r.out[sm].as_slice());
            }
        }
    }
}

fn ops_strategy() -> impl Strategy<Value = Vec<Op>> {
    let add = (0usize..25, prop::collection::vec(0u32..40, 0..20), 1u32..12, 0u32..4, 1u32..4, 0i32..3, any::<bool>())
        .prop_map(|(prefix, tail, max_tokens, min_tokens, n, priority, ignore_eos)| Op::Add {
            prefix,
            tail,
            max_tokens,
            min_tokens,
            n,
            priority,
            ignore_eos,
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
    num_blocks: u32,
    block_size: u32,
    slots: u32,
    max_num_seqs: u32,
    extra_budget: u32,
    prefix: bool,
    thresh: u32,
    aging: u32,
    max_waiting: u32,
    reserve: bool,
    /// prefix_checkpoint_interval in blocks (0 = off).
    interval_blocks: u32,
}

fn cfg_strategy() -> impl Strategy<Value = Cfg> {
    (4u32..40, prop::sample::select(vec![1u32, 2, 4]), 1u32..6, 1u32..6, 0u32..24, any::<bool>(), prop::sample::select(vec![0u32, 3, 8]), prop::sample::select(vec![0u32, 2]), 2u32..12, prop::bool::weighted(0.2), prop::sample::select(vec![0u32, 0, 1, 3]))
        .prop_map(|(num_blocks, block_size, slots, max_num_seqs, extra_budget, prefix, thresh, aging, max_waiting, reserve, interval_blocks)| Cfg {
            num_blocks,
            block_size,
            slots,
            max_num_seqs,
            extra_budget,
            prefix,
            thresh,
            aging,
            max_waiting,
            reserve,
            interval_blocks,
        })
}

fn run(c: Cfg, ops: Vec<Op>, seed: u64) {
    let mut cfg = SchedulerConfig::new(c.num_blocks, c.block_size, c.slots, c.max_num_seqs, c.max_num_seqs + c.extra_budget, 40);
    cfg.enable_prefix_caching = c.prefix;
    cfg.long_prefill_token_threshold = c.thresh;
    cfg.aging_interval_steps = c.aging;
    cfg.max_waiting_requests = c.max_waiting;
    cfg.max_waiting_tokens = 120;
    cfg.reserve_max_context = c.reserve;
    cfg.prefix_checkpoint_interval = c.interval_blocks * c.block_size;
    let s = Scheduler::new(cfg.clone()).unwrap();
    let mbps = cfg.max_blocks_per_seq() as usize;
    let mut h = Harness {
        s,
        rows: vec![vec![-7; mbps]; cfg.max_num_seqs as usize],
        cfg,
        reqs: vec![],
        by_handle: HashMap::new(),
        kv_mem: HashMap::new(),
        state_mem: HashMap::new(),
        outside: HashSet::new(),
        rng: seed | 1,
        step: 0,
    };
    let mut next = 0;
    for op in ops {
        match op {
            Op::Add { prefix, tail, max_tokens, min_tokens, n, priority, ignore_eos } => {
                let mut prompt = SHARED[..prefix].to_vec();
                prompt.extend(tail);
                if prompt.is_empty() {
                    prompt.push(1);
                }
                let params = RequestParams {
                    max_tokens,
                    min_tokens,
                    n,
                    priority,
                    ignore_eos,
                    eos_token_ids: vec![EOS],
                    stop_token_ids: vec![STOP],
                    arrival_time: h.step as f64,
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
    h.do_step(); // reports any outstanding finished-outside entries
    assert!(h.reqs.iter().all(|r| r.st == St::Done), "a request never finished");
    let st = h.s.stats();
    assert_eq!(st.used_blocks, 0, "blocks leaked");
    assert_eq!(st.free_blocks, st.num_blocks);
    assert_eq!(st.free_slots, st.num_slots, "slots leaked");
    assert_eq!(h.s.state_pool().num_free() + st.checkpoint_slots, st.num_slots, "slots leaked");
    assert_eq!(st.checkpoint_slots as usize, h.s.checkpoints().len());
    assert_eq!(st.reserved_blocks, 0);
    if std::env::var("SCHED_COVERAGE").is_ok() {
        eprintln!(
            "COV steps={} preempt={} hit_tokens={} cow={} forks={} reqs={} aborted={} evict={} ck_hits={} skipped={} ck_writes={} ck_evict={} ck_drops={}",
            h.step, st.preemptions, st.prefix_hit_tokens, st.cow_copies,
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
