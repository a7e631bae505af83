//! Request lifecycle: accepting a request (or refusing it at once), finishing
//! sequences and requests (stop, length, abort, a caller's finish), forgetting
//! finished ones, and the read-only queries on requests.

use super::request::{ReqState, Request, Seq};
use super::{order_key, CacheManager, FinishReason, RequestParams, SchedError, ScheduledEvent, Scheduler};

impl Scheduler {
    /// Admits a request into the waiting queue or refuses it at once, changing
    /// nothing. Returns its handle (the `req_indices` value in plans). O(prompt).
    pub fn add_request(&mut self, id: &str, prompt: &[u32], params: RequestParams) -> Result<u32, SchedError> {
        let inv = |m: String| Err(SchedError::InvalidRequest(m));
        let c = &self.cfg;
        if let Some(&h) = self.ids.get(id) {
            let finished = self.requests[h as usize].as_ref().is_none_or(|r| r.state == ReqState::Finished);
            if !finished {
                return inv(format!("request id {id:?} is already in use by an unfinished request; use a unique id"));
            }
        }
        let p = prompt.len();
        if p == 0 {
            return inv("the prompt is empty; send at least one token".into());
        }
        if params.max_tokens == 0 {
            return inv("max_tokens must be at least 1".into());
        }
        if params.min_tokens > params.max_tokens {
            return inv(format!(
                "min_tokens ({}) exceeds max_tokens ({}); lower min_tokens",
                params.min_tokens, params.max_tokens
            ));
        }
        if params.n == 0 {
            return inv("n must be at least 1".into());
        }
        if p > c.max_model_len as usize {
            return inv(format!(
                "the prompt has {p} tokens, more than max_model_len ({}); shorten the prompt",
                c.max_model_len
            ));
        }
        let total = p as u64 + params.max_tokens as u64;
        if total > c.max_model_len as u64 {
            return inv(format!(
                "prompt ({p} tokens) + max_tokens ({}) = {total} exceeds max_model_len ({}); lower max_tokens to at most {}",
                params.max_tokens,
                c.max_model_len,
                c.max_model_len as usize - p
            ));
        }
        if params.n > c.max_num_seqs {
            return inv(format!(
                "n = {} parallel samples exceeds max_num_seqs ({}); lower n",
                params.n, c.max_num_seqs
            ));
        }
        let bs = c.block_size as u64;
        let worst = params.n as u64 * (total.div_ceil(bs) + c.state_pages as u64);
        if worst > c.num_pages as u64 {
            return inv(format!(
                "prompt + max_tokens = {total} tokens x n = {} needs up to {worst} arena pages \
                 ({} KV blocks + {} DeltaNet state pages per sequence) but the whole arena has {}; \
                 lower max_tokens, n or the prompt length",
                params.n,
                total.div_ceil(bs),
                c.state_pages,
                c.num_pages
            ));
        }
        if c.reserve_max_context {
            let need = params.n as u64 * c.max_pages_per_seq() as u64;
            if need > c.num_pages as u64 {
                return inv(format!(
                    "reserve_max_context needs {need} pages for n = {} sequences of max_model_len but the arena has {}; \
                     lower n or max_model_len",
                    params.n, c.num_pages
                ));
            }
        }
        if self.waiting.len() as u64 >= c.max_waiting_requests as u64 {
            return Err(SchedError::QueueFull(format!(
                "the waiting queue holds {} requests (max_waiting_requests); retry later",
                self.waiting.len()
            )));
        }
        if self.waiting_tokens + p as u64 > c.max_waiting_tokens {
            return Err(SchedError::QueueFull(format!(
                "the waiting queue holds {} tokens to prefill and this prompt adds {p} (max_waiting_tokens = {}); retry later",
                self.waiting_tokens, c.max_waiting_tokens
            )));
        }
        // Accepted: from here on nothing fails.
        if let Some(&h) = self.ids.get(id) {
            self.forget(h);
        }
        let class_id = match self.class_ids.get(params.request_class.as_str()) {
            Some(&c) => c,
            // Past the cap ("default" and "other" themselves not counted): "other".
            None if self.class_ids.keys().filter(|k| *k != "default" && *k != super::config::OTHER_REQUEST_CLASS).count()
                >= self.cfg.max_request_classes as usize =>
            {
                match self.class_ids.get(super::config::OTHER_REQUEST_CLASS) {
                    Some(&c) => c,
                    None => {
                        let c = self.classes.len() as u32;
                        self.classes.push(super::config::OTHER_REQUEST_CLASS.to_string());
                        self.class_ids.insert(super::config::OTHER_REQUEST_CLASS.to_string(), c);
                        c
                    }
                }
            }
            None => {
                let c = self.classes.len() as u32;
                self.classes.push(params.request_class.clone());
                self.class_ids.insert(params.request_class.clone(), c);
                c
            }
        };
        let arrival_seq = self.next_arrival;
        self.next_arrival += 1;
        let key = order_key(params.priority, self.step, arrival_seq, self.cfg.aging_interval_steps);
        let seq = Seq::new(self.next_seq_id, 0, prompt.to_vec());
        self.next_seq_id += 1;
        let req = Request {
            id: id.to_string(),
            prompt_len: p,
            params,
            class_id,
            arrival_seq,
            key,
            state: ReqState::Waiting,
            seqs: vec![seq],
            forked: false,
            spare_states: Vec::new(),
            first_scheduled: false,
            num_preemptions: 0,
            refork: false,
        };
        let h = match self.free_handles.pop() {
            Some(h) => {
                self.requests[h as usize] = Some(Box::new(req));
                h
            }
            None => {
                self.requests.push(Some(Box::new(req)));
                (self.requests.len() - 1) as u32
            }
        };
        self.ids.insert(id.to_string(), h);
        self.waiting.insert(key, h);
        self.waiting_tokens += p as u64;
        Ok(h)
    }

