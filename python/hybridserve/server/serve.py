"""``hybridserve serve``: build the engine, start the aiohttp server.

Without a model directory it serves the embedded default: the deterministic
~10M-parameter ``bench`` tiny checkpoint, generated once into a cache folder
(``$HYBRIDSERVE_CACHE`` or ``~/.cache/hybridserve``).
"""

from __future__ import annotations

import argparse
import logging
import os

DEFAULT_MODEL_PRESET = "bench"
DEFAULT_MODEL_SEED = 0


def default_model_dir() -> str:
    """Path of the embedded default checkpoint, written on first use."""
    from hybridserve.model.tiny import write_tiny_checkpoint

    root = os.environ.get("HYBRIDSERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hybridserve"
    )
    path = os.path.join(root, f"tiny-{DEFAULT_MODEL_PRESET}-seed{DEFAULT_MODEL_SEED}")
    if not os.path.exists(os.path.join(path, "config.json")):
        tmp = path + f".tmp{os.getpid()}"
        write_tiny_checkpoint(tmp, preset=DEFAULT_MODEL_PRESET, seed=DEFAULT_MODEL_SEED)
        os.makedirs(root, exist_ok=True)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race; theirs is identical
            pass
    return path


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (config.json + safetensors + tokenizer); "
                        "default: the embedded tiny Qwen3.5-architecture model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (with --num-state-slots: exact pools)")
    p.add_argument("--num-state-slots", type=int, default=None, help="DeltaNet state slots")
    p.add_argument("--kv-cache-memory", default=None,
                   help="byte budget for both pools, e.g. 512MiB (default: from device memory; 512MiB on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--expected-context-len", type=int, default=None,
                   help="sequence length the KV/state split is sized for (default: max model len)")
    p.add_argument("--admission-policy", choices=["paged", "reserve_max"], default="paged")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--log-level", default="info")


def run_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.metrics import EngineMetrics
    from hybridserve.planner import parse_size
    from hybridserve.server.app import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = args.model or default_model_dir()
    engine_args = EngineArgs(
        model=model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_gpu_blocks=args.num_gpu_blocks,
        num_state_slots=args.num_state_slots,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        gpu_memory_utilization=args.gpu_memory_utilization,
        expected_context_len=args.expected_context_len,
        admission_policy=args.admission_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
    )
    engine = LLMEngine(engine_args)
    metrics = EngineMetrics()
    async_engine = AsyncEngine(engine, on_step=metrics.observe_step)
    name = args.served_model_name or os.path.basename(os.path.normpath(model))
    app = build_app(async_engine, metrics, name)
    logging.getLogger("hybridserve.server").info(
        "serving %s on http://%s:%d (POST /v1/completions, /v1/chat/completions; GET /metrics)",
        name, args.host, args.port,
    )
    web.run_app(app, host=args.host, port=args.port, print=None)
    return 0
