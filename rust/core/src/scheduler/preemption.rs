//! Preemption by recompute: priority preemption for an outranking waiting head
//! (with its feasibility check), and giving back everything a victim holds.

use super::admission::lookahead;
use super::request::{ReqState, Request};
use super::{release_seq, PreemptCause, Scheduler};
use crate::BlockId;
use std::collections::HashMap;

impl Scheduler {
    /// Whether running request `v` may be preempted to make room for waiting
    /// request `h`: a strictly more urgent static priority, and an effective
    /// priority (with aging) better by more than the threshold. Equal
    /// priorities never preempt each other (FCFS among equals is unchanged).
    pub(super) fn outranks(&self, h: &Request, v: &Request) -> bool {
        if h.params.priority >= v.params.priority {
            return false;
        }
        let a = self.cfg.aging_interval_steps.max(1) as i128;
        v.key.0 - h.key.0 > self.cfg.priority_preemption_threshold as i128 * a
    }

    /// What the running requests hold that admission weighs: (sequences,
    /// running decodes, decodes crossing into a new block). O(running).
    pub(super) fn running_load(&self) -> (u32, usize, u64) {
        let mut running_units = 0u32;
        let mut decodes = 0usize;
        let mut decode_blocks = 0u64;
        let bs = self.cfg.block_size as usize;
        for &r in &self.running {
            let q = self.requests[r as usize].as_ref().expect("running");
            running_units += q.units();
            for s in q.seqs.iter().filter(|s| s.is_live()) {
                if s.tokens.len() - s.num_computed == 1 && s.num_computed >= q.prompt_len {
                    if self.cfg.num_speculative_tokens == 0 {
                        decodes += 1;
                        decode_blocks += (s.num_computed % bs == 0) as u64;
                    } else {
                        // Its drafts (as many as max_tokens allows) and lookahead.
                        let left = q.prompt_len + q.params.max_tokens as usize - s.tokens.len();
                        let held = s.row.map_or(0, |row| self.row_drafts[row as usize].len());
                        let d = held.min(left.saturating_sub(1));
                        let end = s.tokens.len() + d;
                        let target = end + lookahead(&self.cfg, q.prompt_len, &q.params, end);
                        decodes += 1 + d;
                        decode_blocks += self.cache.blocks_needed(&s.table, target.saturating_sub(s.table.num_tokens())) as u64;
                    }
                }
            }
        }
        (running_units, decodes, decode_blocks)
    }

    /// Would waiting request `h` be admitted with `units` more sequences and
    /// `pages` more pages available, given the running load (see
    /// `running_load`)? Counts its states, the blocks of its first chunk and
    /// one per running decode crossing into a new block; a prefix hit, which
    /// may need fewer, is not counted (conservative). O(h's sequences).
    pub(super) fn admission_room(&self, h: &Request, load: (u32, usize, u64), extra_units: u32, extra_pages: u64) -> bool {
        let (running_units, decodes, decode_blocks) = load;
        let units = h.units();
        let bs = self.cfg.block_size as usize;
        if running_units.saturating_sub(extra_units) + units > self.cfg.max_num_seqs {
            return false;
        }
        if self.cfg.reserve_max_context {
            let need = units as u64 * self.cfg.max_pages_per_seq() as u64;
            let held = self.reserved_pages.saturating_sub(extra_pages);
            return held + need <= self.cfg.num_pages as u64;
        }
        let thresh = self.cfg.long_prefill_token_threshold as usize;
        let mut left = (self.cfg.max_num_batched_tokens as usize).saturating_sub(decodes);
        let mut need = decode_blocks + units as u64 * self.cfg.state_pages as u64;
        for s in h.seqs.iter().filter(|s| s.is_live()) {
            let mut k = (s.tokens.len() - s.num_computed).min(left);
            if thresh > 0 {
                k = k.min(thresh);
            }
            left -= k;
            need += k.div_ceil(bs) as u64;
        }
        need <= self.cache.available_pages(self.step) + extra_pages
    }

    /// What preempting `v` gives back: (sequences, pages). Blocks only count
    /// when no other request holds them (shared ones stay).
    pub(super) fn room_of(&self, v: &Request, r: u32) -> (u32, u64) {
        if self.cfg.reserve_max_context {
            return (v.units(), self.req_reserved.get(&r).copied().unwrap_or(0));
        }
        let states = v.seqs.iter().filter(|s| s.state.is_some()).count() as u64 + v.spare_states.len() as u64;
        let mut held: HashMap<BlockId, u32> = HashMap::new();
        for s in v.seqs.iter().filter(|s| s.is_live()) {
            for &b in s.table.blocks() {
                *held.entry(b).or_insert(0) += 1;
            }
        }
        let blocks = held.iter().filter(|&(&b, &c)| self.cache.refcount(b) == c).count() as u64;
        (v.units(), blocks + states * self.cfg.state_pages as u64)
    }

    /// Priority preemption, before the running walk: while the waiting head
    /// does not fit and the lowest-ranked running request is outranked by it
    /// (see `outranks`), preempt that request, at most
    /// `max_priority_preemptions_per_step` times. Nothing is preempted when even
    /// all the outranked running requests together would not make room. The
    /// head is then admitted by the normal admission below, in this step.
    pub(super) fn priority_preempt(&mut self) -> u32 {
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
        if self.admission_room(head, load, 0, 0) {
            return 0;
        }
        // Feasibility: everything the outranked requests hold, lowest first.
        let (mut u, mut pg) = (0u32, 0u64);
        let mut victims = 0usize;
        let mut feasible = false;
        for &v in self.running.iter().rev() {
            let q = self.requests[v as usize].as_ref().expect("running");
            if !self.outranks(head, q) {
                break;
            }
            let (a, b) = self.room_of(q, v);
            u += a;
            pg += b;
            victims += 1;
            if self.admission_room(head, load, u, pg) {
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
    pub(super) fn preempt(&mut self, req: &mut Request, r: u32, cause: PreemptCause) {
        // Its fork copies are moot: it recomputes. Left pending they would pass the
        // live-destination check if it were readmitted in this step and given back
        // the same state ids (freed states are reused), and then write over the
        // state a checkpoint restore puts there.
        self.pending_state_copies.retain(|pc| pc.req != r);
        debug_assert_eq!(req.state, ReqState::Running, "only a running request is preempted");
        self.running_seqs -= req.seqs.iter().filter(|s| s.is_live()).count() as u32;
        for s in req.seqs.iter_mut().filter(|s| s.is_live()) {
            release_seq(&mut self.cache, &mut self.free_rows, s);
            s.num_computed = 0;
            s.matched = 0;
            s.ckpt_next = 0;
            s.ckpt_after = 0;
            s.ckpt_until = 0;
        }
        for st in req.spare_states.drain(..) {
            self.cache.free_state(st);
        }
        if let Some(res) = self.req_reserved.remove(&r) {
            self.reserved_pages -= res;
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
}
