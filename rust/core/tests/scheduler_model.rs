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

use hybridserve_core::scheduler::{FinishReason, PreemptCause, RequestParams, SchedError, Scheduler, SchedulerConfig};
use proptest::prelude::*;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone)]
enum Op {
    Add { prefix: usize, tail: Vec<u32>, max_tokens: u32, min_tokens: u32, n: u32, priority: i32, ignore_eos: bool, beam: bool },
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
    arrival_step: u64,
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
    st_rows: Vec<Vec<i32>>,
    outside: HashSet<(String, u32, FinishReason)>,
    rng: u64,
    step: u64,
    beam_reorders: u64,
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
            || params.n > c.max_num_seqs
            || params.n as u64 * (total.div_ceil(c.block_size as u64) + c.state_pages as u64) > c.num_pages as u64
            || params.min_tokens > params.max_tokens
            || (c.reserve_max_context
                && params.n as u64 * ((c.max_model_len as u64).div_ceil(c.block_size as u64) + c.state_pages as u64)
                    > c.num_pages as u64);
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
                    arrival_step: self.step,
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

    /// The ordering key of the module docs, computed here independently.
    fn key(&self, i: usize) -> (i128, usize) {
        let r = &self.reqs[i];
        let a = self.cfg.aging_interval_steps as i128;
        let p = r.params.priority as i128;
        (if a == 0 { p } else { p * a + r.arrival_step as i128 }, r.order)
    }

    fn outranks(&self, h: usize, v: usize) -> bool {
        let (ph, pv) = (self.reqs[h].params.priority, self.reqs[v].params.priority);
        let a = self.cfg.aging_interval_steps.max(1) as i128;
        ph < pv && self.key(v).0 - self.key(h).0 > self.cfg.priority_preemption_threshold as i128 * a
    }

    fn units(&self, i: usize) -> u32 {
        let r = &self.reqs[i];
        if r.forked { r.live().len() as u32 } else { r.params.n }
    }

    fn waiting_head(&self) -> Option<usize> {
        (0..self.reqs.len()).filter(|&i| self.reqs[i].st == St::Waiting).min_by_key(|&i| self.key(i))
    }

