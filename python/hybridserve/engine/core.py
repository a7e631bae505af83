"""The engine core: one ``step()`` = schedule, copy, run, sample, update.

::

    plan   = scheduler.schedule()             Rust, GIL released
    logits = runner.execute(plan)             block-table updates, CoW/fork copies, model
    tokens = sampler(logits, rows)            per-sequence RNGs, penalties, logprobs
    events = scheduler.update(tokens)         Rust: append, fork n>1, stop, free
    -> output_processor.process(events)       text, stop strings, outputs (output_processor.py)

The core holds the scheduler, the runner and the sampler, the running requests'
table, beam selection, fault handling (a failed step rolled back: engine.faults) and
the step statistics. It knows nothing of text: requests come in checked and tokenized
(:mod:`hybridserve.engine.processor`), and a step's outputs are built by the output
processor it is given. It never edits block tables or slots: the Rust scheduler owns
them. It is single-threaded; :class:`hybridserve.engine.async_engine.AsyncEngine` runs
its engine on a thread for the server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hybridserve.beam_search import BeamSearch, candidates_to_host
from hybridserve.engine import logprobs
from hybridserve.engine.faults import FaultInjector, recover_step
from hybridserve.engine.processor import EngineRequest
from hybridserve.engine.request_state import RequestState
from hybridserve.errors import QueueFull, UnknownRequest
from hybridserve.outputs import RequestOutput
from hybridserve.sampler import Sampler, SamplingRow


def _rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``: a view when the rows are consecutive (no index tensor to copy to
    the device), else a gather."""
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return t[rows[0]:rows[0] + len(rows)]
    return t.index_select(0, torch.tensor(rows, device=t.device))


# The phases of one step, in order: the scheduler's plan; the runner's staging copy,
# table updates and batch; the model; sampling (rows, sampler, beams, logprobs); and
# the scheduler's update, detokenization, stop strings and the outputs handed back.
STEP_PHASES = ("schedule", "prepare_inputs", "forward", "sample", "process_outputs")


