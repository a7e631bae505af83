"""The offline API, in the convention vLLM users already know::

    from hybridserve import LLM, SamplingParams
    llm = LLM("path/to/checkpoint", dtype="float32", block_size=16)
    for out in llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8)):
        print(out.outputs[0].text, out.outputs[0].finish_reason)
    llm.generate({"prompt_token_ids": [1, 2, 3]})        # vLLM's TokensPrompt (and TextPrompt)
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=None))

It runs the Rust scheduler and the PyTorch runner in-process until every request
has finished.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from hybridserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from hybridserve.engine.args import EngineArgs
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.errors import InvalidRequest
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

Prompt = str | Sequence[int] | dict[str, Any]

# What ``generate`` takes, in vLLM's shapes, for the error that refuses anything else.
ACCEPTED_PROMPTS = (
    "a string, a list of token ids, {\"prompt\": str} (vLLM's TextPrompt), "
    "{\"prompt_token_ids\": [int, ...]} (vLLM's TokensPrompt), or a list of these"
)


def _is_token_id(t: Any) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _one_prompt(p: Any, where: str) -> str | list[int]:
    """One prompt as the engine takes it (text or token ids), or InvalidRequest."""
    if isinstance(p, str):
        return p
    if isinstance(p, dict):
        keys = set(p)
        if keys == {"prompt"} and isinstance(p["prompt"], str):
            return p["prompt"]
        if keys == {"prompt_token_ids"}:
            ids = p["prompt_token_ids"]
            if isinstance(ids, Sequence) and not isinstance(ids, str) and all(_is_token_id(t) for t in ids):
                return [int(t) for t in ids]
            raise InvalidRequest(f"{where}: 'prompt_token_ids' must be a list of token ids, got {ids!r:.80}")
        raise InvalidRequest(
            f"{where}: a prompt dict has exactly one key, 'prompt' (a string) or 'prompt_token_ids' "
            f"(a list of token ids); got keys {sorted(map(str, keys))}. Accepted: {ACCEPTED_PROMPTS}"
        )
    if isinstance(p, Sequence) and p and all(_is_token_id(t) for t in p):
        return [int(t) for t in p]
    raise InvalidRequest(f"{where}: {type(p).__name__} {p!r:.80} is not a prompt. Accepted: {ACCEPTED_PROMPTS}")


def parse_prompts(prompts: Any) -> list[str | list[int]]:
    """vLLM's prompt forms, one or a list, as a list of text or token-id prompts."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, Sequence) and prompts and all(_is_token_id(t) for t in prompts)
    ):
        return [_one_prompt(prompts, "prompt")]
    if not isinstance(prompts, Sequence):
        raise InvalidRequest(f"{type(prompts).__name__} is not a prompt. Accepted: {ACCEPTED_PROMPTS}")
    return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


class LLM:
    """An engine plus a loop: ``generate`` returns one RequestOutput per prompt, in order."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model, **kwargs))

    def get_tokenizer(self) -> Any:
        """The checkpoint's tokenizer (a transformers tokenizer, as vLLM returns)."""
        return self.engine.tokenizer

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}``
        messages) or a list of them, rendered with the checkpoint's chat template as
        the server renders ``/v1/chat/completions``, then generated as token ids.
        ``chat_template_kwargs`` go to the template (e.g. ``{"enable_thinking": False}``)."""
        from hybridserve.server import contract
        from hybridserve.server.protocol import ApiError, chat_messages

        if isinstance(messages, Sequence) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        elif isinstance(messages, Sequence) and not isinstance(messages, str) and messages:
            conversations = list(messages)
        else:
            raise InvalidRequest(
                "messages must be one conversation (a non-empty list of {\"role\": ..., \"content\": ...} "
                "dicts) or a list of conversations"
            )
        prompts: list[dict[str, Any]] = []
        for i, conv in enumerate(conversations):
            body = {"messages": list(conv) if isinstance(conv, Sequence) else conv, "tools": tools,
                    "chat_template_kwargs": chat_template_kwargs}
            try:
                msgs = chat_messages(body)
                # The server's own rendering (tools and template kwargs checked as there).
                prep = contract.prepare(body, chat=True, reasoning_parser=None, tool_parser=None)
                ids = contract.render_chat(self.engine.tokenizer, msgs, add_generation_prompt, prep)
            except ApiError as e:  # the server's check, as a Python exception here
                raise InvalidRequest(f"conversation {i}: {e}") from None
            except InvalidRequest as e:
                raise InvalidRequest(f"conversation {i}: {e}") from None
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, priority=priority, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        prompts = parse_prompts(prompts)
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
        prompts = parse_prompts(prompts)
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
