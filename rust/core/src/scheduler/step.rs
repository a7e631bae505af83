//! One step: `schedule()` walks the running requests (decodes and prefill
//! chunks, preempting for room), admits waiting ones, and assembles the plan;
//! `update()` applies the sampled tokens (registering the checkpoints the
//! forward wrote, forking n > 1 requests, finishing sequences).

use super::admission::{lookahead, MatchTrim};
use super::plan::truncate_seq_slots;
use super::request::ReqState;
use super::{sync_row, AdmitLimit, Entry, PreemptCause, SchedError, Scheduler, SchedulerOutput, Snap, StepUpdate};
use crate::CoreError;

impl Scheduler {
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

        // Pages of dropped checkpoints whose plan has run.
        self.cache.reconcile(self.step);
        let priority_preempted = self.priority_preempt();

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
        let kspec = self.cfg.num_speculative_tokens as usize;
        let thresh = self.cfg.long_prefill_token_threshold as usize;
        let mut budget = self.cfg.max_num_batched_tokens as usize;
        let preempted_any = if kspec == 0 {
            self.walk_running::<false>(&mut budget, &mut pending_decodes, &mut running_units)
        } else {
            self.walk_running::<true>(&mut budget, &mut pending_decodes, &mut running_units)
        };

        // A block preemption means the running set is short of room: admitting
        // would only evict again. Room made for a higher priority is for it.
        self.last_admission_limit = None;
        self.last_limit_room = (0, 0);
        if !preempted_any || priority_preempted > 0 {
            while let Some(r) = self.waiting.first() {
                if budget == 0 {
                    self.note_admission_limit(AdmitLimit::TokenBudget, running_units);
                    break;
                }
                let mut req = self.requests[r as usize].take().expect("waiting handle");
                let mut res = self.try_admit(&mut req, r, &mut budget, &mut running_units, now, bs, thresh, MatchTrim::Full);
                if self.cache.prefix_caching_enabled() {
                    // A prefix match longer than the first chunk holds pages the
                    // chunk does not need yet: try again without them; and since
                    // the matched blocks before a state hit are taken off the
                    // reclaimable list too, last without any match.
                    for trim in [MatchTrim::ToChunk, MatchTrim::Off] {
                        if res != Err(AdmitLimit::Pages) {
                            break;
                        }
                        res = self.try_admit(&mut req, r, &mut budget, &mut running_units, now, bs, thresh, trim);
                    }
                }
                self.requests[r as usize] = Some(req);
                if let Err(limit) = res {
                    self.note_admission_limit(limit, running_units);
                    break;
                }
            }
        }

