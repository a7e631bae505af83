//! The continuous-batching scheduler: owns every request, decides at each
//! iteration boundary which sequences run and how many tokens each advances, and
//! keeps the KV blocks and DeltaNet slots they hold.
//!
//! # Step protocol
//! `schedule(now)` returns a [`SchedulerOutput`]; the caller runs the model and
//! passes the sampled tokens to `update(sampled)`. Then the next `schedule()`.
//! `add_request`, `abort`, `finish` may come at any point between calls.
//!
//! # Policy
//! * Order: running requests by their static key (priority with aging, then
//!   arrival; see [`queue`]), smallest first. Each step walks them in that order;
//!   decodes (one token) are always given budget (the token budget is reserved
//!   for every running decode before any prefill chunk is sized), prefill chunks
//!   get what is left, capped by `long_prefill_token_threshold`. Then waiting
//!   requests are admitted in key order while the head fits (head-of-line: a
//!   request that does not fit blocks those behind it, which keeps FCFS within a
//!   priority and makes the starvation bound below hold). The plan lists decodes
//!   first, then prefill chunks.
//! * Out of blocks while growing a running sequence: preempt by recompute the
//!   running request with the largest key (lowest effective priority, latest
//!   arrival) not yet scheduled this step, or the request itself when it is the
//!   last. Its blocks, slots and rows are freed; it re-enters the waiting queue
//!   with its old key (front of its priority) and on readmission re-prefills
//!   prompt + generated tokens; the last chunk samples the next token. No
//!   admission happens in a step that preempted. The unit of preemption is the
//!   whole request (all n samples).
//! * Priority preemption, first thing in a step: while the waiting head does
//!   not fit (sequences, state slots or blocks for its first chunk) and the
//!   running request with the largest key has a strictly larger static
//!   priority and an effective priority worse by more than
//!   `priority_preemption_threshold` levels, that request is preempted (same
//!   recompute as below), at most `max_priority_preemptions_per_step` per step;
//!   nothing is preempted when all such requests together would not make room.
//!   Admission then runs in the same step and admits the head. One head per
//!   step: a second urgent request is served the same way in the next step. Equal static
//!   priorities never preempt each other, so with one priority the policy is
//!   FCFS as before. The fit check does not count prefix-cache hits
//!   (conservative: it may preempt when a hit alone would have made room).
//! * A running request never fails for lack of room: `add_request` refuses any
//!   request whose worst case (`n * ceil((prompt + max_tokens) / block_size)`
//!   blocks, n slots, n sequences) exceeds the whole pool, so a request alone
//!   always fits, and preemption frees room for the highest-keyed ones.
//! * n > 1: the prompt is prefilled once; its last chunk samples n tokens;
//!   `update()` forks n sequences sharing the prompt blocks (copy-on-write on the
//!   shared tail) and copies the DeltaNet slot (a `state_copies` pair in the next
//!   plan). The n slots are reserved at admission.
//! * Prefix cache: looked up at admission (and readmission after preemption).
//!   The KV of the longest cached run of full blocks is reused; compute is
//!   skipped up to the longest prefix of it that ends at a DeltaNet state
//!   checkpoint, copied into the sequence's own slot by the plan. Prefill
//!   chunks end exactly at the block boundaries where a checkpoint is to be
//!   written (the prompt's last full block, a branch point); see
//!   [`checkpoints`] for where, the copy ordering and the eviction order.
//!   Checkpoint slots are reclaimable: admission counts them as available.
//!
//! # Starvation bound (aging)
//! With aging interval A > 0, a request X of priority p that arrived at step s
//! sorts before every request of priority >= p_min that arrives after step
//! `s + (p - p_min) * A`. Admission is in key order (head of line) and both
//! kinds of preemption take the largest key, a priority preemption only for a
//! head whose key is smaller by more than `threshold * A`. So after step
//! `s + (p - p_min) * A` only the finitely many requests that arrived before it
//! can be admitted ahead of X, and after step `s + (p - p_min - threshold) * A`
//! only those can preempt X for priority. Preemptions among that finite set
//! only ever go from a larger key to a smaller one, so (by induction on the key
//! order, each running request ending within max_tokens steps of being left
//! alone) each of them, and then X, runs to completion after a bounded wait.
//! The model tests check the two mechanisms: no request is admitted while one
//! with a smaller key waits, and every priority victim's key exceeds the
//! waiting head's by more than the threshold. With A = 0 there is no such bound
//! across priorities.
//!
//! # Costs
//! `schedule()` + `update()`: O(running sequences + scheduled tokens + new
//! blocks) per step; nothing grows with context length except a one-off
//! O(prompt) for admission (hashing, block-table rows) and forks. All buffers are
//! reused; ids are numeric inside, strings only at `add_request` and in events.

pub mod checkpoints;
pub mod config;
pub mod metrics;
pub mod output;
pub(crate) mod queue;
pub mod request;

pub use checkpoints::CheckpointStats;
pub use config::SchedulerConfig;
pub use metrics::{ScheduledEvent, SchedulerStats};
pub use output::{PreemptCause, SchedulerOutput, StepUpdate};
pub use request::{FinishReason, RequestParams};

use crate::{BlockId, CoreError, KvCacheManager, SlotId, StatePool};
use checkpoints::Checkpoints;
use queue::{order_key, WaitingQueue};
use request::{ReqState, Request, Seq};
use std::collections::{HashMap, VecDeque};
use std::fmt;

/// Why a scheduler call was refused. Nothing changed when one is returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchedError {
    /// The request can never be served as given (HTTP 400).
    InvalidRequest(String),
    /// The waiting queue is at its cap (HTTP 503); retry later.
    QueueFull(String),
    /// No such request id.
    UnknownRequest(String),
    /// A protocol or argument mistake of the caller (wrong token count, ...).
    InvalidArgument(String),
}

impl fmt::Display for SchedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SchedError::InvalidRequest(m)
            | SchedError::QueueFull(m)
            | SchedError::UnknownRequest(m)
            | SchedError::InvalidArgument(m) => f.write_str(m),
        }
    }
}
impl std::error::Error for SchedError {}

impl From<CoreError> for SchedError {
    fn from(e: CoreError) -> Self {
        SchedError::InvalidArgument(e.to_string())
    }
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    req: u32,
    seq: u32,
    seq_id: u64,
    start: u32,
    k: u32,
    num_samples: u32,
}

#[derive(Debug, Clone, Copy)]
struct PendingStateCopy {
    req: u32,
    seq_id: u64,
    src: SlotId,
    dst: SlotId,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    pool: StatePool,
    ckpts: Checkpoints,
    free_rows: Vec<u32>,
    requests: Vec<Option<Box<Request>>>,
    free_handles: Vec<u32>,
    ids: HashMap<String, u32>,
    classes: Vec<String>,
    class_ids: HashMap<String, u32>,
    waiting: WaitingQueue,
    waiting_tokens: u64,
    /// Sorted by key.
    running: Vec<u32>,
    finished_fifo: VecDeque<(u32, u64)>,
    step: u64,
    next_arrival: u64,
    next_seq_id: u64,
    plan: Vec<Entry>,
    plan_samples: usize,
    plan_pending: bool,
    d_entries: Vec<Entry>,
    p_entries: Vec<Entry>,
    d_slots: Vec<i32>,
    p_slots: Vec<i32>,
    copies: Vec<(BlockId, BlockId)>,
    slot_scratch: Vec<SlotId>,
    pending_state_copies: Vec<PendingStateCopy>,
    finished_outside: Vec<(String, u32, FinishReason)>,
    out: SchedulerOutput,
    upd: StepUpdate,
    events: Vec<ScheduledEvent>,
    reserved_blocks: u64,
    req_reserved: HashMap<u32, u64>,
    preemptions: u64,
    preemptions_priority: u64,
    state_fork_copies: u64,
    finished_requests: u64,
    aborted_requests: u64,
    last_step_tokens: u32,
}