    /// The brute-force arena model (see the module docs), right after schedule().
    fn check_arena(&self, out: &hybridserve_core::scheduler::SchedulerOutput, head_before: Option<usize>) {
        let cfg = &self.cfg;
        let n = cfg.num_pages as usize;
        let pps = cfg.state_pages as usize;
        let kv = self.s.kv();
        let st = self.s.stats();
        // What holds each page, from independent sources.
        let mut owner: Vec<Vec<&str>> = vec![vec![]; n];
        for p in kv.free_list() {
            owner[p as usize].push("free");
        }
        for p in kv.lru_order() {
            owner[p as usize].push("cached");
        }
        let mut refs = vec![0u32; n];
        for t in self.s.running_tables() {
            for b in t {
                refs[b as usize] += 1;
            }
        }
        for (p, &r) in refs.iter().enumerate() {
            if r > 0 {
                owner[p].push("kv");
                assert_eq!(kv.refcount(p as u32), r, "page {p}: refcount differs from the block tables holding it");
            }
        }
        let running_states = self.s.running_states();
        for (_, pages) in &running_states {
            assert_eq!(pages.len(), pps);
            for &p in pages {
                owner[p as usize].push("state");
            }
        }
        let ckpts = self.s.checkpoints();
        for (pages, ..) in &ckpts {
            for &p in pages {
                owner[p as usize].push("checkpoint");
            }
        }
        for &p in &out.checkpoint_pages {
            owner[p as usize].push("checkpoint (in flight)");
        }
        // A dropped checkpoint still busy in this plan keeps its pages until it ran.
        let deferred = st.checkpoint_pages as usize - (ckpts.len() * pps + out.checkpoint_pages.len());
        let unowned: Vec<usize> = (0..n).filter(|&p| owner[p].is_empty()).collect();
        for (p, o) in owner.iter().enumerate() {
            assert!(o.len() <= 1, "page {p} used twice: {o:?}");
        }
        assert_eq!(unowned.len(), deferred, "pages leaked: {unowned:?}");
        assert_eq!(deferred % pps.max(1), 0);
        // The stats' per-use counts.
        let count = |w: &str| owner.iter().filter(|o| o.first() == Some(&w)).count() as u32;
        assert_eq!(st.num_pages as usize, n);
        assert_eq!(st.free_pages, count("free"));
        assert_eq!(st.cached_pages, count("cached"));
        assert_eq!(st.kv_pages, count("kv"));
        assert_eq!(st.running_state_pages, count("state"));
        assert_eq!(st.checkpoint_pages as usize, count("checkpoint") as usize + out.checkpoint_pages.len() + deferred);
        assert_eq!(st.free_pages + st.cached_pages + st.kv_pages + st.running_state_pages + st.checkpoint_pages, st.num_pages);
        // Admission refuses for pages only when they are truly gone: the head
        // (one sequence, nothing preempted this step) would need its n states
        // plus the blocks of its first chunk, no prefix hit counted; pages
        // could still be had: free, cached, evictable checkpoints, and what
        // this plan's checkpoint writes took after admission.
        if st.last_admission_limit == "max_num_seqs" {
            let planned: HashSet<u32> = out.req_indices.iter().copied().collect();
            let h = (0..self.reqs.len())
                .filter(|&i| self.reqs[i].st == St::Waiting && !planned.contains(&self.reqs[i].handle))
                .min_by_key(|&i| self.key(i))
                .expect("a head was refused");
            assert!(
                st.last_admission_running_seqs + self.units(h) > cfg.max_num_seqs,
                "refused for max_num_seqs with {} running",
                st.last_admission_running_seqs
            );
        }
        if st.last_admission_limit == "pages" && out.preempted.is_empty() && !cfg.reserve_max_context {
            // The head after this step's admissions (the harness marks them
            // running only after this check).
            let planned: HashSet<u32> = out.req_indices.iter().copied().collect();
            let h = (0..self.reqs.len())
                .filter(|&i| self.reqs[i].st == St::Waiting && !planned.contains(&self.reqs[i].handle))
                .min_by_key(|&i| self.key(i))
                .expect("a head was refused");
            let _ = head_before;
            if !self.reqs[h].forked {
                let r = &self.reqs[h];
                let left = cfg.max_num_batched_tokens as usize - out.num_tokens();
                let mut chunk = r.tokens(0).len().min(left);
                if cfg.long_prefill_token_threshold > 0 {
                    chunk = chunk.min(cfg.long_prefill_token_threshold as usize);
                }
                let need = r.params.n as u64 * pps as u64 + chunk.div_ceil(cfg.block_size as usize) as u64;
                let could = st.last_admission_available_pages;
                assert!(could <= st.available_pages + out.checkpoint_pages.len() as u64, "pages appeared from nowhere");
                assert!(could < need, "{} refused for pages with {could} available, needing at most {need}; chunk {chunk} stats {st:?} out {out:?}", r.id);
            }
        }
    }