    /// Marks one sequence finished and frees what it holds. An unforked request
    /// is one sequence standing for all n samples: its spare states go too.
    pub(super) fn finish_seq(&mut self, req: &mut Request, si: usize, reason: FinishReason) {
        let s = &mut req.seqs[si];
        debug_assert!(s.is_live(), "finishing a finished sequence");
        if req.state == ReqState::Running && s.is_live() {
            self.running_seqs -= 1;
        }
        s.finished = Some(reason);
        if let Some(st) = s.state {
            if self.pending_state_copies.iter().any(|pc| pc.src == st) {
                s.state = None;
                self.deferred_states.push(st);
            }
        }
        release_seq(&mut self.cache, &mut self.free_rows, s);
        if !req.forked {
            for st in req.spare_states.drain(..) {
                self.cache.free_state(st);
            }
        }
    }

    pub(super) fn close_request(&mut self, req: &mut Request, r: u32, aborted: bool) {
        req.state = ReqState::Finished;
        if let Some(res) = self.req_reserved.remove(&r) {
            self.reserved_pages -= res;
        }
        if aborted {
            self.aborted_requests += 1;
        } else {
            self.finished_requests += 1;
        }
        self.finished_fifo.push_back((r, req.arrival_seq));
    }

    pub(super) fn forget_old_finished(&mut self) {
        while self.finished_fifo.len() > self.cfg.max_finished_retained as usize {
            let (h, aseq) = self.finished_fifo.pop_front().expect("non-empty");
            let same = self.requests[h as usize]
                .as_ref()
                .is_some_and(|r| r.arrival_seq == aseq && r.state == ReqState::Finished);
            if same {
                self.forget(h);
            }
        }
    }

    pub(super) fn forget(&mut self, h: u32) {
        if let Some(r) = self.requests[h as usize].take() {
            if self.ids.get(&r.id) == Some(&h) {
                self.ids.remove(&r.id);
            }
            self.free_handles.push(h);
        }
    }

