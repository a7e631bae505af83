"""OpenAI-compatible request parsing and response bodies.

A request body becomes :class:`SamplingParams` here; anything unknown, out of range
or of the wrong type becomes an :class:`ApiError` (an :class:`InvalidRequest` for
400s) whose message names the field, which the server turns into an OpenAI-style
``{"error": {...}}`` body. Integers are range-checked here, before they reach the
Rust core, whose fixed-width fields would otherwise overflow into a 500.
"""

from __future__ import annotations

import itertools
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from hybridserve.beam_search import BeamSearchParams
from hybridserve.errors import HybridServeError, InvalidRequest
from hybridserve.outputs import CompletionOutput, Logprob, RequestOutput
from hybridserve.sampling import MAX_LOGPROBS, SamplingParams

# OpenAI fields we accept and how they map onto SamplingParams (None: handled here).
_COMMON = {
    "model": None,
    "n": "n",
    "max_tokens": "max_tokens",
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
    "logit_bias": None,
    "stream": None,
    "stream_options": None,
    "user": None,
    "priority": None,
    "request_class": None,
}
# Tools, structured outputs and thinking (hybridserve.server.contract handles them).
_CONTRACT_CHAT = dict.fromkeys(("response_format", "structured_outputs", "tools", "tool_choice",
                                "parallel_tool_calls", "chat_template_kwargs", "include_reasoning"))
_CONTRACT_COMPLETION = dict.fromkeys(("response_format", "structured_outputs"))
COMPLETION_FIELDS = {**_COMMON, **_CONTRACT_COMPLETION, "prompt": None, "logprobs": None, "echo": None,
                     # vLLM's extra parameters: beam search with n as the beam width.
                     "use_beam_search": None, "length_penalty": None}
