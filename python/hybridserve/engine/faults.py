"""Faults stay local: what the engine does when a step raises, and fault injection.

A step that raises in the model, the sampler or output processing is rolled back:

* before the scheduler's ``update()`` (the model call, sampling, logprobs), the Rust
  core's pending plan is undone (``Scheduler.abort_step``): the step's requests give
  back every page and wait again with their committed tokens, re-prefilled when
  readmitted (DeltaNet state is updated in place, so a half-run step cannot be resumed
  from its pages);
* after ``update()`` (detokenization, stop strings, the outputs), the core has already
  committed the step's tokens and some of them may have streamed; those requests
  cannot be replayed exactly once, so they end with ``finish_reason == "error"``.

A request caught in a rolled-back step is retried once; caught again, it ends with
``finish_reason == "error"`` (the server answers an OpenAI error object, or an error
event on a stream). A beam request whose search state already advanced in the failed
step (a fault at sampling) ends with an error instead of a retry. Everyone else goes
on untouched.

A fault that repeats (``max_consecutive_step_failures`` failed steps in a row) or is
fatal (:class:`FatalEngineError`, a lost device, a dead tensor-parallel rank) fails
every open request and raises :class:`FatalEngineError` out of ``step()``; the engine
refuses every later step. ``serve`` then exits non-zero.

``HYBRIDSERVE_FAULT_INJECT`` makes faults on purpose, for tests and chaos runs::

    HYBRIDSERVE_FAULT_INJECT="forward=0.05,sample=0.01,output=0.01,seed=7"
    HYBRIDSERVE_FAULT_INJECT="fatal_after=3"      # step 4 raises FatalEngineError

``forward`` raises after the model call returned (its pages written), ``sample`` after
sampling and logprobs (just before the scheduler's update), ``output`` right after the
update; each with that probability per step, from a generator seeded by ``seed``.
Unset, the engine holds ``None`` and pays one attribute test per point.

The functions below take the engine core (:class:`hybridserve.engine.core.EngineCore`),
whose step loop calls them.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from typing import Any

from hybridserve.errors import ConfigError, FatalEngineError, HybridServeError

logger = logging.getLogger("hybridserve.engine")

FAULT_INJECT_ENV = "HYBRIDSERVE_FAULT_INJECT"
FAULT_POINTS = ("forward", "sample", "output")


class InjectedFault(RuntimeError):
    """A recoverable fault raised on purpose by ``HYBRIDSERVE_FAULT_INJECT``."""


class FaultInjector:
    """Raises :class:`InjectedFault` at a step's fault points with given probabilities,
    and :class:`FatalEngineError` at the step after ``fatal_after`` steps."""

    def __init__(self, probs: Mapping[str, float], seed: int = 0, fatal_after: int | None = None) -> None:
        self.probs = {k: float(v) for k, v in probs.items() if v > 0}
        self.fatal_after = fatal_after
        self.rng = random.Random(seed)
        self.steps = 0
        self.injected = {k: 0 for k in FAULT_POINTS}

    @classmethod
    def parse(cls, spec: str) -> "FaultInjector | None":
        """``"forward=0.05,sample=0.01,output=0.01,seed=7"`` or ``"fatal_after=3"``;
        None for an empty spec. A malformed spec is a ConfigError naming the part."""
        spec = spec.strip()
        if not spec:
            return None
        probs: dict[str, float] = {}
        seed, fatal_after = 0, None
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            try:
                if not sep:
                    raise ValueError
                if key in FAULT_POINTS:
                    p = float(value)
                    if not 0.0 <= p <= 1.0:
                        raise ValueError
                    probs[key] = p
                elif key == "seed":
                    seed = int(value)
                elif key == "fatal_after":
                    fatal_after = int(value)
                    if fatal_after < 0:
                        raise ValueError
                else:
                    raise KeyError(key)
            except KeyError:
                raise ConfigError(
                    f"{FAULT_INJECT_ENV}: unknown key {key!r}; use {', '.join(FAULT_POINTS)}, seed, fatal_after"
                ) from None
            except ValueError:
                raise ConfigError(
                    f"{FAULT_INJECT_ENV}: bad part {part!r}; probabilities in [0, 1] "
                    "(forward=0.05), integers for seed and fatal_after (fatal_after=3)"
                ) from None
        return cls(probs, seed=seed, fatal_after=fatal_after)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "FaultInjector | None":
        env = os.environ if environ is None else environ
        inj = cls.parse(env.get(FAULT_INJECT_ENV, ""))
        if inj is not None:
            logger.warning("fault injection on (%s=%r)", FAULT_INJECT_ENV, env.get(FAULT_INJECT_ENV))
        return inj

    def begin_step(self) -> None:
        self.steps += 1
        if self.fatal_after is not None and self.steps > self.fatal_after:
            raise FatalEngineError(f"injected fatal fault at step {self.steps} ({FAULT_INJECT_ENV} fatal_after)")

    def point(self, name: str) -> None:
        p = self.probs.get(name)
        if p is not None and self.rng.random() < p:
            self.injected[name] += 1
            raise InjectedFault(f"injected {name} fault ({FAULT_INJECT_ENV})")


# Messages of errors after which the device (or the process group) cannot be trusted:
# retrying a step on it would only fail again, or return garbage.
_FATAL_MARKERS = (
    "CUDA error", "device-side assert", "illegal memory access", "NCCL", "unspecified launch failure",
    "ECC error", "device lost", "HIP error",
)


def is_fatal(exc: BaseException) -> bool:
    """Whether ``exc`` must end the process rather than fail one step's requests."""
    if isinstance(exc, FatalEngineError):
        return True
    if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not a step fault
        return False
    try:
        from hybridserve.parallel.errors import TensorParallelError  # noqa: PLC0415
    except ImportError:  # pragma: no cover - the module always exists in a full install
        TensorParallelError = ()  # type: ignore[assignment]  # noqa: N806
    if TensorParallelError and isinstance(exc, TensorParallelError):
        return True
    try:
        import torch  # noqa: PLC0415

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return False  # transient: the same step may fit once others finished
    except (ImportError, AttributeError):  # pragma: no cover
        pass
    msg = str(exc)
    return any(m in msg for m in _FATAL_MARKERS)


