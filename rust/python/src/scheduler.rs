//! `Scheduler`, `SchedulerOutput`, `StepUpdate`: the continuous-batching scheduler.
//!
//! One Python call per core call: `schedule()` and `update()` run with the GIL
//! released, then copy the core's reused buffers into fresh numpy int32 arrays
//! (O(scheduled sequences + tokens + new blocks), nothing proportional to context
//! length). Request ids cross as Python strings cached per request handle, so a
//! step creates no string objects.
//!
//! Clock: the scheduler measures queue delay on its own monotonic clock (seconds
//! since the Scheduler was created); `arrival_time=None` means "now" on that clock.

use hybridserve_core::scheduler::{FinishReason, RequestParams, SchedError, Scheduler, SchedulerConfig};
use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use std::time::Instant;

use crate::errors::CoreResultExt;

pyo3::import_exception!(hybridserve.errors, InvalidRequest);
pyo3::import_exception!(hybridserve.errors, QueueFull);
pyo3::import_exception!(hybridserve.errors, UnknownRequest);

fn sched_err(e: SchedError) -> PyErr {
    match e {
        SchedError::InvalidRequest(m) => InvalidRequest::new_err(m),
        SchedError::QueueFull(m) => QueueFull::new_err(m),
        SchedError::UnknownRequest(m) => UnknownRequest::new_err(m),
        SchedError::InvalidArgument(m) => PyValueError::new_err(m),
    }
}

fn reason_from(s: &str) -> PyResult<FinishReason> {
    match s {
        "stop" => Ok(FinishReason::Stop),
        "length" => Ok(FinishReason::Length),
        "abort" => Ok(FinishReason::Abort),
        other => Err(PyValueError::new_err(format!(
            "finish reason must be 'stop', 'length' or 'abort', got {other:?}"
        ))),
    }
}

/// Token ids from a 1-D integer numpy array or a sequence of ints.
fn token_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    let bad = || PyValueError::new_err(format!("{what} must be integers in [0, 2^32)"));
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, u32>>() {
        return Ok(a.as_array().to_vec());
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return a.as_array().iter().map(|&t| u32::try_from(t).map_err(|_| bad())).collect();
    }
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_array().iter().map(|&t| u32::try_from(t).map_err(|_| bad())).collect();
    }
    let v: Vec<i64> = obj
        .extract()
        .map_err(|_| PyValueError::new_err(format!("{what} must be a sequence of ints or a 1-D integer array")))?;
    v.into_iter().map(|t| u32::try_from(t).map_err(|_| bad())).collect()
}

fn arr<'py>(py: Python<'py>, v: &[i32]) -> Py<PyArray1<i32>> {
    v.to_vec().into_pyarray(py).unbind()
}

fn pairs<'py>(py: Python<'py>, flat: &[i32]) -> Py<PyArray2<i32>> {
    Array2::from_shape_vec((flat.len() / 2, 2), flat.to_vec())
        .expect("pairs are flattened (src, dst)")
        .into_pyarray(py)
        .unbind()
}

/// The plan of one step (see the core's `SchedulerOutput` for the contract).
#[pyclass(name = "SchedulerOutput", module = "hybridserve._core", frozen)]
pub struct PySchedulerOutput {
    #[pyo3(get)]
    request_ids: Py<PyList>,
    #[pyo3(get)]
    sample_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    num_scheduled_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    num_computed_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    input_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i32>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i32>>,
    /// `-1`, or after how many of this step's tokens the entry's DeltaNet state
    /// is written into its checkpoint pages.
    #[pyo3(get)]
    checkpoint_positions: Py<PyArray1<i32>>,
    /// `state_pages` page ids per entry with a checkpoint position, entry order.
    #[pyo3(get)]
    checkpoint_pages: Py<PyArray1<i32>>,
    #[pyo3(get)]
    num_samples: Py<PyArray1<i32>>,
    /// Draft tokens among the entry's scheduled tokens (speculative decoding).
    #[pyo3(get)]
    num_draft_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_table_rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_table_update_rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_table_update_cols: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_table_update_values: Py<PyArray1<i32>>,
    /// Cells of the persistent `[max_num_seqs, state_pages]` state page table.
    #[pyo3(get)]
    state_table_update_rows: Py<PyArray1<i32>>,
    #[pyo3(get)]
    state_table_update_cols: Py<PyArray1<i32>>,
    #[pyo3(get)]
    state_table_update_values: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_copies: Py<PyArray2<i32>>,
    #[pyo3(get)]
    state_copies: Py<PyArray2<i32>>,
    #[pyo3(get)]
    preempted: Py<PyList>,
    /// Why, per `preempted` entry: "blocks_needed" or "priority".
    #[pyo3(get)]
    preempted_causes: Py<PyList>,
    /// `(request_id, sample_index, reason)` finished outside update() (abort, finish).
    #[pyo3(get)]
    finished: Py<PyList>,
    #[pyo3(get)]
    num_decodes: usize,
}