CHAT_FIELDS = {
    **_COMMON,
    **_CONTRACT_CHAT,
    "max_completion_tokens": None,
    "messages": None,
    "logprobs": None,
    "top_logprobs": None,
    "add_generation_prompt": None,
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Inclusive ranges of the integer fields: what the Rust core can hold (u32 counts,
# i32 priority) and OpenAI's int64 seed.
_U32 = (1 << 32) - 1
INT_RANGES: dict[str, tuple[int, int]] = {
    "n": (1, 1024),
    "max_tokens": (1, _U32),
    "max_completion_tokens": (1, _U32),
    "min_tokens": (0, _U32),
    "top_k": (-1, _U32),
    "seed": (-(1 << 63), (1 << 63) - 1),
    "priority": (-(1 << 31), (1 << 31) - 1),
    "logprobs": (0, MAX_LOGPROBS),
    "top_logprobs": (0, MAX_LOGPROBS),
}
LOGIT_BIAS_LIMIT = 100.0


class ApiError(HybridServeError):
    """An HTTP error with its status and OpenAI ``type``/``code``/``param``."""

    def __init__(self, message: str, status: int = 400, err_type: str | None = None,
                 code: str | int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.err_type = err_type
        self.code = code
        self.param = param


def error_body(message: str, err_type: str, code: int | str | None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_type_for(exc: BaseException, status: int) -> str:
    if isinstance(exc, ApiError) and exc.err_type:
        return exc.err_type
    if status == 400 or status == 413 or status == 408:
        return "invalid_request_error"
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    if status == 405:
        return "method_not_allowed"
    if status == 503:
        return "service_unavailable"
    return "internal_server_error" if not isinstance(exc, HybridServeError) else type(exc).__name__


def _check_fields(body: dict[str, Any], allowed: dict[str, str | None]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise InvalidRequest(
            f"unknown field(s) {unknown}; this endpoint accepts {sorted(allowed)}"
        )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_int_ranges(body: dict[str, Any]) -> None:
    for name, (lo, hi) in INT_RANGES.items():
        v = body.get(name)
        if _is_int(v) and not lo <= v <= hi:
            raise ApiError(f"{name}={v} is out of range: it must be an integer in [{lo}, {hi}]", param=name)
    ids = body.get("stop_token_ids")
    if isinstance(ids, list):
        for t in ids:
            if _is_int(t) and not 0 <= t <= _U32:
                raise ApiError(f"stop_token_ids holds {t}, which is not a token id (0 <= id < 2^32)",
                               param="stop_token_ids")


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(f"'model' must be a string, got {type(model).__name__}", param="model")
    if model != served:
        raise ApiError(f"The model `{model}` does not exist; this server serves `{served}` (GET /v1/models).",
                       status=404, err_type="invalid_request_error", code="model_not_found", param="model")


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"'{name}' must be true or false, got {v!r}", param=name)
    return v


@dataclass
class StreamOptions:
    stream: bool
    include_usage: bool


def stream_options(body: dict[str, Any]) -> StreamOptions:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise ApiError("'stream_options' must be an object like {\"include_usage\": true}",
                           param="stream_options")
        if not stream:
            raise ApiError("'stream_options' is only allowed with \"stream\": true", param="stream_options")
        unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise ApiError(f"unknown stream_options {unknown}; accepted: include_usage", param="stream_options")
        include_usage = _bool(opts, "include_usage", False)
        if _bool(opts, "continuous_usage_stats", False):
            raise ApiError("stream_options.continuous_usage_stats is not supported: usage is sent once, in the "
                           "last chunk, with include_usage", param="stream_options")
    return StreamOptions(stream, include_usage)


# A logit_bias key: a token id in plain ASCII decimal digits, no sign, spaces,
# underscores or leading zeros (int() would also take "٥", "5_0", "+5" and " 5 ").
_CANONICAL_ID = re.compile(r"0|[1-9][0-9]{0,9}")


def _canonical_token_id(key: Any) -> int | None:
    if isinstance(key, str) and _CANONICAL_ID.fullmatch(key):
        return int(key)
    return None


def logit_bias(body: dict[str, Any], vocab_size: int) -> dict[int, float] | None:
    raw = body.get("logit_bias")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError("'logit_bias' must be an object mapping token ids to biases, e.g. {\"50256\": -100}",
                       param="logit_bias")
    out: dict[int, float] = {}
    for k, v in raw.items():
        tok = _canonical_token_id(k)
        if tok is None:
            raise ApiError(f"logit_bias key {str(k)[:40]!r} is not a token id written in decimal digits "
                           "(like \"50256\")", param="logit_bias")
        if not 0 <= tok < vocab_size:
            raise ApiError(f"logit_bias token id {tok} is outside the vocabulary [0, {vocab_size})",
                           param="logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ApiError(f"logit_bias[{k!r}] must be a finite number, got {v!r}", param="logit_bias")
        out[tok] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(v)))
    return out


def sampling_params_from(body: dict[str, Any], allowed: dict[str, str | None], *, chat: bool,
                         vocab_size: int) -> SamplingParams:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(body, allowed)
    check_int_ranges(body)
    kwargs = {dst: body[src] for src, dst in allowed.items() if dst is not None and src in body}
    if chat:
        if body.get("max_completion_tokens") is not None:
            if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
                raise ApiError("give max_completion_tokens or max_tokens (its old name), not both",
                               param="max_completion_tokens")
            kwargs["max_tokens"] = body["max_completion_tokens"]
        if _bool(body, "logprobs", False):
            top = body.get("top_logprobs")
            if top is not None and not _is_int(top):
                raise ApiError(f"'top_logprobs' must be an integer, got {top!r}", param="top_logprobs")
            kwargs["logprobs"] = top or 0
        elif body.get("top_logprobs") is not None:
            raise ApiError("'top_logprobs' needs \"logprobs\": true", param="top_logprobs")
    else:
        if body.get("logprobs") is not None:
            kwargs["logprobs"] = body["logprobs"]
    if kwargs.get("max_tokens") is None and not chat:
        kwargs["max_tokens"] = 16
    for k in [k for k, v in kwargs.items() if v is None and k not in ("seed", "stop", "stop_token_ids", "logprobs")]:
        del kwargs[k]  # null means "the default", as OpenAI treats it
    if chat and kwargs.get("max_tokens") is None:
        kwargs["max_tokens"] = None  # vLLM's chat default: the rest of the context
    bias = logit_bias(body, vocab_size)
    if bias:
        kwargs["logit_bias"] = bias
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(f"'user' must be a string (an end-user id), got {type(user).__name__}", param="user")
    params = SamplingParams(**kwargs)
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ApiError(f"stop_token_ids holds {bad[:5]}, outside the vocabulary [0, {vocab_size})",
                       param="stop_token_ids")
    return params


BEAM_SEARCH_UNSUPPORTED = ("stop", "stop_token_ids", "logprobs", "echo", "logit_bias", "min_tokens",
                           "presence_penalty", "frequency_penalty", "repetition_penalty", "top_p",
                           "top_k", "min_p", "best_of")
# Values that mean "off" for a field above (0 for the rest).
_NEUTRAL = {"top_p": (1,), "top_k": (-1, 0), "repetition_penalty": (1,), "best_of": (1,)}


def beam_search_params(body: dict[str, Any], params: SamplingParams) -> BeamSearchParams | None:
    """vLLM's ``use_beam_search``: ``n`` beams, deterministic (temperature 0 or
    omitted), non-streamed; None for an ordinary request."""
    if not _bool(body, "use_beam_search", False):
        if body.get("length_penalty") is not None:
            raise ApiError("'length_penalty' needs \"use_beam_search\": true", param="length_penalty")
        return None
    t = body.get("temperature")
    if t is not None and t != 0:
        raise ApiError(f"temperature must be 0 (or omitted) with use_beam_search, got {t!r}", param="temperature")
    if _bool(body, "stream", False):
        raise ApiError("use_beam_search returns whole results only; set \"stream\": false", param="stream")
    # The search scores beams by their plain log-probabilities: fields that would
    # change what it returns are refused rather than silently ignored.
    for field in BEAM_SEARCH_UNSUPPORTED:
        v = body.get(field)
        if v is not None and v is not False and v != [] and v != {} and v != "" and v not in _NEUTRAL.get(field, (0,)):
            raise ApiError(f"'{field}' is not supported with use_beam_search; remove it or turn beam "
                           "search off", param=field)
    lp = body.get("length_penalty", 1.0)
    if lp is None:
        lp = 1.0
    if isinstance(lp, bool) or not isinstance(lp, (int, float)):
        raise ApiError(f"'length_penalty' must be a number, got {lp!r}", param="length_penalty")
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens,
                                ignore_eos=params.ignore_eos, length_penalty=float(lp))
    except InvalidRequest as e:
        raise ApiError(str(e), param="n" if "beam_width" in str(e) else "length_penalty") from None


def request_priority(body: dict[str, Any]) -> tuple[int, str]:
    priority = body.get("priority", 0)
    if not _is_int(priority):
        raise InvalidRequest(f"priority must be an integer (lower runs first), got {priority!r}")
    klass = body.get("request_class", "default")
    if not isinstance(klass, str) or not klass or len(klass) > 64:
        raise InvalidRequest("request_class must be a non-empty string of at most 64 characters")
    return priority, klass


def _is_token_list(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(t) for t in v)


MAX_PROMPTS_PER_REQUEST = 256


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The prompts of a completion request: a string, a token list, or a list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        if len(prompt) > MAX_PROMPTS_PER_REQUEST:
            raise ApiError(f"at most {MAX_PROMPTS_PER_REQUEST} prompts per request, got {len(prompt)}",
                           param="prompt")
        return list(prompt)
    raise InvalidRequest(
        "'prompt' must be a string, a list of token ids, or a non-empty list of strings or of token-id lists"
    )


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Messages normalised for the chat template: text parts joined, null content as ''."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(f"messages[{i}].role={role!r} is not one of {list(CHAT_ROLES)}", param="messages")
        content = m.get("content")
        if content is None:
            if role != "assistant" and role != "tool":
                raise ApiError(f"messages[{i}].content is null; only an assistant message may omit its content",
                               param="messages")
            content = ""
        elif isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"messages[{i}].content[{j}] must be {{\"type\": \"text\", \"text\": str}}; "
                                   "this server takes text parts only", param="messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string, a list of text parts or null",
                           param="messages")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ApiError(f"messages[{i}].{key} must be a string, got {type(m[key]).__name__}",
                               param="messages")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise ApiError(f"messages[{i}].tool_calls must be a list of tool-call objects, got "
                           f"{type(calls).__name__}", param="messages")
        msg = {k: v for k, v in m.items() if k in ("name", "tool_calls", "tool_call_id")}
        msg.update(role=role, content=content)
        out.append(msg)
    return out


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(outs: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# ------------------------------------------------------------------ token text and bytes


# GPT-2's byte-level alphabet: byte-level BPE vocabularies spell each byte as one char.
_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


class TokenText:
    """Per-token text and raw bytes for logprobs, cached per token id.

    A byte-level token that is half a UTF-8 character decodes to U+FFFD; its bytes
    come from the vocabulary spelling instead, so two such tokens stay distinct."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}
        # What skip_special_tokens leaves out of a text.
        self.special_ids: frozenset[int] = frozenset(getattr(tokenizer, "all_special_ids", None) or ())

    def text(self, tok: int) -> str:
        t = self._text.get(tok)
        if t is None:
            t = self._text[tok] = self.tokenizer.decode([tok])
        return t

    def bytes(self, tok: int) -> list[int]:
        b = self._bytes.get(tok)
        if b is None:
            text = self.text(tok)
            b = list(text.encode("utf-8"))
            if "\ufffd" in text:
                piece = self.tokenizer.convert_ids_to_tokens(tok)
                if isinstance(piece, str) and piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                    b = [int(piece[3:5], 16)]
                elif isinstance(piece, str) and piece and all(c in _UNICODE_TO_BYTE for c in piece):
                    b = [_UNICODE_TO_BYTE[c] for c in piece]
            self._bytes[tok] = b
        return b


def _ranked(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    alts = [(t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k]
    return sorted(alts, key=lambda x: x[1].rank)


def completion_logprobs(
    tt: TokenText,
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    k: int,
    offset: int,
    skip_special_from: int | None = None,
) -> dict[str, Any]:
    """The legacy completions logprobs block (tokens, token_logprobs, top_logprobs,
    text_offset); ``offset`` is the character offset of the first token. An entry of
    None (the first prompt token) has no logprob. From position ``skip_special_from``
    on, special tokens are not in the response's text (skip_special_tokens), so they
    take no characters of it."""
    return _completion_logprobs(tt, token_ids, entries, k, offset, skip_special_from)[0]


def _completion_logprobs(tt: TokenText, token_ids: Any, entries: Any, k: int, offset: int,
                         skip_special_from: int | None) -> tuple[dict[str, Any], int]:
    """``completion_logprobs`` and the offset after its last token."""
    tokens, lps, tops, offsets = [], [], [], []
    special = tt.special_ids if skip_special_from is not None else ()
    for i, (tok, entry) in enumerate(zip(token_ids, entries)):
        text = tt.text(tok)
        tokens.append(text)
        offsets.append(offset)
        if not (tok in special and i >= skip_special_from):
            offset += len(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(entry[tok].logprob)
        top: dict[str, float] = {}
        for t, lp in [(tok, entry[tok])] + _ranked(entry, k):
            key = tt.text(t)
            if key in top and t != tok:
                # Two tokens with the same text (byte pieces): vLLM's id spelling keeps both.
                key = f"token_id:{t}"
            top.setdefault(key, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


# Positions per slice of a lazily encoded logprobs block: a slice of 20 alternatives
# each is built and encoded in about a millisecond.
LOGPROBS_SLICE = 128


class LazyLogprobs:
    """A logprobs block that is built and JSON-encoded a slice of positions at a time
    (:func:`json_pieces`), to the same text ``json.dumps`` gives the whole block.

    A 32K-token echo with 20 alternatives is ~700K numbers and ~20 MB of JSON: built in
    one call it holds the GIL (and, on the event loop, every stream) for seconds, and it
    keeps ~32K dicts alive for the collector. A slice's dicts die with the slice, and
    the encoder can hand the thread back between slices."""

    __slots__ = ("kind", "args", "end_offset")

    def __init__(self, kind: str, *args: Any) -> None:
        self.kind = kind  # "completion": completion_logprobs' args; "chat": chat_logprobs'
        self.args = args
        self.end_offset: int | None = None  # completion: the offset after the last token, once encoded

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "chat":
            return chat_logprobs(*self.args)
        block, self.end_offset = _completion_logprobs(*self.args)
        return block

    def pieces(self) -> Any:
        """The block's JSON text in pieces; an empty piece marks the end of a slice (a
        point where the encoder may yield)."""
        import json

        if self.kind == "chat":
            tt, ids, entries, k = self.args
            yield '{"content": ['
            for s in range(0, len(ids), LOGPROBS_SLICE):
                part = chat_logprobs(tt, ids[s:s + LOGPROBS_SLICE], entries[s:s + LOGPROBS_SLICE], k)["content"]
                yield (", " if s else "") + json.dumps(part)[1:-1]
                yield ""
            yield "]}"
            return
        tt, ids, entries, k, offset, skip_from = self.args
        it = iter(entries)
        cols: tuple[list[str], ...] = ([], [], [], [])
        names = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        for s in range(0, len(ids), LOGPROBS_SLICE):
            block, offset = _completion_logprobs(
                tt, ids[s:s + LOGPROBS_SLICE], itertools.islice(it, LOGPROBS_SLICE), k, offset,
                None if skip_from is None else skip_from - s)
            for col, name in zip(cols, names):
                col.append(json.dumps(block[name])[1:-1])
            yield ""
        self.end_offset = offset
        for i, (col, name) in enumerate(zip(cols, names)):
            yield ('{"' if i == 0 else ', "') + name + '": ['
            for j, frag in enumerate(col):
                yield (", " if j else "") + frag
            yield "]"
        yield "}"


def json_pieces(obj: Any) -> Any:
    """``json.dumps(obj)`` as a sequence of pieces (their concatenation is the same
    text); a :class:`LazyLogprobs` inside is encoded a slice at a time, and an empty
    piece marks a point where the consumer may yield."""
    import json

    if isinstance(obj, LazyLogprobs):
        yield from obj.pieces()
    elif isinstance(obj, dict) and obj and _has_lazy(obj):
        for i, (key, v) in enumerate(obj.items()):
            yield ("{" if i == 0 else ", ") + json.dumps(key) + ": "
            yield from json_pieces(v)
        yield "}"
    elif isinstance(obj, list) and obj and _has_lazy(obj):
        for i, v in enumerate(obj):
            yield "[" if i == 0 else ", "
            yield from json_pieces(v)
        yield "]"
    else:
        yield json.dumps(obj)


def _has_lazy(obj: Any) -> bool:
    if isinstance(obj, LazyLogprobs):
        return True
    if isinstance(obj, dict):
        return any(_has_lazy(v) for v in obj.values())
    if isinstance(obj, list):
        return any(_has_lazy(v) for v in obj)
    return False


def chat_logprobs(tt: TokenText, token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> dict[str, Any]:
    """The chat logprobs block: ``{"content": [{token, logprob, bytes, top_logprobs[]}]}``."""
    content = []
    for tok, entry in zip(token_ids, entries):
        content.append({
            "token": tt.text(tok),
            "logprob": entry[tok].logprob,
            "bytes": tt.bytes(tok),
            "top_logprobs": [
                {"token": tt.text(t), "logprob": lp.logprob, "bytes": tt.bytes(t)} for t, lp in _ranked(entry, k)
            ],
        })
    return {"content": content}


def completion_choice(index: int, c: CompletionOutput, out: RequestOutput, tt: TokenText,
                      params: SamplingParams, echo_text: str | None, lazy: bool = False) -> dict[str, Any]:
    text = c.text
    logprobs = None
    if echo_text is not None:
        text = echo_text + text
    if c.logprobs is not None:
        k = params.logprobs or 0
        ids, entries = list(c.token_ids), list(c.logprobs)
        offset = 0
        if echo_text is not None:
            plp = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            ids = list(out.prompt_token_ids) + ids
            # Chained, not listed: each prompt position's {token: Logprob} is made as it
            # is read and dropped after (a list would keep them all alive for the collector).
            entries = itertools.chain(plp, entries)
        skip_from = (len(ids) - len(c.token_ids)) if params.skip_special_tokens else None
        args = (tt, ids, entries, k, offset, skip_from)
        logprobs = LazyLogprobs("completion", *args) if lazy else completion_logprobs(*args)
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def completion_body(rid: str, model: str, outs: list[RequestOutput], tt: TokenText, params: SamplingParams,
                    echo_texts: list[str | None], lazy: bool = False) -> dict[str, Any]:
    """The response body; ``lazy``: its logprobs blocks are :class:`LazyLogprobs`
    (encode it with :func:`json_pieces`)."""
    n = params.n
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            completion_choice(i * n + c.index, c, out, tt, params, echo_texts[i], lazy)
            for i, out in enumerate(outs) for c in out.outputs
        ],
        "usage": usage(outs),
    }


def chat_body(rid: str, model: str, out: RequestOutput, tt: TokenText, params: SamplingParams,
              lazy: bool = False) -> dict[str, Any]:
    k = params.logprobs or 0

    def logprobs(c: CompletionOutput) -> Any:
        if c.logprobs is None:
            return None
        if lazy:
            return LazyLogprobs("chat", tt, list(c.token_ids), list(c.logprobs), k)
        return chat_logprobs(tt, c.token_ids, c.logprobs, k)

    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs(c),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ],
        "usage": usage([out]),
    }