    /// Finishes sequences outside `update()`: all of a request (`sample = None`,
    /// abort) or one sample. They are reported in the next plan's `finished`.
    pub(super) fn finish_outside(&mut self, h: u32, sample: Option<u32>, reason: FinishReason) -> Result<bool, SchedError> {
        let mut req = self.requests[h as usize].take().expect("known handle");
        if req.state == ReqState::Finished {
            self.requests[h as usize] = Some(req);
            return Ok(false);
        }
        let targets: Vec<usize> = if !req.forked {
            if let Some(s) = sample {
                if s >= req.params.n {
                    let n = req.params.n;
                    self.requests[h as usize] = Some(req);
                    return Err(SchedError::InvalidArgument(format!("sample_index {s} out of range for n = {n}")));
                }
            }
            vec![0]
        } else {
            match sample {
                None => (0..req.seqs.len()).filter(|&i| req.seqs[i].is_live()).collect(),
                Some(s) => match req.seqs.iter().position(|q| q.sample_index == s) {
                    Some(i) if req.seqs[i].is_live() => vec![i],
                    Some(_) => {
                        self.requests[h as usize] = Some(req);
                        return Ok(false);
                    }
                    None => {
                        let n = req.params.n;
                        self.requests[h as usize] = Some(req);
                        return Err(SchedError::InvalidArgument(format!("sample_index {s} out of range for n = {n}")));
                    }
                },
            }
        };
        let was_waiting = req.state == ReqState::Waiting;
        if was_waiting {
            self.waiting_tokens -= req.pending_tokens();
        }
        for &i in &targets {
            self.finish_seq(&mut req, i, reason);
            if req.forked {
                self.finished_outside.push((req.id.clone(), req.seqs[i].sample_index, reason));
            } else {
                for s in 0..req.params.n {
                    self.finished_outside.push((req.id.clone(), s, reason));
                }
            }
        }
        if req.all_finished() {
            if was_waiting {
                self.waiting.remove(&req.key);
            } else {
                self.running.retain(|&x| x != h);
            }
            self.close_request(&mut req, h, reason == FinishReason::Abort);
        } else if was_waiting {
            self.waiting_tokens += req.pending_tokens();
        }
        self.requests[h as usize] = Some(req);
        self.settle_deferred_states();
        Ok(true)
    }

    /// Aborts a request in any state, returning every page it holds. Returns
    /// false if it had already finished; Err for an unknown id. O(running).
    pub fn abort(&mut self, id: &str) -> Result<bool, SchedError> {
        let h = self.handle(id)?;
        self.finish_outside(h, None, FinishReason::Abort)
    }

    /// Finishes one sample (a stop string found by the caller). Returns false if
    /// it had already finished.
    pub fn finish(&mut self, id: &str, sample_index: u32, reason: FinishReason) -> Result<bool, SchedError> {
        let h = self.handle(id)?;
        self.finish_outside(h, Some(sample_index), reason)
    }

    pub(super) fn handle(&self, id: &str) -> Result<u32, SchedError> {
        self.ids.get(id).copied().ok_or_else(|| {
            SchedError::UnknownRequest(format!("unknown request id {id:?} (never added, or finished and forgotten)"))
        })
    }

    /// Generated tokens of one sample (empty before its first token).
    pub fn output_tokens(&self, id: &str, sample_index: u32) -> Result<&[u32], SchedError> {
        let h = self.handle(id)?;
        let req = self.requests[h as usize].as_ref().expect("known handle");
        if sample_index >= req.params.n {
            return Err(SchedError::InvalidArgument(format!(
                "sample_index {sample_index} out of range for n = {}",
                req.params.n
            )));
        }
        let seq = req.seqs.iter().find(|s| s.sample_index == sample_index).unwrap_or(&req.seqs[0]);
        Ok(&seq.tokens[req.prompt_len..])
    }

    /// The request id behind a plan/update handle.
    pub fn request_id(&self, handle: u32) -> Option<&str> {
        self.requests.get(handle as usize)?.as_ref().map(|r| r.id.as_str())
    }

    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Waiting requests' handles in admission order (tests, debugging).
    pub fn waiting_order(&self) -> Vec<u32> {
        self.waiting.iter().collect()
    }

    /// Drains the first-scheduled events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<ScheduledEvent> {
        std::mem::take(&mut self.events)
    }
}

/// Frees a sequence's blocks (tail first), state pages and buffer row.
pub(super) fn release_seq(cache: &mut CacheManager, free_rows: &mut Vec<u32>, s: &mut Seq) {
    cache.free_table(&mut s.table);
    if let Some(st) = s.state.take() {
        cache.free_state(st);
    }
    if let Some(row) = s.row.take() {
        free_rows.push(row);
    }
    s.bt_synced = 0;
    s.st_synced = false;
}
