//! Counters and per-request events kept by the scheduler.

/// A snapshot of the scheduler's gauges and cumulative counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerStats {
    /// The arena: `free_pages + kv_pages + running_state_pages +
    /// checkpoint_pages + cached_pages == num_pages` at every call.
    pub num_pages: u32,
    /// On the free list.
    pub free_pages: u32,
    /// KV blocks referenced by block tables.
    pub kv_pages: u32,
    /// DeltaNet states of running sequences (and states reserved for the
    /// children of an n > 1 request).
    pub running_state_pages: u32,
    /// DeltaNet state checkpoints (reclaimable).
    pub checkpoint_pages: u32,
    /// Unreferenced cached KV blocks (reclaimable).
    pub cached_pages: u32,
    /// Pages a new request could get now: free + cached + evictable checkpoints'.
    pub available_pages: u64,
    /// Pages one DeltaNet state takes.
    pub pages_per_state: u32,
    /// Admission stopped at the waiting head because (cumulative, one per
    /// step at most): the arena's pages were short / max_num_seqs was reached /
    /// the step's token budget was spent.
    pub admission_limited_pages: u64,
    pub admission_limited_seqs: u64,
    pub admission_limited_budget: u64,
    /// The last limit hit: "pages", "max_num_seqs", "token_budget" or "".
    pub last_admission_limit: &'static str,
    /// At that moment: sequences running (n > 1 requests count n) and pages
    /// obtainable (free + cached + evictable checkpoints).
    pub last_admission_running_seqs: u32,
    pub last_admission_available_pages: u64,
    pub alloc_failures: u64,
    /// Unused slots in the last blocks of running sequences (O(running) to compute).
    pub tail_waste: u64,
    pub prefix_queries: u64,
    pub prefix_query_tokens: u64,
    pub prefix_hits: u64,
    pub prefix_hit_tokens: u64,
    pub evictions: u64,
    pub cow_copies: u64,
    pub preemptions: u64,
    /// Of `preemptions`: a running sequence needed a page / a waiting request
    /// of a clearly higher priority needed room.
    pub preemptions_blocks: u64,
    pub preemptions_priority: u64,
    /// DeltaNet state copies of forks: n > 1 children from their parent,
    /// beams taking over another beam's continuation (`reorder_beams`).
    pub state_fork_copies: u64,
    /// KV blocks referenced by more than one running sequence (samples and
    /// beams sharing a prefix, or a common cached prefix). O(running blocks).
    pub shared_blocks: u32,
    pub num_running_requests: u32,
    pub num_running_seqs: u32,
    pub num_waiting_requests: u32,
    pub waiting_tokens: u64,
    pub steps: u64,
    pub last_step_tokens: u32,
    pub last_step_seqs: u32,
    pub finished_requests: u64,
    pub aborted_requests: u64,
    /// Pages reserved by the `reserve_max_context` policy (0 when paged).
    pub reserved_pages: u64,
    /// DeltaNet checkpoints held now (each `pages_per_state` pages).
    pub checkpoints: u32,
    /// Admitted sequences that looked for a checkpoint / found one.
    pub checkpoint_queries: u64,
    pub checkpoint_hits: u64,
    /// Prompt tokens whose compute a checkpoint hit skipped.
    pub prefix_skipped_tokens: u64,
    /// KV-matched tokens recomputed for want of a checkpoint at their end.
    pub prefix_lost_tokens: u64,
    pub checkpoint_writes: u64,
    /// Checkpoint writes not done for want of pages.
    pub checkpoint_writes_skipped: u64,
    /// Checkpoints evicted for room / dropped with their KV chain.
    pub checkpoint_evictions: u64,
    pub checkpoint_drops: u64,
    /// Speculative decoding: draft tokens scheduled (summed over plans), and
    /// drafts accepted (`accepted - 1` summed over updated entries with drafts).
    pub spec_draft_tokens: u64,
    pub spec_accepted_tokens: u64,
    /// How many times draft position i (0-based) was accepted
    /// (`num_speculative_tokens` long).
    pub spec_accepted_by_position: Vec<u64>,
}

/// One per request, the first time it is scheduled: its queue delay and class,
/// so the engine can slice time-to-schedule by class.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduledEvent {
    pub request_id: String,
    pub request_class: String,
    /// `now` of the first schedule() that included it.
    pub time: f64,
    /// `time - arrival_time`.
    pub queue_delay: f64,
}