        self.assemble_plan();
        self.plan_pending = true;
        Ok(&self.out)
    }

    /// The walk over the running requests in key order (see [`Self::schedule`]):
    /// decodes and prefill chunks, preempting for room. Returns whether it
    /// preempted. Monomorphised on speculative decoding, so that without it
    /// (`SPEC = false`) none of that work is in the loop.
    fn walk_running<const SPEC: bool>(&mut self, budget_io: &mut usize, pending_io: &mut usize, units_io: &mut u32) -> bool {
        let thresh = self.cfg.long_prefill_token_threshold as usize;
        let mut budget = *budget_io;
        let mut pending_decodes = *pending_io;
        let mut running_units = *units_io;
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
                st: self.out.st_update_rows.len(),
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
                let mut drafts = 0usize;
                let k = if decode {
                    pending_decodes -= 1;
                    if beams_wait {
                        continue;
                    }
                    let held = if SPEC { seq.row.map_or(0, |row| self.row_drafts[row as usize].len()) } else { 0 };
                    if held > 0 {
                        // Within the budget left after one row for every decode still
                        // to come, and never past max_tokens: r outputs left, at most
                        // r - 1 drafts (the step commits up to 1 + drafts tokens).
                        let left = req.prompt_len + req.params.max_tokens as usize - seq.tokens.len();
                        drafts = held.min(left.saturating_sub(1)).min(budget.saturating_sub(pending_decodes + 1));
                    }
                    1 + drafts
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
                    seq.cap_to_one_checkpoint(seq.num_computed, k, self.cfg.prefix_checkpoint_interval as usize)
                };
                if k == 0 {
                    continue;
                }
                let start = seq.num_computed;
                let end = start + k;
                let samples = end - drafts == seq.tokens.len();
                // Speculative decoding: an entry that samples also reserves the
                // k positions past its row, where the drafter writes.
                let la = if SPEC && samples { lookahead(&self.cfg, req.prompt_len, &req.params, end) } else { 0 };
                let n_cached = end.min(seq.matched).saturating_sub(start);
                let n_new = k - n_cached;
                loop {
                    let slots = if decode { &mut self.d_slots } else { &mut self.p_slots };
                    let before = slots.len();
                    let res = if SPEC && decode {
                        // The table may already reserve positions past `start` (the
                        // last step's lookahead and rejected drafts): keep those
                        // blocks (the drafter wrote there), drop what lies past this
                        // step's need, grow to it, and take the row's slots.
                        let target = end + la;
                        truncate_seq_slots(&mut self.cache, seq, target);
                        let grow = target - seq.table.num_tokens();
                        let r = self.cache.append_slots(&mut seq.table, grow, slots, &mut self.copies, self.step);
                        if r.is_ok() {
                            slots.truncate(before);
                            self.cache.push_slots(&seq.table, start, k, slots);
                        }
                        r
                    } else {
                        slots.extend(std::iter::repeat_n(-1, n_cached));
                        let r = self.cache.append_slots(&mut seq.table, n_new + la, slots, &mut self.copies, self.step);
                        if SPEC && la > 0 && r.is_ok() {
                            slots.truncate(slots.len() - la);
                        }
                        r
                    };
                    match res {
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
                let num_samples = if samples {
                    if !req.forked { req.params.n } else { 1 }
                } else {
                    0
                };
                if seq.row.is_none() {
                    let row = self.free_rows.pop().expect("a row per running sequence (max_num_seqs)");
                    if SPEC {
                        self.row_drafts[row as usize].clear();
                    }
                    seq.row = Some(row);
                    seq.bt_synced = 0;
                    seq.st_synced = false;
                }
                sync_row(seq, &self.cache, &mut self.out);
                budget -= k;
                let e = Entry {
                    req: r,
                    seq: si as u32,
                    seq_id: seq.seq_id,
                    start: start as u32,
                    k: k as u32,
                    num_samples,
                    ckpt: None,
                };
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
                self.out.st_update_rows.truncate(snap.st);
                self.out.st_update_cols.truncate(snap.st);
                self.out.st_update_values.truncate(snap.st);
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
        *budget_io = budget;
        *pending_io = pending_decodes;
        *units_io = running_units;
        preempted_any
    }

    /// Applies the tokens sampled for the last plan: `num_samples[b]` tokens per
    /// entry, concatenated in batch order. Entries whose request was aborted or
    /// finished since are skipped. O(entries + new full blocks hashed).
    /// (`update_spec(sampled, None, None)`.)
    pub fn update(&mut self, sampled: &[i32]) -> Result<&StepUpdate, SchedError> {
        if self.cfg.num_speculative_tokens == 0 {
            self.update_impl::<false>(sampled, None, None)
        } else {
            self.update_impl::<true>(sampled, None, None)
        }
    }

    /// [`Self::update`] for speculative decoding (`num_speculative_tokens` > 0).
    ///
    /// `accepted` (one count per entry of the last plan, or None): entry `b`
    /// contributes `accepted[b]` tokens of `sampled` (in entry order) instead of
    /// `num_samples[b]`. For an entry that carried `d = num_draft_tokens[b] > 0`
    /// drafts, `1 <= accepted[b] <= d + 1`: its first `accepted[b] - 1` drafts
    /// (the same token ids) then the token the target drew; its sequence's
    /// `num_computed` advances by `accepted[b]` and the tokens are committed one
    /// by one under the stop rule (a stop drops the rest). For other entries
    /// `accepted[b] == num_samples[b]`. None: every entry contributes
    /// `num_samples[b]` (a drafted entry then accepts none of its drafts).
    ///
    /// `drafts` (one list per entry, or None = none at all): the drafts of the
    /// entry's sequence for its NEXT step, at most `num_speculative_tokens`
    /// each; they replace what the sequence held. Ignored for sequences that
    /// finished (here or since the plan) and for the entry that forks an n > 1
    /// request (its children start without drafts); refused for entries that
    /// sample nothing and for beam-search requests.
    ///
    /// Any mismatch is an `InvalidArgument` and changes nothing.
    pub fn update_spec(
        &mut self,
        sampled: &[i32],
        accepted: Option<&[i32]>,
        drafts: Option<&[Vec<u32>]>,
    ) -> Result<&StepUpdate, SchedError> {
        if self.cfg.num_speculative_tokens == 0 && accepted.is_none() && drafts.is_none() {
            self.update_impl::<false>(sampled, None, None)
        } else {
            self.update_impl::<true>(sampled, accepted, drafts)
        }
    }

    /// `update_spec`, monomorphised on speculative decoding: without it
    /// (`SPEC = false`: no drafts can be in the plan, no counts or drafts
    /// given) the loop is the plain one.
    fn update_impl<const SPEC: bool>(
        &mut self,
        sampled: &[i32],
        accepted: Option<&[i32]>,
        drafts: Option<&[Vec<u32>]>,
    ) -> Result<&StepUpdate, SchedError> {
        if !self.plan_pending {
            return Err(SchedError::InvalidArgument("update() called without a schedule() before it".into()));
        }
        if accepted.is_some() || drafts.is_some() {
            self.check_spec_args(sampled.len(), accepted, drafts)?;
        } else if sampled.len() != self.plan_samples {
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
        if let Some(acc) = accepted {
            // The accepted drafts are fed tokens: the sampled ids must be them.
            let (mut off, mut q0) = (0usize, 0usize);
            for (b, e) in self.plan.iter().enumerate() {
                let a = acc[b] as usize;
                if self.out.num_draft_tokens[b] > 0 {
                    let fed = &self.out.input_ids[q0 + 1..q0 + a];
                    if let Some(j) = (0..a - 1).find(|&j| sampled[off + j] != fed[j]) {
                        return Err(SchedError::InvalidArgument(format!(
                            "update(): entry {b} accepted {a} tokens, but its token {j} ({}) is not draft {j} ({}); \
                             pass the accepted drafts themselves, then the target's token",
                            sampled[off + j],
                            fed[j]
                        )));
                    }
                }
                off += a;
                q0 += e.k as usize;
            }
        }
        self.plan_pending = false;
        for st in self.states_in_plan.drain(..) {
            self.cache.free_state(st);
        }
        self.forget_old_finished();
        self.upd.clear();
        let bs = self.cfg.block_size as usize;
        let mut off = 0usize;
        let mut any_done = false;
        for pi in 0..self.plan.len() {
            let e = self.plan[pi];
            let ns = match accepted {
                Some(acc) if SPEC => acc[pi] as usize,
                _ => e.num_samples as usize,
            };
            let toks = &sampled[off..off + ns];
            off += ns;
            let nd = if SPEC { self.out.num_draft_tokens[pi] as u32 } else { 0 };
            if nd > 0 {
                self.spec_accepted_tokens += ns as u64 - 1;
                for c in &mut self.spec_accepted_by_position[..ns - 1] {
                    *c += 1;
                }
            }
            let Some(mut req) = self.requests[e.req as usize].take() else { continue };
            let si = e.seq as usize;
            let valid = req.state == ReqState::Running
                && req.seqs.get(si).is_some_and(|s| s.seq_id == e.seq_id && s.is_live() && s.num_computed == e.start as usize);
            if !valid {
                if let Some((_, st)) = e.ckpt {
                    self.cache.free_state(st);
                }
                self.requests[e.req as usize] = Some(req);
                continue;
            }
            let extra_key = req.params.extra_key;
            if nd > 0 {
                // A verified speculative row: the first `ns` rows' inputs are now
                // in the cache (the last token, then the accepted drafts); the
                // accepted tokens are committed one by one under the stop rule.
                let seq = &mut req.seqs[si];
                let mut stop = None;
                for &t in toks {
                    let t = t as u32;
                    seq.tokens.push(t);
                    self.upd.req_indices.push(e.req);
                    self.upd.sample_indices.push(seq.sample_index as i32);
                    self.upd.tokens.push(t as i32);
                    if let Some(reason) = req.params.check_stop(seq.tokens.len() - req.prompt_len, t) {
                        stop = Some(reason);
                        break;
                    }
                }
                seq.num_computed = seq.tokens.len() - 1;
                if self.cfg.enable_prefix_caching && seq.num_computed / bs > seq.table.num_hashed_blocks() {
                    self.cache.cache_full_blocks(&mut seq.table, &seq.tokens[..seq.num_computed], extra_key);
                }
                if let Some(reason) = stop {
                    self.finish_seq(&mut req, si, reason);
                    self.upd.finished.push((e.req, req.seqs[si].sample_index, reason));
                }
            } else {
                let seq = &mut req.seqs[si];
                seq.num_computed += e.k as usize;
                if self.cfg.enable_prefix_caching && seq.num_computed / bs > seq.table.num_hashed_blocks() {
                    self.cache.cache_full_blocks(&mut seq.table, &seq.tokens[..seq.num_computed], extra_key);
                }
                if let Some((due, st)) = e.ckpt {
                    // The forward wrote the state after `due` tokens into `st`.
                    let due = due as usize;
                    let c = &mut self.cache;
                    if seq.table.chain.len() >= due / bs {
                        c.register_checkpoint(&seq.table.chain[..due / bs], st, self.step);
                    } else {
                        c.free_state(st);
                        c.note_checkpoint_write_skipped();
                    }
                }
                while seq.ckpt_next != 0 && seq.num_computed >= seq.ckpt_next {
                    seq.ckpt_next = seq.ckpt_after;
                    seq.ckpt_after = 0;
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
            }
            if SPEC && e.num_samples == 1 {
                // Drafts for the next step replace the old ones (none given: none).
                // (A finished sequence gave its row back: nothing to keep.)
                if let Some(row) = req.seqs[si].row {
                    let held = &mut self.row_drafts[row as usize];
                    held.clear();
                    if let Some(d) = drafts {
                        held.extend_from_slice(&d[pi]);
                    }
                }
            }
            if req.all_finished() {
                any_done = true;
                self.close_request(&mut req, e.req, false);
            }
            self.requests[e.req as usize] = Some(req);
        }
        self.plan_ckpt_states = 0;
        self.settle_deferred_states();
        self.cache.reconcile(self.step + 1);
        if any_done {
            let reqs = &self.requests;
            self.running
                .retain(|&r| reqs[r as usize].as_ref().is_some_and(|q| q.state == ReqState::Running));
        }
        Ok(&self.upd)
    }

    /// The shape checks of `update_spec`'s speculative arguments (nothing changes).
    fn check_spec_args(&self, n_sampled: usize, accepted: Option<&[i32]>, drafts: Option<&[Vec<u32>]>) -> Result<(), SchedError> {
        let bad = |m: String| Err(SchedError::InvalidArgument(m));
        let b = self.plan.len();
        let mut want = 0usize;
        if let Some(acc) = accepted {
            if acc.len() != b {
                return bad(format!("update(): accepted has {} counts but the last plan has {b} entries; pass one per entry", acc.len()));
            }
            for (i, (e, &a)) in self.plan.iter().zip(acc).enumerate() {
                let nd = self.out.num_draft_tokens[i] as u32;
                if nd > 0 {
                    if a < 1 || a as u32 > nd + 1 {
                        return bad(format!(
                            "update(): accepted[{i}] = {a} but entry {i} carried {} drafts; it must be in [1, {}] \
                             (the accepted drafts plus the target's token)",
                            nd,
                            nd + 1
                        ));
                    }
                } else if a != e.num_samples as i32 {
                    return bad(format!(
                        "update(): accepted[{i}] = {a} but entry {i} carried no drafts; it must equal num_samples[{i}] = {}",
                        e.num_samples
                    ));
                }
                want += a as usize;
            }
        } else {
            want = self.plan_samples;
        }
        if n_sampled != want {
            return bad(format!(
                "update() got {n_sampled} sampled tokens but the last plan with these counts asks for {want} \
                 (the sum of accepted, else of num_samples); pass exactly that many in batch order"
            ));
        }
        if let Some(d) = drafts {
            if d.len() != b {
                return bad(format!("update(): drafts has {} lists but the last plan has {b} entries; pass one per entry", d.len()));
            }
            let kmax = self.cfg.num_speculative_tokens as usize;
            for (i, (e, l)) in self.plan.iter().zip(d).enumerate() {
                if l.is_empty() {
                    continue;
                }
                if l.len() > kmax {
                    return bad(format!(
                        "update(): drafts[{i}] has {} tokens, more than num_speculative_tokens ({kmax})",
                        l.len()
                    ));
                }
                if e.num_samples == 0 {
                    return bad(format!("update(): drafts[{i}] given for an entry that sampled nothing (mid-prefill); pass []"));
                }
                let req = self.requests[e.req as usize].as_ref();
                if req.is_some_and(|r| r.params.beam_search) {
                    return bad(format!("update(): drafts[{i}] given for a beam-search request; beams do not speculate, pass []"));
                }
            }
        }
        Ok(())
    }
}
