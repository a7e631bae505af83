"""Grammar compilation with xgrammar: one compiler per tokenizer, a cache keyed by the
constraint, and a time bound so that a pathological schema is a 400, not a stuck engine.

Every constraint is compiled as an xgrammar *structural tag*: the plain kinds become one
format (``json_schema``, ``regex``, ``grammar``), and a request whose output opens inside
Qwen3.5's reasoning block gets a ``</think>``-terminated free-text prefix in front, so the
constraint holds only after the reasoning (see ``StructuredOutputsParams.reasoning``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Any

from hybridserve.errors import InvalidRequest
from hybridserve.structured.params import StructuredOutputsParams

logger = logging.getLogger("hybridserve.structured")

# A compile that takes longer than this is refused (xgrammar cannot be interrupted; the
# worker thread finishes it in the background and its result is dropped).
DEFAULT_COMPILE_TIMEOUT_S = 10.0
# Compiled grammars kept (LRU); a Qwen-vocabulary JSON schema takes ~0.1-1 MB.
DEFAULT_CACHE_SIZE = 256
# Consecutive whitespace characters JSON may hold between tokens: a bound keeps an
# untrained or looping model from spending its whole budget on spaces.
JSON_MAX_WHITESPACE = 2
# Text the reasoning block may not contain (the tags themselves).
THINK_EXCLUDES = ["<think>", "</think>"]
THINK_END, THINK_SUFFIX = "</think>", "\n\n"


def _require_xgrammar():
    try:
        import xgrammar  # noqa: F401
    except ImportError as e:  # pragma: no cover - a dependency of the package
        raise InvalidRequest("structured outputs need the 'xgrammar' package (pip install xgrammar)") from e
    import xgrammar
    return xgrammar


def constraint_format(spec: StructuredOutputsParams) -> dict[str, Any]:
    """The structural-tag format (a JSON-ready dict) of one constraint."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        fmt: dict[str, Any] = {"type": "grammar",
                               "grammar": json_schema_ebnf({"type": "object"} if kind == "json_object" else spec.json)}
    elif kind == "regex":
        fmt = {"type": "regex", "pattern": spec.regex}
    elif kind == "choice":
        fmt = {"type": "regex", "pattern": "|".join("(?:" + re.escape(c) + ")" for c in spec.choice)}
    elif kind == "grammar":
        fmt = {"type": "grammar", "grammar": spec.grammar}
    else:  # structural_tag: a whole tag, or just its format
        tag = spec.structural_tag
        fmt = tag["format"] if tag.get("type") == "structural_tag" and "format" in tag else tag
    if spec.reasoning:
        fmt = {"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": THINK_EXCLUDES},
             "end": THINK_END},
            {"type": "const_string", "value": THINK_SUFFIX},
            fmt,
        ]}
    return fmt


# xgrammar 0.2.9 gives strings with maxLength/minLength the character class below, which
# lets raw control characters (U+0000-U+001F but CR/LF) into a JSON string: strict JSON
# parsers reject them. Its unbounded strings already exclude them; so do these.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_STRICT_STRING_CHAR = r'[^\0-\x1f\"\\]'