#[pymethods]
impl PySchedulerOutput {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.request_ids.bind(py).len()
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SchedulerOutput(seqs={}, tokens={}, decodes={})",
            self.request_ids.bind(py).len(),
            self.input_ids.bind(py).len().unwrap_or(0),
            self.num_decodes
        )
    }
}

/// What `update()` did: one row per new token, and the sequences that finished.
#[pyclass(name = "StepUpdate", module = "hybridserve._core", frozen)]
pub struct PyStepUpdate {
    #[pyo3(get)]
    request_ids: Py<PyList>,
    #[pyo3(get)]
    sample_indices: Py<PyArray1<i32>>,
    #[pyo3(get)]
    token_ids: Py<PyArray1<i32>>,
    #[pyo3(get)]
    finished_request_ids: Py<PyList>,
    #[pyo3(get)]
    finished_sample_indices: Py<PyArray1<i32>>,
    /// "stop" or "length" (an abort never finishes inside update()).
    #[pyo3(get)]
    finished_reasons: Py<PyList>,
}

#[pyclass(name = "Scheduler", module = "hybridserve._core")]
pub struct PyScheduler {
    inner: Scheduler,
    clock: Instant,
    /// Python string of each request handle's id, so plans create no strings.
    id_strings: Vec<Option<Py<PyString>>>,
}

impl PyScheduler {
    fn clock_now(&self) -> f64 {
        self.clock.elapsed().as_secs_f64()
    }

}

