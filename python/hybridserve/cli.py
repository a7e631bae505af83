"""The ``hybridserve`` command line: one subcommand per entry of :data:`SUBCOMMANDS`.

``main(argv)`` returns the exit status (0 success, 2 bad input) instead of exiting, so
tests and embedding code can call it; the console script hands it to ``sys.exit``.
A new subcommand (``serve``) is one more :class:`Subcommand` in the dict.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from hybridserve import cli_args
from hybridserve.argtypes import non_negative_int, positive_int, size
from hybridserve.bench.cli import add_bench_arguments, run_bench
from hybridserve.errors import FatalEngineError, HybridServeError
from hybridserve.server.serve import add_serve_arguments, run_serve

EXIT_OK = 0
EXIT_BAD_INPUT = 2


@dataclass(frozen=True)
class Subcommand:
    """``add_arguments`` fills the subcommand's parser; ``run`` returns the exit status."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---- argument types (argparse turns ArgumentTypeError into exit 2 + usage) -----------


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; write e.g. 0.9") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(
            f"{text!r} must be a fraction of device memory in (0, 1]; write e.g. 0.9"
        )
    return value


def _device_memory(text: str) -> int:
    """A size (``80GB``, ``141GB``, ``80GiB``) or a device name (``h100``, ``h200``)."""
    from hybridserve.planner import DEVICE_MEMORY, device_memory_bytes

    named = device_memory_bytes(text)
    if named is not None:
        return named
    try:
        return size(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; or name a device: {', '.join(DEVICE_MEMORY)}") from None


# ---- plan ----------------------------------------------------------------------------


def _add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", metavar="CONFIG",
        help="a shipped preset (qwen3.5-27b, qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b; "
        "quantized forms qwen3.5-27b-q4_k_m, qwen3.5-27b-fp8, qwen3.5-35b-a3b-q4_k_m, qwen3.5-35b-a3b-fp8), "
        "a config.json, a checkpoint directory, or tiny:PRESET (a generated tiny model)",
    )
    mem = p.add_argument_group("memory (the arena's budget is --kv-cache-memory-bytes, else derived from the device)")
    mem.add_argument(
        "--device-memory", type=_device_memory, default="80GB", metavar="SIZE|DEVICE",
        help="memory of one device: 80GB (decimal), 80GiB, 81559MiB, or a device name "
        "(h100 = 80GB, h200 = 141GB, b200 = 180GB) (default: 80GB)",
    )
    mem.add_argument(
        "--gpu-memory-utilization", type=_fraction, default=0.9, metavar="FRACTION",
        help="fraction of device memory hybridserve may use (default: 0.9)",
    )
    mem.add_argument(
        "--reserve", type=size, default="2GiB", metavar="SIZE",
        help="runtime reserve for activations and the CUDA context (default: 2GiB)",
    )
    cli_args.add_memory_budget(mem, old_spelling="--pool-mib",
                               default_help="derived from --device-memory and the above; when given, "
                                            "those are ignored")
    mem.add_argument(
        "--enforce-eager", action="store_true",
        help="the engine will run without CUDA graphs: no scratch state is set aside "
        "(default: one sequence's state pages are, as on CUDA)",
    )
    mem.add_argument(
        "--min-sessions", type=positive_int, default=None, metavar="K",
        help="the same as --sessions K without --shared-prefix (kept for scripts)",
    )
    mem.add_argument(
        "--max-num-seqs", type=positive_int, default=None, metavar="N",
        help="cap the session counts at the engine's max_num_seqs (default: no cap)",
    )
    p.add_argument(
        "--context", type=positive_int, default=32768, metavar="L",
        help="tokens per session (default: 32768)",
    )
    cli_args.add_block_size(p)
    cli_args.add_kv_cache_dtype(p, old_spelling=True, planning=True)
    cli_args.add_speculative_config(p)
    p.add_argument(
        "--omit-conv-state", action="store_true",
        help="leave the DeltaNet conv state out of the seed's byte counts, as the seed does "
        "(the arena's page counts always hold it)",
    )
    share = p.add_argument_group("scenarios")
    share.add_argument(
        "--shared-prefix", type=non_negative_int, metavar="P",
        help="sessions share their first P tokens (with --sessions)",
    )
    share.add_argument(
        "--sessions", type=positive_int, metavar="K",
        help="K sessions of --context tokens at once: the smallest number of devices (tensor "
        "parallel) that runs them, with each device's numbers; with --shared-prefix P they "
        "share their first P tokens",
    )
    share.add_argument("--n", type=positive_int, default=1, help="samples per request (default: 1)")
    share.add_argument(
        "--prompt-len", type=non_negative_int, metavar="P",
        help="with --n > 1: the shared prompt's length (default: context - 1, i.e. each "
        "sample has written its first token)",
    )
    tp = p.add_argument_group("tensor parallelism (one model over N devices)")
    tp.add_argument(
        "--tensor-parallel-size", "-tp", type=positive_int, default=None, metavar="N",
        help="show what each of N devices holds (its shard of the weights, its share of every "
        "sequence's KV and DeltaNet state) and how many sessions the N run; with --kv-cache-memory-bytes "
        "that is each device's arena budget. N must divide the model's heads, intermediate "
        "widths and vocabulary (KV heads replicate when N is a multiple of them)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _run_plan(args: argparse.Namespace) -> int:
    from hybridserve import planner as pl
    from hybridserve.config import ModelConfig
    from hybridserve.presets import preset_names, resolve_config

    config_path = resolve_config(
        cli_args.resolve_model(args.config) if args.config.startswith(cli_args.TINY_PREFIX) else args.config)
    if not os.path.exists(config_path):
        raise _BadInput(
            f"{args.config!r} is not a config.json, a checkpoint directory or a preset "
            f"({', '.join(preset_names())})"
        )
    checkpoint_dir = config_path if os.path.isdir(config_path) or config_path.endswith(".gguf") else None
    if checkpoint_dir is not None and os.path.isdir(checkpoint_dir) and not any(
        f.endswith(".safetensors") for f in os.listdir(checkpoint_dir)
    ):
        checkpoint_dir = None  # a directory with only config.json: count parameters
    config = ModelConfig.from_json(config_path)
    if args.shared_prefix is not None and args.sessions is None:
        raise _BadInput("--shared-prefix P needs --sessions K: how many sessions share the prefix")
    if args.sessions is not None and args.min_sessions is not None and args.sessions != args.min_sessions:
        raise _BadInput(
            f"--sessions {args.sessions} and --min-sessions {args.min_sessions} disagree; "
            "give one (--min-sessions is the old name of --sessions)")
    min_sessions = args.sessions or args.min_sessions or 1
    if args.kv_cache_memory_bytes is not None and (args.sessions or args.min_sessions) and args.shared_prefix is None:
        raise _BadInput(
            "--sessions K without --shared-prefix asks how many devices run K sessions, which "
            "needs a device (--device-memory), not --kv-cache-memory-bytes")
    if args.prompt_len is not None and args.n == 1:
        raise _BadInput("--prompt-len only matters with --n greater than 1")
    report = pl.capacity_report(
        config,
        context_len=args.context,
        pool_bytes=args.kv_cache_memory_bytes,
        device_memory=args.device_memory,
        utilization=args.gpu_memory_utilization,
        reserve=args.reserve,
        checkpoint_dir=checkpoint_dir,
        block_size=args.block_size,
        kv_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        include_conv=not args.omit_conv_state,
        cuda_graphs=not args.enforce_eager,
        max_num_seqs=args.max_num_seqs,
        min_sessions=min_sessions,
        shared_prefix_len=args.shared_prefix,
        sessions=args.sessions if args.shared_prefix is not None else None,
        n=args.n,
        prompt_len=args.prompt_len,
        tensor_parallel=args.tensor_parallel_size,
        speculative_tokens=(args.speculative_config.num_speculative_tokens
                            if args.speculative_config is not None else 0),
    )
    d = report.to_dict()
    d["speculative_config"] = None if args.speculative_config is None else args.speculative_config.to_dict()
    d["config"] = os.fspath(args.config)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(pl.render_plan(report, config_name=os.fspath(args.config)))
    return EXIT_OK


class _BadInput(Exception):
    """Input that argparse's types cannot see alone (combinations of options)."""


SUBCOMMANDS: dict[str, Subcommand] = {
    "plan": Subcommand(
        help="memory plan: the arena's pages, sessions that fit (paged vs reserved), devices needed",
        add_arguments=_add_plan_arguments,
        run=_run_plan,
    ),
    "serve": Subcommand(
        help="serve a checkpoint (default: the embedded tiny model) over an OpenAI-compatible HTTP API",
        add_arguments=add_serve_arguments,
        run=run_serve,
    ),
    "bench": Subcommand(
        help="benchmark: seeded traffic on the in-process engine (throughput) or a live server (serve)",
        add_arguments=add_bench_arguments,
        run=run_bench,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridserve",
        description="Serving engine for hybrid attention/Gated-DeltaNet models (Qwen3.5).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(sp)
        sp.set_defaults(_run=cmd.run, _parser=sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage + the message
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    try:
        return args._run(args)
    except FatalEngineError as e:  # the engine stopped (not the input's fault): status 1
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return 1
    except (HybridServeError, _BadInput) as e:
        print(f"{parser.prog} {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
