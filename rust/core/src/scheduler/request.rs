//! Request and sequence state owned by the scheduler.

use crate::{BlockId, BlockTable, StateId};

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop token (EOS unless ignore_eos, or one of stop_token_ids), or `finish()`.
    Stop,
    /// max_tokens reached.
    Length,
    /// `abort()`.
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What a caller says about one request besides its id and prompt.
#[derive(Debug, Clone)]
pub struct RequestParams {
    /// New tokens per sample, at least 1.
    pub max_tokens: u32,
    /// Stop tokens (EOS included) are ignored until this many tokens exist.
    pub min_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Parallel samples: the prompt is prefilled once, then forked n ways.
    pub n: u32,
    /// Lower runs first.
    pub priority: i32,
    pub request_class: String,
    /// Caller's clock (seconds); queue delay is measured against `schedule(now)`.
    pub arrival_time: f64,
    /// Salt of the prefix-cache keys (different salts never share blocks).
    pub extra_key: u64,
    /// Beam search: the n sequences are beams the caller re-parents each step
    /// (`Scheduler::reorder_beams`); a recompute after preemption stops each
    /// beam's prefill one token short so that all beams decode in one step.
    pub beam_search: bool,
}

impl Default for RequestParams {
    fn default() -> Self {
        RequestParams {
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            eos_token_ids: Vec::new(),
            ignore_eos: false,
            n: 1,
            priority: 0,
            request_class: "default".into(),
            arrival_time: 0.0,
            extra_key: 0,
            beam_search: false,
        }
    }
}

impl RequestParams {
    /// The stop rule, in vLLM's order: nothing stops before `min_tokens` outputs;
    /// then EOS (unless ignore_eos) or a stop token gives Stop; then max_tokens
    /// gives Length.
    #[inline]
    pub fn check_stop(&self, num_output: usize, last: u32) -> Option<FinishReason> {
        if num_output >= self.min_tokens as usize
            && ((!self.ignore_eos && self.eos_token_ids.contains(&last)) || self.stop_token_ids.contains(&last))
        {
            return Some(FinishReason::Stop);
        }
        if num_output >= self.max_tokens as usize {
            return Some(FinishReason::Length);
        }
        None
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReqState {
    Waiting,
    Running,
    Finished,
}

/// One sample's token stream and the resources it holds while running.
#[derive(Debug)]
pub(crate) struct Seq {
    pub seq_id: u64,
    pub sample_index: u32,
    /// Prompt then generated tokens (contiguous: hashing and re-prefill read it).
    pub tokens: Vec<u32>,
    /// Tokens whose KV and DeltaNet state this run has computed.
    pub num_computed: usize,
    /// Leading tokens whose KV came from the prefix cache at admission. Those
    /// past the restored checkpoint are recomputed for the DeltaNet state with
    /// slot_mapping -1 (their KV is already in the cache).
    pub matched: usize,
    /// Block boundaries (token counts) where a DeltaNet checkpoint is to be
    /// written, nearest first; 0 = none. A prefill chunk holds at most one.
    pub ckpt_next: usize,
    pub ckpt_after: usize,
    /// With `prefix_checkpoint_interval`: also every interval up to here.
    pub ckpt_until: usize,
    pub table: BlockTable,
    /// Its DeltaNet state's pages (while running).
    pub state: Option<StateId>,
    /// Whether the caller's state page table row holds `state`'s pages.
    pub st_synced: bool,
    /// Row of the persistent block-table buffer, while running and scheduled once.
    pub row: Option<u32>,
    /// Leading blocks of `table` the caller's buffer row already holds.
    pub bt_synced: usize,
    /// Value last sent for column `bt_synced - 1` (a copy-on-write changes it).
    pub bt_last: BlockId,
    pub finished: Option<FinishReason>,
}

impl Seq {
    pub fn new(seq_id: u64, sample_index: u32, tokens: Vec<u32>) -> Self {
        Seq {
            seq_id,
            sample_index,
            tokens,
            num_computed: 0,
            matched: 0,
            ckpt_next: 0,
            ckpt_after: 0,
            ckpt_until: 0,
            table: BlockTable::new(),
            state: None,
            st_synced: false,
            row: None,
            bt_synced: 0,
            bt_last: 0,
            finished: None,
        }
    }

    #[inline]
    pub fn is_live(&self) -> bool {
        self.finished.is_none()
    }

    /// The next boundary past `x` (at or after `num_computed`) where a
    /// checkpoint is due (0: none).
    #[inline]
    pub fn next_checkpoint_after(&self, x: usize, interval: usize) -> usize {
        let mut t = 0;
        for c in [self.ckpt_next, self.ckpt_after] {
            if c > x {
                t = c;
                break;
            }
        }
        if interval > 0 && self.ckpt_until > x {
            let m = (x / interval + 1) * interval;
            if m <= self.ckpt_until && (t == 0 || m < t) {
                t = m;
            }
        }
        t
    }

    /// Caps a prefill chunk starting at `start` of `k` tokens so that it holds
    /// at most one checkpoint boundary: it ends just before the second one.
    #[inline]
    pub fn cap_to_one_checkpoint(&self, start: usize, k: usize, interval: usize) -> usize {
        let first = self.next_checkpoint_after(start, interval);
        if first == 0 || first >= start + k {
            return k;
        }
        match self.next_checkpoint_after(first, interval) {
            0 => k,
            second => k.min(second - start - 1),
        }
    }
}

#[derive(Debug)]
pub(crate) struct Request {
    pub id: String,
    pub prompt_len: usize,
    pub params: RequestParams,
    pub class_id: u32,
    /// Order of add_request calls (unique): FCFS tie-break and preemption order.
    pub arrival_seq: u64,
    /// Static ordering key, smaller runs first: see `SchedulerConfig` (aging).
    pub key: (i128, u64),
    pub state: ReqState,
    /// One sequence until the prompt's last chunk samples n tokens, then n.
    pub seqs: Vec<Seq>,
    pub forked: bool,
    /// States reserved at admission for the children of an unforked n>1 request.
    pub spare_states: Vec<StateId>,
    pub first_scheduled: bool,
    pub num_preemptions: u32,
    /// A forked request preempted with more than one live sequence: on
    /// readmission only the leader (first live sequence) prefills the prompt;
    /// the others wait, then fork from it at the prompt's end and prefill only
    /// their own generated tokens.
    pub refork: bool,
}

impl Request {
    /// Sequences this request counts against max_num_seqs and the state pool:
    /// n until it forks (the children's slots are reserved), then the live ones.
    #[inline]
    pub fn units(&self) -> u32 {
        if self.forked {
            self.seqs.iter().filter(|s| s.is_live()).count() as u32
        } else {
            self.params.n
        }
    }

    /// Tokens still to prefill if it were (re)admitted now.
    pub fn pending_tokens(&self) -> u64 {
        self.seqs.iter().filter(|s| s.is_live()).map(|s| (s.tokens.len() - s.num_computed) as u64).sum()
    }

    /// The sequence that prefills the prompt for all while `refork` is set.
    pub fn leader(&self) -> usize {
        self.seqs.iter().position(|s| s.is_live()).unwrap_or(0)
    }

    /// Whether sequence `si` waits for the leader to fork it (see `refork`).
    #[inline]
    pub fn waits_for_refork(&self, si: usize) -> bool {
        self.refork && si != self.leader() && self.seqs[si].num_computed == 0
    }

    pub fn all_finished(&self) -> bool {
        self.seqs.iter().all(|s| !s.is_live())
    }
}
