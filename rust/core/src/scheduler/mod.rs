//! The continuous-batching scheduler: owns every request, decides at each
//! iteration boundary which sequences run and how many tokens each advances, and
//! keeps the arena pages they hold (KV blocks and DeltaNet state pages, behind
//! one [`cache_manager::CacheManager`] with one free count).
//!
//! # Step protocol
//! `schedule(now)` returns a [`SchedulerOutput`]; the caller runs the model and
//! passes the sampled tokens to `update(sampled)` (speculative decoding:
//! `update_spec(sampled, accepted, drafts)`). Then the next `schedule()`.
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
//! * Room is counted in pages of the one arena: a sequence holds its state
//!   pages plus its KV blocks. Reclaimable pages (parked cached blocks, then
//!   checkpoints by their compute-saved-per-page order) are evicted before
//!   anything is refused or preempted.
//! * Out of pages while growing a running sequence: preempt by recompute the
//!   running request with the largest key (lowest effective priority, latest
//!   arrival) not yet scheduled this step, or the request itself when it is the
//!   last. Its blocks, states and rows are freed; it re-enters the waiting queue
//!   with its old key (front of its priority) and on readmission re-prefills
//!   prompt + generated tokens; the last chunk samples the next token. No
//!   admission happens in a step that preempted. The unit of preemption is the
//!   whole request (all n samples).
//! * Priority preemption, first thing in a step: while the waiting head does
//!   not fit (sequences, or pages for its states and its first chunk) and the
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
//!   request whose worst case (n sequences of `ceil((prompt + max_tokens) /
//!   block_size)` blocks plus `state_pages` pages each) exceeds the whole arena, so a request alone
//!   always fits, and preemption frees room for the highest-keyed ones.
//! * n > 1: the prompt is prefilled once; its last chunk samples n tokens;
//!   `update()` forks n sequences sharing the prompt blocks (copy-on-write on the
//!   shared tail) and copies the DeltaNet state (page pairs in the next plan's
//!   `state_copies`). The n states are reserved at admission.
//! * Prefix cache: looked up at admission (and readmission after preemption).
//!   The KV of the longest cached run of full blocks is reused; compute is
//!   skipped up to the longest prefix of it that ends at a DeltaNet state
//!   checkpoint, copied into the sequence's own state pages by the plan. The
//!   plan asks the forward to write a checkpoint at a position inside a chunk
//!   (the prompt's last full block, a branch point); see [`checkpoints`] for
//!   where, the copy ordering and the eviction order.
//!
//! # Speculative decoding (`num_speculative_tokens` = k > 0)
//! The caller drafts up to k tokens per decoding sequence after each step and
//! hands them to `update_spec` (with how many of the last plan's drafts each
//! entry accepted). A sequence's drafts are kept beside its tokens, never in
//! them: only accepted tokens are committed, hashed for the prefix cache or
//! checkpointed. The next plan feeds a decode's last token then `d' <= d` of
//! its drafts (`num_draft_tokens`), `d'` cut to the token budget left after one
//! row for every decode still to come, and to `max_tokens` (r outputs left: at
//! most r - 1 drafts). Prefill chunks never carry drafts, so no checkpoint is
//! ever asked of a drafted row. After the step `num_computed` advances by the
//! accepted count; the accepted tokens pass the stop rule one by one.
//! Lookahead: every entry that samples reserves KV slots up to
//! `seq_len + k - 1` (not reaching `prompt + max_tokens`, where no token is
//! ever fed; none for beams, which do not speculate), in its block-table row,
//! for the drafter to write before the next plan. So a table may hold slots
//! past `num_computed` (lookahead, rejected drafts); `update` keeps them, and
//! the next `schedule` trims the table to that step's need and grows it, like
//! any other allocation (admission and preemption count it). A fork shares
//! only the computed prefix: the parent's lookahead is given back first, so no
//! slot anyone writes is ever shared. Drafts are dropped on preemption,
//! `abort_step`, fork and finish.
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

// The rooms: memory behind `cache_manager` (KV blocks, state pages and
// checkpoints, one free count), policy by concern: `admission`, `preemption`,
// `forking` (n > 1, beams), `lifecycle` (requests in and out), `step`
// (schedule / update), `plan` (assembling the caller's views), `stats`.
mod abort;
mod admission;
pub mod cache_manager;
pub mod checkpoints;
pub mod config;
mod forking;
mod lifecycle;
mod plan;
mod preemption;
mod stats;
#[cfg(test)]
mod stats_oracle;
mod step;
pub mod metrics;
pub mod output;
pub(crate) mod queue;
pub mod request;

