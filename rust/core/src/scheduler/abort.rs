//! Rolling back a step whose forward, sampling or output processing failed.
//!
//! The plan of a failed step is never `update()`d. Its requests cannot resume
//! from where the plan left them: the forward may have run part of the way,
//! and DeltaNet state is updated in place, so their state pages (and the KV
//! slots the plan wrote) hold a half-applied step. `abort_step` therefore
//! gives back everything the plan's requests hold and puts them back in the
//! waiting queue with their committed tokens (those `update()` accepted), as
//! a preemption by recompute does. They are re-prefilled on readmission; no
//! token is lost or duplicated. Requests outside the plan, the prefix cache's
//! registered blocks and the live checkpoints are untouched (a plan only
//! writes pages of its own sequences and the checkpoint pages it allocated,
//! which are freed here).

use super::request::ReqState;
use super::{PreemptCause, SchedError, Scheduler};
use crate::BlockId;
use std::collections::HashSet;

impl Scheduler {
    /// Rolls back the pending plan (see the module docs). Returns the handles
    /// of the requests sent back to the waiting queue. Errors if no plan is
    /// pending. O(plan entries + running sequences).
    pub fn abort_step(&mut self) -> Result<Vec<u32>, SchedError> {
        if !self.plan_pending {
            return Err(SchedError::InvalidArgument(
                "abort_step() called without a pending plan (schedule() first; update() already consumed it)".into(),
            ));
        }
        self.plan_pending = false;
        // Pages the plan read or wrote that no sequence owns: checkpoint states
        // it was to write, and finished states its fork copies read.
        for e in &self.plan {
            if let Some((_, st)) = e.ckpt {
                self.cache.free_state(st);
            }
        }
        for st in self.states_in_plan.drain(..) {
            self.cache.free_state(st);
        }
        self.plan_ckpt_states = 0;

        // The requests whose pages the plan wrote: its entries, and the children
        // of the fork copies it carried (a copy may have run half-way).
        let mut victims: Vec<u32> = Vec::new();
        let mut seen: HashSet<u32> = HashSet::new();
        for e in &self.plan {
            if seen.insert(e.req) {
                victims.push(e.req);
            }
        }
        if !self.out.state_copies.is_empty() {
            let dst: HashSet<BlockId> = self.out.state_copies.chunks(2).map(|p| p[1] as BlockId).collect();
            for &r in &self.running {
                let q = self.requests[r as usize].as_ref().expect("running handle");
                let hit = q.seqs.iter().any(|s| {
                    s.state.is_some_and(|st| self.cache.state_pages(st).iter().any(|p| dst.contains(p)))
                });
                if hit && seen.insert(r) {
                    victims.push(r);
                }
            }
        }
        let mut sent_back = Vec::with_capacity(victims.len());
        for r in victims {
            let Some(mut req) = self.requests[r as usize].take() else { continue };
            if req.state == ReqState::Running {
                self.preempt(&mut req, r, PreemptCause::BlocksNeeded);
                // A rollback is not a preemption: the counters and the plan's
                // preempted list (already read by the caller) stay as they were.
                self.preemptions -= 1;
                req.num_preemptions -= 1;
                self.out.preempted.pop();
                self.out.preempted_causes.pop();
                sent_back.push(r);
            }
            self.requests[r as usize] = Some(req);
        }
        let reqs = &self.requests;
        self.running
            .retain(|&r| reqs[r as usize].as_ref().is_some_and(|q| q.state == ReqState::Running));
        self.plan.clear();
        self.plan_samples = 0;
        self.settle_deferred_states();
        self.cache.reconcile(self.step + 1);
        Ok(sent_back)
    }
}
