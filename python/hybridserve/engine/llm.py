"""The offline API, in the convention vLLM users already know::

    from hybridserve import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", dtype="float32", block_size=16)
    for out in llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8)):
        print(out.outputs[0].text, out.outputs[0].finish_reason)

It runs the Rust scheduler and the PyTorch runner in-process until every request
has finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.errors import InvalidRequest
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """An engine plus a loop: ``generate`` returns one RequestOutput per prompt, in order."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model, **kwargs))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # one prompt, as text or as token ids
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequest(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "pass one SamplingParams, or one per prompt"
                )
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequest(f"got {len(priority)} priorities for {len(prompts)} prompts")

        engine = self.engine
        ids: list[str] = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                rid = f"offline-{engine._counter}"
                engine._counter += 1
                engine.add_request(rid, prompt, params, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:  # nothing half-queued survives a rejected batch
                engine.abort_request(rid)
            raise

        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        try:
            results = _run_to_completion(engine, ids, bar)
        finally:
            if bar is not None:
                bar.close()
        return [results[rid] for rid in ids]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: per prompt, the ``beam_width`` best sequences,
        best first. The beams of one prompt are one request inside the engine (they
        share blocks and fork DeltaNet state); prompts run batched, beside whatever
        else the engine runs."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if priority is not None and len(priority) != len(prompts):
            raise InvalidRequest(f"got {len(priority)} priorities for {len(prompts)} prompts")
        engine = self.engine
        ids: list[str] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = f"offline-beam-{engine._counter}"
                engine._counter += 1
                engine.add_beam_request(rid, prompt, params, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results = _run_to_completion(engine, ids)
        outs = []
        for rid in ids:
            r = results[rid]
            prompt_ids = list(r.prompt_token_ids)
            outs.append(BeamSearchOutput(sequences=[
                BeamSearchSequence(
                    tokens=prompt_ids + list(c.token_ids), cum_logprob=float(c.cumulative_logprob),
                    text=c.text, finish_reason=c.finish_reason, output_token_ids=list(c.token_ids),
                )
                for c in r.outputs
            ]))
        return outs


def _run_to_completion(engine: Any, ids: list[str], bar: Any = None) -> dict[str, RequestOutput]:
    """Steps the engine until every request of ``ids`` finished; their final outputs.

    On any exception (Ctrl-C included) the requests still unfinished are aborted, so
    nothing of this call keeps running in the engine afterwards."""
    results: dict[str, RequestOutput] = {}
    wanted = set(ids)
    idle_steps = 0
    engine.emit_unfinished = False  # only finished outputs are wanted here
    try:
        while wanted - results.keys():
            outputs = engine.step()
            # The scheduler guarantees progress; an engine that schedules nothing for
            # this long with work pending is a bug, reported instead of spinning.
            idle_steps = 0 if engine.last_step_stats["num_scheduled_seqs"] else idle_steps + 1
            if idle_steps > 10_000:
                raise RuntimeError(
                    f"the engine scheduled nothing for {idle_steps} steps with "
                    f"{len(wanted - results.keys())} requests unfinished: {engine.stats()}"
                )
            for out in outputs:
                if out.finished and out.request_id in wanted:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
    except BaseException:
        for rid in wanted - results.keys():
            if rid in engine.requests:
                engine.abort_request(rid)
        raise
    finally:
        engine.emit_unfinished = True
    return results
