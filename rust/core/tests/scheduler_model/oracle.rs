//! The oracle's own record of every request (its true token streams) and the
//! harness that drives the scheduler beside it: admission and stop rules and the
//! priority key, re-implemented here from the module docs of `main.rs`.

use super::St;
use hybridserve_core::scheduler::{FinishReason, RequestParams, SchedError, Scheduler, SchedulerConfig};
use std::collections::{HashMap, HashSet};

pub(crate) struct OReq {
    pub(crate) id: String,
    pub(crate) prompt: Vec<u32>,
    pub(crate) params: RequestParams,
    pub(crate) handle: u32,
    pub(crate) st: St,
    pub(crate) forked: bool,
    pub(crate) out: Vec<Vec<u32>>,
    pub(crate) done: Vec<bool>,
    pub(crate) computed: Vec<usize>,
    /// Speculative decoding: the drafts the last update gave each sample.
    pub(crate) drafts: Vec<Vec<u32>>,
    pub(crate) first_step: Option<u64>,
    pub(crate) order: usize,
    pub(crate) arrival_step: u64,
}

impl OReq {
    pub(crate) fn tokens(&self, s: usize) -> Vec<u32> {
        let mut t = self.prompt.clone();
        t.extend_from_slice(&self.out[s]);
        t
    }
    pub(crate) fn live(&self) -> Vec<usize> {
        if self.forked { (0..self.out.len()).filter(|&i| !self.done[i]).collect() } else if self.done[0] { vec![] } else { vec![0] }
    }
}

pub(crate) const EOS: u32 = 7;
pub(crate) const STOP: u32 = 5;
pub(crate) const SHARED: [u32; 24] = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34];

pub(crate) struct Harness {
    pub(crate) s: Scheduler,
    pub(crate) cfg: SchedulerConfig,
    pub(crate) reqs: Vec<OReq>,
    pub(crate) by_handle: HashMap<u32, usize>,
    pub(crate) kv_mem: HashMap<i32, Vec<u32>>,
    pub(crate) state_mem: HashMap<i32, Vec<u32>>,
    pub(crate) rows: Vec<Vec<i32>>,
    pub(crate) st_rows: Vec<Vec<i32>>,
    pub(crate) outside: HashSet<(String, u32, FinishReason)>,
    pub(crate) rng: u64,
    pub(crate) step: u64,
    pub(crate) beam_reorders: u64,
    pub(crate) evictions_checked: u64,
    /// Speculative decoding, counted here: drafts scheduled, drafts accepted,
    /// acceptances per draft position.
    pub(crate) spec_drafts: u64,
    pub(crate) spec_accepted: u64,
    pub(crate) spec_by_pos: Vec<u64>,
}

impl Harness {
    pub(crate) fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    pub(crate) fn stop_rule(p: &RequestParams, n_out: usize, t: u32) -> Option<FinishReason> {
        let stop_tok = (!p.ignore_eos && p.eos_token_ids.contains(&t)) || p.stop_token_ids.contains(&t);
        if n_out >= p.min_tokens as usize && stop_tok {
            Some(FinishReason::Stop)
        } else if n_out >= p.max_tokens as usize {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    pub(crate) fn add(&mut self, id: String, prompt: Vec<u32>, params: RequestParams) {
        let c = &self.cfg;
        let total = prompt.len() as u64 + params.max_tokens as u64;
        let dup = self.reqs.iter().any(|r| r.id == id && r.st != St::Done);
        let invalid = dup
            || total > c.max_model_len as u64
            || params.n > c.max_num_seqs
            || params.n as u64 * (total.div_ceil(c.block_size as u64) + c.state_pages as u64) > c.num_pages as u64
            || params.min_tokens > params.max_tokens
            || (c.reserve_max_context
                && params.n as u64 * ((c.max_model_len as u64).div_ceil(c.block_size as u64) + c.state_pages as u64)
                    > c.num_pages as u64);
        let waiting: Vec<&OReq> = self.reqs.iter().filter(|r| r.st == St::Waiting).collect();
        let wtok: u64 = waiting.iter().map(|r| r.live().iter().map(|&i| r.tokens(i).len() as u64).sum::<u64>()).sum();
        let full = waiting.len() as u64 >= c.max_waiting_requests as u64 || wtok + prompt.len() as u64 > c.max_waiting_tokens;
        let res = self.s.add_request(&id, &prompt, params.clone());
        match res {
            Ok(h) => {
                assert!(!invalid && !full, "accepted a request the rules refuse: {id}");
                let n = params.n as usize;
                self.by_handle.insert(h, self.reqs.len());
                let order = self.reqs.len();
                self.reqs.push(OReq {
                    id,
                    prompt,
                    params,
                    handle: h,
                    st: St::Waiting,
                    forked: false,
                    out: vec![vec![]; n],
                    done: vec![false; n],
                    computed: vec![0; n],
                    drafts: vec![vec![]; n],
                    first_step: None,
                    order,
                    arrival_step: self.step,
                });
            }
            Err(SchedError::InvalidRequest(_)) => assert!(invalid, "refused a valid request {id}: {res:?}"),
            Err(SchedError::QueueFull(_)) => assert!(!invalid && full, "QueueFull wrongly: {res:?}"),
            Err(e) => panic!("unexpected {e:?}"),
        }
    }

    pub(crate) fn finish_outside(&mut self, i: usize, sample: Option<u32>, reason: FinishReason) {
        // Ids are per live request: a re-added id names the newest request.
        let id = self.reqs[i].id.clone();
        let i = self.reqs.iter().rposition(|r| r.id == id).unwrap();
        let r = &mut self.reqs[i];
        let res = match sample {
            None => self.s.abort(&r.id),
            Some(sm) => self.s.finish(&r.id, sm, reason),
        };
        if r.st == St::Done {
            assert_eq!(res, Ok(false));
            return;
        }
        let targets: Vec<usize> = if !r.forked {
            (0..r.out.len()).collect()
        } else {
            match sample {
                None => r.live(),
                Some(sm) => {
                    if r.done[sm as usize] {
                        assert_eq!(res, Ok(false));
                        return;
                    }
                    vec![sm as usize]
                }
            }
        };
        assert_eq!(res, Ok(true));
        for t in targets {
            r.done[t] = true;
            self.outside.insert((r.id.clone(), t as u32, reason));
        }
        if r.done.iter().all(|&d| d) {
            r.st = St::Done;
        }
    }

    /// The ordering key of the module docs, computed here independently.
    pub(crate) fn key(&self, i: usize) -> (i128, usize) {
        let r = &self.reqs[i];
        let a = self.cfg.aging_interval_steps as i128;
        let p = r.params.priority as i128;
        (if a == 0 { p } else { p * a + r.arrival_step as i128 }, r.order)
    }

    pub(crate) fn outranks(&self, h: usize, v: usize) -> bool {
        let (ph, pv) = (self.reqs[h].params.priority, self.reqs[v].params.priority);
        let a = self.cfg.aging_interval_steps.max(1) as i128;
        ph < pv && self.key(v).0 - self.key(h).0 > self.cfg.priority_preemption_threshold as i128 * a
    }

    pub(crate) fn units(&self, i: usize) -> u32 {
        let r = &self.reqs[i];
        if r.forked { r.live().len() as u32 } else { r.params.n }
    }

    pub(crate) fn waiting_head(&self) -> Option<usize> {
        (0..self.reqs.len()).filter(|&i| self.reqs[i].st == St::Waiting).min_by_key(|&i| self.key(i))
    }
}