def error_output(engine: Any, rid: str, reason: str = "error") -> Any:
    """Ends request ``rid`` with ``finish_reason == reason`` on every unfinished sample:
    out of the scheduler (every page back), out of the engine; its final output."""
    state = engine.requests.pop(rid)
    unfinished = [s for s in state.samples if s.finish_reason is None]
    engine._end_request(rid, state, reason)
    for s in unfinished:
        if s.completion is not None:
            try:
                s.completion.finish()
            except Exception:  # noqa: BLE001 - the detokenizer may be what failed
                pass
    engine.errored_requests += 1
    try:
        return state.to_output()
    except Exception:  # noqa: BLE001 - a broken detokenizer state: the tokens without text
        from hybridserve.outputs import CompletionOutput, RequestOutput  # noqa: PLC0415

        return RequestOutput(
            request_id=rid, prompt=state.prompt, prompt_token_ids=list(state.prompt_token_ids),
            outputs=[CompletionOutput(index=s.index, text="", token_ids=list(s.token_ids),
                                      cumulative_logprob=s.cumulative_logprob, logprobs=None,
                                      finish_reason=s.finish_reason) for s in state.samples],
            finished=True, metrics=state.metrics,
        )


def _resync_for_retry(engine: Any, rid: str, state: Any) -> None:
    """A request retried from its committed tokens: logprobs recorded by the failed
    step come off, and the sampler forgets its per-row state (rebuilt from the tokens)."""
    for s in state.samples:
        lps = s.logprobs
        if lps is not None and len(lps) > len(s.token_ids):
            for entry in lps[len(s.token_ids):]:
                if s.cumulative_logprob is not None and entry:
                    s.cumulative_logprob -= next(iter(entry.values())).logprob
            del lps[len(s.token_ids):]
    engine._release_sampler_rows(rid, state)


