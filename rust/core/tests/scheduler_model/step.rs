//! One engine step against the oracle: the plan's rows, KV and state reads through
//! the caller-side tables, priority preemption, sampling and the update's finishes.

use super::oracle::Harness;
use super::St;
use hybridserve_core::scheduler::PreemptCause;
use std::collections::HashSet;

impl Harness {
    // is_multiple_of needs Rust 1.87 (the MSRV is 1.80); entries are indices into
    // several parallel plan arrays.
    #[allow(clippy::manual_is_multiple_of, clippy::needless_range_loop)]
    pub(crate) fn do_step(&mut self) {
        self.step += 1;
        let cfg = self.cfg.clone();
        let bs = cfg.block_size as usize;
        let head_before = self.waiting_head();
        let was_waiting: Vec<bool> = self.reqs.iter().map(|r| r.st == St::Waiting).collect();
        let out = self.s.schedule(self.step as f64).expect("schedule").clone();
        // Priority preemption: victims outranked by the head, within the bound.
        assert_eq!(out.preempted.len(), out.preempted_causes.len());
        let mut n_prio = 0u32;
        for (&v, &c) in out.preempted.iter().zip(&out.preempted_causes) {
            if c == PreemptCause::Priority {
                n_prio += 1;
                let h = head_before.expect("a priority preemption without a waiting request");
                let vi = self.by_handle[&v];
                assert!(self.outranks(h, vi), "priority victim {} is not outranked by head {}", self.reqs[vi].id, self.reqs[h].id);
            }
        }
        assert!(n_prio <= cfg.max_priority_preemptions_per_step, "priority preemption bound exceeded");
        // Sequences finished outside update() since the last plan.
        let got: HashSet<_> = out.finished.iter().cloned().collect();
        assert_eq!(got, std::mem::take(&mut self.outside), "finished-outside report");
        for &h in &out.preempted {
            let r = &mut self.reqs[self.by_handle[&h]];
            assert_eq!(r.st, St::Running, "preempted a request that was not running");
            r.st = St::Waiting;
            r.computed.iter_mut().for_each(|c| *c = 0);
            // A preemption drops the drafts.
            r.drafts.iter_mut().for_each(|d| d.clear());
        }
        // Budget.
        let b = out.num_seqs();
        assert!(b <= cfg.max_num_seqs as usize);
        assert!(out.num_tokens() <= cfg.max_num_batched_tokens as usize, "token budget exceeded");
        assert_eq!(out.query_start_loc.len(), b + 1);
        assert_eq!(out.slot_mapping.len(), out.num_tokens());
        // Copies first, then the block-table buffer.
        for c in out.block_copies.chunks(2) {
            for o in 0..bs as i32 {
                match self.kv_mem.get(&(c[0] * bs as i32 + o)).cloned() {
                    Some(v) => self.kv_mem.insert(c[1] * bs as i32 + o, v),
                    None => self.kv_mem.remove(&(c[1] * bs as i32 + o)),
                };
            }
        }
        let snapshot = self.state_mem.clone();
        let mut written = HashSet::new();
        for c in out.state_copies.chunks(2) {
            assert!(written.insert(c[1]), "two copies write page {}", c[1]);
            self.state_mem.insert(c[1], snapshot.get(&c[0]).cloned().unwrap_or_default());
        }
        for c in out.block_copies.chunks(2) {
            assert!(written.insert(c[1]), "two copies write page {}", c[1]);
        }
        // No copy reads a page another copy writes, except beams re-parented into
        // each other (state copies among one request's beams: a permutation, safe
        // because the runner gathers every source before scattering).
        let state_dst: HashSet<i32> = out.state_copies.chunks(2).map(|c| c[1]).collect();
        let block_dst: HashSet<i32> = out.block_copies.chunks(2).map(|c| c[1]).collect();
        for c in out.block_copies.chunks(2) {
            assert!(!written.contains(&c[0]), "a block copy reads page {} that a copy of the same plan writes", c[0]);
        }
        for c in out.state_copies.chunks(2) {
            assert!(!block_dst.contains(&c[0]), "a state copy reads page {} that a block copy writes", c[0]);
        }
        if !self.reqs.iter().any(|r| r.params.beam_search && r.st == St::Running) {
            for c in out.state_copies.chunks(2) {
                assert!(!state_dst.contains(&c[0]), "a state copy reads page {} another state copy writes", c[0]);
            }
        }
        let ckpts = self.s.checkpoints();
        let ckpt_pages: HashSet<i32> = ckpts.iter().flat_map(|c| c.0.iter().map(|&p| p as i32)).collect();
        assert_eq!(ckpt_pages.len(), ckpts.len() * cfg.state_pages as usize, "two checkpoints share a page");
        for (pages, tokens, last_block, _) in &ckpts {
            let tokens = *tokens;
            assert!(tokens > 0 && tokens % bs == 0, "checkpoint off a block boundary");
            let kv = self.kv_mem.get(&(*last_block as i32 * bs as i32 + bs as i32 - 1)).cloned().unwrap_or_default();
            for &p in pages {
                let st = self.state_mem.get(&(p as i32)).cloned().unwrap_or_default();
                assert_eq!(st.len(), tokens, "checkpoint page {p} holds a state of {} tokens, keyed at {tokens}", st.len());
                assert_eq!(kv, st, "checkpoint state is not the prefix its key (block chain) stands for");
            }
        }
        for k in 0..out.bt_update_rows.len() {
            let row = &mut self.rows[out.bt_update_rows[k] as usize];
            row[out.bt_update_cols[k] as usize] = out.bt_update_values[k];
        }
        for k in 0..out.st_update_rows.len() {
            let row = &mut self.st_rows[out.st_update_rows[k] as usize];
            row[out.st_update_cols[k] as usize] = out.st_update_values[k];
        }
        self.check_arena(&out, head_before);
        self.check_evictions(&out);
        let mut seen_slots = HashSet::new();
        let mut seen_rows = HashSet::new();
        let mut seen_seq = HashSet::new();
        let mut in_prefill_part = false;
        let mut ck_off = 0usize;
        let kspec = cfg.num_speculative_tokens as usize;
        let beams_running = self.reqs.iter().any(|r| r.params.beam_search && r.st == St::Running);
        // Per entry: the tokens it feeds (committed, then its drafts) and its
        // state pages (a drafted entry's state is set to the accepted prefix
        // after update, as the engine's rollback does).
        let mut fed_of: Vec<Vec<u32>> = Vec::with_capacity(b);
        let mut st_row_of: Vec<Vec<i32>> = Vec::with_capacity(b);
        assert_eq!(out.num_draft_tokens.len(), b);
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let sm = out.sample_indices[e] as usize;
            let r = &mut self.reqs[i];
            if r.st == St::Waiting {
                r.st = St::Running;
                r.first_step.get_or_insert(self.step);
            }
            assert_eq!(r.st, St::Running);
            assert!(!r.done[sm], "scheduled a finished sample");
            let committed = r.tokens(sm);
            let (start, k) = (out.num_computed_tokens[e] as usize, out.num_scheduled_tokens[e] as usize);
            // Drafts: only on decodes, a prefix of what the last update gave,
            // within max_tokens (r outputs left: at most r - 1), cut short only
            // when the token budget is full.
            let nd = out.num_draft_tokens[e] as usize;
            let mut toks = committed.clone();
            if nd > 0 {
                assert!(kspec > 0 && !r.params.beam_search, "drafts scheduled without speculative decoding");
                assert_eq!(start + 1, committed.len(), "drafts on a non-decode entry");
                assert_eq!(k, 1 + nd);
                assert_eq!(out.checkpoint_positions[e], -1, "a checkpoint asked of a drafted entry");
                assert!(nd <= r.drafts[sm].len(), "more drafts scheduled than given");
                toks.extend_from_slice(&r.drafts[sm][..nd]);
            }
            let is_dec = k == 1 + nd && start >= r.prompt.len() && start + 1 == committed.len();
            if is_dec && !r.drafts[sm].is_empty() {
                let left = r.params.max_tokens as usize - r.out[sm].len();
                let want = r.drafts[sm].len().min(left - 1);
                assert!(nd <= want, "drafted past max_tokens");
                if nd < want && out.preempted.is_empty() && !beams_running {
                    assert_eq!(out.num_tokens(), cfg.max_num_batched_tokens as usize, "drafts cut although the budget was not full");
                }
            }
            let q0 = out.query_start_loc[e] as usize;
            assert_eq!(out.query_start_loc[e + 1] as usize, q0 + k);
            assert!(k >= 1);
            // A recomputed forked request prefills the prompt once, in its first live sample.
            if r.forked && start < r.prompt.len() {
                assert_eq!(Some(&sm), r.live().first(), "{}: sample {sm} re-prefills the prompt", r.id);
            }
            if r.computed[sm] == 0 && start > 0 {
                // A checkpoint hit, or a sample re-forked at the prompt's end after a
                // recompute: the state check below verifies the state it starts from.
                let refork = r.forked && start == r.prompt.len();
                assert!(refork || (cfg.enable_prefix_caching && start % bs == 0 && start < toks.len()), "bad hit start {start}");
                r.computed[sm] = start;
            }
            assert_eq!(start, r.computed[sm], "num_computed_tokens disagrees with what was computed");
            let st_row = self.st_rows[out.block_table_rows[e] as usize].clone();
            assert!(st_row.iter().all(|p| !ckpt_pages.contains(p)), "a sequence runs on a checkpoint's pages");
            assert_eq!(out.seq_lens[e] as usize, start + k);
            assert!(start + k - nd <= committed.len());
            let is_decode = is_dec;
            if e < out.num_decodes {
                assert!(is_decode, "a non-decode among the decodes");
            } else {
                in_prefill_part = true;
            }
            let _ = in_prefill_part;
            if !is_decode && cfg.long_prefill_token_threshold > 0 {
                assert!(k <= cfg.long_prefill_token_threshold as usize);
            }
            if r.params.beam_search && r.forked && !is_decode {
                assert!(start + k < toks.len(), "a beam's recompute must leave its last token to the joint decode");
            }
            let want_samples = if start + k - nd == committed.len() { if r.forked { 1 } else { r.params.n as i32 } } else { 0 };
            assert_eq!(out.num_samples[e], want_samples);
            for &p in &st_row {
                assert!(seen_slots.insert(p), "state page {p} shared by two entries");
            }
            assert!(seen_rows.insert(out.block_table_rows[e]), "buffer row shared by two entries");
            assert!(seen_seq.insert((i, sm)), "sequence scheduled twice");
            for j in 0..k {
                assert_eq!(out.input_ids[q0 + j] as u32, toks[start + j], "fed the wrong token");
                assert_eq!(out.positions[q0 + j] as usize, start + j);
            }
            // Recurrent state: zeros at start 0, else exactly what this sample
            // consumed, in every page of its state page table.
            for &p in &st_row {
                if start == 0 {
                    self.state_mem.insert(p, vec![]);
                } else {
                    assert_eq!(self.state_mem.get(&p).map(|v| v.as_slice()), Some(&toks[..start]), "wrong DeltaNet state");
                }
                self.state_mem.insert(p, toks[..start + k].to_vec());
            }
            fed_of.push(toks.clone());
            st_row_of.push(st_row.clone());
            // A checkpoint written inside the chunk: the state after its first `pos` tokens.
            let pos = out.checkpoint_positions[e];
            if pos >= 0 {
                let pos = pos as usize;
                assert!(pos >= 1 && pos <= k, "checkpoint position {pos} outside the chunk of {k}");
                assert_eq!((start + pos) % bs, 0, "checkpoint off a block boundary");
                let pps = cfg.state_pages as usize;
                for &p in &out.checkpoint_pages[ck_off..ck_off + pps] {
                    assert!(!st_row.contains(&p), "a checkpoint written over the running state");
                    self.state_mem.insert(p, toks[..start + pos].to_vec());
                }
                ck_off += pps;
            }
        }
        assert_eq!(ck_off, out.checkpoint_pages.len(), "checkpoint pages without a position");
        // Admission in key order: nothing admitted while a smaller key waits.
        let admitted: Vec<usize> =
            (0..self.reqs.len()).filter(|&i| was_waiting[i] && self.reqs[i].st == St::Running).collect();
        for &a in &admitted {
            for w in (0..self.reqs.len()).filter(|&w| self.reqs[w].st == St::Waiting) {
                assert!(self.key(w) > self.key(a), "{} admitted while {} (smaller key) waits", self.reqs[a].id, self.reqs[w].id);
            }
        }
        // No missed room: where sequences are the only scarce resource (blocks
        // for everyone, no checkpoints, budget left over), a waiting head that
        // outranks running requests is admitted unless the per-step bound was
        // reached or even without all of them it would not fit.
        let plenty = !cfg.enable_prefix_caching
            && !cfg.reserve_max_context
            && cfg.num_pages as usize > cfg.max_num_seqs as usize * cfg.max_pages_per_seq() as usize;
        if plenty && cfg.max_priority_preemptions_per_step > 0 && out.num_tokens() < cfg.max_num_batched_tokens as usize {
            // One head per step: the check applies to the head the step began with.
            if let Some(h) = self.waiting_head().filter(|&h| Some(h) == head_before) {
                let running: Vec<usize> = (0..self.reqs.len()).filter(|&i| self.reqs[i].st == St::Running).collect();
                if running.iter().any(|&r| self.outranks(h, r)) && n_prio < cfg.max_priority_preemptions_per_step {
                    let kept: u32 = running.iter().filter(|&&r| !self.outranks(h, r)).map(|&r| self.units(r)).sum();
                    let cap = cfg.max_num_seqs;
                    assert!(kept + self.units(h) > cap, "{} left waiting although outranked requests hold its room", self.reqs[h].id);
                }
            }
        }
        // KV writes of the whole step, then every entry reads its full context.
        for e in 0..b {
            let toks = &fed_of[e];
            let (start, k, q0) = (out.num_computed_tokens[e] as usize, out.num_scheduled_tokens[e] as usize, out.query_start_loc[e] as usize);
            for j in 0..k {
                let s = out.slot_mapping[q0 + j];
                if s >= 0 {
                    self.kv_mem.insert(s, toks[..=start + j].to_vec());
                }
            }
        }
        let (width, dense) = self.s.block_tables();
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let toks = &fed_of[e];
            let row = &self.rows[out.block_table_rows[e] as usize];
            let len = out.seq_lens[e] as usize;
            for p in 0..len {
                let blk = row[p / bs];
                assert_eq!(blk, dense[e * width + p / bs], "buffer row differs from the block table");
                let slot = blk * bs as i32 + (p % bs) as i32;
                assert_eq!(self.kv_mem.get(&slot).map(|v| v.as_slice()), Some(&toks[..=p]), "attention would read wrong KV at pos {p}");
            }
            // No slot collisions: every slot this entry writes is in a block no
            // other table holds.
            let q0 = out.query_start_loc[e] as usize;
            for j in 0..out.num_scheduled_tokens[e] as usize {
                let sl = out.slot_mapping[q0 + j];
                if sl >= 0 {
                    assert_eq!(self.s.kv().refcount(sl as u32 / bs as u32), 1, "a written slot's block is shared");
                }
            }
            // Lookahead: an entry that samples has slots, in its buffer row, for
            // the k positions past its row (not reaching prompt + max_tokens),
            // in blocks of its own.
            let r = &self.reqs[i];
            if kspec > 0 && out.num_samples[e] > 0 && !r.params.beam_search {
                let end = (len + kspec).min(r.prompt.len() + r.params.max_tokens as usize);
                assert!(end <= cfg.max_model_len as usize);
                let nblk = end.div_ceil(bs);
                assert!(width >= nblk, "lookahead slots missing: {nblk} blocks needed, table has fewer");
                for c in len / bs..nblk {
                    let blk = dense[e * width + c];
                    assert!(blk >= 0, "lookahead block missing");
                    assert_eq!(row[c], blk, "lookahead block not in the caller's buffer row");
                    assert_eq!(self.s.kv().refcount(blk as u32), 1, "a lookahead block is shared");
                }
            }
        }
        // Beams decode together: all live beams of a forked beam request, or none.
        for (i, r) in self.reqs.iter().enumerate() {
            if r.params.beam_search && r.forked && r.st == St::Running {
                let dec: Vec<bool> = r.live().iter().map(|&sm| (0..b).any(|e| self.by_handle[&out.req_indices[e]] == i
                    && out.sample_indices[e] as usize == sm && out.num_samples[e] == 1)).collect();
                assert!(dec.iter().all(|&d| d) || dec.iter().all(|&d| !d), "{}: beams decoded apart {dec:?}", r.id);
            }
        }
        // Beams: re-parent every request whose beams all decoded this step.
        let mut beam_reqs: Vec<usize> = Vec::new();
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let r = &self.reqs[i];
            if r.params.beam_search && r.forked && !beam_reqs.contains(&i) && r.done.iter().all(|&d| !d) {
                let w = r.out.len();
                let all = (0..w).all(|sm| (0..b).any(|f| out.req_indices[f] == out.req_indices[e] && out.sample_indices[f] as usize == sm && out.num_samples[f] == 1));
                if all {
                    beam_reqs.push(i);
                }
            }
        }
        for i in beam_reqs {
            let w = self.reqs[i].out.len();
            let parents: Vec<u32> = (0..w).map(|_| (self.rand() % w as u64) as u32).collect();
            let id = self.reqs[i].id.clone();
            self.s.reorder_beams(&id, &parents).expect("reorder_beams");
            let r = &mut self.reqs[i];
            r.out = parents.iter().map(|&p| r.out[p as usize].clone()).collect();
            self.beam_reorders += 1;
        }
        // Sample and update. A drafted entry accepts a random count: that many
        // of its drafts (0..=d), then a token of the target.
        let mut sampled = Vec::new();
        let mut accepted = Vec::with_capacity(b);
        for e in 0..b {
            let nd = out.num_draft_tokens[e] as usize;
            if nd > 0 {
                let a = 1 + (self.rand() % (nd as u64 + 1)) as usize;
                let start = out.num_computed_tokens[e] as usize;
                sampled.extend(fed_of[e][start + 1..start + a].iter().map(|&t| t as i32));
                sampled.push((self.rand() % 9) as i32);
                accepted.push(a as i32);
            } else {
                for _ in 0..out.num_samples[e] {
                    let t = (self.rand() % 9) as i32; // 0..8: EOS (7) and STOP (5) happen
                    sampled.push(t);
                }
                accepted.push(out.num_samples[e]);
            }
        }
        // Drafts for the next step: for every entry that sampled (a forking
        // entry's are ignored), 0..=k random tokens.
        let drafts: Vec<Vec<u32>> = (0..b)
            .map(|e| {
                let beam = self.reqs[self.by_handle[&out.req_indices[e]]].params.beam_search;
                if kspec == 0 || out.num_samples[e] == 0 || beam {
                    return vec![];
                }
                let n = (self.rand() % (kspec as u64 + 1)) as usize;
                (0..n).map(|_| (self.rand() % 9) as u32).collect()
            })
            .collect();
        let mut gave_drafts = false;
        let upd = if kspec == 0 {
            self.s.update(&sampled).expect("update").clone()
        } else {
            // Now and then a bad call first: refused, nothing changed.
            if self.rand() % 6 == 0 && b > 0 {
                let before = self.s.stats();
                let mut bad_acc = accepted.clone();
                let mut bad_sampled = sampled.clone();
                let mut bad_drafts = drafts.clone();
                let e = (self.rand() % b as u64) as usize;
                match self.rand() % 5 {
                    0 => bad_acc[e] = if out.num_draft_tokens[e] > 0 { out.num_draft_tokens[e] + 2 } else { out.num_samples[e] + 1 },
                    1 => bad_acc[e] = if out.num_draft_tokens[e] > 0 { 0 } else { out.num_samples[e] + 1 },
                    2 => { bad_acc.pop(); }
                    3 if out.num_samples[e] == 0 => bad_drafts[e] = vec![1],
                    3 => bad_drafts[e] = vec![1; kspec + 1],
                    _ => bad_sampled.push(1),
                }
                let r = self.s.update_spec(&bad_sampled, Some(&bad_acc), Some(&bad_drafts));
                assert!(r.is_err(), "a bad update_spec was accepted");
                assert_eq!(self.s.stats(), before, "a refused update_spec changed something");
            }
            let with_drafts = self.rand() % 4 != 0;
            gave_drafts = with_drafts;
            let acc = if out.num_draft_tokens.iter().all(|&d| d == 0) && self.rand() % 2 == 0 { None } else { Some(&accepted[..]) };
            self.s.update_spec(&sampled, acc, with_drafts.then_some(&drafts[..])).expect("update").clone()
        };
        let mut want_rows = Vec::new();
        let mut want_fin = HashSet::new();
        let mut off = 0;
        for e in 0..b {
            let i = self.by_handle[&out.req_indices[e]];
            let r = &mut self.reqs[i];
            let sm = out.sample_indices[e] as usize;
            let ns = accepted[e] as usize;
            let nd = out.num_draft_tokens[e] as usize;
            let k = out.num_scheduled_tokens[e] as usize;
            let toks = &sampled[off..off + ns];
            off += ns;
            if nd > 0 {
                self.spec_drafts += nd as u64;
                self.spec_accepted += ns as u64 - 1;
                for c in &mut self.spec_by_pos[..ns - 1] {
                    *c += 1;
                }
                // Committed one by one; a stop drops the rest.
                for &t in toks {
                    r.out[sm].push(t as u32);
                    r.computed[sm] += 1;
                    want_rows.push((out.req_indices[e], sm as i32, t));
                    if let Some(why) = Self::stop_rule(&r.params, r.out[sm].len(), t as u32) {
                        r.done[sm] = true;
                        want_fin.insert((out.req_indices[e], sm as u32, why));
                        break;
                    }
                }
                // The engine leaves the state at the last accepted position.
                if !r.done[sm] {
                    let c = r.tokens(sm)[..r.computed[sm]].to_vec();
                    for &p in &st_row_of[e] {
                        self.state_mem.insert(p, c.clone());
                    }
                }
            } else if ns > 1 {
                r.forked = true;
                let c = r.computed[0] + k;
                for (j, &t) in toks.iter().enumerate() {
                    r.computed[j] = c;
                    r.out[j].push(t as u32);
                    r.drafts[j].clear();
                    want_rows.push((out.req_indices[e], j as i32, t));
                    if let Some(why) = Self::stop_rule(&r.params, r.out[j].len(), t as u32) {
                        r.done[j] = true;
                        want_fin.insert((out.req_indices[e], j as u32, why));
                    }
                }
            } else {
                r.computed[sm] += k;
                if ns == 1 {
                    let t = toks[0];
                    r.out[sm].push(t as u32);
                    want_rows.push((out.req_indices[e], sm as i32, t));
                    if let Some(why) = Self::stop_rule(&r.params, r.out[sm].len(), t as u32) {
                        r.done[sm] = true;
                        want_fin.insert((out.req_indices[e], sm as u32, why));
                    }
                }
            }
            if out.num_samples[e] == 1 {
                r.drafts[sm] = if gave_drafts && !r.done[sm] { drafts[e].clone() } else { vec![] };
            }
            assert!(r.out.iter().all(|o| o.len() <= r.params.max_tokens as usize), "past max_tokens");
            if r.done.iter().all(|&d| d) {
                r.st = St::Done;
            }
        }
        let got_rows: Vec<_> = (0..upd.tokens.len()).map(|j| (upd.req_indices[j], upd.sample_indices[j], upd.tokens[j])).collect();
        assert_eq!(got_rows, want_rows);
        let got_fin: HashSet<_> = upd.finished.iter().cloned().collect();
        assert_eq!(got_fin, want_fin, "finished set");
        // Output tokens readable through the API agree.
        for r in self.reqs.iter().filter(|r| r.st != St::Done) {
            for sm in 0..r.out.len() {
                assert_eq!(self.s.output_tokens(&r.id, sm as u32).unwrap(), r.out[sm].as_slice());
            }
        }
    }
}
