//! The per-step plan and the per-step update result. Both are buffers owned by the
//! scheduler and cleared (not reallocated) every step.

use super::request::FinishReason;

/// The plan of one step. Entries `b in 0..B` are in batch order: decodes first,
/// then prefill chunks. Per-token arrays have `T = query_start_loc[B]` entries,
/// entry `b` owning `query_start_loc[b]..query_start_loc[b+1]`.
///
/// Block tables: the caller keeps a persistent `int32[max_num_seqs,
/// max_blocks_per_seq]` buffer. Entry `b` reads row `block_table_rows[b]`; before
/// running the step the caller applies `buf[bt_update_rows[k], bt_update_cols[k]]
/// = bt_update_values[k]`. Updates name only columns whose value changed (new
/// blocks, a copy-on-write tail, a row reassigned to a new sequence), so the cost
/// per step is O(B + new blocks), independent of context length. Columns past a
/// sequence's `ceil(seq_len / block_size)` blocks may hold stale ids: ignore them.
///
/// `slot_mapping[t] == -1` means the KV of that token is already in the cache
/// (prefix-cache hit past the restored DeltaNet checkpoint): do not write it.
/// The token is still fed, to rebuild the DeltaNet state.
/// `num_computed_tokens == 0` means the sequence's DeltaNet state starts from
/// zeros; `> 0` means it continues from its state pages (after a checkpoint hit
/// the plan's `state_copies` put the checkpoint there).
///
/// State page tables: a persistent `int32[max_num_seqs, state_pages]` buffer;
/// entry `b` reads row `block_table_rows[b]` (the same row as its block
/// table). Before the step the caller applies `st_update_*` like the block
/// table updates (only changed cells: a row given to a sequence whose state it
/// does not hold yet).
///
/// Copies (`block_copies`, `state_copies`, page pairs `(src, dst)` of the one
/// arena) must be performed before anything else of the step, including
/// zero-initialising fresh states. Across both lists every source is read
/// before any destination is written (one gather, one scatter); no two pairs
/// write the same page.
///
/// Speculative decoding: entry `b`'s last `num_draft_tokens[b]` tokens are
/// drafts (after its last committed token, at the next positions, with slots);
/// every entry that samples also has slots, in its block-table row, for the
/// positions `seq_lens[b] .. seq_lens[b] + k - 1` (k = num_speculative_tokens,
/// never reaching prompt + max_tokens), where the drafter writes.
///
/// Checkpoints: `checkpoint_positions[b] = k >= 1` asks the forward to write
/// entry `b`'s DeltaNet state as it is after its first `k` scheduled tokens
/// into the `state_pages` pages that follow in `checkpoint_pages` (in entry
/// order); `-1` = none. At most one per entry.
#[derive(Debug, Default, Clone)]
pub struct SchedulerOutput {
    /// Scheduler-internal request handle per entry (see `Scheduler::request_id`).
    pub req_indices: Vec<u32>,
    pub sample_indices: Vec<i32>,
    pub seq_ids: Vec<i64>,
    pub num_scheduled_tokens: Vec<i32>,
    pub query_start_loc: Vec<i32>,
    pub num_computed_tokens: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub input_ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slot_mapping: Vec<i32>,
    /// `-1`, or the number of this step's tokens after which the entry's state
    /// is written into its checkpoint pages.
    pub checkpoint_positions: Vec<i32>,
    /// `state_pages` page ids per entry with a checkpoint position, in entry order.
    pub checkpoint_pages: Vec<i32>,
    /// Speculative decoding: how many of the entry's `num_scheduled_tokens`
    /// rows are draft tokens, fed after its last token (0 for entries without
    /// drafts and for prefill chunks). Such an entry has `num_samples` 1: the
    /// caller samples its rows itself and passes the accepted count to
    /// `update_spec`. No checkpoint is ever asked of it.
    pub num_draft_tokens: Vec<i32>,
    /// Tokens to sample from the entry's last position: 0 (mid-prefill), 1, or n
    /// (last prompt chunk of an unforked n>1 request).
    pub num_samples: Vec<i32>,
    pub block_table_rows: Vec<i32>,
    pub bt_update_rows: Vec<i32>,
    pub bt_update_cols: Vec<i32>,
    pub bt_update_values: Vec<i32>,
    pub st_update_rows: Vec<i32>,
    pub st_update_cols: Vec<i32>,
    pub st_update_values: Vec<i32>,
    /// Flattened `(src, dst)` block pairs.
    pub block_copies: Vec<i32>,
    /// Flattened `(src_page, dst_page)` pairs: fork copies (n > 1 children,
    /// beams) and checkpoint restores, whole states page by page.
    pub state_copies: Vec<i32>,
    /// Requests preempted in this step (back in the waiting queue), by handle.
    pub preempted: Vec<u32>,
    /// Why, one per `preempted` entry.
    pub preempted_causes: Vec<PreemptCause>,
    /// Sequences finished outside `update()` (abort, finish) since the last plan.
    pub finished: Vec<(String, u32, FinishReason)>,
    /// Entries `0..num_decodes` are decodes.
    pub num_decodes: usize,
}

impl SchedulerOutput {
    pub fn num_seqs(&self) -> usize {
        self.req_indices.len()
    }
    pub fn num_tokens(&self) -> usize {
        self.input_ids.len()
    }
    pub fn total_samples(&self) -> usize {
        self.num_samples.iter().map(|&x| x as usize).sum()
    }
    pub(crate) fn clear(&mut self) {
        self.req_indices.clear();
        self.sample_indices.clear();
        self.seq_ids.clear();
        self.num_scheduled_tokens.clear();
        self.query_start_loc.clear();
        self.num_computed_tokens.clear();
        self.seq_lens.clear();
        self.input_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.checkpoint_positions.clear();
        self.checkpoint_pages.clear();
        self.num_samples.clear();
        self.num_draft_tokens.clear();
        self.block_table_rows.clear();
        self.bt_update_rows.clear();
        self.bt_update_cols.clear();
        self.bt_update_values.clear();
        self.st_update_rows.clear();
        self.st_update_cols.clear();
        self.st_update_values.clear();
        self.block_copies.clear();
        self.state_copies.clear();
        self.preempted.clear();
        self.preempted_causes.clear();
        self.finished.clear();
        self.num_decodes = 0;
    }
}

/// Why a running request was preempted (recompute).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PreemptCause {
    /// A running sequence needed a page and none was left.
    BlocksNeeded,
    /// A waiting request of a clearly higher priority needed room.
    Priority,
}

impl PreemptCause {
    pub fn as_str(self) -> &'static str {
        match self {
            PreemptCause::BlocksNeeded => "blocks_needed",
            PreemptCause::Priority => "priority",
        }
    }
}

/// What `update()` did: one row per new token, in batch order (the n tokens of a
/// forking entry in sample order), and the sequences that finished.
#[derive(Debug, Default, Clone)]
pub struct StepUpdate {
    pub req_indices: Vec<u32>,
    pub sample_indices: Vec<i32>,
    pub tokens: Vec<i32>,
    /// `(request handle, sample index, reason)`; the handle stays valid until the
    /// next `update()` at least.
    pub finished: Vec<(u32, u32, FinishReason)>,
}

impl StepUpdate {
    pub(crate) fn clear(&mut self) {
        self.req_indices.clear();
        self.sample_indices.clear();
        self.tokens.clear();
        self.finished.clear();
    }
}
