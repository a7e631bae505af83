//! Stats and introspection: the counters and gauges snapshot (arena pages by
//! use, what limited admission) and the read-only views tests use.

use super::{AdmitLimit, CacheManager, CheckpointStats, Scheduler, SchedulerStats};
use crate::{BlockId, KvCacheManager};

impl Scheduler {
    /// Dense block tables of the last plan's entries (`-1` padded): tests and
    /// debugging; the engine uses the incremental row updates instead.
    pub fn block_tables(&self) -> (usize, Vec<i32>) {
        let rows: Vec<&[BlockId]> = self
            .out
            .req_indices
            .iter()
            .zip(&self.out.seq_ids)
            .map(|(&r, &sid)| {
                self.requests[r as usize]
                    .as_ref()
                    .and_then(|q| q.seqs.iter().find(|s| s.seq_id == sid as u64))
                    .map(|s| s.table.blocks())
                    .unwrap_or(&[])
            })
            .collect();
        let width = rows.iter().map(|b| b.len()).max().unwrap_or(0);
        let mut dense = vec![-1i32; rows.len() * width];
        for (i, b) in rows.iter().enumerate() {
            for (j, &x) in b.iter().enumerate() {
                dense[i * width + j] = x as i32;
            }
        }
        (width, dense)
    }

    pub fn kv(&self) -> &KvCacheManager {
        self.cache.kv()
    }

    pub fn cache(&self) -> &CacheManager {
        &self.cache
    }

    /// Records every eviction with the candidates the order saw (tests).
    pub fn record_evictions(&mut self, on: bool) {
        self.cache.record_evictions(on);
    }

    /// The evictions recorded since the last call (see [`Self::record_evictions`]).
    pub fn take_eviction_log(&mut self) -> Vec<super::EvictionRecord> {
        self.cache.take_eviction_log()
    }

    /// `(state pages, tokens, last block of its chain, generation of that
    /// block's prefix-cache entry)` of every live checkpoint, sorted (tests and
    /// debugging).
    pub fn checkpoints(&self) -> Vec<(Vec<BlockId>, usize, BlockId, u64)> {
        let mut v: Vec<_> = self
            .cache
            .list_checkpoints()
            .into_iter()
            .map(|(st, t, b, g)| (self.cache.state_pages(st).to_vec(), t, b, g))
            .collect();
        v.sort_unstable();
        v
    }

    pub fn checkpoint_stats(&self) -> CheckpointStats {
        self.cache.checkpoint_stats()
    }

    /// The KV blocks of every live running sequence's block table, one list
    /// per sequence (tests and debugging).
    pub fn running_tables(&self) -> Vec<Vec<BlockId>> {
        let mut v = Vec::new();
        for &r in &self.running {
            let req = self.requests[r as usize].as_ref().expect("running");
            v.extend(req.seqs.iter().filter(|s| s.is_live()).map(|s| s.table.blocks().to_vec()));
        }
        v
    }

    /// `(sequence id, its state pages)` of every running sequence holding a
    /// state, plus the states reserved for unforked children as id `u64::MAX`
    /// and finished sequences' states a fork copy still reads as
    /// `u64::MAX - 1` (tests and debugging).
    pub fn running_states(&self) -> Vec<(u64, Vec<BlockId>)> {
        let mut v = Vec::new();
        for &r in &self.running {
            let req = self.requests[r as usize].as_ref().expect("running");
            for s in req.seqs.iter().filter(|s| s.is_live()) {
                if let Some(st) = s.state {
                    v.push((s.seq_id, self.cache.state_pages(st).to_vec()));
                }
            }
            for &st in &req.spare_states {
                v.push((u64::MAX, self.cache.state_pages(st).to_vec()));
            }
        }
        for &st in self.deferred_states.iter().chain(&self.states_in_plan) {
            v.push((u64::MAX - 1, self.cache.state_pages(st).to_vec()));
        }
        v
    }

    /// The counters and gauges. O(1): every gauge is a counter kept where it
    /// changes (the engine and the bench read this every step); the oracle
    /// test beside this file recomputes them from scratch after every call.
    pub fn stats(&self) -> SchedulerStats {
        let kv = self.cache.kv().stats();
        let ck = self.cache.checkpoint_stats();
        // Every block reference is a live running sequence's table (finishing,
        // preempting and failed admissions free theirs), so the KV manager's
        // totals over all tables are those of the running sequences.
        let tail_waste = self.cache.kv().total_tail_waste();
        let shared_blocks = self.cache.kv().num_shared_blocks();
        let pps = self.cfg.state_pages;
        let num_pages = self.cache.num_pages();
        let free_pages = self.cache.kv().num_free_list();
        let cached_pages = self.cache.kv().num_cached_blocks();
        let state_pages = self.cache.num_live_state_pages();
        let checkpoint_pages = (ck.states + self.plan_ckpt_states) * pps;
        SchedulerStats {
            num_pages,
            free_pages,
            kv_pages: num_pages - free_pages - cached_pages - state_pages,
            running_state_pages: state_pages - checkpoint_pages,
            checkpoint_pages,
            cached_pages,
            // While a plan is out, its checkpoints are not evictable yet.
            available_pages: self.cache.available_pages(self.step + !self.plan_pending as u64),
            pages_per_state: pps,
            admission_limited_pages: self.admission_limited[AdmitLimit::Pages as usize],
            admission_limited_seqs: self.admission_limited[AdmitLimit::MaxNumSeqs as usize],
            admission_limited_budget: self.admission_limited[AdmitLimit::TokenBudget as usize],
            last_admission_limit: match self.last_admission_limit {
                None => "",
                Some(AdmitLimit::Pages) => "pages",
                Some(AdmitLimit::MaxNumSeqs) => "max_num_seqs",
                Some(AdmitLimit::TokenBudget) => "token_budget",
            },
            last_admission_running_seqs: self.last_limit_room.0,
            last_admission_available_pages: self.last_limit_room.1,
            alloc_failures: kv.alloc_failures,
            tail_waste,
            prefix_queries: kv.prefix_queries,
            prefix_query_tokens: kv.prefix_query_tokens,
            prefix_hits: kv.prefix_hits,
            prefix_hit_tokens: kv.prefix_hit_tokens,
            evictions: kv.evictions,
            cow_copies: kv.cow_copies,
            preemptions: self.preemptions,
            preemptions_blocks: self.preemptions - self.preemptions_priority,
            preemptions_priority: self.preemptions_priority,
            state_fork_copies: self.state_fork_copies,
            shared_blocks,
            num_running_requests: self.running.len() as u32,
            num_running_seqs: self.running_seqs,
            num_waiting_requests: self.waiting.len() as u32,
            waiting_tokens: self.waiting_tokens,
            steps: self.step,
            last_step_tokens: self.last_step_tokens,
            last_step_seqs: self.plan.len() as u32,
            finished_requests: self.finished_requests,
            aborted_requests: self.aborted_requests,
            reserved_pages: self.reserved_pages,
            checkpoints: ck.states,
            checkpoint_queries: ck.queries,
            checkpoint_hits: ck.hits,
            prefix_skipped_tokens: ck.skipped_tokens,
            prefix_lost_tokens: ck.lost_tokens,
            checkpoint_writes: ck.writes,
            checkpoint_writes_skipped: ck.writes_skipped,
            checkpoint_evictions: ck.evictions,
            checkpoint_drops: ck.drops,
            spec_draft_tokens: self.spec_draft_tokens,
            spec_accepted_tokens: self.spec_accepted_tokens,
            spec_accepted_by_position: self.spec_accepted_by_position.clone(),
        }
    }
}
