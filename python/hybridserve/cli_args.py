"""The arguments ``serve``, ``bench throughput`` and ``plan`` share, spelled as vLLM
spells them, with one validation each (issue 32).

* ``--kv-cache-memory-bytes SIZE``: the cache arena's one byte budget. vLLM's forms
  (``4294967296``, ``4G`` = 4 GiB, ``4g`` = 4 GB, ``512M``, ``1.5G``) and the
  planner's (``4GiB``, ``512MiB``, ``80GB``). The older spellings ``--kv-cache-memory``
  (serve, bench) and ``--pool-mib N`` (plan, MiB) still work and print a warning.
* ``--kv-cache-dtype``: ``auto`` (the model's dtype) or a dtype; ``plan --kv-dtype``
  is its old spelling.
* ``--block-size``: a power of two, the same rule the engine enforces.
* ``--seed``, ``--tokenizer``.
* a model name: a checkpoint directory, or ``tiny:PRESET`` (a generated tiny model).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Any

from hybridserve.argtypes import positive_int
from hybridserve.errors import ConfigError

TINY_PREFIX = "tiny:"
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

# vLLM's human-readable integers: a lower-case suffix is decimal, an upper-case one binary.
_VLLM_INT_RE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def memory_bytes(text: str) -> int:
    """A byte count as ``--kv-cache-memory-bytes`` takes it (see the module's docs)."""
    from hybridserve.planner import parse_size

    t = str(text).strip().replace("_", "")
    if t.isdigit():
        value = int(t)
    elif m := _VLLM_INT_RE.fullmatch(t):
        num, suffix = m.groups()
        scale = _DECIMAL.get(suffix) or _BINARY[suffix]
        whole, _, frac = num.partition(".")
        value = int(whole) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
    else:
        try:
            value = parse_size(t)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(
                f"{e}; or bytes as vLLM writes them: 4294967296, 4G (GiB), 4g (GB), 512M") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of bytes")
    return value


def mib_as_bytes(text: str) -> int:
    """``--pool-mib N``: N MiB, in bytes."""
    return positive_int(text) << 20


def block_size(text: str) -> int:
    """Tokens per KV block: a power of two (the engine's paged kernels need one)."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(
            f"--block-size {value} is not a power of two; use 8, 16, 32, ...")
    return value


def kv_cache_dtype(text: str) -> str:
    """A dtype the engine's cache arena holds, or ``auto``."""
    name = text.removeprefix("torch.")
    if name not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(
            f"--kv-cache-dtype {text!r} is not supported; use one of {', '.join(KV_CACHE_DTYPES)}")
    return name


def planned_kv_dtype(text: str) -> str:
    """``plan`` also sizes dtypes the engine does not serve yet (float8: what-if)."""
    from hybridserve.config import DTYPE_BYTES

    name = text.removeprefix("torch.")
    if name != "auto" and name not in DTYPE_BYTES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; use auto or one of {', '.join(sorted(DTYPE_BYTES))}")
    return name


class _Store(argparse.Action):
    """Stores like ``store``, but refuses one setting given twice with different values
    (``--kv-cache-memory-bytes 1G --pool-mib 512``), and warns on a deprecated spelling."""

    def __init__(self, option_strings: list[str], dest: str, deprecated: dict[str, str] | None = None,
                 **kwargs: Any) -> None:
        self.deprecated = deprecated or {}
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if option_string in self.deprecated:
            print(f"hybridserve: warning: {option_string} is deprecated; use {self.deprecated[option_string]} "
                  "(vLLM's name)", file=sys.stderr)
        given = vars(namespace).setdefault("_given", {})
        prev = given.get(self.dest)
        if prev is not None and prev[0] != option_string and prev[1] != values:
            parser.error(f"{prev[0]} and {option_string} both set {self.dest.replace('_', '-')} "
                         f"({prev[1]} vs {values}); give it once")
        given[self.dest] = (option_string, values)
        setattr(namespace, self.dest, values)


def add_memory_budget(group: Any, *, old_spelling: str | None = None, default_help: str) -> None:
    """``--kv-cache-memory-bytes`` and, for scripts, the command's old spelling of it."""
    group.add_argument(
        "--kv-cache-memory-bytes", dest="kv_cache_memory_bytes", type=memory_bytes, action=_Store,
        default=None, metavar="SIZE",
        help="the one byte budget of the cache arena (KV blocks, DeltaNet state, checkpoints): bytes, "
             f"4G (GiB), 4g (GB), 512MiB, 80GB (default: {default_help})")
    if old_spelling == "--kv-cache-memory":
        group.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=memory_bytes,
                           action=_Store, deprecated={"--kv-cache-memory": "--kv-cache-memory-bytes"},
                           metavar="SIZE", help="deprecated spelling of --kv-cache-memory-bytes (default: unset)")
    elif old_spelling == "--pool-mib":
        group.add_argument("--pool-mib", dest="kv_cache_memory_bytes", type=mib_as_bytes, action=_Store,
                           deprecated={"--pool-mib": "--kv-cache-memory-bytes NMiB"}, metavar="N",
                           help="deprecated: --kv-cache-memory-bytes in MiB (default: unset)")


def add_kv_cache_dtype(group: Any, *, old_spelling: bool = False, planning: bool = False) -> None:
    kind = planned_kv_dtype if planning else kv_cache_dtype
    group.add_argument("--kv-cache-dtype", type=kind, action=_Store, default="auto",
                       help="dtype of the cache arena's KV and state pages; auto = the model's dtype "
                            "(default: auto)")
    if old_spelling:
        group.add_argument("--kv-dtype", dest="kv_cache_dtype", type=kind, action=_Store,
                           deprecated={"--kv-dtype": "--kv-cache-dtype"},
                           help="deprecated spelling of --kv-cache-dtype (default: auto)")


def speculative_config(text: str) -> Any:
    """``--speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'`` (vLLM's)."""
    from hybridserve.errors import ConfigError
    from hybridserve.spec.config import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_speculative_config(group: Any) -> None:
    group.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                       help="speculative decoding with the checkpoint's MTP layer, vLLM's JSON: "
                            "'{\"method\": \"mtp\", \"num_speculative_tokens\": 2}' (default: off)")


def add_block_size(group: Any) -> None:
    group.add_argument("--block-size", type=block_size, default=16,
                       help="tokens per KV block, a power of two (default: 16)")


def add_seed_and_tokenizer(group: Any, *, seed_help: str = "the engine's random seed (default: 0)") -> None:
    group.add_argument("--seed", type=int, default=0, help=seed_help)
    group.add_argument("--tokenizer", default=None, metavar="DIR",
                       help="tokenizer directory, if not the checkpoint's (default: the checkpoint's)")


def resolve_model(name: str | None) -> str:
    """A checkpoint directory for a model name: ``tiny:PRESET`` (generated once into the
    cache), None (the embedded default tiny model), or a path as given."""
    from hybridserve.server.serve import default_model_dir

    if name is None:
        return default_model_dir()
    if name.startswith(TINY_PREFIX):
        return default_model_dir(name.removeprefix(TINY_PREFIX))
    return name


__all__ = ["speculative_config", "add_speculative_config", "memory_bytes", "block_size", "kv_cache_dtype", "add_memory_budget", "add_kv_cache_dtype",
           "add_block_size", "add_seed_and_tokenizer", "resolve_model"]
