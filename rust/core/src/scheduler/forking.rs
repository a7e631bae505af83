//! Forking: n > 1 samples sharing a prefilled prompt, re-forking after a
//! recompute, and beams re-parented each step (`reorder_beams`). Children
//! share blocks (copy-on-write tails) and get a copy of the parent's state
//! pages in the next plan.

use super::request::{ReqState, Request, Seq};
use super::plan::truncate_seq_slots;
use super::{PendingStateCopy, SchedError, Scheduler};
use crate::StateId;

impl Scheduler {
    /// The leader of a recomputed forked request has prefilled the prompt: the
    /// other live sequences share its prompt blocks and copy its state, then
    /// prefill only their own generated tokens.
    pub(super) fn refork(&mut self, req: &mut Request, r: u32, leader: usize) {
        req.refork = false;
        let p = req.prompt_len;
        debug_assert_eq!(req.seqs[leader].table.num_tokens, p);
        let src = req.seqs[leader].state.expect("running leader has a state");
        for j in 0..req.seqs.len() {
            if j == leader || !req.seqs[j].is_live() {
                continue;
            }
            let table = self.cache.fork_table(&req.seqs[leader].table);
            let s = &mut req.seqs[j];
            debug_assert!(s.num_computed == 0 && s.table.blocks().is_empty());
            s.table = table;
            s.num_computed = p;
            s.matched = 0;
            s.bt_synced = 0;
            let dst = s.state.expect("reserved state");
            self.pending_state_copies.push(PendingStateCopy { req: r, seq_id: s.seq_id, src, dst });
            self.state_fork_copies += 1;
        }
    }

    pub(super) fn fork(&mut self, req: &mut Request, r: u32, si: usize, toks: &[i32]) {
        debug_assert!(!req.forked && si == 0 && toks.len() == req.params.n as usize);
        req.forked = true;
        let parent_state = req.seqs[0].state.expect("running parent has a state");
        // The children share the parent's blocks up to what it computed, never
        // its lookahead slots (speculative decoding): each reserves its own.
        let computed = req.seqs[0].num_computed;
        truncate_seq_slots(&mut self.cache, &mut req.seqs[0], computed);
        if let Some(row) = req.seqs[0].row {
            self.row_drafts[row as usize].clear();
        }
        let spares = std::mem::take(&mut req.spare_states);
        for (i, &dst) in spares.iter().enumerate() {
            let parent = &req.seqs[0];
            let mut child = Seq::new(self.next_seq_id, (i + 1) as u32, parent.tokens.clone());
            self.next_seq_id += 1;
            child.table = self.cache.fork_table(&parent.table);
            child.num_computed = parent.num_computed;
            child.matched = parent.matched;
            child.state = Some(dst);
            self.pending_state_copies.push(PendingStateCopy { req: r, seq_id: child.seq_id, src: parent_state, dst });
            self.state_fork_copies += 1;
            req.seqs.push(child);
            self.running_seqs += 1;
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

    /// Beam search: between `schedule()` and `update()` of a step that decoded
    /// every beam of request `id`, makes beam `i` a continuation of beam
    /// `parents[i]` (as it was after this step's forward). Beam i keeps its
    /// state pages, row and sample index: its block table becomes a fork of the
    /// parent's (refcounts rise; the shared partly-filled tail is copied on the
    /// next append), its old blocks are released (freed when no one else holds
    /// them), and the parent's DeltaNet state is copied into its pages by the
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
        let new_tables: Vec<_> =
            moved.iter().map(|&i| self.cache.fork_table(&req.seqs[parents[i] as usize].table)).collect();
        let tails: Vec<Vec<u32>> =
            moved.iter().map(|&i| req.seqs[parents[i] as usize].tokens[prompt_len..].to_vec()).collect();
        let states: Vec<StateId> = req.seqs.iter().map(|s| s.state.expect("running beam has a state")).collect();
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
            self.cache.free_table(&mut t);
            s.tokens.truncate(prompt_len);
            s.tokens.extend_from_slice(&tail);
            self.pending_state_copies.push(PendingStateCopy { req: h, seq_id: s.seq_id, src: states[p], dst: states[i] });
            self.state_fork_copies += 1;
        }
        self.requests[h as usize] = Some(req);
        Ok(())
    }
}
