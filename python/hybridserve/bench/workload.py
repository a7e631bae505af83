"""Seeded benchmark traffic: request classes, lengths, shared prefixes, Poisson arrivals.

A workload is a list of :class:`BenchRequest` sorted by arrival time. It depends only
on the seed and the specs, never on the clock, so two runs (or the engine run and the
HF baseline of one run) send exactly the same requests.

A class is written as on the command line::

    interactive:rate=4,prompt=64-256,output=32-128,priority=0,prefix=128,weight=3

* ``prompt=A-B`` / ``output=A-B``: token lengths drawn uniformly from [A, B] (one
  number: fixed). ``prompt`` counts the request's own tokens; a class ``prefix=P``
  prepends the same P tokens to every prompt of the class (so the prompt is P + prompt).
* ``rate=R``: the class's own Poisson arrivals, R requests/s (``inf``: all at t=0).
  Without it the class gets its share of ``--request-rate``.
* ``weight=W``: share of ``--num-prompts`` (default: the rate when finite, else 1).
* ``priority=K``: sent with each request (lower runs first).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from hybridserve.errors import ConfigError

#: Default token-id range of synthetic prompts: printable ASCII, a valid id in any
#: real vocabulary and a plain byte for the byte-level tiny tokenizer.
DEFAULT_TOKEN_RANGE = (32, 127)


@dataclass(frozen=True)
class RequestClass:
    name: str
    prompt_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (16, 128)
    rate: float | None = None  # requests/s of this class; None: share of --request-rate
    priority: int = 0
    prefix_len: int = 0
    weight: float | None = None

    def share_weight(self) -> float:
        if self.weight is not None:
            return self.weight
        if self.rate is not None and math.isfinite(self.rate):
            return self.rate
        return 1.0


@dataclass
class BenchRequest:
    request_id: str
    request_class: str
    prompt: list[int] | str
    prompt_len: int  # tokens when known (synthetic); for text prompts, characters until run
    output_len: int
    priority: int
    arrival_time: float  # seconds after the start of the run

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("prompt")
        return d


@dataclass
class Workload:
    requests: list[BenchRequest]
    classes: list[RequestClass]
    seed: int
    request_rate: float
    description: dict[str, Any] = field(default_factory=dict)

    @property
    def class_names(self) -> list[str]:
        return [c.name for c in self.classes]


def _range(text: str, what: str) -> tuple[int, int]:
    a, sep, b = text.partition("-")
    try:
        lo, hi = int(a), int(b) if sep else int(a)
    except ValueError:
        raise ConfigError(f"{what} must be a length or a range such as 64-512, got {text!r}") from None
    if lo < 1 or hi < lo:
        raise ConfigError(f"{what} range {text!r} must satisfy 1 <= low <= high")
    return lo, hi


def parse_range(text: str, what: str = "length") -> tuple[int, int]:
    """``"64-512"`` -> (64, 512); ``"128"`` -> (128, 128)."""
    return _range(text, what)


def parse_rate(text: str, what: str = "--request-rate") -> float:
    """A request rate (per second) > 0, or ``inf`` for all at once."""
    try:
        r = float(text)
    except ValueError:
        raise ConfigError(f"{what} must be a number of requests per second or 'inf', got {text!r}") from None
    if not r > 0:
        raise ConfigError(f"{what} must be positive (or 'inf' for all at once), got {text!r}")
    return r


def parse_class(spec: str, *, default_prompt: tuple[int, int], default_output: tuple[int, int]) -> RequestClass:
    """Parse ``name:key=value,...`` (see the module docs for the keys)."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name or len(name) > 64:
        raise ConfigError(f"a request class needs a name of 1-64 characters: {spec!r}")
    kw: dict[str, Any] = {"prompt_len": default_prompt, "output_len": default_output}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"class {name!r}: expected key=value, got {item!r}")
        if key == "prompt":
            kw["prompt_len"] = _range(value, f"class {name!r} prompt")
        elif key == "output":
            kw["output_len"] = _range(value, f"class {name!r} output")
        elif key == "rate":
            kw["rate"] = parse_rate(value, f"class {name!r} rate")
        elif key == "priority":
            try:
                kw["priority"] = int(value)
            except ValueError:
                raise ConfigError(f"class {name!r}: priority must be an integer, got {value!r}") from None
        elif key == "prefix":
            try:
                kw["prefix_len"] = int(value)
            except ValueError:
                kw["prefix_len"] = -1
            if kw["prefix_len"] < 0:
                raise ConfigError(f"class {name!r}: prefix must be a whole number of tokens, got {value!r}")
        elif key == "weight":
            try:
                kw["weight"] = float(value)
            except ValueError:
                kw["weight"] = -1.0
            if not kw["weight"] > 0:
                raise ConfigError(f"class {name!r}: weight must be a positive number, got {value!r}")
        else:
            raise ConfigError(
                f"class {name!r}: unknown key {key!r}; use rate, prompt, output, priority, prefix, weight"
            )
    return RequestClass(name=name, **kw)