# JSON-schema keywords xgrammar 0.2.9 accepts but does not enforce (checked against its
# matcher: an output breaking them is accepted). A schema using one is refused, so that
# "validates against the schema" stays true of every output.
UNENFORCED_KEYWORDS = ("uniqueItems", "not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                       "dependencies")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_ONE = ("additionalProperties", "unevaluatedProperties", "items", "additionalItems", "contains",
                  "propertyNames", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def unenforced_keywords(schema: Any, path: str = "$") -> list[str]:
    """``["keyword at path", ...]`` for each keyword the grammar would silently ignore."""
    out: list[str] = []
    if not isinstance(schema, dict):
        return out
    for kw in UNENFORCED_KEYWORDS:
        if kw in schema:
            out.append(f"{kw!r} at {path}")
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        out.append(f"'allOf' with {len(schema['allOf'])} schemas at {path} (merge them into one)")
    for key in _SUBSCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, s in sub.items():
                out += unenforced_keywords(s, f"{path}.{key}.{name}")
    for key in _SUBSCHEMA_ONE:
        if isinstance(schema.get(key), dict):
            out += unenforced_keywords(schema[key], f"{path}.{key}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, s in enumerate(schema[key]):
                out += unenforced_keywords(s, f"{path}.{key}[{i}]")
    return out


def json_schema_ebnf(schema: Any) -> str:
    """The EBNF of a JSON schema (xgrammar's conversion, whitespace runs bounded, string
    characters as strict JSON allows them)."""
    import json

    bad = unenforced_keywords(schema)
    if bad:
        raise InvalidRequest("the JSON schema uses keywords the engine cannot enforce: " + ", ".join(bad[:8])
                             + "; remove them (or validate them after the response)")
    xgr = _require_xgrammar()
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), max_whitespace_cnt=JSON_MAX_WHITESPACE,
                                               strict_mode=True)
    except Exception as e:  # noqa: BLE001 - xgrammar raises several types
        raise InvalidRequest(f"cannot compile the json constraint: {_short(e)}") from None
    return str(grammar).replace(_LOOSE_STRING_CHAR, _STRICT_STRING_CHAR)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe; caches by the constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        xgr = _require_xgrammar()
        self.xgr = xgr
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = list(stop_token_ids)
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2, cache_enabled=False)
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar-compile")
        # Metrics: compiles, cache hits, total compile seconds, timeouts, by kind.
        self.compiles = 0
        self.cache_hits = 0
        self.compile_seconds = 0.0
        self.timeouts = 0
        self.requests_by_kind: dict[str, int] = {}

    def _compile_now(self, spec: StructuredOutputsParams) -> Any:
        import json

        t0 = time.perf_counter()
        tag = {"type": "structural_tag", "format": constraint_format(spec)}
        compiled = self._compiler.compile_structural_tag(json.dumps(tag))
        dt = time.perf_counter() - t0
        with self._lock:
            self.compiles += 1
            self.compile_seconds += dt
        logger.debug("compiled a %s constraint in %.1f ms", spec.kind, dt * 1e3)
        return compiled

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached); InvalidRequest naming the problem when the
        constraint does not compile or does not compile within the time bound."""
        key = spec.key()
        with self._lock:
            self.requests_by_kind[spec.kind] = self.requests_by_kind.get(spec.kind, 0) + 1
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
            fut = self._pending.get(key)
            if fut is None:
                fut = self._pending[key] = self._pool.submit(self._compile_now, spec)
        try:
            compiled = fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.timeouts += 1
            raise InvalidRequest(
                f"the {spec.kind} constraint did not compile within {self.timeout_s:g} s; simplify it "
                "(fewer alternatives, bounded repetitions, smaller enums)") from None
        except InvalidRequest:
            with self._lock:
                self._pending.pop(key, None)
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / its own errors
            with self._lock:
                self._pending.pop(key, None)
            raise InvalidRequest(f"cannot compile the {spec.kind} constraint: {_short(e)}") from None
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"compiles": self.compiles, "cache_hits": self.cache_hits,
                    "compile_seconds": self.compile_seconds, "compile_timeouts": self.timeouts,
                    "requests_by_kind": dict(self.requests_by_kind)}


def _short(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text if len(text) <= 400 else text[:400] + " ..."


# -- Qwen3.5's XML tool-call arguments ------------------------------------------------
#
# The checkpoint's template renders a call's arguments as
#     <parameter=P>\nVALUE\n</parameter>\n
# one after another between "<function=NAME>\n" and "</function>": exactly one newline
# after the opening tag and one before the closing tag, a string VALUE raw (not JSON),
# anything else as JSON. xgrammar's own "qwen_xml" style lets 0-2 whitespace characters
# in around every value, so a string's own leading / trailing whitespace could not be
# told from the format's; these formats allow exactly the template's text, and the
# parser (server/tools.py) takes exactly one newline off each side.

QWEN_PARAM_CLOSE = "</parameter>"
_STRING_ONLY_KEYWORDS = {"type", "description", "title", "default", "examples", "enum", "const", "pattern",
                         "minLength", "maxLength", "$comment", "deprecated", "readOnly", "writeOnly"}


def _is_string_schema(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    t = schema.get("type")
    if t == "string" or t == ["string"]:
        return True
    if t is None:
        for key in ("enum",):
            vals = schema.get(key)
            if isinstance(vals, list) and vals and all(isinstance(v, str) for v in vals):
                return True
        if isinstance(schema.get("const"), str):
            return True
    return False


def _pattern_body(pattern: str) -> str:
    """A JSON-schema pattern as a whole-value regex (schemas anchor with ^...$; the
    value must match whole, as xgrammar reads patterns)."""
    if pattern.startswith("^"):
        pattern = pattern[1:]
    if pattern.endswith("$") and not pattern.endswith("\\$"):
        pattern = pattern[:-1]
    return pattern


def qwen_xml_string_format(schema: dict[str, Any], where: str) -> dict[str, Any]:
    """The format of a raw string VALUE under ``schema``."""
    extra = sorted(set(schema) - _STRING_ONLY_KEYWORDS)
    if extra:
        raise InvalidRequest(f"{where}: the keywords {extra} cannot be enforced on a raw string value in "
                             "Qwen's XML tool-call format; remove them")
    if "const" in schema:
        return {"type": "const_string", "value": str(schema["const"])}
    if "enum" in schema:
        vals = [v for v in schema["enum"] if isinstance(v, str)]
        if not vals:
            raise InvalidRequest(f"{where}: a string parameter's enum has no string value")
        return {"type": "or", "elements": [{"type": "const_string", "value": v} for v in vals]}
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    if "pattern" in schema:
        if lo is not None or hi is not None:
            raise InvalidRequest(f"{where}: 'pattern' together with 'minLength'/'maxLength' cannot be "
                                 "enforced on a raw string value; fold the length into the pattern")
        return {"type": "regex", "pattern": _pattern_body(schema["pattern"])}
    if lo is not None or hi is not None:
        return {"type": "regex", "pattern": "[\\s\\S]{%d,%s}" % (int(lo or 0), "" if hi is None else int(hi))}
    # Free text: anything but the closing tag itself, so the parser's first
    # "</parameter>" is the value's end.
    return {"type": "any_text", "excludes": [QWEN_PARAM_CLOSE]}


def qwen_xml_value_format(schema: Any, where: str) -> dict[str, Any]:
    """The format of one parameter's VALUE: raw text for a string schema, JSON for any
    other; a schema that allows both (``["string", "null"]``, an ``anyOf`` with a string
    branch) allows either writing, as the parser reads them (server/tools.convert_value)."""
    if _is_string_schema(schema):
        return qwen_xml_string_format(schema, where)
    if isinstance(schema, dict):
        t = schema.get("type")
        if isinstance(t, list) and "string" in t:
            string_part = {k: v for k, v in schema.items() if k in _STRING_ONLY_KEYWORDS and k not in ("enum", "const")}
            string_part["type"] = "string"
            rest = [x for x in t if x != "string"]
            elements = [qwen_xml_string_format(string_part, where)]
            if rest:
                elements.append({"type": "grammar", "grammar": json_schema_ebnf({**schema, "type": rest})})
            return elements[0] if len(elements) == 1 else {"type": "or", "elements": elements}
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches and t is None and any(
                    _is_string_schema(b) or (isinstance(b, dict) and isinstance(b.get("type"), list)
                                             and "string" in b["type"]) for b in branches):
                return {"type": "or", "elements": [qwen_xml_value_format(b, f"{where}.{key}[{i}]")
                                                   for i, b in enumerate(branches)]}
    return {"type": "grammar", "grammar": json_schema_ebnf(schema if isinstance(schema, dict) else {})}


def qwen_xml_arguments_format(parameters: dict[str, Any], where: str = "tools") -> dict[str, Any]:
    """The format of a call's arguments, from just after "<function=NAME>\\n" up to
    "</function>": each property in the schema's order, the required ones always and the
    others optionally, each as the template writes it."""
    props = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    unknown = sorted(required - set(props))
    if unknown:
        raise InvalidRequest(f"{where}: 'required' names {unknown}, which are not in 'properties'")
    elements: list[dict[str, Any]] = []
    for name, sub in props.items():
        if not re.fullmatch(r"[^<>\n]+", name):
            raise InvalidRequest(f"{where}: the parameter name {name!r} cannot be written in Qwen's XML "
                                 "tool-call format (no '<', '>' or newline)")
        tag = {"type": "tag", "begin": f"<parameter={name}>\n",
               "content": qwen_xml_value_format(sub, f"{where}: parameter {name!r}"),
               "end": "\n" + QWEN_PARAM_CLOSE + "\n"}
        elements.append(tag if name in required else {"type": "optional", "content": tag})
    if not elements:
        return {"type": "const_string", "value": ""}
    if len(elements) == 1:
        return elements[0]
    return {"type": "sequence", "elements": elements}
