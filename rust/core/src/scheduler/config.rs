//! Scheduler settings and their validation.

use crate::CoreError;

/// Everything that shapes admission and the per-step budget.
///
/// Aging: a waiting request's effective priority is
/// `priority - (steps waited) / aging_interval_steps` (continuous, not floored),
/// so two requests compare by the static key `priority * aging_interval_steps +
/// arrival_step` (then by arrival order). `aging_interval_steps = 0` turns aging
/// off (pure priority, FCFS within a priority).
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Pages of the one arena (KV blocks, DeltaNet states, checkpoints).
    pub num_pages: u32,
    pub block_size: u32,
    /// Pages one DeltaNet state (a sequence's or a checkpoint's) takes
    /// (`ArenaLayout.state_pages`; 0 for a model without DeltaNet layers).
    pub state_pages: u32,
    /// Sequences per step (an n>1 request counts n from admission on).
    pub max_num_seqs: u32,
    /// Tokens per step across all sequences (decodes count 1 each).
    pub max_num_batched_tokens: u32,
    pub max_model_len: u32,
    /// KV prefix cache and DeltaNet state checkpoints (see `checkpoints`).
    pub enable_prefix_caching: bool,
    /// Also checkpoint every this many tokens of a prompt (a multiple of
    /// `block_size`; 0 = off, the default). Each costs `state_pages` pages while
    /// kept (reclaimable) and, when two fall in one chunk, a chunk boundary.
    pub prefix_checkpoint_interval: u32,
    /// Cap on one sequence's prefill chunk per step (0 = no cap beyond the budget).
    pub long_prefill_token_threshold: u32,
    /// `add_request` answers QueueFull beyond this many waiting requests.
    pub max_waiting_requests: u32,
    /// ... or beyond this many tokens still to prefill in the waiting queue.
    pub max_waiting_tokens: u64,
    /// Steps of waiting that improve the effective priority by one (0 = no aging).
    pub aging_interval_steps: u32,
    /// Priority preemption: a waiting request that does not fit preempts running
    /// requests whose static priority is higher (less urgent) and whose effective
    /// priority is worse by MORE than this many levels. Default 1: adjacent
    /// classes never preempt each other (a recompute throws away the victim's
    /// whole context, worth paying only for a clear gap); two levels apart do.
    pub priority_preemption_threshold: u32,
    /// At most this many priority preemptions per step (0 turns priority
    /// preemption off). Default 4: an urgent request of up to n = 4 samples (or
    /// four single ones) gets room in one step, while one arrival cannot empty a
    /// large batch at once; more victims, if needed, follow in later steps.
    pub max_priority_preemptions_per_step: u32,
    /// Pre-paging baseline: admit only when `ceil(max_model_len / block_size)`
    /// blocks plus a state per sequence can be reserved against the whole arena.
    pub reserve_max_context: bool,
    /// Finished requests whose outputs stay readable (`output_tokens`); older
    /// ones are forgotten first-in first-out.
    pub max_finished_retained: u32,
    /// Distinct `request_class` values kept by name, "default" not counted
    /// (first come, first kept); later ones are all [`OTHER_REQUEST_CLASS`].
    /// Clients choose the values, so they are bounded like the metrics' labels
    /// (`hybridserve.metrics`, same default).
    pub max_request_classes: u32,
    /// Speculative decoding (MTP): draft tokens per decoding sequence and step
    /// (0 = off, the default). With k > 0 the caller hands each sequence's
    /// drafts to `update_spec`, the next plan feeds them after the last token
    /// (up to `1 + k` rows per decode, `num_draft_tokens`), and every entry that
    /// samples also reserves KV slots for the `k` positions past its row (the
    /// drafter writes there before the next plan); see `Scheduler::update_spec`.
    pub num_speculative_tokens: u32,
}

/// The class of requests past `max_request_classes`.
pub const OTHER_REQUEST_CLASS: &str = "other";

impl SchedulerConfig {
    pub fn new(
        num_pages: u32,
        block_size: u32,
        state_pages: u32,
        max_num_seqs: u32,
        max_num_batched_tokens: u32,
        max_model_len: u32,
    ) -> Self {
        SchedulerConfig {
            num_pages,
            block_size,
            state_pages,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_prefix_caching: true,
            prefix_checkpoint_interval: 0,
            long_prefill_token_threshold: 0,
            max_waiting_requests: u32::MAX,
            max_waiting_tokens: u64::MAX,
            aging_interval_steps: 256,
            priority_preemption_threshold: 1,
            max_priority_preemptions_per_step: 4,
            reserve_max_context: false,
            max_finished_retained: 4096,
            max_request_classes: 16,
            num_speculative_tokens: 0,
        }
    }

    /// Pages one sequence of `max_model_len` tokens occupies, state included.
    pub fn max_pages_per_seq(&self) -> u32 {
        self.max_blocks_per_seq() + self.state_pages
    }

    /// Blocks one sequence of `max_model_len` tokens occupies.
    pub fn max_blocks_per_seq(&self) -> u32 {
        self.max_model_len.div_ceil(self.block_size.max(1))
    }

    #[allow(clippy::manual_is_multiple_of)] // is_multiple_of needs Rust 1.87; the MSRV is 1.80
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |m: String| Err(CoreError::InvalidArgument(m));
        if self.block_size == 0 || self.num_pages == 0 {
            return bad(format!(
                "num_pages ({}) and block_size ({}) must be positive; give the cache arena more memory",
                self.num_pages, self.block_size
            ));
        }
        if self.state_pages >= self.num_pages {
            return bad(format!(
                "the arena has {} pages but one sequence's DeltaNet state alone takes {} (state_pages); \
                 give the cache arena more memory (kv_cache_memory / gpu_memory_utilization)",
                self.num_pages, self.state_pages
            ));
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be positive".into());
        }
        if self.max_model_len < 2 {
            return bad(format!("max_model_len ({}) must be at least 2", self.max_model_len));
        }
        if self.prefix_checkpoint_interval % self.block_size != 0 {
            return bad(format!(
                "prefix_checkpoint_interval ({}) must be a multiple of block_size ({}) (0 turns it off)",
                self.prefix_checkpoint_interval, self.block_size
            ));
        }
        if self.max_num_batched_tokens < self.max_num_seqs {
            return bad(format!(
                "max_num_batched_tokens ({}) must be >= max_num_seqs ({}) so every running \
                 sequence can decode in one step; raise max_num_batched_tokens or lower max_num_seqs",
                self.max_num_batched_tokens, self.max_num_seqs
            ));
        }
        if (self.num_pages as u64) * (self.block_size as u64) > i32::MAX as u64 {
            return bad(format!(
                "num_pages * block_size ({}) must fit an int32 slot id; lower num_pages",
                self.num_pages as u64 * self.block_size as u64
            ));
        }
        if self.num_speculative_tokens >= self.max_model_len {
            return bad(format!(
                "num_speculative_tokens ({}) must be below max_model_len ({})",
                self.num_speculative_tokens, self.max_model_len
            ));
        }
        // A request of max_model_len that cannot fit is not fatal here:
        // add_request refuses such requests one by one.
        Ok(())
    }
}