/// The cached Python string of a request handle (every admitted handle has one).
fn id_of(ids: &[Option<Py<PyString>>], py: Python<'_>, handle: u32) -> Py<PyString> {
    match ids.get(handle as usize).and_then(|s| s.as_ref()) {
        Some(s) => s.clone_ref(py),
        None => PyString::new(py, "").unbind(),
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        num_pages, block_size, state_pages, max_num_seqs, max_num_batched_tokens, max_model_len,
        *, enable_prefix_caching = true, long_prefill_token_threshold = 0,
        max_waiting_requests = None, max_waiting_tokens = None, aging_interval_steps = 256,
        reserve_max_context = false, max_finished_retained = 4096,
        prefix_checkpoint_interval = 0, priority_preemption_threshold = 1, max_priority_preemptions_per_step = 4,
        max_request_classes = 16, num_speculative_tokens = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_pages: u32,
        block_size: u32,
        state_pages: u32,
        max_num_seqs: u32,
        max_num_batched_tokens: u32,
        max_model_len: u32,
        enable_prefix_caching: bool,
        long_prefill_token_threshold: u32,
        max_waiting_requests: Option<u32>,
        max_waiting_tokens: Option<u64>,
        aging_interval_steps: u32,
        reserve_max_context: bool,
        max_finished_retained: u32,
        prefix_checkpoint_interval: u32,
        priority_preemption_threshold: u32,
        max_priority_preemptions_per_step: u32,
        max_request_classes: u32,
        num_speculative_tokens: u32,
    ) -> PyResult<Self> {
        let mut cfg = SchedulerConfig::new(
            num_pages,
            block_size,
            state_pages,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
        );
        cfg.enable_prefix_caching = enable_prefix_caching;
        cfg.long_prefill_token_threshold = long_prefill_token_threshold;
        cfg.max_waiting_requests = max_waiting_requests.unwrap_or(u32::MAX);
        cfg.max_waiting_tokens = max_waiting_tokens.unwrap_or(u64::MAX);
        cfg.aging_interval_steps = aging_interval_steps;
        cfg.reserve_max_context = reserve_max_context;
        cfg.max_finished_retained = max_finished_retained;
        cfg.prefix_checkpoint_interval = prefix_checkpoint_interval;
        cfg.priority_preemption_threshold = priority_preemption_threshold;
        cfg.max_priority_preemptions_per_step = max_priority_preemptions_per_step;
        cfg.max_request_classes = max_request_classes;
        cfg.num_speculative_tokens = num_speculative_tokens;
        let inner = Scheduler::new(cfg).py()?;
        Ok(PyScheduler { inner, clock: Instant::now(), id_strings: Vec::new() })
    }

    /// Columns of the persistent block-table buffer: ceil(max_model_len / block_size).
    #[getter]
    fn max_blocks_per_seq(&self) -> u32 {
        self.inner.max_blocks_per_seq()
    }

    /// Columns of the persistent state page table buffer: pages per DeltaNet state.
    #[getter]
    fn state_pages(&self) -> u32 {
        self.inner.config().state_pages
    }

    /// Draft tokens per decoding sequence and step (0: speculative decoding off).
    #[getter]
    fn num_speculative_tokens(&self) -> u32 {
        self.inner.config().num_speculative_tokens
    }

    /// Pages of the arena the scheduler hands out (ids 0..num_pages).
    #[getter]
    fn num_pages(&self) -> u32 {
        self.inner.config().num_pages
    }

    /// Seconds on the scheduler's clock (what arrival_time and events use).
    fn now(&self) -> f64 {
        self.clock_now()
    }

    /// Queue a request, or raise InvalidRequest / QueueFull at once (nothing changes).
    #[pyo3(signature = (
        request_id, prompt_token_ids, *, max_tokens = 16, min_tokens = 0, stop_token_ids = None,
        ignore_eos = false, eos_token_ids = None, n = 1, priority = 0, request_class = "default",
        arrival_time = None, extra_key = 0, beam_search = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: &Bound<'_, PyString>,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: i64,
        min_tokens: i64,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
        ignore_eos: bool,
        eos_token_ids: Option<&Bound<'_, PyAny>>,
        n: i64,
        priority: i32,
        request_class: &str,
        arrival_time: Option<f64>,
        extra_key: u64,
        beam_search: bool,
    ) -> PyResult<()> {
        let prompt = token_ids(prompt_token_ids, "prompt_token_ids")?;
        let stop = match stop_token_ids {
            Some(o) => token_ids(o, "stop_token_ids")?,
            None => Vec::new(),
        };
        let eos = match eos_token_ids {
            Some(o) => token_ids(o, "eos_token_ids")?,
            None => Vec::new(),
        };
        let positive = |v: i64, what: &str| {
            u32::try_from(v).map_err(|_| InvalidRequest::new_err(format!("{what} must be in [0, 2^32), got {v}")))
        };
        let params = RequestParams {
            max_tokens: positive(max_tokens, "max_tokens")?,
            min_tokens: positive(min_tokens, "min_tokens")?,
            stop_token_ids: stop,
            eos_token_ids: eos,
            ignore_eos,
            n: positive(n, "n")?,
            priority,
            request_class: request_class.to_string(),
            arrival_time: arrival_time.unwrap_or_else(|| self.clock_now()),
            extra_key,
            beam_search,
        };
        let id = request_id.to_str()?;
        let inner = &mut self.inner;
        let handle = py.detach(|| inner.add_request(id, &prompt, params)).map_err(sched_err)?;
        let h = handle as usize;
        if self.id_strings.len() <= h {
            self.id_strings.resize_with(h + 1, || None);
        }
        self.id_strings[h] = Some(request_id.clone().unbind());
        Ok(())
    }

    /// Plan one step (GIL released while planning).
    fn schedule(&mut self, py: Python<'_>) -> PyResult<PySchedulerOutput> {
        let now = self.clock_now();
        let inner = &mut self.inner;
        let ids = &self.id_strings;
        let out = py.detach(move || inner.schedule(now)).map_err(sched_err)?;
        let request_ids = PyList::new(py, out.req_indices.iter().map(|&h| id_of(ids, py, h)))?.unbind();
        let preempted = PyList::new(py, out.preempted.iter().map(|&h| id_of(ids, py, h)))?.unbind();
        let preempted_causes = PyList::new(py, out.preempted_causes.iter().map(|c| c.as_str()))?.unbind();
        let finished = PyList::new(
            py,
            out.finished.iter().map(|(id, si, r)| (id.as_str(), *si, r.as_str())),
        )?
        .unbind();
        Ok(PySchedulerOutput {
            request_ids,
            sample_indices: arr(py, &out.sample_indices),
            seq_ids: out.seq_ids.clone().into_pyarray(py).unbind(),
            num_scheduled_tokens: arr(py, &out.num_scheduled_tokens),
            query_start_loc: arr(py, &out.query_start_loc),
            num_computed_tokens: arr(py, &out.num_computed_tokens),
            seq_lens: arr(py, &out.seq_lens),
            input_ids: arr(py, &out.input_ids),
            positions: arr(py, &out.positions),
            slot_mapping: arr(py, &out.slot_mapping),
            checkpoint_positions: arr(py, &out.checkpoint_positions),
            checkpoint_pages: arr(py, &out.checkpoint_pages),
            num_samples: arr(py, &out.num_samples),
            num_draft_tokens: arr(py, &out.num_draft_tokens),
            block_table_rows: arr(py, &out.block_table_rows),
            block_table_update_rows: arr(py, &out.bt_update_rows),
            block_table_update_cols: arr(py, &out.bt_update_cols),
            block_table_update_values: arr(py, &out.bt_update_values),
            state_table_update_rows: arr(py, &out.st_update_rows),
            state_table_update_cols: arr(py, &out.st_update_cols),
            state_table_update_values: arr(py, &out.st_update_values),
            block_copies: pairs(py, &out.block_copies),
            state_copies: pairs(py, &out.state_copies),
            preempted,
            preempted_causes,
            finished,
            num_decodes: out.num_decodes,
        })
    }

    /// Apply the sampled tokens (num_samples[b] per entry, batch order; GIL released).
    /// Speculative decoding: `accepted` (one count per entry) says how many tokens
    /// each entry contributes instead, and `drafts` (one list per entry, None = [])
    /// the drafts of each entry's sequence for its next step (see the core's
    /// `update_spec`). A ValueError changes nothing.
    #[pyo3(signature = (sampled, accepted = None, drafts = None))]
    fn update(
        &mut self,
        py: Python<'_>,
        sampled: &Bound<'_, PyAny>,
        accepted: Option<&Bound<'_, PyAny>>,
        drafts: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyStepUpdate> {
        let tokens: Vec<i32> = if let Ok(a) = sampled.extract::<PyReadonlyArray1<'_, i32>>() {
            a.as_array().to_vec()
        } else {
            token_ids(sampled, "sampled tokens")?.into_iter().map(|t| t as i32).collect()
        };
        let accepted: Option<Vec<i32>> = match accepted {
            None => None,
            Some(o) => Some(if let Ok(a) = o.extract::<PyReadonlyArray1<'_, i32>>() {
                a.as_array().to_vec()
            } else {
                let v: Vec<i64> = o.extract().map_err(|_| {
                    PyValueError::new_err("accepted must be a sequence of ints or a 1-D integer array (one count per entry)")
                })?;
                v.into_iter().map(|x| i32::try_from(x).unwrap_or(-1)).collect()
            }),
        };
        let drafts: Option<Vec<Vec<u32>>> = match drafts {
            None => None,
            Some(o) => {
                let items: Vec<Bound<'_, PyAny>> = o.extract().map_err(|_| {
                    PyValueError::new_err("drafts must be a list with one list of draft token ids per entry")
                })?;
                let mut v = Vec::with_capacity(items.len());
                for it in &items {
                    v.push(if it.is_none() { Vec::new() } else { token_ids(it, "draft tokens")? });
                }
                Some(v)
            }
        };
        let inner = &mut self.inner;
        let ids = &self.id_strings;
        let upd = py
            .detach(move || inner.update_spec(&tokens, accepted.as_deref(), drafts.as_deref()))
            .map_err(sched_err)?;
        let request_ids = PyList::new(py, upd.req_indices.iter().map(|&h| id_of(ids, py, h)))?.unbind();
        let finished_request_ids = PyList::new(py, upd.finished.iter().map(|&(h, _, _)| id_of(ids, py, h)))?.unbind();
        let finished_sample_indices: Vec<i32> = upd.finished.iter().map(|&(_, s, _)| s as i32).collect();
        let finished_reasons = PyList::new(py, upd.finished.iter().map(|&(_, _, r)| r.as_str()))?.unbind();
        Ok(PyStepUpdate {
            request_ids,
            sample_indices: arr(py, &upd.sample_indices),
            token_ids: arr(py, &upd.tokens),
            finished_request_ids,
            finished_sample_indices: finished_sample_indices.into_pyarray(py).unbind(),
            finished_reasons,
        })
    }

    /// Roll back the pending plan of a step that failed (forward, sampling or output
    /// processing raised): its requests give back every page and wait again with their
    /// committed tokens (re-prefilled on readmission); nobody else changes. Returns the
    /// ids of the requests sent back.
    fn abort_step(&mut self, py: Python<'_>) -> PyResult<Vec<Py<PyString>>> {
        let inner = &mut self.inner;
        let handles = py.detach(move || inner.abort_step()).map_err(sched_err)?;
        Ok(handles.iter().map(|&h| id_of(&self.id_strings, py, h)).collect())
    }

    /// Beam search, between schedule() and update() of a step that decoded every
    /// beam: beam i continues beam parents[i] (blocks forked, state copied next plan).
    fn reorder_beams(&mut self, request_id: &str, parents: Vec<u32>) -> PyResult<()> {
        self.inner.reorder_beams(request_id, &parents).map_err(sched_err)
    }

    /// Finish one sample (e.g. a stop string found by the caller). False if already finished.
    #[pyo3(signature = (request_id, sample_index, reason = "stop"))]
    fn finish(&mut self, request_id: &str, sample_index: u32, reason: &str) -> PyResult<bool> {
        let r = reason_from(reason)?;
        self.inner.finish(request_id, sample_index, r).map_err(sched_err)
    }

    /// Abort a request in any state; every page it held comes back. False if it had finished.
    fn abort(&mut self, py: Python<'_>, request_id: &str) -> PyResult<bool> {
        let inner = &mut self.inner;
        py.detach(|| inner.abort(request_id)).map_err(sched_err)
    }

    fn get_output_tokens<'py>(&self, py: Python<'py>, request_id: &str, sample_index: u32) -> PyResult<Bound<'py, PyArray1<i32>>> {
        let toks = self.inner.output_tokens(request_id, sample_index).map_err(sched_err)?;
        Ok(toks.iter().map(|&t| t as i32).collect::<Vec<i32>>().into_pyarray(py))
    }

    fn has_unfinished(&self) -> bool {
        self.inner.has_unfinished()
    }
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    /// Dense `[B, width]` block tables of the last plan (-1 padded): tests and debugging.
    fn block_tables<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray2<i32>>> {
        let (width, dense) = self.inner.block_tables();
        let rows = dense.len().checked_div(width).unwrap_or(0);
        Ok(Array2::from_shape_vec((rows, width), dense)
            .map_err(|e| PyValueError::new_err(e.to_string()))?
            .into_pyarray(py))
    }

    /// Requests first scheduled since the last call: (request_id, request_class, time, queue_delay).
    fn take_events(&mut self) -> Vec<(String, String, f64, f64)> {
        self.inner
            .take_events()
            .into_iter()
            .map(|e| (e.request_id, e.request_class, e.time, e.queue_delay))
            .collect()
    }

    /// Live DeltaNet checkpoints as `(state pages, tokens, last block of the
    /// chain, generation of its prefix-cache entry)`, sorted.
    fn checkpoints(&self) -> Vec<(Vec<u32>, usize, u32, u64)> {
        self.inner.checkpoints()
    }

    /// `(sequence id, state pages)` of every running sequence's state (and
    /// reserved ones, see the core): tests and debugging.
    fn running_states(&self) -> Vec<(u64, Vec<u32>)> {
        self.inner.running_states()
    }

    /// KV blocks of every live running sequence's block table: tests and debugging.
    fn running_tables(&self) -> Vec<Vec<u32>> {
        self.inner.running_tables()
    }

    /// The arena's free list and parked cached blocks: tests and debugging.
    fn free_and_cached_pages(&self) -> (Vec<u32>, Vec<u32>) {
        (self.inner.kv().free_list(), self.inner.kv().lru_order())
    }

    /// Counters and gauges of the core, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("num_pages", s.num_pages)?;
        d.set_item("free_pages", s.free_pages)?;
        d.set_item("kv_pages", s.kv_pages)?;
        d.set_item("running_state_pages", s.running_state_pages)?;
        d.set_item("checkpoint_pages", s.checkpoint_pages)?;
        d.set_item("cached_pages", s.cached_pages)?;
        d.set_item("available_pages", s.available_pages)?;
        d.set_item("pages_per_state", s.pages_per_state)?;
        d.set_item("admission_limited_pages", s.admission_limited_pages)?;
        d.set_item("admission_limited_seqs", s.admission_limited_seqs)?;
        d.set_item("admission_limited_budget", s.admission_limited_budget)?;
        d.set_item("last_admission_limit", s.last_admission_limit)?;
        d.set_item("last_admission_running_seqs", s.last_admission_running_seqs)?;
        d.set_item("last_admission_available_pages", s.last_admission_available_pages)?;
        // The KV view of the same arena (names kept for KV-only readers):
        // blocks = pages; free = free list + parked cached; used = KV in use.
        d.set_item("num_blocks", s.num_pages)?;
        d.set_item("free_blocks", s.free_pages + s.cached_pages)?;
        d.set_item("used_blocks", s.kv_pages)?;
        d.set_item("cached_blocks", s.cached_pages)?;
        d.set_item("alloc_failures", s.alloc_failures)?;
        d.set_item("tail_waste", s.tail_waste)?;
        d.set_item("prefix_queries", s.prefix_queries)?;
        d.set_item("prefix_query_tokens", s.prefix_query_tokens)?;
        d.set_item("prefix_hits", s.prefix_hits)?;
        d.set_item("prefix_hit_tokens", s.prefix_hit_tokens)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("cow_copies", s.cow_copies)?;
        d.set_item("preemptions", s.preemptions)?;
        d.set_item("preemptions_blocks", s.preemptions_blocks)?;
        d.set_item("preemptions_priority", s.preemptions_priority)?;
        d.set_item("state_fork_copies", s.state_fork_copies)?;
        d.set_item("shared_blocks", s.shared_blocks)?;
        d.set_item("num_running_requests", s.num_running_requests)?;
        d.set_item("num_running_seqs", s.num_running_seqs)?;
        d.set_item("num_waiting_requests", s.num_waiting_requests)?;
        d.set_item("waiting_tokens", s.waiting_tokens)?;
        d.set_item("steps", s.steps)?;
        d.set_item("last_step_tokens", s.last_step_tokens)?;
        d.set_item("last_step_seqs", s.last_step_seqs)?;
        d.set_item("finished_requests", s.finished_requests)?;
        d.set_item("aborted_requests", s.aborted_requests)?;
        d.set_item("reserved_pages", s.reserved_pages)?;
        d.set_item("checkpoints", s.checkpoints)?;
        d.set_item("checkpoint_queries", s.checkpoint_queries)?;
        d.set_item("checkpoint_hits", s.checkpoint_hits)?;
        d.set_item("prefix_skipped_tokens", s.prefix_skipped_tokens)?;
        d.set_item("prefix_lost_tokens", s.prefix_lost_tokens)?;
        d.set_item("checkpoint_writes", s.checkpoint_writes)?;
        d.set_item("checkpoint_writes_skipped", s.checkpoint_writes_skipped)?;
        d.set_item("checkpoint_evictions", s.checkpoint_evictions)?;
        d.set_item("checkpoint_drops", s.checkpoint_drops)?;
        d.set_item("spec_draft_tokens", s.spec_draft_tokens)?;
        d.set_item("spec_accepted_tokens", s.spec_accepted_tokens)?;
        d.set_item("spec_accepted_by_position", s.spec_accepted_by_position)?;
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyScheduler>()?;
    m.add_class::<PySchedulerOutput>()?;
    m.add_class::<PyStepUpdate>()?;
    Ok(())
}
