"""OpenAI-compatible request parsing and response bodies.

A request body becomes :class:`SamplingParams` here; anything unknown or out of
range becomes an :class:`InvalidRequest` whose message names the field, which the
server turns into an HTTP 400 with an OpenAI-style ``{"error": {...}}`` body.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from hybridserve.errors import HybridServeError, InvalidRequest
from hybridserve.outputs import RequestOutput
from hybridserve.sampling import SamplingParams

# OpenAI fields we accept and how they map onto SamplingParams (None: handled here).
_COMMON = {
    "model": None,
    "n": "n",
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "include_stop_str_in_output": "include_stop_str_in_output",
    "skip_special_tokens": "skip_special_tokens",
    "stream": None,
    "stream_options": None,
    "user": None,
    "priority": None,
    "request_class": None,
}
COMPLETION_FIELDS = {**_COMMON, "prompt": None, "logprobs": None, "echo": None}
CHAT_FIELDS = {
    **_COMMON,
    "messages": None,
    "logprobs": None,
    "top_logprobs": None,
    "add_generation_prompt": None,
}


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_type_for(exc: BaseException, status: int) -> str:
    if status == 400:
        return "invalid_request_error"
    if status == 404:
        return "not_found_error"
    if status == 503:
        return "service_unavailable"
    return "internal_server_error" if not isinstance(exc, HybridServeError) else type(exc).__name__


def _check_fields(body: dict[str, Any], allowed: dict[str, str | None]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; this endpoint accepts {sorted(allowed)}"
        )


def sampling_params_from(body: dict[str, Any], allowed: dict[str, str | None], *, chat: bool) -> SamplingParams:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(body, allowed)
    kwargs = {dst: body[src] for src, dst in allowed.items() if dst is not None and src in body}
    if chat:
        if body.get("logprobs"):
            kwargs["logprobs"] = int(body.get("top_logprobs") or 0)
    elif body.get("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = 16 if not chat else 256
    return SamplingParams(**kwargs)


def request_priority(body: dict[str, Any]) -> tuple[int, str]:
    priority = body.get("priority", 0)
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequest(f"priority must be an integer (lower runs first), got {priority!r}")
    klass = body.get("request_class", "default")
    if not isinstance(klass, str) or not klass or len(klass) > 64:
        raise InvalidRequest("request_class must be a non-empty string of at most 64 characters")
    return priority, klass


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        return completion_prompt({"prompt": prompt[0]})
    raise InvalidRequest(
        "'prompt' must be a string or a list of token ids (one prompt per request)"
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(out: RequestOutput) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": completion,
        "total_tokens": len(out.prompt_token_ids) + completion,
    }


def _logprobs_block(c: Any, tokenizer: Any, start: int = 0) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tokens, lps, tops = [], [], []
    for tok, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        tokens.append(tokenizer.decode([tok]))
        lps.append(entry[tok].logprob)
        tops.append({tokenizer.decode([t]): lp.logprob for t, lp in entry.items()})
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops}


def completion_body(rid: str, model: str, out: RequestOutput, tokenizer: Any) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": _logprobs_block(c, tokenizer),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
        "usage": usage(out),
    }


def chat_body(rid: str, model: str, out: RequestOutput, tokenizer: Any) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": _logprobs_block(c, tokenizer),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
        "usage": usage(out),
    }
