//! Admission: the waiting head gets its states and the blocks of its first
//! chunk (prefix match, checkpoint restore) or stays waiting, saying what was
//! short (pages, max_num_seqs, token budget).

use super::request::{ReqState, Request, Seq};
use super::{push_state_copy, sync_row, AdmitLimit, Entry, ScheduledEvent, Scheduler};
use crate::StateId;

impl Scheduler {
    /// Records what stopped admission, with the room there was at that moment
    /// (sequences running, pages obtainable) for the stats.
    pub(super) fn note_admission_limit(&mut self, limit: AdmitLimit, running_units: u32) {
        self.admission_limited[limit as usize] += 1;
        self.last_admission_limit = Some(limit);
        self.last_limit_room = (running_units, self.cache.available_pages(self.step));
    }

    /// Admits waiting request `r` with its first chunk(s), or says what was
    /// short (nothing changes then: the page check is a reservation made
    /// before anything is evicted).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn try_admit(
        &mut self,
        req: &mut Request,
        r: u32,
        budget: &mut usize,
        running_units: &mut u32,
        now: f64,
        bs: usize,
        thresh: usize,
        trim: MatchTrim,
    ) -> Result<(), AdmitLimit> {
        let units = req.units();
        if *running_units + units > self.cfg.max_num_seqs {
            return Err(AdmitLimit::MaxNumSeqs);
        }
        let pps = self.cfg.state_pages as u64;
        let reserve = if self.cfg.reserve_max_context {
            let need = units as u64 * self.cfg.max_pages_per_seq() as u64;
            if self.reserved_pages + need > self.cfg.num_pages as u64 {
                return Err(AdmitLimit::Pages);
            }
            need
        } else {
            0
        };
        // Chunk sizes, and a conservative page check before touching the cache.
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
            let la = if k == s.tokens.len() { lookahead(&self.cfg, req.prompt_len, &req.params, k) } else { 0 };
            need_blocks += (k + la).div_ceil(bs);
            chunks.push(k);
        }
        if chunks.first().copied().unwrap_or(0) == 0 && req.seqs[0].is_live() {
            return Err(AdmitLimit::TokenBudget);
        }
        let caching = self.cache.prefix_caching_enabled();
        let available = self.cache.available_pages(self.step);
        // The states are needed whatever a prefix hit covers (a restore only
        // saves them when it adopts a checkpoint, which counts as available).
        if units as u64 * pps > available {
            return Err(AdmitLimit::Pages);
        }
        // Without a prefix cache this bound is exact enough to skip the work below;
        // with one, blocks a hit covers are not needed, so the reservation decides.
        if !caching && need_blocks as u64 + units as u64 * pps > available {
            return Err(AdmitLimit::Pages);
        }
        let pending = req.pending_tokens();
        let interval = self.cfg.prefix_checkpoint_interval as usize;
        // (sequence, state to copy from, checkpoint key)
        let mut restores: Vec<(usize, StateId, u64)> = Vec::new();
        let p_s = self.p_slots.len();
        let c_s = self.copies.len();
        let refork = req.refork;
        // Phase 1, nothing allocated: prefix matches (they take their blocks
        // off the reclaimable list, which `available_pages` then no longer
        // counts), checkpoint lookups, chunk sizes, and the exact pages needed.
        let mut n_cached_of = vec![0usize; req.seqs.len()];
        // Lookahead slots of a chunk that samples (speculative decoding).
        let mut la_of = vec![0usize; req.seqs.len()];
        let mut need = units as u64 * pps;
        for (si, s) in req.seqs.iter_mut().enumerate() {
            if !s.is_live() || (refork && si != leader) {
                continue;
            }
            // A re-forking leader must end at the prompt with nothing of its own in
            // its table: the others fork that table.
            let upto = if refork { req.prompt_len } else { s.tokens.len() };
            s.matched = self.cache.match_prefix(&mut s.table, &s.tokens[..upto], req.params.extra_key);
            if trim != MatchTrim::Full {
                let keep = if trim == MatchTrim::ToChunk { (chunks[si] / bs).min(s.table.num_blocks()) } else { 0 };
                self.cache.truncate_match(&mut s.table, keep);
                s.matched = s.table.num_tokens();
            }
            let mut hit = 0;
            if caching {
                if let Some((t, src, key)) = self.cache.lookup_checkpoint(&s.table.chain, s.matched / bs, self.step) {
                    hit = t;
                    restores.push((si, src, key));
                }
            }
            s.num_computed = hit;
            set_checkpoint_targets(s, req.prompt_len, hit, caching, bs, interval > 0);
            let mut k = chunks[si].min(s.tokens.len() - hit);
            if refork && si == leader {
                k = k.min(req.prompt_len - hit);
            }
            if req.params.beam_search && req.forked {
                // Recompute of a beam: its last token is fed as a decode, with the others'.
                k = k.min(s.tokens.len() - 1 - hit);
            }
            k = s.cap_to_one_checkpoint(hit, k, interval);
            chunks[si] = k;
            if k == 0 {
                continue;
            }
            let n_cached = (hit + k).min(s.matched).saturating_sub(hit);
            n_cached_of[si] = n_cached;
            if hit + k == s.tokens.len() {
                la_of[si] = lookahead(&self.cfg, req.prompt_len, &req.params, hit + k);
            }
            need += self.cache.blocks_needed(&s.table, k - n_cached + la_of[si]) as u64;
        }
        // Phase 2: the reservation. Short: nothing was evicted; the matches are
        // undone below. Else the appends and states draw on it and fit.
        let mut keys: Vec<u64> = restores.iter().map(|r| r.2).collect();
        keys.sort_unstable();
        keys.dedup();
        let adoptable = (keys.len() as u64).min(units as u64) * pps;
        let mut failed = false;
        let mut reservation = match self.cache.reserve(need, adoptable, self.step) {
            Ok(r) => Some(r),
            Err(_) => {
                failed = true;
                None
            }
        };
        if let Some(res) = reservation.as_mut() {
            for (si, s) in req.seqs.iter_mut().enumerate() {
                let k = chunks[si];
                if !s.is_live() || (refork && si != leader) || k == 0 {
                    continue;
                }
                let n_cached = n_cached_of[si];
                self.p_slots.extend(std::iter::repeat_n(-1, n_cached));
                let la = la_of[si];
                let r = self.cache.append_slots_reserved(res, &mut s.table, k - n_cached + la, &mut self.p_slots, &mut self.copies, self.step);
                if r.is_ok() {
                    self.p_slots.truncate(self.p_slots.len() - la);
                }
                if r.is_err() {
                    debug_assert!(false, "an append under a reservation was short");
                    failed = true;
                    break;
                }
            }
        }
        // States: fresh pages (evicting reclaimable ones); when none are left,
        // a sequence takes over the checkpoint it resumes from instead of
        // copying it (the restores' checkpoints are busy, so never evicted).
        let mut fresh: Vec<StateId> = Vec::new();
        let mut adopted = 0usize;
        while !failed && fresh.len() + adopted < units as usize {
            let res = reservation.as_mut().expect("reserved");
            if let Some(st) = self.cache.alloc_state_reserved(res, self.step) {
                fresh.push(st);
            } else if adopted < restores.len() {
                let rs = &mut restores[adopted];
                match self.cache.adopt_checkpoint(rs.2) {
                    Some(st) => {
                        req.seqs[rs.0].state = Some(st);
                        rs.1 = st;
                        adopted += 1;
                    }
                    None => failed = true,
                }
            } else {
                failed = true;
            }
        }
        if failed {
            self.p_slots.truncate(p_s);
            self.copies.truncate(c_s);
            for st in fresh {
                self.cache.free_state(st);
            }
            for s in req.seqs.iter_mut() {
                self.cache.free_table(&mut s.table);
                if let Some(st) = s.state.take() {
                    // Adopted from a checkpoint above; that checkpoint is lost.
                    self.cache.free_state(st);
                }
                s.matched = 0;
                s.num_computed = 0;
                s.ckpt_next = 0;
                s.ckpt_after = 0;
                s.ckpt_until = 0;
            }
            self.cache.reconcile(self.step);
            return Err(AdmitLimit::Pages);
        }
        // Commit.
        let mut it = fresh.into_iter();
        if req.forked {
            for s in req.seqs.iter_mut().filter(|s| s.is_live() && s.state.is_none()) {
                s.state = Some(it.next().expect("one state per live sequence"));
            }
        } else {
            if req.seqs[0].state.is_none() {
                req.seqs[0].state = Some(it.next().expect("a state for the sequence"));
            }
            req.spare_states.clear();
            req.spare_states.extend(it);
        }
        for &(si, src, _) in &restores {
            let dst = req.seqs[si].state.expect("state assigned above");
            if src != dst {
                push_state_copy(&self.cache, src, dst, &mut self.out.state_copies);
            }
        }
        if caching {
            self.cache.note_checkpoint_queries(req.seqs.iter().filter(|s| s.is_live()).map(|s| (s.matched, s.num_computed)));
        }
        self.waiting.remove(&req.key);
        self.waiting_tokens -= pending;
        req.state = ReqState::Running;
        let pos = self.running.partition_point(|&x| self.requests[x as usize].as_ref().expect("running").key < req.key);
        self.running.insert(pos, r);
        self.running_seqs += req.seqs.iter().filter(|s| s.is_live()).count() as u32;
        *running_units += units;
        if reserve > 0 {
            self.reserved_pages += reserve;
            self.req_reserved.insert(r, reserve);
        }
        for (si, s) in req.seqs.iter_mut().enumerate() {
            let k = chunks[si];
            if k == 0 || !s.is_live() {
                continue;
            }
            let row = self.free_rows.pop().expect("a row per running sequence (max_num_seqs)");
            self.row_drafts[row as usize].clear();
            s.row = Some(row);
            s.bt_synced = 0;
            s.st_synced = false;
            sync_row(s, &self.cache, &mut self.out);
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
                ckpt: None,
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
        Ok(())
    }
}

