//! The brute-force arena model: every page is exactly one thing after each schedule().

use super::oracle::Harness;
use super::St;
use std::collections::HashSet;

impl Harness {
    /// The brute-force arena model (see the module docs), right after schedule().
    pub(crate) fn check_arena(&self, out: &hybridserve_core::scheduler::SchedulerOutput, head_before: Option<usize>) {
        let cfg = &self.cfg;
        let n = cfg.num_pages as usize;
        let pps = cfg.state_pages as usize;
        let kv = self.s.kv();
        let st = self.s.stats();
        // What holds each page, from independent sources.
        let mut owner: Vec<Vec<&str>> = vec![vec![]; n];
        for p in kv.free_list() {
            owner[p as usize].push("free");
        }
        for p in kv.lru_order() {
            owner[p as usize].push("cached");
        }
        let mut refs = vec![0u32; n];
        for t in self.s.running_tables() {
            for b in t {
                refs[b as usize] += 1;
            }
        }
        for (p, &r) in refs.iter().enumerate() {
            if r > 0 {
                owner[p].push("kv");
                assert_eq!(kv.refcount(p as u32), r, "page {p}: refcount differs from the block tables holding it");
            }
        }
        let running_states = self.s.running_states();
        for (_, pages) in &running_states {
            assert_eq!(pages.len(), pps);
            for &p in pages {
                owner[p as usize].push("state");
            }
        }
        let ckpts = self.s.checkpoints();
        for (pages, ..) in &ckpts {
            for &p in pages {
                owner[p as usize].push("checkpoint");
            }
        }
        for &p in &out.checkpoint_pages {
            owner[p as usize].push("checkpoint (in flight)");
        }
        // A dropped checkpoint still busy in this plan keeps its pages until it ran.
        let deferred = st.checkpoint_pages as usize - (ckpts.len() * pps + out.checkpoint_pages.len());
        let unowned: Vec<usize> = (0..n).filter(|&p| owner[p].is_empty()).collect();
        for (p, o) in owner.iter().enumerate() {
            assert!(o.len() <= 1, "page {p} used twice: {o:?}");
        }
        assert_eq!(unowned.len(), deferred, "pages leaked: {unowned:?}");
        assert_eq!(deferred % pps.max(1), 0);
        // The stats' per-use counts.
        let count = |w: &str| owner.iter().filter(|o| o.first() == Some(&w)).count() as u32;
        assert_eq!(st.num_pages as usize, n);
        assert_eq!(st.free_pages, count("free"));
        assert_eq!(st.cached_pages, count("cached"));
        assert_eq!(st.kv_pages, count("kv"));
        assert_eq!(st.running_state_pages, count("state"));
        assert_eq!(st.checkpoint_pages as usize, count("checkpoint") as usize + out.checkpoint_pages.len() + deferred);
        assert_eq!(st.free_pages + st.cached_pages + st.kv_pages + st.running_state_pages + st.checkpoint_pages, st.num_pages);
        // Admission refuses for pages only when they are truly gone: the head
        // (one sequence, nothing preempted this step) would need its n states
        // plus the blocks of its first chunk, no prefix hit counted; pages
        // could still be had: free, cached, evictable checkpoints, and what
        // this plan's checkpoint writes took after admission.
        if st.last_admission_limit == "max_num_seqs" {
            let planned: HashSet<u32> = out.req_indices.iter().copied().collect();
            let h = (0..self.reqs.len())
                .filter(|&i| self.reqs[i].st == St::Waiting && !planned.contains(&self.reqs[i].handle))
                .min_by_key(|&i| self.key(i))
                .expect("a head was refused");
            assert!(
                st.last_admission_running_seqs + self.units(h) > cfg.max_num_seqs,
                "refused for max_num_seqs with {} running",
                st.last_admission_running_seqs
            );
        }
        if st.last_admission_limit == "pages" && out.preempted.is_empty() && !cfg.reserve_max_context {
            // The head after this step's admissions (the harness marks them
            // running only after this check).
            let planned: HashSet<u32> = out.req_indices.iter().copied().collect();
            let h = (0..self.reqs.len())
                .filter(|&i| self.reqs[i].st == St::Waiting && !planned.contains(&self.reqs[i].handle))
                .min_by_key(|&i| self.key(i))
                .expect("a head was refused");
            let _ = head_before;
            if !self.reqs[h].forked {
                let r = &self.reqs[h];
                let left = cfg.max_num_batched_tokens as usize - out.num_tokens();
                let mut chunk = r.tokens(0).len().min(left);
                if cfg.long_prefill_token_threshold > 0 {
                    chunk = chunk.min(cfg.long_prefill_token_threshold as usize);
                }
                // A chunk that samples also takes its lookahead slots.
                let la = if cfg.num_speculative_tokens > 0 && !r.params.beam_search && chunk == r.tokens(0).len() {
                    (cfg.num_speculative_tokens as usize).min(r.prompt.len() + r.params.max_tokens as usize - chunk)
                } else {
                    0
                };
                let need = r.params.n as u64 * pps as u64 + (chunk + la).div_ceil(cfg.block_size as usize) as u64;
                let could = st.last_admission_available_pages;
                assert!(could <= st.available_pages + out.checkpoint_pages.len() as u64, "pages appeared from nowhere");
                assert!(could < need, "{} refused for pages with {could} available, needing at most {need}; chunk {chunk} stats {st:?} out {out:?}", r.id);
            }
        }
    }
}