pub use checkpoints::{CheckpointStats, CheckpointView, EvictKey, Victim};
pub use cache_manager::{EvictionRecord, Reservation, Shortfall};
pub use config::SchedulerConfig;
pub use metrics::{ScheduledEvent, SchedulerStats};
pub use output::{PreemptCause, SchedulerOutput, StepUpdate};
pub use request::{FinishReason, RequestParams};

pub use cache_manager::CacheManager;
use lifecycle::release_seq;
use plan::{push_state_copy, sync_row};

use crate::{BlockId, CoreError, StateId};
use queue::{order_key, WaitingQueue};
use request::Request;
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
    /// A checkpoint written inside this chunk: (boundary in tokens, its state).
    ckpt: Option<(u32, StateId)>,
}

#[derive(Debug, Clone, Copy)]
struct PendingStateCopy {
    req: u32,
    seq_id: u64,
    src: StateId,
    dst: StateId,
}

/// What stopped admission at the waiting head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AdmitLimit {
    Pages,
    MaxNumSeqs,
    TokenBudget,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    cache: CacheManager,
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
    /// Live sequences of the running requests, kept where requests enter and
    /// leave `running` and where sequences fork or finish (stats read it).
    running_seqs: u32,
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
    pending_state_copies: Vec<PendingStateCopy>,
    finished_outside: Vec<(String, u32, FinishReason)>,
    out: SchedulerOutput,
    upd: StepUpdate,
    events: Vec<ScheduledEvent>,
    reserved_pages: u64,
    req_reserved: HashMap<u32, u64>,
    /// Checkpoint states of the plan in flight (allocated, not registered yet).
    plan_ckpt_states: u32,
    /// States of finished sequences that a pending fork copy still reads:
    /// kept through the next plan (`states_in_plan`) and freed by the update
    /// after it, so no page of that plan is both read and written.
    deferred_states: Vec<StateId>,
    states_in_plan: Vec<StateId>,
    admission_limited: [u64; 3],
    last_admission_limit: Option<AdmitLimit>,
    /// (sequences running, pages obtainable) when admission last stopped.
    last_limit_room: (u32, u64),
    preemptions: u64,
    preemptions_priority: u64,
    state_fork_copies: u64,
    finished_requests: u64,
    aborted_requests: u64,
    last_step_tokens: u32,
    /// Speculative decoding counters: drafts scheduled, drafts accepted,
    /// acceptances per draft position (`num_speculative_tokens` long).
    spec_draft_tokens: u64,
    spec_accepted_tokens: u64,
    spec_accepted_by_position: Vec<u64>,
    /// Speculative decoding: the draft tokens the caller gave each running
    /// sequence for its next step, by its buffer row (kept outside `Seq`, so
    /// the plain decode walk touches no more memory). Fed after its last token
    /// by the next plan, replaced by every update that applies one of its
    /// entries, cleared when the row is handed to a sequence (so a preempted
    /// or finished sequence's drafts die with its row) and when it forks.
    /// Never in `tokens`: only accepted tokens are committed and hashed.
    row_drafts: Vec<Vec<u32>>,
}

struct Snap {
    d_e: usize,
    p_e: usize,
    d_s: usize,
    p_s: usize,
    copies: usize,
    bt: usize,
    st: usize,
    budget: usize,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Self, CoreError> {
        cfg.validate()?;
        let cache = CacheManager::new(cfg.num_pages, cfg.block_size, cfg.state_pages, cfg.enable_prefix_caching)?;
        // Rows are handed out from the end: row 0 first.
        let free_rows = (0..cfg.max_num_seqs).rev().collect();
        Ok(Scheduler {
            cache,
            free_rows,
            requests: Vec::new(),
            free_handles: Vec::new(),
            ids: HashMap::new(),
            classes: Vec::new(),
            class_ids: HashMap::new(),
            waiting: WaitingQueue::default(),
            waiting_tokens: 0,
            running: Vec::new(),
            running_seqs: 0,
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
            pending_state_copies: Vec::new(),
            finished_outside: Vec::new(),
            out: SchedulerOutput::default(),
            upd: StepUpdate::default(),
            events: Vec::new(),
            reserved_pages: 0,
            req_reserved: HashMap::new(),
            plan_ckpt_states: 0,
            deferred_states: Vec::new(),
            states_in_plan: Vec::new(),
            admission_limited: [0; 3],
            last_admission_limit: None,
            last_limit_room: (0, 0),
            preemptions: 0,
            preemptions_priority: 0,
            state_fork_copies: 0,
            finished_requests: 0,
            aborted_requests: 0,
            last_step_tokens: 0,
            spec_draft_tokens: 0,
            spec_accepted_tokens: 0,
            spec_accepted_by_position: vec![0; cfg.num_speculative_tokens as usize],
            row_drafts: vec![Vec::new(); cfg.max_num_seqs as usize],
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


































}





