//! Plan assembly: the caller-side views of a step (block-table and state
//! page table row updates, page-pair copies, checkpoint pages, per-token
//! arrays).

use super::request::{ReqState, Seq};
use super::{CacheManager, PendingStateCopy, Scheduler, SchedulerOutput};
use crate::StateId;

impl Scheduler {
    /// Whether the destination of a pending fork copy is still held by its
    /// child (not preempted or finished since the copy was decided).
    pub(super) fn copy_dst_live(&self, pc: &PendingStateCopy) -> bool {
        self.requests[pc.req as usize].as_ref().is_some_and(|r| {
            r.state == ReqState::Running && r.seqs.iter().any(|s| s.seq_id == pc.seq_id && s.state == Some(pc.dst))
        })
    }

    /// Drops pending fork copies whose child is gone and frees the deferred
    /// states no remaining copy reads (when a request ends, nothing is left
    /// held for a plan that will never come).
    pub(super) fn settle_deferred_states(&mut self) {
        if self.deferred_states.is_empty() {
            return;
        }
        let pending = std::mem::take(&mut self.pending_state_copies);
        self.pending_state_copies = pending.into_iter().filter(|pc| self.copy_dst_live(pc)).collect();
        let mut i = 0;
        while i < self.deferred_states.len() {
            let st = self.deferred_states[i];
            if self.pending_state_copies.iter().any(|pc| pc.src == st) {
                i += 1;
            } else {
                self.deferred_states.swap_remove(i);
                self.cache.free_state(st);
            }
        }
    }

    /// The plan's memory side after the walk and admission (checkpoint pages,
    /// fork copies, checkpoint reconciliation), then the output arrays:
    /// decodes first, then prefill chunks. O(entries + tokens + copies).
    pub(super) fn assemble_plan(&mut self) {
        if self.cfg.num_speculative_tokens == 0 {
            self.assemble_plan_impl::<false>()
        } else {
            self.assemble_plan_impl::<true>()
        }
    }

    /// [`Self::assemble_plan`], monomorphised on speculative decoding.
    fn assemble_plan_impl<const SPEC: bool>(&mut self) {
        // Checkpoint pages for this plan's chunks, now that every sequence and
        // admission has its room: from free or reclaimable pages only.
        self.plan_ckpt_states = 0;
        if self.cfg.enable_prefix_caching {
            let interval = self.cfg.prefix_checkpoint_interval as usize;
            for e in self.p_entries.iter_mut() {
                let seq = &self.requests[e.req as usize].as_ref().expect("planned handle").seqs[e.seq as usize];
                let due = seq.next_checkpoint_after(e.start as usize, interval);
                if due == 0 || due > (e.start + e.k) as usize {
                    continue;
                }
                match self.cache.alloc_checkpoint_state(due, self.step) {
                    Some(st) => {
                        e.ckpt = Some((due as u32, st));
                        self.plan_ckpt_states += 1;
                    }
                    None => self.cache.note_checkpoint_write_skipped(),
                }
            }
        }
        // Fork copies decided by the last update(), for children still holding
        // the destination (not preempted or finished in between).
        for pc in std::mem::take(&mut self.pending_state_copies) {
            if self.copy_dst_live(&pc) {
                push_state_copy(&self.cache, pc.src, pc.dst, &mut self.out.state_copies);
            }
        }
        std::mem::swap(&mut self.states_in_plan, &mut self.deferred_states);
        // Checkpoints whose KV chain lost a block to this step's allocations.
        self.cache.reconcile(self.step);

        // Assemble the plan: decodes, then prefill chunks.
        let out = &mut self.out;
        out.num_decodes = self.d_entries.len();
        out.query_start_loc.push(0);
        self.plan.clear();
        self.plan_samples = 0;
        let mut t = 0i32;
        let n_decodes = self.d_entries.len();
        for (i, e) in self.d_entries.iter().chain(self.p_entries.iter()).enumerate() {
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
            // A decode's rows past its last token are drafts; prefill chunks carry none.
            let d = if SPEC && i < n_decodes { k - 1 } else { 0 };
            out.input_ids.extend(seq.tokens[start..start + k - d].iter().map(|&x| x as i32));
            if SPEC {
                if d > 0 {
                    let row = seq.row.expect("scheduled sequence has a row") as usize;
                    out.input_ids.extend(self.row_drafts[row][..d].iter().map(|&x| x as i32));
                }
                out.num_draft_tokens.push(d as i32);
                self.spec_draft_tokens += d as u64;
            }
            out.positions.extend(start as i32..(start + k) as i32);
            match e.ckpt {
                Some((due, st)) => {
                    out.checkpoint_positions.push(due as i32 - start as i32);
                    out.checkpoint_pages.extend(self.cache.state_pages(st).iter().map(|&p| p as i32));
                }
                None => out.checkpoint_positions.push(-1),
            }
            out.num_samples.push(e.num_samples as i32);
            out.block_table_rows.push(seq.row.expect("scheduled sequence has a row") as i32);
            self.plan.push(*e);
            self.plan_samples += e.num_samples as usize;
        }
        if !SPEC {
            out.num_draft_tokens.resize(self.plan.len(), 0);
        }
        out.slot_mapping.extend_from_slice(&self.d_slots);
        out.slot_mapping.extend_from_slice(&self.p_slots);
        for &(s, d) in &self.copies {
            out.block_copies.push(s as i32);
            out.block_copies.push(d as i32);
        }
        self.last_step_tokens = t as u32;
    }
}

/// Gives back `seq`'s reserved slots past its first `n` tokens (speculative
/// decoding, see [`CacheManager::truncate_slots`]); the caller's buffer row is
/// then synced only up to the blocks kept, so blocks appended later at those
/// columns are sent again.
pub(super) fn truncate_seq_slots(cache: &mut CacheManager, seq: &mut Seq, n: usize) {
    cache.truncate_slots(&mut seq.table, n);
    let kept = seq.table.num_blocks();
    if seq.bt_synced > kept {
        seq.bt_synced = kept;
        seq.bt_last = seq.table.blocks().last().copied().unwrap_or(0);
    }
}

/// Appends the page pairs copying state `src` into state `dst`.
pub(super) fn push_state_copy(cache: &CacheManager, src: StateId, dst: StateId, out: &mut Vec<i32>) {
    for (&a, &b) in cache.state_pages(src).iter().zip(cache.state_pages(dst)) {
        out.push(a as i32);
        out.push(b as i32);
    }
}

/// Emits the block-table cells of `seq`'s row that the caller's buffer lacks:
/// a changed tail (copy-on-write) and the blocks appended since the last sync;
/// and the whole state page table row when the row is new to this state.
#[inline]
pub(super) fn sync_row(seq: &mut Seq, cache: &CacheManager, out: &mut SchedulerOutput) {
    let row = seq.row.expect("row assigned") as i32;
    if !seq.st_synced {
        let st = seq.state.expect("a running sequence has a state");
        for (c, &p) in cache.state_pages(st).iter().enumerate() {
            out.st_update_rows.push(row);
            out.st_update_cols.push(c as i32);
            out.st_update_values.push(p as i32);
        }
        seq.st_synced = true;
    }
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