    fn do_step(&mut self) {
        self.step += 1;
        let cfg = self.cfg.clone();
        let bs = cfg.block_size as usize;
        let head_before = self.waiting_head();
        let was_waiting: Vec<bool> = self.reqs.iter().map(|r| r.st == St::Waiting).collect();
        let out = self.s.schedule(self.step as f64).expect("schedule").clone();
        // Priority preemption: victims outranked by the head, within the bound.
        assert_eq!(out.preempted.len(), out.preempted_causes.len());
        let mut n_prio = 0u32;
        for (&v, &c) in out.preempted.iter().zip(&out.preempted_causes) {
            if c == PreemptCause::Priority {
                n_prio += 1;
                let h = head_before.expect("a priority preemption without a waiting request");
                let vi = self.by_handle[&v];
                assert!(self.outranks(h, vi), "priority victim {} is not outranked by head {}", self.reqs[vi].id, self.reqs[h].id);
            }
        }
        assert!(n_prio <= cfg.max_priority_preemptions_per_step, "priority preemption bound exceeded");
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
        let mut written = HashSet::new();
        for c in out.state_copies.chunks(2) {
            assert!(written.insert(c[1]), "two copies write page {}", c[1]);
            self.state_mem.insert(c[1], snapshot.get(&c[0]).cloned().unwrap_or_default());
        }
        for c in out.block_copies.chunks(2) {
            assert!(written.insert(c[1]), "two copies write page {}", c[1]);
        }
        // No copy reads a page another copy writes, except beams re-parented into
        // each other (state copies among one request's beams: a permutation, safe
        // because the runner gathers every source before scattering).
        let state_dst: HashSet<i32> = out.state_copies.chunks(2).map(|c| c[1]).collect();
        let block_dst: HashSet<i32> = out.block_copies.chunks(2).map(|c| c[1]).collect();
        for c in out.block_copies.chunks(2) {
            assert!(!written.contains(&c[0]), "a block copy reads page {} that a copy of the same plan writes", c[0]);
        }
        for c in out.state_copies.chunks(2) {
            assert!(!block_dst.contains(&c[0]), "a state copy reads page {} that a block copy writes", c[0]);
        }
        if !self.reqs.iter().any(|r| r.params.beam_search && r.st == St::Running) {
            for c in out.state_copies.chunks(2) {
                assert!(!state_dst.contains(&c[0]), "a state copy reads page {} another state copy writes", c[0]);
            }
        }
        let ckpts = self.s.checkpoints();
        let ckpt_pages: HashSet<i32> = ckpts.iter().flat_map(|c| c.0.iter().map(|&p| p as i32)).collect();
        assert_eq!(ckpt_pages.len(), ckpts.len() * cfg.state_pages as usize, "two checkpoints share a page");
        for (pages, tokens, last_block, _) in &ckpts {
            let tokens = *tokens;
            assert!(tokens > 0 && tokens % bs == 0, "checkpoint off a block boundary");
            let kv = self.kv_mem.get(&(*last_block as i32 * bs as i32 + bs as i32 - 1)).cloned().unwrap_or_default();
            for &p in pages {
                let st = self.state_mem.get(&(p as i32)).cloned().unwrap_or_default();
                assert_eq!(st.len(), tokens, "checkpoint page {p} holds a state of {} tokens, keyed at {tokens}", st.len());
                assert_eq!(kv, st, "checkpoint state is not the prefix its key (block chain) stands for");
            }
        }
        for k in 0..out.bt_update_rows.len() {
            let row = &mut self.rows[out.bt_update_rows[k] as usize];
            row[out.bt_update_cols[k] as usize] = out.bt_update_values[k];
        }
        for k in 0..out.st_update_rows.len() {
            let row = &mut self.st_rows[out.st_update_rows[k] as usize];
            row[out.st_update_cols[k] as usize] = out.st_update_values[k];
        }
        self.check_arena(&out, head_before);
        let mut seen_slots = HashSet::new();
        let mut seen_rows = HashSet::new();
        let mut seen_seq = HashSet::new();
        let mut in_prefill_part = false;
        let mut ck_off = 0usize;
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
            // A recomputed forked request prefills the prompt once, in its first live sample.
            if r.forked && start < r.prompt.len() {
                assert_eq!(Some(&sm), r.live().first(), "{}: sample {sm} re-prefills the prompt", r.id);
            }
            if r.computed[sm] == 0 && start > 0 {
                // A checkpoint hit, or a sample re-forked at the prompt's end after a
                // recompute: the state check below verifies the state it starts from.
                let refork = r.forked && start == r.prompt.len();
                assert!(refork || (cfg.enable_prefix_caching && start % bs == 0 && start < toks.len()), "bad hit start {start}");
                r.computed[sm] = start;
            }
            assert_eq!(start, r.computed[sm], "num_computed_tokens disagrees with what was computed");
            let st_row = self.st_rows[out.block_table_rows[e] as usize].clone();
            assert!(st_row.iter().all(|p| !ckpt_pages.contains(p)), "a sequence runs on a checkpoint's pages");
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
            if r.params.beam_search && r.forked && !is_decode {
                assert!(start + k < toks.len(), "a beam's recompute must leave its last token to the joint decode");
            }
            let want_samples = if start + k == toks.len() { if r.forked { 1 } else { r.params.n as i32 } } else { 0 };
            assert_eq!(out.num_samples[e], want_samples);
            for &p in &st_row {
                assert!(seen_slots.insert(p), "state page {p} shared by two entries");
            }
            assert!(seen_rows.insert(out.block_table_rows[e]), "buffer row shared by two entries");
            assert!(seen_seq.insert((i, sm)), "sequence scheduled twice");
            for j in 0..k {
                assert_eq!(out.input_ids[q0 + j] as u32, toks[start + j], "fed the wrong token");
                assert_eq!(out.positions[q0 + j] as usize, start + j);
            }
            // Recurrent state: zeros at start 0, else exactly what this sample
            // consumed, in every page of its state page table.
            for &p in &st_row {
                if start == 0 {
                    self.state_mem.insert(p, vec![]);
                } else {
                    assert_eq!(self.state_mem.get(&p).map(|v| v.as_slice()), Some(&toks[..start]), "wrong DeltaNet state");
                }
                self.state_mem.insert(p, toks[..start + k].to_vec());
            }
            // A checkpoint written inside the chunk: the state after its first `pos` tokens.
            let pos = out.checkpoint_positions[e];
            if pos >= 0 {
                let pos = pos as usize;
                assert!(pos >= 1 && pos <= k, "checkpoint position {pos} outside the chunk of {k}");
                assert_eq!((start + pos) % bs, 0, "checkpoint off a block boundary");
                let pps = cfg.state_pages as usize;
                for &p in &out.checkpoint_pages[ck_off..ck_off + pps] {
                    assert!(!st_row.contains(&p), "a checkpoint written over the running state");
                    self.state_mem.insert(p, toks[..start + pos].to_vec());
                }
                ck_off += pps;
            }
        }
        assert_eq!(ck_off, out.checkpoint_pages.len(), "checkpoint pages without a position");
        // Admission in key order: nothing admitted while a smaller key waits.
        let admitted: Vec<usize> =
            (0..self.reqs.len()).filter(|&i| was_waiting[i] && self.reqs[i].st == St::Running).collect();
        for &a in &admitted {
            for w in (0..self.reqs.len()).filter(|&w| self.reqs[w].st == St::Waiting) {
                assert!(self.key(w) > self.key(a), "{} admitted while {} (smaller key) waits", self.reqs[a].id, self.reqs[w].id);
            }
        }
        // No missed room: where sequences are the only scarce resource (blocks
        // for everyone, no checkpoints, budget left over), a waiting head that
        // outranks running requests is admitted unless the per-step bound was
        // reached or even without all of them it would not fit.
        let plenty = !cfg.enable_prefix_caching
            && !cfg.reserve_max_context
            && cfg.num_pages as usize > cfg.max_num_seqs as usize * cfg.max_pages_per_seq() as usize;
        if plenty && cfg.max_priority_preemptions_per_step > 0 && out.num_tokens() < cfg.max_num_batched_tokens as usize {
            // One head per step: the check applies to the head the step began with.
            if let Some(h) = self.waiting_head().filter(|&h| Some(h) == head_before) {
                let running: Vec<usize> = (0..self.reqs.len()).filter(|&i| self.reqs[i].st == St::Running).collect();
                if running.iter().any(|&r| self.outranks(h, r)) && n_prio < cfg.max_priority_preemptions_per_step {
                    let kept: u32 = running.iter().filter(|&&r| !self.outranks(h, r)).map(|&r| self.units(r)).sum();
                    let cap = cfg.max_num_seqs;
                    assert!(kept + self.units(h) > cap, "{} left waiting although outranked requests hold its room", self.reqs[h].id);
                }
            }
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
        // Beams decode together: all live beams of a forked beam request, or none.
        for (i, r) in self.reqs.iter().enumerate() {
            if r.params.beam_search && r.forked && r.st == St::Running {
                let dec: Vec<bool> = r.live().iter().map(|&sm| (0..b).any(|e| self.by_handle[&out.req_indices[e]] == i
                    && out.sample_indices[e] as usize == sm && out.num_samples[e] == 1)).collect();
                assert!(dec.iter().all(|&d| d) || dec.iter().all(|&d| !d), "{}: beams decoded apart {dec:?}", r.id);
            }
        }
        // Beams: re-parent every request whose beams all decoded this step.
        let mut beam_reqs: Vec<usize> = Vec::new();
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let r = &self.reqs[i];
            if r.params.beam_search && r.forked && !beam_reqs.contains(&i) && r.done.iter().all(|&d| !d) {
                let w = r.out.len();
                let all = (0..w).all(|sm| (0..b).any(|f| out.req_indices[f] == out.req_indices[e] && out.sample_indices[f] as usize == sm && out.num_samples[f] == 1));
                if all {
                    beam_reqs.push(i);
                }
            }
        }
        for i in beam_reqs {
            let w = self.reqs[i].out.len();
            let parents: Vec<u32> = (0..w).map(|_| (self.rand() % w as u64) as u32).collect();
            let id = self.reqs[i].id.clone();
            self.s.reorder_beams(&id, &parents).expect("reorder_beams");
            let r = &mut self.reqs[i];
            r.out = parents.iter().map(|&p| r.out[p as usize].clone()).collect();
            self.beam_reorders += 1;
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
}

fn cfg_strategy() -> impl Strategy<Value = Cfg> {
    let prio = (prop::sample::select(vec![0u32, 1, 2]), prop::sample::select(vec![0u32, 1, 4]));
    ((prop_oneof![3 => 6u32..60, 1 => 200u32..260], prop::sample::select(vec![1u32, 2, 4]), 1u32..4, 1u32..6, 0u32..24, any::<bool>(), prop::sample::select(vec![0u32, 3, 8]), prop::sample::select(vec![0u32, 2]), 2u32..12, prop::bool::weighted(0.2), prop::sample::select(vec![0u32, 0, 1, 3])), prio)
        .prop_map(|((num_pages, block_size, state_pages, max_num_seqs, extra_budget, prefix, thresh, aging, max_waiting, reserve, interval_blocks), (prio_threshold, prio_bound))| Cfg {
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
    let s = Scheduler::new(cfg.clone()).unwrap();
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
    if std::env::var("SCHED_COVERAGE").is_ok() {
        eprintln!(
            "COV reorders={} steps={} preempt={} prio={} hit_tokens={} cow={} forks={} reqs={} aborted={} evict={} ck_hits={} skipped={} ck_writes={} ck_evict={} ck_drops={}",
            h.beam_reorders, h.step, st.preemptions, st.preemptions_priority, st.prefix_hit_tokens, st.cow_copies,
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

/// The starvation bound of the module docs, under a stream of urgent arrivals
/// (one priority-0 request per step from step 1, each 1 prefill step + 2
/// decodes) against one priority-3 request X arriving at step 0 and running at
/// once, with one sequence of room:
/// with aging A = 2 and threshold 1, X may be preempted for priority only by
/// arrivals before step (3 - 0 - 1) * A = 4 and passed in admission only by
/// arrivals up to step (3 - 0) * A = 6, so it finishes within
/// 6 + 7 arrivals * 3 steps + its own 3 steps. Without aging it never runs.
fn urgent_stream(aging: u32, steps: u64) -> (Option<u64>, Vec<u64>) {
    let mut cfg = SchedulerConfig::new(200, 4, 1, 1, 64, 40);
    cfg.enable_prefix_caching = false;
    cfg.aging_interval_steps = aging;
    cfg.priority_preemption_threshold = 1;
    cfg.max_priority_preemptions_per_step = 4;
    let mut s = Scheduler::new(cfg).unwrap();
    let p = |priority| RequestParams { max_tokens: 3, priority, ignore_eos: true, ..Default::default() };
    s.add_request("x", &[1, 2, 3], p(3)).unwrap();
    let mut x_done = None;
    let mut x_preempted_at = vec![];
    for t in 0..steps {
        if t > 0 {
            s.add_request(&format!("u{t}"), &[4, 5], p(0)).unwrap();
        }
        let out = s.schedule(t as f64).unwrap().clone();
        for (&h, &c) in out.preempted.iter().zip(&out.preempted_causes) {
            if s.request_id(h) == Some("x") && c == PreemptCause::Priority {
                x_preempted_at.push(t);
            }
        }
        let n = out.total_samples();
        let upd = s.update(&vec![9; n]).unwrap().clone();
        for &(h, _, _) in &upd.finished {
            if s.request_id(h) == Some("x") {
                x_done.get_or_insert(t);
            }
        }
    }
    (x_done, x_preempted_at)
}

#[test]
fn starvation_bound_under_an_urgent_stream() {
    let (done, preempted) = urgent_stream(2, 60);
    let done = done.expect("x never finished: starvation");
    assert!(done <= 6 + 7 * 3 + 3, "x finished at step {done}, past the bound");
    assert!(!preempted.is_empty() && preempted.iter().all(|&t| t < 4), "x preempted at {preempted:?}");
    let (done0, _) = urgent_stream(0, 60);
    assert_eq!(done0, None, "without aging the urgent stream should starve x (the bound needs aging)");
}