def _split_counts(total: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of ``total`` by ``weights`` (deterministic, sums to total)."""
    w = np.asarray(weights, dtype=float)
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(int)
    order = np.argsort(-(exact - counts), kind="stable")
    for i in order[: total - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


def _arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    if not math.isfinite(rate):
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def load_dataset(path: str) -> list[dict[str, Any]]:
    """A JSONL file: one object per line with ``prompt`` (text or token ids) and
    optionally ``output_len`` (or ``max_tokens``) and ``class``."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{lineno}: not valid JSON ({e})") from None
            prompt = row.get("prompt") if isinstance(row, dict) else None
            if not (isinstance(prompt, str) and prompt) and not (
                isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
            ):
                raise ConfigError(f"{path}:{lineno}: each line needs a non-empty 'prompt' (text or token ids)")
            rows.append(row)
    if not rows:
        raise ConfigError(f"{path} holds no prompts")
    return rows


def generate_workload(
    *,
    num_prompts: int,
    seed: int = 0,
    classes: list[RequestClass] | None = None,
    request_rate: float = math.inf,
    prompt_len: tuple[int, int] = (64, 512),
    output_len: tuple[int, int] = (16, 128),
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
    dataset: list[dict[str, Any]] | None = None,
) -> Workload:
    """The requests of one benchmark run; the same arguments give the same requests."""
    if num_prompts < 1:
        raise ConfigError(f"--num-prompts must be at least 1, got {num_prompts}")
    if not request_rate > 0:
        raise ConfigError(f"--request-rate must be positive or inf, got {request_rate}")
    classes = classes or [RequestClass("default", prompt_len, output_len)]
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ConfigError(f"request class names must be distinct, got {names}")
    lo_tok, hi_tok = token_range
    if not 0 <= lo_tok < hi_tok:
        raise ConfigError(f"token range {token_range} must satisfy 0 <= low < high")
    by_name = {c.name: i for i, c in enumerate(classes)}
    # Each class draws from its own stream, so adding a class or changing one
    # class's lengths leaves the other classes' requests as they were.
    rngs = [np.random.default_rng([seed, i]) for i in range(len(classes))]
    weights = [c.share_weight() for c in classes]
    total_w = sum(weights)

    per_class: list[list[tuple[list[int] | str, int, int]]] = [[] for _ in classes]
    if dataset is None:
        counts = _split_counts(num_prompts, weights)
        for i, (c, n) in enumerate(zip(classes, counts)):
            rng = rngs[i]
            prefix = rng.integers(lo_tok, hi_tok, size=c.prefix_len).tolist()
            plens = rng.integers(c.prompt_len[0], c.prompt_len[1] + 1, size=n)
            olens = rng.integers(c.output_len[0], c.output_len[1] + 1, size=n)
            for pl, ol in zip(plens.tolist(), olens.tolist()):
                ids = prefix + rng.integers(lo_tok, hi_tok, size=pl).tolist()
                per_class[i].append((ids, len(ids), ol))
    else:
        pick = np.random.default_rng([seed, 1 << 20])
        idx = (pick.permutation(len(dataset))[:num_prompts] if num_prompts <= len(dataset)
               else pick.integers(0, len(dataset), size=num_prompts))
        rot = 0
        for j in idx.tolist():
            row = dataset[j]
            klass = row.get("class")
            if klass is None:
                i = rot % len(classes)  # untagged rows go round the classes
                rot += 1
            elif klass in by_name:
                i = by_name[klass]
            else:
                raise ConfigError(f"dataset row of class {klass!r}, which no --class defines ({names})")
            c = classes[i]
            ol = row.get("output_len", row.get("max_tokens"))
            if ol is None:
                ol = int(rngs[i].integers(c.output_len[0], c.output_len[1] + 1))
            prompt = row["prompt"]
            per_class[i].append((prompt, len(prompt), int(ol)))

    reqs: list[BenchRequest] = []
    for i, c in enumerate(classes):
        rate = c.rate if c.rate is not None else request_rate * weights[i] / total_w
        times = _arrivals(rngs[i], len(per_class[i]), rate)
        for k, ((prompt, plen, ol), t) in enumerate(zip(per_class[i], times.tolist())):
            reqs.append(BenchRequest(
                request_id=f"{c.name}-{k}", request_class=c.name, prompt=prompt, prompt_len=plen,
                output_len=ol, priority=c.priority, arrival_time=float(t),
            ))
    reqs.sort(key=lambda r: (r.arrival_time, by_name[r.request_class], r.request_id))
    return Workload(
        requests=reqs, classes=list(classes), seed=seed, request_rate=request_rate,
        description={
            "num_prompts": num_prompts,
            "seed": seed,
            "request_rate": request_rate if math.isfinite(request_rate) else "inf",
            "token_range": list(token_range),
            "dataset": dataset is not None,
            "classes": [
                {**asdict(c), "rate": (None if c.rate is None else (c.rate if math.isfinite(c.rate) else "inf")),
                 "count": len(per_class[i])}
                for i, c in enumerate(classes)
            ],
        },
    )