/// Speculative decoding: the positions past `end` (a row that samples) that
/// get KV slots for the drafter: `num_speculative_tokens`, never reaching
/// `prompt + max_tokens` (no token is ever fed there); none for beams.
pub(super) fn lookahead(cfg: &super::SchedulerConfig, prompt_len: usize, params: &super::RequestParams, end: usize) -> usize {
    if cfg.num_speculative_tokens == 0 || params.beam_search {
        return 0;
    }
    (cfg.num_speculative_tokens as usize).min((prompt_len + params.max_tokens as usize).saturating_sub(end))
}

/// How much of a prefix match admission keeps. Matched blocks nobody runs on
/// are reclaimable pages that a hit takes off the free list, so a long match
/// can need more pages than computing the first chunk from scratch.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum MatchTrim {
    /// The whole match (the first attempt).
    Full,
    /// At most the blocks of the first chunk.
    ToChunk,
    /// None: the first chunk computed from position 0, so the head is refused
    /// for pages only when even that does not fit.
    Off,
}

/// A branch-point checkpoint must skip at least this many blocks more than
/// the state match it extends.
const MIN_BRANCH_GAIN_BLOCKS: usize = 4;

/// Where `s` (just matched: `hit` tokens restored, `s.matched` KV-matched)
/// writes checkpoints, nearest first: the branch point (end of a KV match
/// longer than the state match), then the prompt's last full block that
/// leaves a token to compute; with `every`, also each multiple of
/// `prefix_checkpoint_interval` up to that (see `Seq::next_checkpoint`).
pub(super) fn set_checkpoint_targets(s: &mut Seq, prompt_len: usize, hit: usize, caching: bool, bs: usize, every: bool) {
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