struct Snap {
    d_e: usize,
    p_e: usize,
    d_s: usize,
    p_s: usize,
    copies: usize,
    bt: usize,
    budget: usize,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self, CoreError> {
        cfg.validate()?;
        let kv = KvCacheManager::new(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)?;
        let pool = StatePool::new(cfg.num_state_slots);
        let ckpts = Checkpoints::new(cfg.block_size, cfg.checkpoint_slot_cost_blocks);
        // Rows are handed out from the end: row 0 first.
        let free_rows = (0..cfg.max_num_seqs).rev().collect();
        Ok(Scheduler {
            kv,
            pool,
            ckpts,
            free_rows,
            requests: Vec::new(),
            free_handles: Vec::new(),
            ids: HashMap::new(),
            classes: Vec::new(),
            class_ids: HashMap::new(),
            waiting: WaitingQueue::default(),
            waiting_tokens: 0,
            running: Vec::new(),
            finished_fifo: VecDeque::new(),
            step: 0,
            next_arrival: 0,
            next_seq_id: 0,
            plan: Vec::new(),
            plan_samples: 0,
            plan_pending: false,
            d_entries: Vec::new(),
            p_entries: Vec::new(),
            d_slots: Vec::new(),
            p_slots: Vec::new(),
            copies: Vec::new(),
            slot_scratch: Vec::new(),
            pending_state_copies: Vec::new(),
            finished_outside: Vec::new(),
            out: SchedulerOutput::default(),
            upd: StepUpdate::default(),
            events: Vec::new(),
            reserved_blocks: 0,
            req_reserved: HashMap::new(),
            preemptions: 0,
            preemptions_priority: 0,
            state_fork_copies: 0,
            finished_requests: 0,
            aborted_requests: 0,
            last_step_tokens: 0,
            cfg,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Columns of the persistent block-table buffer: `ceil(max_model_len / block_size)`.
    pub fn max_blocks_per_seq(&self) -> u32 {
        self.cfg.max_blocks_per_seq()
    }

    /// Admits a request into the waiting queue or refuses it at once, changing
    /// nothing. Returns its handle (the `req_indices` value in plans). O(prompt).
    pub fn add_request(&mut self, id: &str, prompt: &[u32], params: RequestParams) -> Result<u32, SchedError> {
        let inv = |m: String| Err(SchedError::InvalidRequest(m));
        let c = &self.cfg;
        if let Some(&h) = self.ids.get(id) {
            let finished = self.requests[h as usize].as_ref().is_none_or(|r| r.state == ReqState::Finished);
            if !finished {
                return inv(format!("request id {id:?} is already in use by an unfinished request; use a unique id"));
            }
        }
        let p = prompt.len();
        if p == 0 {
            return inv("the prompt is empty; send at least one token".into());
        }
        if params.max_tokens == 0 {
            return inv("max_tokens must be at least 1".into());
        }
        if params.min_tokens > params.max_tokens {
            return inv(format!(
                "min_tokens ({}) exceeds max_tokens ({}); lower min_tokens",
                params.min_tokens, params.max_tokens
            ));
        }
        if params.n == 0 {
            return inv("n must be at least 1".into());
        }
        if p > c.max_model_len as usize {
            return inv(format!(
                "the prompt has {p} tokens, more than max_model_len ({}); shorten the prompt",
                c.max_model_len
            ));
        }
        let total = p as u64 + params.max_tokens as u64;
        if total > c.max_model_len as u64 {
            return inv(format!(
                "prompt ({p} tokens) + max_tokens ({}) = {total} exceeds max_model_len ({}); lower max_tokens to at most {}",
                params.max_tokens,
                c.max_model_len,
                c.max_model_len as usize - p
            ));
        }
        if params.n > c.num_state_slots || params.n > c.max_num_seqs {
            return inv(format!(
                "n = {} parallel samples exceeds the state pool ({} slots) or max_num_seqs ({}); lower n",
                params.n, c.num_state_slots, c.max_num_seqs
            ));
        }
        let bs = c.block_size as u64;
        let worst = params.n as u64 * total.div_ceil(bs);
        if worst > c.num_blocks as u64 {
            return inv(format!(
                "prompt + max_tokens = {total} tokens x n = {} needs up to {worst} KV blocks but the whole pool has {}; \
                 lower max_tokens, n or the prompt length",
                params.n, c.num_blocks
            ));
        }
        if c.reserve_max_context {
            let need = params.n as u64 * c.max_blocks_per_seq() as u64;
            if need > c.num_blocks as u64 {
                return inv(format!(
                    "reserve_max_context needs {need} blocks for n = {} sequences of max_model_len but the pool has {}; \
                     lower n or max_model_len",
                    params.n, c.num_blocks
                ));
            }
        }
        if self.waiting.len() as u64 >= c.max_waiting_requests as u64 {
            return Err(SchedError::QueueFull(format!(
                "the waiting queue holds {} requests (max_waiting_requests); retry later",
                self.waiting.len()
            )));
        }
        if self.waiting_tokens + p as u64 > c.max_waiting_tokens {
            return Err(SchedError::QueueFull(format!(
                "the waiting queue holds {} tokens to prefill and this prompt adds {p} (max_waiting_tokens = {}); retry later",
                self.waiting_tokens, c.max_waiting_tokens
            )));
        }
        // Accepted: from here on nothing fails.
        if let Some(&h) = self.ids.get(id) {
            self.forget(h);
        }
        let class_id = match self.class_ids.get(params.request_class.as_str()) {
            Some(&c) => c,
            None => {
                let c = self.classes.len() as u32;
                self.classes.push(params.request_class.clone());
                self.class_ids.insert(params.request_class.clone(), c);
                c
            }
        };
        let arrival_seq = self.next_arrival;
        self.next_arrival += 1;
        let key = order_key(params.priority, self.step, arrival_seq, self.cfg.aging_interval_steps);
        let seq = Seq::new(self.next_seq_id, 0, prompt.to_vec());
        self.next_seq_id += 1;
        let req = Request {
            id: id.to_string(),
            prompt_len: p,
            params,
            class_id,
            arrival_seq,
            key,
            state: ReqState::Waiting,
            seqs: vec![seq],
            forked: false,
            spare_slots: Vec::new(),
            first_scheduled: false,
            num_preemptions: 0,
            refork: false,
        };
        let h = match self.free_handles.pop() {
            Some(h) => {
                self.requests[h as usize] = Some(Box::new(req));
                h
            }
            None => {
                self.requests.push(Some(Box::new(req)));
                (self.requests.len() - 1) as u32
            }
        };
        self.ids.insert(id.to_string(), h);
        self.waiting.insert(key, h);
        self.waiting_tokens += p as u64;
        Ok(h)
    }

    /// Plans one step (see [`SchedulerOutput`] for the layout). Errors if the
    /// previous non-empty plan was not passed to `update()` yet.
    pub fn schedule(&mut self, now: f64) -> Result<&SchedulerOutput, SchedError> {
        if self.plan_pending && !self.plan.is_empty() {
            return Err(SchedError::InvalidArgument(
                "schedule() called again before update() consumed the previous plan; call update(sampled) first".into(),
            ));
        }
        self.step += 1;
        self.out.clear();
        self.d_entries.clear();
        self.p_entries.clear();
        self.d_slots.clear();
        self.p_slots.clear();
        self.copies.clear();
        std::mem::swap(&mut self.out.finished, &mut self.finished_outside);

        // First, so the fork copies below skip the victims' (freed) slots: a
        // freed slot may be the destination of the admitted head's restore.
        let priority_preempted = self.priority_preempt();

        // Fork copies decided by the last update(), for children still holding the slot.
        for pc in self.pending_state_copies.drain(..) {
            let live = self.requests[pc.req as usize].as_ref().is_some_and(|r| {
                r.state == ReqState::Running && r.seqs.iter().any(|s| s.seq_id == pc.seq_id && s.slot == Some(pc.dst))
            });
            if live {
                self.out.state_copies.push(pc.src as i32);
                self.out.state_copies.push(pc.dst as i32);
            }
        }
        // Checkpoint writes registered by the last update(), before any forward
        // advances their sequences; then slots of dropped checkpoints whose
        // copies have run.
        self.ckpts.reconcile(&mut self.kv, &mut self.pool, self.step);
        self.ckpts.emit_writes(&mut self.out.state_copies);

        let mut pending_decodes = 0usize;
        let mut running_units = 0u32;
        for &r in &self.running {
            let req = self.requests[r as usize].as_ref().expect("running handle");
            running_units += req.units();
            for s in &req.seqs {
                if s.is_live() && s.tokens.len() - s.num_computed == 1 && s.num_computed >= req.prompt_len {
                    pending_decodes += 1;
                    // The walk below reads the token to feed and the tail block:
                    // start those (scattered) cache lines loading now, all at once.
                    crate::prefetch(s.tokens.as_ptr().wrapping_add(s.tokens.len() - 1));
                    crate::prefetch(s.table.blocks.as_ptr().wrapping_add(s.table.blocks.len().saturating_sub(1)));
                }
            }
        }

        let bs = self.cfg.block_size as usize;
        let thresh = self.cfg.long_prefill_token_threshold as usize;
        let mut budget = self.cfg.max_num_batched_tokens as usize;
        let mut preempted_any = false;
        let mut i = 0;
        while i < self.running.len() {
            let r = self.running[i];
            let mut req = self.requests[r as usize].take().expect("running handle");
            let snap = Snap {
                d_e: self.d_entries.len(),
                p_e: self.p_entries.len(),
                d_s: self.d_slots.len(),
                p_s: self.p_slots.len(),
                copies: self.copies.len(),
                bt: self.out.bt_update_rows.len(),
                budget,
            };
            let mut self_preempt = false;
            // Beams decode together: while one is still recomputing, the
            // others (ready to decode) wait for it.
            let beams_wait = req.params.beam_search
                && req.forked
                && req.seqs.iter().any(|s| s.is_live() && s.tokens.len() - s.num_computed > 1);
            let leader = req.leader();
            for si in 0..req.seqs.len() {
                if req.waits_for_refork(si) {
                    continue;
                }
                let refork_lead = req.refork && si == leader;
                let seq = &mut req.seqs[si];
                if !seq.is_live() {
                    continue;
                }
                let need = seq.tokens.len() - seq.num_computed;
                let decode = need == 1 && seq.num_computed >= req.prompt_len;
                let k = if decode {
                    pending_decodes -= 1;
                    if beams_wait {
                        continue;
                    }
                    1
                } else {
                    let mut k = need.min(budget.saturating_sub(pending_decodes));
                    if req.params.beam_search && req.forked {
                        k = k.min(need - 1);
                    }
                    if refork_lead && seq.num_computed < req.prompt_len {
                        k = k.min(req.prompt_len - seq.num_computed);
                    }
                    if thresh > 0 {
                        k = k.min(thresh);
                    }
                    let due = seq.next_checkpoint(self.cfg.prefix_checkpoint_interval as usize);
                    if due > seq.num_computed {
                        k = k.min(due - seq.num_computed);
                    }
                    k
                };
                if k == 0 {
                    continue;
                }
                let start = seq.num_computed;
                let end = start + k;
                let n_cached = end.min(seq.matched).saturating_sub(start);
                let n_new = k - n_cached;
                loop {
                    let slots = if decode { &mut self.d_slots } else { &mut self.p_slots };
                    let before = slots.len();
                    slots.extend(std::iter::repeat_n(-1, n_cached));
                    match self.kv.append_slots(&mut seq.table, n_new, slots, &mut self.copies) {
                        Ok(()) => break,
                        Err(CoreError::OutOfBlocks { .. }) => {
                            slots.truncate(before);
                            if self.running.len() - 1 > i {
                                let v = self.running.pop().expect("victim");
                                let mut vreq = self.requests[v as usize].take().expect("victim handle");
                                for s in &vreq.seqs {
                                    if s.is_live()
                                        && s.tokens.len() - s.num_computed == 1
                                        && s.num_computed >= vreq.prompt_len
                                    {
                                        pending_decodes -= 1;
                                    }
                                }
                                running_units -= vreq.units();
                                self.preempt(&mut vreq, v, PreemptCause::BlocksNeeded);
                                self.requests[v as usize] = Some(vreq);
                                preempted_any = true;
                            } else {
                                self_preempt = true;
                                break;
                            }
                        }
                        Err(e) => panic!("append_slots failed unexpectedly: {e}"),
                    }
                }
                if self_preempt {
                    break;
                }
                let num_samples = if end == seq.tokens.len() {
                    if !req.forked { req.params.n } else { 1 }
                } else {
                    0
                };
                if seq.row.is_none() {
                    seq.row = Some(self.free_rows.pop().expect("a row per running sequence (max_num_seqs)"));
                    seq.bt_synced = 0;
                }
                sync_row(seq, &mut self.out);
                budget -= k;
                let e = Entry { req: r, seq: si as u32, seq_id: seq.seq_id, start: start as u32, k: k as u32, num_samples };
                if decode {
                    self.d_entries.push(e);
                } else {
                    self.p_entries.push(e);
                }
            }
            if self_preempt {
                self.d_entries.truncate(snap.d_e);
                self.p_entries.truncate(snap.p_e);
                self.d_slots.truncate(snap.d_s);
                self.p_slots.truncate(snap.p_s);
                self.copies.truncate(snap.copies);
                self.out.bt_update_rows.truncate(snap.bt);
                self.out.bt_update_cols.truncate(snap.bt);
                self.out.bt_update_values.truncate(snap.bt);
                budget = snap.budget;
                let popped = self.running.pop();
                debug_assert_eq!(popped, Some(r));
                running_units -= req.units();
                self.preempt(&mut req, r, PreemptCause::BlocksNeeded);
                self.requests[r as usize] = Some(req);
                preempted_any = true;
                break;
            }
            self.requests[r as usize] = Some(req);
            i += 1;
        }

        // A block preemption means the running set is short of room: admitting
        // would only evict again. Room made for a higher priority is for it.
        if !preempted_any || priority_preempted > 0 {
            while budget > 0 {
                let Some(r) = self.waiting.first() else { break };
                let mut req = self.requests[r as usize].take().expect("waiting handle");
                let ok = self.try_admit(&mut req, r, &mut budget, &mut running_units, now, bs, thresh);
                self.requests[r as usize] = Some(req);
                if !ok {
                    break;
                }
            }
        }

        // Checkpoints whose KV chain lost a block to this step's allocations.
        self.ckpts.reconcile(&mut self.kv, &mut self.pool, self.step);

        // Assemble the plan: decodes, then prefill chunks.
        let out = &mut self.out;
        out.num_decodes = self.d_entries.len();
        out.query_start_loc.push(0);
        self.plan.clear();
        self.plan_samples = 0;
        let mut t = 0i32;
        for e in self.d_entries.iter().chain(self.p_entries.iter()) {
            let req = self.requests[e.req as usize].as_ref().expect("planned handle");
            let seq = &req.seqs[e.seq as usize];
            let (start, k) = (e.start as usize, e.k as usize);
            out.req_indices.push(e.req);
            out.sample_indices.push(seq.sample_index as i32);
            out.seq_ids.push(seq.seq_id as i64);
            out.num_scheduled_tokens.push(k as i32);
            out.num_computed_tokens.push(start as i32);
            out.seq_lens.push((start + k) as i32);
            t += k as i32;
            out.query_start_loc.push(t);
            out.input_ids.extend(seq.tokens[start..start + k].iter().map(|&x| x as i32));
            out.positions.extend(start as i32..(start + k) as i32);
            out.state_slots.push(seq.slot.expect("running sequence has a slot") as i32);
            out.num_samples.push(e.num_samples as i32);
            out.block_table_rows.push(seq.row.expect("scheduled sequence has a row") as i32);
            self.plan.push(*e);
            self.plan_samples += e.num_samples as usize;
        }
        out.slot_mapping.extend_from_slice(&self.d_slots);
        out.slot_mapping.extend_from_slice(&self.p_slots);
        for &(s, d) in &self.copies {
            out.block_copies.push(s as i32);
            out.block_copies.push(d as i32);
        }
        self.last_step_tokens = t as u32;
        self.plan_pending = true;
        Ok(&self.out)
    }

    #[allow(clippy::too_many_arguments)]
    fn try_admit(
        &mut self,
        req: &mut Request,
        r: u32,
        budget: &mut usize,
        running_units: &mut u32,
        now: f64,
        bs: usize,
        thresh: usize,
    ) -> bool {
        let units = req.units();
        if *running_units + units > self.cfg.max_num_seqs {
            return false;
        }
        let free_slots = self.pool.num_free();
        if free_slots < units && free_slots + self.ckpts.num_evictable(self.step) < units {
            return false;
        }
        let reserve = if self.cfg.reserve_max_context {
            let need = units as u64 * self.cfg.max_blocks_per_seq() as u64;
            if self.reserved_blocks + need > self.cfg.num_blocks as u64 {
                return false;
            }
            need
        } else {
            0
        };
        // Chunk sizes, and a conservative block check before touching the cache.
        let mut left = *budget;
        let mut need_blocks = 0usize;
        let mut chunks = Vec::with_capacity(req.seqs.len());
        let leader = req.leader();
        for (si, s) in req.seqs.iter().enumerate() {
            if !s.is_live() || req.waits_for_refork(si) {
                chunks.push(0);
                continue;
            }
            let mut k = s.tokens.len().min(left);
            if req.refork && si == leader {
                k = k.min(req.prompt_len);
            }
            if thresh > 0 {
                k = k.min(thresh);
            }
            left -= k;
            need_blocks += k.div_ceil(bs);
            chunks.push(k);
        }
        if chunks.first().copied().unwrap_or(0) == 0 && req.seqs[0].is_live() {
            return false;
        }
        let caching = self.kv.prefix_caching_enabled();
        // Without a prefix cache this bound is exact enough to skip the work below;
        // with one, blocks a hit covers are not needed, so the appends decide.
        if !caching && need_blocks > self.kv.num_free_blocks() as usize {
            return false;
        }
        let pending = req.pending_tokens();
        // (sequence, slot to copy the state from, checkpoint key)
        let mut restores: Vec<(usize, SlotId, u64)> = Vec::new();
        let p_s = self.p_slots.len();
        let c_s = self.copies.len();
        let mut failed = false;
        let refork = req.refork;
        for (si, s) in req.seqs.iter_mut().enumerate() {
            if !s.is_live() || (refork && si != leader) {
                continue;
            }
            // A re-forking leader must end at the prompt with nothing of its own in
            // its table: the others fork that table.
            let upto = if refork { req.prompt_len } else { s.tokens.len() };
            s.matched = self.kv.match_prefix(&mut s.table, &s.tokens[..upto], req.params.extra_key);
            let mut hit = 0;
            if caching {
                if let Some((t, src, key)) = self.ckpts.lookup(&s.table.chain, s.matched / bs, self.step) {
                    hit = t;
                    restores.push((si, src, key));
                }
            }
            s.num_computed = hit;
            set_checkpoint_targets(s, req.prompt_len, hit, caching, bs, self.cfg.prefix_checkpoint_interval > 0);
            let mut k = chunks[si].min(s.tokens.len() - hit);
            if refork && si == leader {
                k = k.min(req.prompt_len - hit);
            }
            if req.params.beam_search && req.forked {
                // Recompute of a beam: its last token is fed as a decode, with the others'.
                k = k.min(s.tokens.len() - 1 - hit);
            }
            let due = s.next_checkpoint(self.cfg.prefix_checkpoint_interval as usize);
            if due > hit {
                k = k.min(due - hit);
            }
            chunks[si] = k;
            if k == 0 {
                continue;
            }
            let n_cached = (hit + k).min(s.matched).saturating_sub(hit);
            self.p_slots.extend(std::iter::repeat_n(-1, n_cached));
            if self.kv.append_slots(&mut s.table, k - n_cached, &mut self.p_slots, &mut self.copies).is_err() {
                failed = true;
                break;
            }
        }
        // Slots: checkpoints are reclaimable. Those this request restores from
        // are busy (kept); when nothing else is left, a sequence takes over the
        // checkpoint it resumes from instead of copying it.
        while !failed && self.pool.num_free() < units {
            if !self.ckpts.evict_one(&mut self.kv, &mut self.pool, self.step) {
                break;
            }
        }
        let mut adopted = 0usize;
        if !failed && self.pool.num_free() < units {
            let short = (units - self.pool.num_free()) as usize;
            if short > restores.len() {
                failed = true;
            } else {
                for rs in restores.iter_mut().take(short) {
                    match self.ckpts.adopt(&mut self.kv, &mut self.pool, rs.2) {
                        Some(slot) => {
                            req.seqs[rs.0].slot = Some(slot);
                            rs.1 = slot;
                            adopted += 1;
                        }
                        None => {
                            failed = true;
                            break;
                        }
                    }
                }
            }
        }
        if failed {
            self.p_slots.truncate(p_s);
            self.copies.truncate(c_s);
            for s in req.seqs.iter_mut() {
                self.kv.free(&mut s.table);
                if let Some(slot) = s.slot.take() {
                    // Adopted from a checkpoint above; that checkpoint is lost.
                    self.pool.free(slot).expect("adopted slot held");
                }
                s.matched = 0;
                s.num_computed = 0;
                s.ckpt_next = 0;
                s.ckpt_after = 0;
                s.ckpt_until = 0;
            }
            return false;
        }
        // Commit.
        self.slot_scratch.clear();
        self.pool.allocate_n(units as usize - adopted, &mut self.slot_scratch).expect("slots checked above");
        let mut it = self.slot_scratch.iter();
        if req.forked {
            for s in req.seqs.iter_mut().filter(|s| s.is_live() && s.slot.is_none()) {
                s.slot = Some(*it.next().expect("one slot per live sequence"));
            }
        } else {
            if req.seqs[0].slot.is_none() {
                req.seqs[0].slot = Some(*it.next().expect("a slot for the sequence"));
            }
            req.spare_slots.clear();
            req.spare_slots.extend(it);
        }
        for &(si, src, _) in &restores {
            let dst = req.seqs[si].slot.expect("slot assigned above");
            if src != dst {
                self.out.state_copies.push(src as i32);
                self.out.state_copies.push(dst as i32);
            }
        }
        if caching {
            let st = &mut self.ckpts.stats;
            for s in req.seqs.iter().filter(|s| s.is_live()) {
                st.queries += 1;
                st.hits += (s.num_computed > 0) as u64;
                st.skipped_tokens += s.num_computed as u64;
                st.lost_tokens += (s.matched.max(s.num_computed) - s.num_computed) as u64;
            }
        }
        self.waiting.remove(&req.key);
        self.waiting_tokens -= pending;
        req.state = ReqState::Running;
        let pos = self.running.partition_point(|&x| self.requests[x as usize].as_ref().expect("running").key < req.key);
        self.running.insert(pos, r);
        *running_units += units;
        if reserve > 0 {
            self.reserved_blocks += reserve;
            self.req_reserved.insert(r, reserve);
        }
        for (si, s) in req.seqs.iter_mut().enumerate() {
            let k = chunks[si];
            if k == 0 || !s.is_live() {
                continue;
            }
            s.row = Some(self.free_rows.pop().expect("a row per running sequence (max_num_seqs)"));
            s.bt_synced = 0;
            sync_row(s, &mut self.out);
            *budget -= k;
            let start = s.num_computed;
            let num_samples = if start + k == s.tokens.len() {
                if req.forked { 1 } else { req.params.n }
            } else {
                0
            };
            self.p_entries.push(Entry {
                req: r,
                seq: si as u32,
                seq_id: s.seq_id,
                start: start as u32,
                k: k as u32,
                num_samples,
            });
        }
        if !req.first_scheduled {
            req.first_scheduled = true;
            self.events.push(ScheduledEvent {
                request_id: req.id.clone(),
                request_class: self.classes[req.class_id as usize].clone(),
                time: now,
                queue_delay: now - req.params.arrival_time,
            });
        }
        true
    }

    /// Whether running request `v` may be preempted to make room for waiting
    /// request `h`: a strictly more urgent static priority, and an effective
    /// priority (with aging) better by more than the threshold. Equal
    /// priorities never preempt each other (FCFS among equals is unchanged).
    fn outranks(&self, h: &Request, v: &Request) -> bool {
        if h.params.priority >= v.params.priority {
            return false;
        }
        let a = self.cfg.aging_interval_steps.max(1) as i128;
        v.key.0 - h.key.0 > self.cfg.priority_preemption_threshold as i128 * a
    }

    /// What the running requests hold that admission weighs: (sequences,
    /// running decodes, decodes crossing into a new block). O(running).
    fn running_load(&self) -> (u32, usize, u64) {
        let mut running_units = 0u32;
        let mut decodes = 0usize;
        let mut decode_blocks = 0u64;
        let bs = self.cfg.block_size as usize;
        for &r in &self.running {
            let q = self.requests[r as usize].as_ref().expect("running");
            running_units += q.units();
            for s in q.seqs.iter().filter(|s| s.is_live()) {
                if s.tokens.len() - s.num_computed == 1 && s.num_computed >= q.prompt_len {
                    decodes += 1;
                    decode_blocks += (s.num_computed % bs == 0) as u64;
                }
            }
        }
        (running_units, decodes, decode_blocks)
    }

    /// Would waiting request `h` be admitted with `units` sequences, `slots`
    /// state slots and `blocks` KV blocks free, given the running load (see
    /// `running_load`)? Counts the blocks of its first chunk and one per running
    /// decode crossing into a new block; a prefix hit, which may need fewer, is
    /// not counted (conservative). O(h's sequences).
    fn admission_room(&self, h: &Request, load: (u32, usize, u64), extra_units: u32, extra_slots: u32, extra_blocks: u64) -> bool {
        let (running_units, decodes, decode_blocks) = load;
        let units = h.units();
        let bs = self.cfg.block_size as usize;
        if running_units.saturating_sub(extra_units) + units > self.cfg.max_num_seqs {
            return false;
        }
        if self.pool.num_free() + self.ckpts.num_evictable(self.step) + extra_slots < units {
            return false;
        }
        if self.cfg.reserve_max_context {
            let need = units as u64 * self.cfg.max_blocks_per_seq() as u64;
            let held = self.reserved_blocks.saturating_sub(extra_blocks);
            return held + need <= self.cfg.num_blocks as u64;
        }
        let thresh = self.cfg.long_prefill_token_threshold as usize;
        let mut left = (self.cfg.max_num_batched_tokens as usize).saturating_sub(decodes);
        let mut need = decode_blocks;
        for s in h.seqs.iter().filter(|s| s.is_live()) {
            let mut k = (s.tokens.len() - s.num_computed).min(left);
            if thresh > 0 {
                k = k.min(thresh);
            }
            left -= k;
            need += k.div_ceil(bs) as u64;
        }
        need <= self.kv.num_free_blocks() as u64 + extra_blocks
    }

    /// What preempting `v` gives back: (sequences, slots, blocks). Blocks only
    /// count when no other request holds them (shared ones stay).
    fn room_of(&self, v: &Request, r: u32) -> (u32, u32, u64) {
        let slots = v.seqs.iter().filter(|s| s.slot.is_some()).count() as u32 + v.spare_slots.len() as u32;
        if self.cfg.reserve_max_context {
            return (v.units(), slots, self.req_reserved.get(&r).copied().unwrap_or(0));
        }
        let mut held: HashMap<BlockId, u32> = HashMap::new();
        for s in v.seqs.iter().filter(|s| s.is_live()) {
            for &b in s.table.blocks() {
                *held.entry(b).or_insert(0) += 1;
            }
        }
        let blocks = held.iter().filter(|&(&b, &c)| self.kv.refcount(b) == c).count() as u64;
        (v.units(), slots, blocks)
    }

    /// Priority preemption, before the running walk: while the waiting head
    /// does not fit and the lowest-ranked running request is outranked by it
    /// (see `outranks`), preempt that request, at most
    /// `max_priority_preemptions_per_step` times. Nothing is preempted when even
    /// all the outranked running requests together would not make room. The
    /// head is then admitted by the normal admission below, in this step.
    fn priority_preempt(&mut self) -> u32 {
        let bound = self.cfg.max_priority_preemptions_per_step;
        if bound == 0 || self.running.is_empty() {
            return 0;
        }
        let Some(hh) = self.waiting.first() else { return 0 };
        let head = self.requests[hh as usize].as_ref().expect("waiting handle");
        // O(1) exit first: running is sorted by key, so when its last request is
        // not outranked, none is (the common case: equal priorities).
        let last = *self.running.last().expect("non-empty");
        if !self.outranks(head, self.requests[last as usize].as_ref().expect("running")) {
            return 0;
        }
        let load = self.running_load();
        if self.admission_room(head, load, 0, 0, 0) {
            return 0;
        }
        // Feasibility: everything the outranked requests hold, lowest first.
        let (mut u, mut sl, mut bl) = (0u32, 0u32, 0u64);
        let mut victims = 0usize;
        let mut feasible = false;
        for &v in self.running.iter().rev() {
            let q = self.requests[v as usize].as_ref().expect("running");
            if !self.outranks(head, q) {
                break;
            }
            let (a, b, c) = self.room_of(q, v);
            u += a;
            sl += b;
            bl += c;
            victims += 1;
            if self.admission_room(head, load, u, sl, bl) {
                feasible = true;
                break;
            }
        }
        if !feasible {
            return 0;
        }
        let n = victims.min(bound as usize);
        for _ in 0..n {
            let v = self.running.pop().expect("victim");
            let mut vreq = self.requests[v as usize].take().expect("victim handle");
            self.preempt(&mut vreq, v, PreemptCause::Priority);
            self.requests[v as usize] = Some(vreq);
        }
        n as u32
    }

    /// Frees everything a running request holds and puts it back in the queue.
    fn preempt(&mut self, req: &mut Request, r: u32, cause: PreemptCause) {
        for s in req.seqs.iter_mut().filter(|s| s.is_live()) {
            release_seq(&mut self.kv, &mut self.pool, &mut self.free_rows, s);
            s.num_computed = 0;
            s.matched = 0;
            s.ckpt_next = 0;
            s.ckpt_after = 0;
            s.ckpt_until = 0;
        }
        for s in req.spare_slots.drain(..) {
            self.pool.free(s).expect("spare slot held");
        }
        if let Some(res) = self.req_reserved.remove(&r) {
            self.reserved_blocks -= res;
        }
        req.refork = req.forked && req.seqs.iter().filter(|s| s.is_live()).count() > 1;
        req.state = ReqState::Waiting;
        req.num_preemptions += 1;
        self.preemptions += 1;
        self.waiting.insert(req.key, r);
        self.waiting_tokens += req.pending_tokens();
        self.out.preempted.push(r);
        self.out.preempted_causes.push(cause);
        if cause == PreemptCause::Priority {
            self.preemptions_priority += 1;
        }
    }

    /// Applies the tokens sampled for the last plan: `num_samples[b]` tokens per
    /// entry, concatenated in batch order. Entries whose request was aborted or
    /// finished since are skipped. O(entries + new full blocks hashed).
    pub fn update(&mut self, sampled: &[i32]) -> Result<&StepUpdate, SchedError> {
        if !self.plan_pending {
            return Err(SchedError::InvalidArgument("update() called without a schedule() before it".into()));
        }
        if sampled.len() != self.plan_samples {
            return Err(SchedError::InvalidArgument(format!(
                "update() got {} sampled tokens but the last plan asks for {} (the sum of num_samples); \
                 pass exactly num_samples[b] tokens per entry in batch order",
                sampled.len(),
                self.plan_samples
            )));
        }
        if let Some(&bad) = sampled.iter().find(|&&t| t < 0) {
            return Err(SchedError::InvalidArgument(format!(
                "update() got a negative token id ({bad}); pass the sampled token ids"
            )));
        }
        self.plan_pending = false;
        self.forget_old_finished();
        self.upd.clear();
        let bs = self.cfg.block_size as usize;
        let mut off = 0usize;
        let mut any_done = false;
        for pi in 0..self.plan.len() {
            let e = self.plan[pi];
            let ns = e.num_samples as usize;
            let toks = &sampled[off..off + ns];
            off += ns;
            let Some(mut req) = self.requests[e.req as usize].take() else { continue };
            let si = e.seq as usize;
            let valid = req.state == ReqState::Running
                && req.seqs.get(si).is_some_and(|s| s.seq_id == e.seq_id && s.is_live() && s.num_computed == e.start as usize);
            if !valid {
                self.requests[e.req as usize] = Some(req);
                continue;
            }
            let extra_key = req.params.extra_key;
            {
                let seq = &mut req.seqs[si];
                let due = if seq.ckpt_next != 0 || seq.ckpt_until > seq.num_computed {
                    seq.next_checkpoint(self.cfg.prefix_checkpoint_interval as usize)
                } else {
                    0
                };
                seq.num_computed += e.k as usize;
                if self.cfg.enable_prefix_caching && seq.num_computed / bs > seq.table.num_hashed_blocks() {
                    self.kv.cache_full_blocks(&mut seq.table, &seq.tokens[..seq.num_computed], extra_key);
                }
                if due != 0 && seq.num_computed == due && seq.table.chain.len() >= due / bs {
                    let slot = seq.slot.expect("running sequence has a slot");
                    // The copy runs in the next plan, before the next forward.
                    let next = self.step + 1;
                    self.ckpts.write(&mut self.kv, &mut self.pool, &seq.table.chain[..due / bs], slot, next, next);
                }
                if seq.ckpt_next != 0 && seq.num_computed >= seq.ckpt_next {
                    seq.ckpt_next = seq.ckpt_after;
                    seq.ckpt_after = 0;
                }
            }
            if req.refork && si == req.leader() && req.seqs[si].num_computed >= req.prompt_len {
                self.refork(&mut req, e.req, si);
            }
            if ns == 1 {
                let t = toks[0] as u32;
                let seq = &mut req.seqs[si];
                seq.tokens.push(t);
                self.upd.req_indices.push(e.req);
                self.upd.sample_indices.push(seq.sample_index as i32);
                self.upd.tokens.push(t as i32);
                if let Some(reason) = req.params.check_stop(seq.tokens.len() - req.prompt_len, t) {
                    self.finish_seq(&mut req, si, reason);
                    self.upd.finished.push((e.req, req.seqs[si].sample_index, reason));
                }
            } else if ns > 1 {
                self.fork(&mut req, e.req, si, toks);
            }
            if req.all_finished() {
                any_done = true;
                self.close_request(&mut req, e.req, false);
            }
            self.requests[e.req as usize] = Some(req);
        }
        self.ckpts.reconcile(&mut self.kv, &mut self.pool, self.step + 1);
        if any_done {
            let reqs = &self.requests;
            self.running
                .retain(|&r| reqs[r as usize].as_ref().is_some_and(|q| q.state == ReqState::Running));
        }
        Ok(&self.upd)
    }

    /// The leader of a recomputed forked request has prefilled the prompt: the
    /// other live sequences share its prompt blocks and copy its state, then
    /// prefill only their own generated tokens.
    fn refork(&mut self, req: &mut Request, r: u32, leader: usize) {
        req.refork = false;
        let p = req.prompt_len;
        debug_assert_eq!(req.seqs[leader].table.num_tokens, p);
        let src = req.seqs[leader].slot.expect("running leader has a slot");
        for j in 0..req.seqs.len() {
            if j == leader || !req.seqs[j].is_live() {
                continue;
            }
            let table = self.kv.fork(&req.seqs[leader].table);
            let s = &mut req.seqs[j];
            debug_assert!(s.num_computed == 0 && s.table.blocks().is_empty());
            s.table = table;
            s.num_computed = p;
            s.matched = 0;
            s.bt_synced = 0;
            let dst = s.slot.expect("reserved slot");
            self.pending_state_copies.push(PendingStateCopy { req: r, seq_id: s.seq_id, src, dst });
            self.state_fork_copies += 1;
        }
    }

    fn fork(&mut self, req: &mut Request, r: u32, si: usize, toks: &[i32]) {
        debug_assert!(!req.forked && si == 0 && toks.len() == req.params.n as usize);
        req.forked = true;
        let parent_slot = req.seqs[0].slot.expect("running parent has a slot");
        let spares = std::mem::take(&mut req.spare_slots);
        for (i, &dst) in spares.iter().enumerate() {
            let parent = &req.seqs[0];
            let mut child = Seq::new(self.next_seq_id, (i + 1) as u32, parent.tokens.clone());
            self.next_seq_id += 1;
            child.table = self.kv.fork(&parent.table);
            child.num_computed = parent.num_computed;
            child.matched = parent.matched;
            child.slot = Some(dst);
            self.pending_state_copies.push(PendingStateCopy { req: r, seq_id: child.seq_id, src: parent_slot, dst });
            self.state_fork_copies += 1;
            req.seqs.push(child);
        }
        for (i, &t) in toks.iter().enumerate() {
            let t = t as u32;
            req.seqs[i].tokens.push(t);
            self.upd.req_indices.push(r);
            self.upd.sample_indices.push(i as i32);
            self.upd.tokens.push(t as i32);
            if let Some(reason) = req.params.check_stop(req.seqs[i].tokens.len() - req.prompt_len, t) {
                self.finish_seq(req, i, reason);
                self.upd.finished.push((r, i as u32, reason));
            }
        }
    }

    /// Marks one sequence finished and frees what it holds. An unforked request
    /// is one sequence standing for all n samples: its spare slots go too.
    fn finish_seq(&mut self, req: &mut Request, si: usize, reason: FinishReason) {
        let s = &mut req.seqs[si];
        s.finished = Some(reason);
        release_seq(&mut self.kv, &mut self.pool, &mut self.free_rows, s);
        if !req.forked {
            for s in req.spare_slots.drain(..) {
                self.pool.free(s).expect("spare slot held");
            }
        }
    }

    fn close_request(&mut self, req: &mut Request, r: u32, aborted: bool) {
        req.state = ReqState::Finished;
        if let Some(res) = self.req_reserved.remove(&r) {
            self.reserved_blocks -= res;
        }
        if aborted {
            self.aborted_requests += 1;
        } else {
            self.finished_requests += 1;
        }
        self.finished_fifo.push_back((r, req.arrival_seq));
    }

    fn forget_old_finished(&mut self) {
        while self.finished_fifo.len() > self.cfg.max_finished_retained as usize {
            let (h, aseq) = self.finished_fifo.pop_front().expect("non-empty");
            let same = self.requests[h as usize]
                .as_ref()
                .is_some_and(|r| r.arrival_seq == aseq && r.state == ReqState::Finished);
            if same {
                self.forget(h);
            }
        }
    }

    fn forget(&mut self, h: u32) {
        if let Some(r) = self.requests[h as usize].take() {
            if self.ids.get(&r.id) == Some(&h) {
                self.ids.remove(&r.id);
            }
            self.free_handles.push(h);
        }
    }

    /// Beam search: between `schedule()` and `update()` of a step that decoded
    /// every beam of request `id`, makes beam `i` a continuation of beam
    /// `parents[i]` (as it was after this step's forward). Beam i keeps its
    /// slot, row and sample index: its block table becomes a fork of the
    /// parent's (refcounts rise; the shared partly-filled tail is copied on the
    /// next append), its old blocks are released (freed when no one else holds
    /// them), and the parent's DeltaNet state is copied into its slot by the
    /// next plan's `state_copies` (a permutation is safe: copies are one gather,
    /// then one scatter). `update()` then appends beam i's token. O(moved beams x
    /// (blocks + generated tokens)): beams that keep their parent are not touched.
    pub fn reorder_beams(&mut self, id: &str, parents: &[u32]) -> Result<(), SchedError> {
        let h = self.handle(id)?;
        let req = self.requests[h as usize].as_ref().expect("known handle");
        let bad = |m: String| Err(SchedError::InvalidArgument(m));
        if !req.params.beam_search || !req.forked || req.state != ReqState::Running {
            return bad(format!("request {id:?} is not a running, forked beam-search request"));
        }
        let w = req.seqs.len();
        if parents.len() != w || parents.iter().any(|&p| p as usize >= w) {
            return bad(format!("reorder_beams needs {w} parent indices in [0, {w}), got {parents:?}"));
        }
        let in_plan = |si: usize| self.plan.iter().any(|e| e.req == h && e.seq as usize == si && e.num_samples == 1);
        if !self.plan_pending || (0..w).any(|i| !req.seqs[i].is_live() || !in_plan(i)) {
            return bad("reorder_beams must come between schedule() and update() of a step that decoded every beam".into());
        }
        if parents.iter().enumerate().all(|(i, &p)| p as usize == i) {
            return Ok(());
        }
        let mut req = self.requests[h as usize].take().expect("known handle");
        // Only beams that change parent move, and only what differs: every beam
        // holds the prompt, so a moved beam takes its parent's generated tokens; its
        // block-table row is resent from the first block that differs.
        let prompt_len = req.prompt_len;
        let moved: Vec<usize> = (0..w).filter(|&i| parents[i] as usize != i).collect();
        let new_tables: Vec<_> = moved.iter().map(|&i| self.kv.fork(&req.seqs[parents[i] as usize].table)).collect();
        let tails: Vec<Vec<u32>> =
            moved.iter().map(|&i| req.seqs[parents[i] as usize].tokens[prompt_len..].to_vec()).collect();
        let slots: Vec<SlotId> = req.seqs.iter().map(|s| s.slot.expect("running beam has a slot")).collect();
        for ((&i, mut t), tail) in moved.iter().zip(new_tables).zip(tails) {
            let p = parents[i] as usize;
            let s = &mut req.seqs[i];
            std::mem::swap(&mut s.table, &mut t);
            let (old, new) = (t.blocks(), s.table.blocks());
            let same = old.iter().zip(new).take_while(|(a, b)| a == b).count();
            if same < s.bt_synced {
                // Columns before bt_synced - 1 hold the old table's blocks.
                s.bt_synced = same;
                if same > 0 {
                    s.bt_last = old[same - 1];
                }
            }
            self.kv.free(&mut t);
            s.tokens.truncate(prompt_len);
            s.tokens.extend_from_slice(&tail);
            self.pending_state_copies.push(PendingStateCopy { req: h, seq_id: s.seq_id, src: slots[p], dst: slots[i] });
            self.state_fork_copies += 1;
        }
        self.requests[h as usize] = Some(req);
        Ok(())
    }

    /// Finishes sequences outside `update()`: all of a request (`sample = None`,
    /// abort) or one sample. They are reported in the next plan's `finished`.
    fn finish_outside(&mut self, h: u32, sample: Option<u32>, reason: FinishReason) -> Result<bool, SchedError> {
        let mut req = self.requests[h as usize].take().expect("known handle");
        if req.state == ReqState::Finished {
            self.requests[h as usize] = Some(req);
            return Ok(false);
        }
        let targets: Vec<usize> = if !req.forked {
            if let Some(s) = sample {
                if s >= req.params.n {
                    let n = req.params.n;
                    self.requests[h as usize] = Some(req);
                    return Err(SchedError::InvalidArgument(format!("sample_index {s} out of range for n = {n}")));
                }
            }
            vec![0]
        } else {
            match sample {
                None => (0..req.seqs.len()).filter(|&i| req.seqs[i].is_live()).collect(),
                Some(s) => match req.seqs.iter().position(|q| q.sample_index == s) {
                    Some(i) if req.seqs[i].is_live() => vec![i],
                    Some(_) => {
                        self.requests[h as usize] = Some(req);
                        return Ok(false);
                    }
                    None => {
                        let n = req.params.n;
                        self.requests[h as usize] = Some(req);
                        return Err(SchedError::InvalidArgument(format!("sample_index {s} out of range for n = {n}")));
                    }
                },
            }
        };
        let was_waiting = req.state == ReqState::Waiting;
        if was_waiting {
            self.waiting_tokens -= req.pending_tokens();
        }
        for &i in &targets {
            self.finish_seq(&mut req, i, reason);
            if req.forked {
                self.finished_outside.push((req.id.clone(), req.seqs[i].sample_index, reason));
            } else {
                for s in 0..req.params.n {
                    self.finished_outside.push((req.id.clone(), s, reason));
                }
            }
        }
        if req.all_finished() {
            if was_waiting {
                self.waiting.remove(&req.key);
            } else {
                self.running.retain(|&x| x != h);
            }
            self.close_request(&mut req, h, reason == FinishReason::Abort);
        } else if was_waiting {
            self.waiting_tokens += req.pending_tokens();
        }
        self.requests[h as usize] = Some(req);
        Ok(true)
    }

    /// Aborts a request in any state, returning every block and slot. Returns
    /// false if it had already finished; Err for an unknown id. O(running).
    pub fn abort(&mut self, id: &str) -> Result<bool, SchedError> {
        let h = self.handle(id)?;
        self.finish_outside(h, None, FinishReason::Abort)
    }

    /// Finishes one sample (a stop string found by the caller). Returns false if
    /// it had already finished.
    pub fn finish(&mut self, id: &str, sample_index: u32, reason: FinishReason) -> Result<bool, SchedError> {
        let h = self.handle(id)?;
        self.finish_outside(h, Some(sample_index), reason)
    }

    fn handle(&self, id: &str) -> Result<u32, SchedError> {
        self.ids.get(id).copied().ok_or_else(|| {
            SchedError::UnknownRequest(format!("unknown request id {id:?} (never added, or finished and forgotten)"))
        })
    }

    /// Generated tokens of one sample (empty before its first token).
    pub fn output_tokens(&self, id: &str, sample_index: u32) -> Result<&[u32], SchedError> {
        let h = self.handle(id)?;
        let req = self.requests[h as usize].as_ref().expect("known handle");
        if sample_index >= req.params.n {
            return Err(SchedError::InvalidArgument(format!(
                "sample_index {sample_index} out of range for n = {}",
                req.params.n
            )));
        }
        let seq = req.seqs.iter().find(|s| s.sample_index == sample_index).unwrap_or(&req.seqs[0]);
        Ok(&seq.tokens[req.prompt_len..])
    }

    /// The request id behind a plan/update handle.
    pub fn request_id(&self, handle: u32) -> Option<&str> {
        self.requests.get(handle as usize)?.as_ref().map(|r| r.id.as_str())
    }

    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Waiting requests' handles in admission order (tests, debugging).
    pub fn waiting_order(&self) -> Vec<u32> {
        self.waiting.iter().collect()
    }

    /// Drains the first-scheduled events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<ScheduledEvent> {
        std::mem::take(&mut self.events)
    }

    /// Dense block tables of the last plan's entries (`-1` padded): tests and
    /// debugging; the engine uses the incremental row updates instead.
    pub fn block_tables(&self) -> (usize, Vec<i32>) {
        let rows: Vec<&[BlockId]> = self
            .out
            .req_indices
            .iter()
            .zip(&self.out.seq_ids)
            .map(|(&r, &sid)| {
                self.requests[r as usize]
                    .as_ref()
                    .and_then(|q| q.seqs.iter().find(|s| s.seq_id == sid as u64))
                    .map(|s| s.table.blocks())
                    .unwrap_or(&[])
            })
            .collect();
        let width = rows.iter().map(|b| b.len()).max().unwrap_or(0);
        let mut dense = vec![-1i32; rows.len() * width];
        for (i, b) in rows.iter().enumerate() {
            for (j, &x) in b.iter().enumerate() {
                dense[i * width + j] = x as i32;
            }
        }
        (width, dense)
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }
    pub fn state_pool(&self) -> &StatePool {
        &self.pool
    }

    /// `(slot, tokens, last block of its chain)` of every live checkpoint,
    /// sorted (tests and debugging).
    pub fn checkpoints(&self) -> Vec<(SlotId, usize, BlockId)> {
        self.ckpts.list()
    }

    pub fn checkpoint_stats(&self) -> CheckpointStats {
        self.ckpts.stats()
    }

    pub fn stats(&self) -> SchedulerStats {
        let kv = self.kv.stats();
        let ck = self.ckpts.stats();
        let mut tail_waste = 0u64;
        let mut running_seqs = 0u32;
        let mut shared = std::collections::HashSet::new();
        for &r in &self.running {
            let req = self.requests[r as usize].as_ref().expect("running");
            for s in req.seqs.iter().filter(|s| s.is_live()) {
                tail_waste += self.kv.tail_waste(&s.table) as u64;
                running_seqs += 1;
                shared.extend(s.table.blocks().iter().copied().filter(|&b| self.kv.refcount(b) > 1));
            }
        }
        SchedulerStats {
            num_blocks: self.kv.num_blocks(),
            free_blocks: self.kv.num_free_blocks(),
            used_blocks: self.kv.num_used_blocks(),
            cached_blocks: self.kv.num_cached_blocks(),
            num_slots: self.pool.num_slots(),
            // Like free_blocks (which counts parked cached blocks), free_slots
            // counts the reclaimable checkpoint slots; used_slots is sequences'.
            free_slots: self.pool.num_free() + ck.slots,
            used_slots: self.pool.num_used() - ck.slots,
            alloc_failures: kv.alloc_failures,
            tail_waste,
            prefix_queries: kv.prefix_queries,
            prefix_query_tokens: kv.prefix_query_tokens,
            prefix_hits: kv.prefix_hits,
            prefix_hit_tokens: kv.prefix_hit_tokens,
            evictions: kv.evictions,
            cow_copies: kv.cow_copies,
            preemptions: self.preemptions,
            preemptions_blocks: self.preemptions - self.preemptions_priority,
            preemptions_priority: self.preemptions_priority,
            state_fork_copies: self.state_fork_copies,
            shared_blocks: shared.len() as u32,
            num_running_requests: self.running.len() as u32,
            num_running_seqs: running_seqs,
            num_waiting_requests: self.waiting.len() as u32,
            waiting_tokens: self.waiting_tokens,
            steps: self.step,
            last_step_tokens: self.last_step_tokens,
            last_step_seqs: self.plan.len() as u32,
            finished_requests: self.finished_requests,
            aborted_requests: self.aborted_requests,
            reserved_blocks: self.reserved_blocks,
            checkpoint_slots: ck.slots,
            checkpoint_queries: ck.queries,
            checkpoint_hits: ck.hits,
            prefix_skipped_tokens: ck.skipped_tokens,
            prefix_lost_tokens: ck.lost_tokens,
            checkpoint_writes: ck.writes,
            checkpoint_writes_skipped: ck.writes_skipped,
            checkpoint_evictions: ck.evictions,
            checkpoint_drops: ck.drops,
        }
    }
}

/// A branch-point checkpoint must skip at least this many blocks more than
/// the state match it extends.
const MIN_BRANCH_GAIN_BLOCKS: usize = 4;

/// Where `s` (just matched: `hit` tokens restored, `s.matched` KV-matched)
/// writes checkpoints, nearest first: the branch point (end of a KV match
/// longer than the state match), then the prompt's last full block that
/// leaves a token to compute; with `every`, also each multiple of
/// `prefix_checkpoint_interval` up to that (see `Seq::next_checkpoint`).
fn set_checkpoint_targets(s: &mut Seq, prompt_len: usize, hit: usize, caching: bool, bs: usize, every: bool) {
    s.ckpt_next = 0;
    s.ckpt_after = 0;
    s.ckpt_until = 0;
    if !caching {
        return;
    }
    // A branch checkpoint costs a chunk boundary now; below this gain (e.g. the
    // previous turn's generated tokens, cached past its prompt checkpoint) the
    // prompt-end checkpoint serves later turns as well.
    let branch = if s.matched >= hit + MIN_BRANCH_GAIN_BLOCKS * bs { s.matched } else { 0 };
    let prompt_end = (prompt_len.saturating_sub(1) / bs) * bs;
    if every {
        s.ckpt_until = prompt_end;
    }
    let end = if prompt_end > hit.max(branch) { prompt_end } else { 0 };
    if branch > 0 {
        s.ckpt_next = branch;
        s.ckpt_after = end;
    } else {
        s.ckpt_next = end;
    }
}

/// Frees a sequence's blocks (tail first), slot and buffer row.
fn release_seq(kv: &mut KvCacheManager, pool: &mut StatePool, free_rows: &mut Vec<u32>, s: &mut Seq) {
    kv.free(&mut s.table);
    if let Some(slot) = s.slot.take() {
        pool.free(slot).expect("sequence slot held");
    }
    if let Some(row) = s.row.take() {
        free_rows.push(row);
    }
    s.bt_synced = 0;
}

/// Emits the block-table cells of `seq`'s row that the caller's buffer lacks:
/// a changed tail (copy-on-write) and the blocks appended since the last sync.
#[inline]
fn sync_row(seq: &mut Seq, out: &mut SchedulerOutput) {
    let row = seq.row.expect("row assigned") as i32;
    let blocks = seq.table.blocks();
    let synced = seq.bt_synced;
    if synced > 0 && blocks[synced - 1] != seq.bt_last {
        out.bt_update_rows.push(row);
        out.bt_update_cols.push((synced - 1) as i32);
        out.bt_update_values.push(blocks[synced - 1] as i32);
    }
    for (c, &b) in blocks.iter().enumerate().skip(synced) {
        out.bt_update_rows.push(row);
        out.bt_update_cols.push(c as i32);
        out.bt_update_values.push(b as i32);
    }
    seq.bt_synced = blocks.len();
    if let Some(&b) = blocks.last() {
        seq.bt_last = b;
    }
}