def recover_step(engine: Any, plan: Any, exc: BaseException, phase: str, update: Any = None) -> list:
    """Rolls back a failed step (see the module docs); returns the final outputs of the
    requests it ended with an error. Raises FatalEngineError when the fault is fatal or
    has repeated ``max_consecutive_step_failures`` times."""
    engine._rows_cache = None
    if engine.output_processor is not None:
        engine.output_processor.forget_steady_rows()
    engine.requests_epoch += 1
    if not isinstance(exc, Exception):
        # Ctrl-C or exit inside a step: leave the core consistent (no pending plan) and
        # let it propagate; the caller aborts what it started.
        if phase != "output":
            _abort_plan(engine)
        raise exc
    engine.failed_steps += 1
    engine._consecutive_failures += 1
    limit = engine.max_consecutive_step_failures
    # Under tensor parallelism the ranks may have parted ways mid-step: never retried.
    fatal = (is_fatal(exc) or engine.parallel is not None
             or (limit > 0 and engine._consecutive_failures >= limit))
    if phase != "output":
        _abort_plan(engine)
    if fatal:
        # The engine's own fatal errors (a dead tensor-parallel rank names its rank) go
        # out as they are; anything else as a FatalEngineError naming it.
        cause = exc if isinstance(exc, HybridServeError) and is_fatal(exc) else FatalEngineError(
            f"{engine._consecutive_failures} consecutive failed steps, the last: {exc!r}"
            if not is_fatal(exc) else f"fatal fault: {exc!r}")
        engine._fatal = cause
        logger.error("engine failed, failing %d open request(s): %s", len(engine.requests), cause)
        for rid in list(engine.requests):
            error_output(engine, rid)
        raise cause from exc
    # The requests the failed step touched.
    caught: list[str] = []
    seen: set[str] = set()
    ids: list = list(plan.request_ids) if plan is not None else []
    if phase == "output" and update is not None:
        ids += list(update.request_ids) + list(update.finished_request_ids)
    for rid in ids:
        if rid not in seen and rid in engine.requests:
            seen.add(rid)
            caught.append(rid)
    # Forget retries of requests that are gone (their ids may come back).
    retried = engine._fault_retried
    for rid in [r for r, st in retried.items() if engine.requests.get(r) is not st]:
        del retried[rid]
    outputs = []
    n_retry = 0
    for rid in caught:
        state = engine.requests[rid]
        beam_moved = phase == "sample" and rid in engine.beams
        if phase == "output" or beam_moved or retried.get(rid) is state:
            outputs.append(error_output(engine, rid))
        else:
            retried[rid] = state
            engine.retried_requests += 1
            n_retry += 1
            _resync_for_retry(engine, rid, state)
    # The step's record for the callers that read it (the offline loop's progress
    # guard, the async engine's hand-off time): it scheduled, and produced nothing.
    engine.last_step_stats = {
        "num_scheduled_seqs": len(plan.request_ids) if plan is not None else 0,
        "num_batched_tokens": len(plan.input_ids) if plan is not None else 0,
        "step_seconds": 0.0,
        "phase_seconds": dict.fromkeys(engine._phase_seconds, 0.0),
        "failed": True,
    }
    logger.warning("step failed in %s (%r): %d request(s) retried, %d ended with an error",
                   phase, exc, n_retry, len(outputs))
    return outputs


def _abort_plan(engine: Any) -> None:
    try:
        engine.scheduler.abort_step()
    except Exception as e:  # noqa: BLE001 - no plan pending (update() consumed it)
        logger.debug("abort_step: %s", e)