class EngineCore:
    """The step loop over the Rust scheduler, the runner and the sampler."""

    def __init__(self, scheduler: Any, runner: Any, sampler: Any, *, vocab_size: int, device: torch.device,
                 eos_token_ids: list[int], arena_layout: Any, max_num_seqs: int, max_waiting_requests: int,
                 max_consecutive_step_failures: int, parallel: Any = None, host_one_thread: bool = False) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.arena_layout = arena_layout
        self.max_num_seqs = max_num_seqs
        self.max_waiting_requests = max_waiting_requests
        self.parallel = parallel
        # The step's host work after the model call runs torch on one thread (see
        # HOST_PARALLEL_MIN_ELEMENTS); the thread count is given back after it.
        self._host_one_thread = host_one_thread
        # Builds the step's outputs from the scheduler's update (an OutputProcessor,
        # set by the engine that composes the two).
        self.output_processor: Any = None
        self.requests: dict[str, RequestState] = {}
        # Constrained decoding (hybridserve.structured), built with the first constrained
        # request; the step's mask job runs while its forward does.
        self.structured: Any = None
        self._structured_job: Any = None
        # Counts every change to `requests` (add, abort, finish): the last step's
        # sampler rows (and common output rows) are reused while it and the batch stay.
        self.requests_epoch = 0
        self._rows_cache: tuple | None = None
        # request id -> (k, per-prompt-token logprobs) for requests that asked for
        # prompt logprobs; empty in the common case, so steps pay nothing for it.
        self.prompt_logprobs: dict[str, logprobs.PromptLogprobs] = {}
        # Beam requests: id -> their selection state (see hybridserve.beam_search).
        self.beams: dict[str, BeamSearch] = {}
        # Preemptions by (cause, victim's request_class), for the metrics.
        self.preemptions_by: dict[tuple[str, str], int] = {}
        # Faults stay local (hybridserve.engine.faults): failed steps rolled back, their
        # requests retried once (request id -> the state retried), the engine's end when
        # faults repeat or are fatal. The injector is None unless asked for.
        self.fault_injector = FaultInjector.from_env()
        self.max_consecutive_step_failures = max_consecutive_step_failures
        self.failed_steps = self.retried_requests = self.errored_requests = 0
        self._consecutive_failures = 0
        self._fault_retried: dict[str, RequestState] = {}
        self._fatal: BaseException | None = None
        self.step_count = 0
        self.last_step_stats: dict[str, Any] = {}
        # Cumulative wall seconds of each phase of step() (see STEP_PHASES).
        self._phase_seconds: dict[str, float] = dict.fromkeys(STEP_PHASES, 0.0)
        # Work for the previous step's outputs that the caller wants done between this
        # step's input preparation and its model call (the async engine hands them to
        # its event loop there, so the loop's work overlaps the forward, which on a GPU
        # waits without the GIL). Its time counts in this step's process_outputs.
        self.before_forward: Callable[[], None] | None = None
        self._before_forward_seconds = 0.0
        # Speculative decoding (hybridserve.spec): set by from_parts when asked for.
        self.spec: Any = None

    # ---------------------------------------------------------------- requests
    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def check_waiting_room(self) -> None:
        """QueueFull when max_waiting_requests requests already wait beyond what the free
        run slots will admit at the next step (requests added between two steps all
        wait until it, though the free slots will take them)."""
        cap = self.max_waiting_requests
        waiting = self.scheduler.num_waiting()
        if waiting >= cap:
            free = max(self.max_num_seqs - self.scheduler.num_running(), 0)
            if waiting - free >= cap:
                raise QueueFull(f"the waiting queue holds {waiting - free} requests beyond the {free} free run "
                                f"slot(s) (max_waiting_requests = {cap}); retry later")

    def add_request(self, req: EngineRequest) -> str:
        """Hands a checked request (:class:`~hybridserve.engine.processor.EngineRequest`)
        to the scheduler and keeps its state; the scheduler's refusal is raised as it is."""
        rid = req.request_id
        try:
            self.scheduler.add_request(rid, req.prompt_token_ids, **req.schedule)
        except BaseException:
            if req.structured:  # compiled already: a refusal gives it back
                self.structured.release(rid)
            raise
        self.requests[rid] = req.state
        self.requests_epoch += 1
        if req.prompt_logprobs is not None:
            self.prompt_logprobs[rid] = (req.prompt_logprobs, [None] * len(req.state.prompt_token_ids))
        if req.beam is not None:
            self.beams[rid] = req.beam
        return rid

    def finish(self, request_id: str, sample: int, reason: str) -> None:
        """Ends one sample's sequence in the scheduler (a stop string, a search over)."""
        self.scheduler.finish(request_id, sample, reason)

    def retire(self, request_id: str, state: RequestState) -> None:
        """A finished request leaves the table; its sampler rows go back."""
        del self.requests[request_id]
        self.requests_epoch += 1
        self._release_sampler_rows(request_id, state)

    def _beam_select(self, plan: Any, step: Any, sampled: np.ndarray) -> list[str]:
        """Replaces the sampled tokens of beam requests by the search's choice and
        re-parents their beams in the scheduler; returns the requests whose search ended.

        Every beam request's candidates come to the host in one transfer; the engine
        keeps no per-beam token lists (the search holds the beams), so a step moves
        only what changed."""
        req_ids = plan.request_ids
        rows: dict[str, dict[int, tuple[int, int]]] = {}
        off = 0
        for row, (b, k) in enumerate(zip(step.batch_index.tolist(), step.num_samples.tolist())):
            rid = req_ids[b]
            if rid in self.beams:
                rows.setdefault(rid, {})[int(plan.sample_indices[b]) if k == 1 else -1] = (row, off)
            off += k
        work, parts = [], []
        for rid, got in rows.items():
            bs = self.beams[rid]
            # The prompt's last row (the fork), or the W beams' rows in sample order.
            fork = -1 in got
            order = [got[-1]] if fork else [got[i] for i in range(bs.width)]
            lps = torch.log_softmax(_rows(step.logits, [r for r, _ in order]).float(), dim=-1)
            parts.append(bs.candidates(lps))
            work.append((rid, bs, order, fork))
        ended = []
        for (rid, bs, order, fork), (vals, idx) in zip(work, candidates_to_host(parts)):
            parents, toks = bs.advance(vals, idx)
            if fork:
                o = order[0][1]
                sampled[o:o + bs.width] = toks
            else:
                if parents != list(range(bs.width)):
                    self.scheduler.reorder_beams(rid, parents)
                for i, (_, o) in enumerate(order):
                    sampled[o] = toks[i]
            if bs.done:
                ended.append(rid)
        return ended

    def abort_request(self, request_id: str) -> None:
        """Cancel a request in any state; its blocks and slot return to the pools."""
        state = self.requests.pop(request_id, None)
        if state is None:
            raise UnknownRequest(f"no request with id {request_id!r}")
        self._end_request(request_id, state, "abort")

    def _end_request(self, request_id: str, state: RequestState, reason: str) -> None:
        """The request (already out of ``self.requests``) leaves the scheduler, every page
        back, and the engine's per-request tables; unfinished samples end with ``reason``.
        One path for aborts and for requests a fault ends (engine.faults)."""
        self.requests_epoch += 1
        self.beams.pop(request_id, None)
        self.prompt_logprobs.pop(request_id, None)
        self._fault_retried.pop(request_id, None)
        self.scheduler.abort(request_id)
        self._release_sampler_rows(request_id, state)
        for s in state.samples:
            if s.finish_reason is None:
                s.finish_reason = reason

    def _release_sampler_rows(self, request_id: str, state: RequestState) -> None:
        # The sampler keeps device state per (request, sample) across steps.
        if self.structured is not None:
            self.structured.release(request_id)
        for i in range(len(state.samples)):
            self.sampler.release((request_id, i))
        if self.spec is not None:
            self.spec.release(request_id, len(state.samples))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -------------------------------------------------------------------- step
    def _sampling_rows(self, plan: Any, batch_index: np.ndarray, num_samples: np.ndarray) -> list[SamplingRow]:
        """The sampler's rows of a step. A sample's row is made once and kept on its
        SampleState (its fields are the same objects every step: the params, the
        growing token list, the stream), so a decode step costs a lookup per row."""
        req_ids = plan.request_ids
        # A steady decode batch: the same requests (none added, aborted or finished
        # since), the same samples, one row each, in the same order: the same rows.
        steady = len(batch_index) == len(req_ids) and not self.beams and bool((num_samples == 1).all())
        if steady:
            cache = self._rows_cache
            if (cache is not None and cache[0] == self.requests_epoch and cache[1] == req_ids
                    and np.array_equal(cache[2], plan.sample_indices)):
                return cache[3]
        self._rows_cache = None
        rows = []
        sample_indices = np.asarray(plan.sample_indices).tolist()  # a list: numpy item reads are slow
        requests = self.requests
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        for b, k in zip(batch_index.tolist(), num_samples.tolist()):
            rid = req_ids[b]
            state = requests[rid]
            if k > 1:
                rows.append(SamplingRow(
                    params=state.params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=state.samples[0].token_ids,
                    num_samples=k,
                    generators=[state.samples[i].generator for i in range(k)],
                    keys=[(rid, i) for i in range(k)],
                    eos_token_id=eos,
                ))
                continue
            sample = state.samples[sample_indices[b]]
            row = sample.sampling_row
            if row is None:
                row = sample.sampling_row = SamplingRow(
                    params=state.params,
                    prompt_token_ids=state.prompt_token_ids,
                    output_token_ids=sample.token_ids,
                    generator=sample.generator,
                    key=(rid, sample.index),
                    eos_token_id=eos,
                )
            rows.append(row)
        if steady:
            self._rows_cache = (self.requests_epoch, list(req_ids), np.array(plan.sample_indices), rows)
        return rows

    def step(self) -> list[RequestOutput]:
        """Advance every scheduled sequence by one step; return the outputs that changed
        (only the finished ones when ``emit_unfinished`` is False).

        A step that raises is rolled back and its requests retried once or ended with
        ``finish_reason == "error"`` (hybridserve.engine.faults); a fatal or repeating
        fault fails every open request and raises FatalEngineError, then and after."""
        if self._fatal is not None:
            raise self._fatal  # the engine stays stopped: the same error at once
        self._fault_plan = self._fault_update = None
        self._fault_phase = "schedule"
        try:
            outputs = self._step()
        except BaseException as e:  # noqa: BLE001 - rolled back, or re-raised as fatal
            return recover_step(self, self._fault_plan, e, self._fault_phase, self._fault_update)
        self._consecutive_failures = 0
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One step (see :meth:`step`).

        Each phase's wall time is added to ``stats()["step_phase_seconds"]`` and given
        for this step in ``last_step_stats["phase_seconds"]``: consecutive clock reads,
        so the five add up to the step's time."""
        t0 = time.perf_counter()
        self._before_forward_seconds = 0.0
        if self.parallel is not None:
            # A failed rank fails every step at once, before anything is scheduled.
            self.parallel.check_healthy()
        plan = self.scheduler.schedule()
        self._fault_plan, self._fault_phase = plan, "forward"
        if self.fault_injector is not None:
            self.fault_injector.begin_step()
        now = time.monotonic()
        # Requests that changed this step -> the indices of their samples that did.
        changed: dict[str, set[int]] = {}
        for rid, cause in zip(plan.preempted, plan.preempted_causes):
            st = self.requests.get(rid)
            if st is not None:
                st.metrics.num_preemptions += 1
                key = (cause, st.metrics.request_class)
                self.preemptions_by[key] = self.preemptions_by.get(key, 0) + 1
        # The core records each request's first schedule (its queue delay on the
        # core's clock); draining the events every step keeps that list short.
        for rid, _klass, _t, queue_delay in self.scheduler.take_events():
            st = self.requests.get(rid)
            if st is not None and st.metrics.first_scheduled_time is None:
                st.metrics.first_scheduled_time = now
                st.metrics.queue_delay = queue_delay

        want = logprobs.prompt_logprob_rows(self.prompt_logprobs, plan) if self.prompt_logprobs else ()
        t_sched = time.perf_counter()
        runner = self.runner
        runner.inputs_ready_at = None
        runner.before_forward = self._run_before_forward if self.before_forward is not None else None
        # The sampler's rows are known from the plan: its index lists travel in the
        # runner's staging copy (one host->device copy per step). A sampler that is
        # not ours (a test's, a bench's wrapper) is simply called with the logits.
        prep = None
        if isinstance(self.sampler, Sampler):
            num_samples = np.asarray(plan.num_samples)
            batch_index = np.nonzero(num_samples > 0)[0]
            if len(batch_index):
                prep = self.sampler.plan(self._sampling_rows(plan, batch_index, num_samples[batch_index]),
                                         self.vocab_size, self.device)
                runner.extra_segments = prep.segments
        runner.extra_views = None
        if self.structured is not None and self.structured.active:
            self._structured_job = self.structured.begin_step(plan, self.requests)
        if self.spec is not None:
            self.spec.before_forward(plan)
        try:
            # The one-argument call in the common case keeps runner wrappers (tests,
            # benches) that take only the plan working.
            step = runner.execute(plan, want) if want else runner.execute(plan)
        except BaseException:
            self._structured_job = None  # the step is rolled back; its masks are dropped
            if prep is not None:
                self.sampler.discard(prep)
            raise
        finally:
            runner.extra_segments = None
            runner.before_forward = None
        t_fwd = time.perf_counter()
        # The model call is over: the rest of the step (sampling, outputs) runs its
        # torch ops on one thread (not with prompt logprobs: [tokens, vocab] ops).
        threads = torch.get_num_threads() if self._host_one_thread and not want else None
        if threads is not None:
            torch.set_num_threads(1)
        try:
            return self._after_forward(plan, step, prep, want, t0, t_sched, t_fwd, changed, now)
        finally:
            if threads is not None:
                torch.set_num_threads(threads)

    def _after_forward(self, plan: Any, step: Any, prep: Any, want: Any, t0: float, t_sched: float,
                       t_fwd: float, changed: dict[str, set[int]], now: float) -> list[RequestOutput]:
        """The rest of :meth:`step` after the model call: sampling, the scheduler's
        update, and the outputs (the output processor's)."""
        runner = self.runner
        # The runner stamps the end of its input preparation; a wrapper that did not
        # run the real runner leaves no stamp and the whole call counts as forward.
        t_prep = getattr(self.runner, "inputs_ready_at", None)
        if t_prep is None or not t_sched <= t_prep <= t_fwd:
            t_prep = t_sched
        # The hand-off run before the model call (inside prepare's clock reads) moves
        # to process_outputs, the phase it belongs to.
        handoff = min(self._before_forward_seconds, t_prep - t_sched)
        if self.fault_injector is not None:
            self.fault_injector.point("forward")
        self._fault_phase = "sample"
        if step is not None and step.prompt_spans:
            logprobs.record_prompt_logprobs(self.requests, self.prompt_logprobs, plan, step)
        job, self._structured_job = self._structured_job, None
        if job is not None and step is not None and len(step.batch_index):
            self.structured.apply(job, step.logits)
        if step is not None and len(step.batch_index):
            if prep is not None:
                views, runner.extra_views = runner.extra_views, None
                out = self.sampler.sample_planned(step.logits, prep, views)
                prep = None
            else:
                out = self.sampler(step.logits, self._sampling_rows(plan, step.batch_index, step.num_samples))
            sampled = np.asarray(out.token_ids, dtype=np.int32)
            beams_ended = self._beam_select(plan, step, sampled) if self.beams else ()
            logprobs.record_logprobs(self.requests, plan, step, out)
        else:
            out = None
            sampled = np.zeros(0, dtype=np.int32)
            beams_ended = ()
        if prep is not None:  # planned rows the step did not sample
            self.sampler.discard(prep)
        accepted = drafts = None
        extra_logprobs: dict = {}
        if self.spec is not None:
            # Verify rounds, the DeltaNet commit of the kept rows, the next drafts.
            sampled, accepted, drafts, extra_logprobs = self.spec.after_sampling(
                self, plan, step, out, sampled, self.structured)
        t_sample = time.perf_counter()
        if self.fault_injector is not None:
            self.fault_injector.point("sample")
        if accepted is None and drafts is None:
            update = self.scheduler.update(sampled)
        else:
            update = self.scheduler.update(sampled, accepted, drafts)
        self._fault_update, self._fault_phase = update, "output"
        if self.fault_injector is not None:
            self.fault_injector.point("output")
        now = time.monotonic()
        if accepted is not None:
            self.output_processor.forget_steady_rows()
        outputs = self.output_processor.process(update, changed, beams_ended, now,
                                                extra_logprobs=extra_logprobs if accepted is not None else None)
        self.step_count += 1
        t_end = time.perf_counter()
        phases = (t_sched - t0, t_prep - t_sched - handoff, t_fwd - t_prep, t_sample - t_fwd,
                  t_end - t_sample + handoff)
        acc = self._phase_seconds
        for name, dt in zip(STEP_PHASES, phases):
            acc[name] += dt
        self.last_step_stats = {
            "num_scheduled_seqs": len(plan.request_ids),
            "num_batched_tokens": len(plan.input_ids),
            "step_seconds": t_end - t0,
            "phase_seconds": dict(zip(STEP_PHASES, phases)),
        }
        return outputs

    def _run_before_forward(self) -> None:
        t0 = time.perf_counter()
        try:
            self.before_forward()  # type: ignore[misc]
        finally:
            self._before_forward_seconds += time.perf_counter() - t0

    def add_phase_time(self, phase: str, seconds: float) -> None:
        """Adds host work done for the engine outside ``step()`` (the async engine's
        hand-off of outputs to the clients' queues) to a phase's total."""
        self._phase_seconds[phase] += seconds


    def stats(self) -> dict[str, Any]:
        d = dict(self.scheduler.stats())
        # Layout padding of the pages in use: every KV page wastes kv_padding_bytes,
        # every state (running or checkpoint) state_padding_bytes.
        lay = self.arena_layout
        states = (d["running_state_pages"] + d["checkpoint_pages"]) // max(lay.state_pages, 1)
        d["page_bytes"] = lay.page_bytes
        d["padding_bytes"] = d["kv_pages"] * lay.kv_padding_bytes + states * lay.state_padding_bytes
        # [(cause, victim request_class, count)]: JSON-friendly.
        d["preemptions_by"] = [(c, k, n) for (c, k), n in sorted(self.preemptions_by.items())]
        d["step_phase_seconds"] = dict(self._phase_seconds)
        d["failed_steps"] = self.failed_steps
        d["retried_requests"] = self.retried_requests
        d["errored_requests"] = self.errored_requests
        if self.structured is not None:
            d["structured"] = self.structured.stats()
        if self.spec is not None:
            d.update(self.spec.stats())
        return d

    @classmethod
    def from_parts(cls, parts: Any) -> "EngineCore":
        """The core over the start-up builder's :class:`~hybridserve.engine.builder.EngineParts`."""
        args = parts.args
        core = cls(parts.scheduler, parts.runner, parts.sampler, vocab_size=parts.model_config.vocab_size,
                   device=parts.device, eos_token_ids=parts.eos_token_ids, arena_layout=parts.arena_plan.layout,
                   max_num_seqs=args.max_num_seqs, max_waiting_requests=args.max_waiting_requests,
                   max_consecutive_step_failures=args.max_consecutive_step_failures, parallel=parts.parallel,
                   host_one_thread=parts.host_one_thread)
        if args.speculative_config is not None:
            from hybridserve.spec.decoder import SpecDecoder

            core.spec = SpecDecoder(args.speculative_config, parts.model, parts.cache, parts.runner,
                                    args.block_size)
        return core
