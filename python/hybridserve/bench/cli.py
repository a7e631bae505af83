"""``hybridserve bench throughput`` (in-process engine) and ``hybridserve bench serve``
(a live OpenAI-compatible server): the arguments and the two runs.

Both build the same seeded workload (:mod:`hybridserve.bench.workload`), print the
same table and write the same JSON document (:mod:`hybridserve.bench.report`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from hybridserve.errors import ConfigError


def _rate(text: str) -> float:
    from hybridserve.bench.workload import parse_rate

    try:
        return parse_rate(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _range(text: str) -> tuple[int, int]:
    from hybridserve.bench.workload import parse_range

    try:
        return parse_range(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _token_range(text: str) -> tuple[int, int]:
    lo, hi = _range(text)
    return lo, hi + 1


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    w.add_argument("--num-prompts", type=int, default=64, help="requests to send (default: 64)")
    w.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="Poisson arrivals, requests/s over all classes without their own rate (default: inf, all at once)")
    w.add_argument("--prompt-len", type=_range, default=(64, 512), metavar="A-B",
                   help="prompt tokens, uniform in [A, B] (default: 64-512)")
    w.add_argument("--output-len", type=_range, default=(16, 128), metavar="A-B",
                   help="output tokens, uniform in [A, B], EOS ignored (default: 16-128)")
    w.add_argument("--class", dest="classes", action="append", default=[], metavar="SPEC",
                   help="a request class, repeatable: name:rate=4,prompt=64-256,output=32-128,priority=0,"
                        "prefix=128,weight=1 (unset keys take the defaults above)")
    w.add_argument("--dataset", default=None, metavar="JSONL",
                   help="prompts from a JSONL file ({\"prompt\": text or token ids, \"output_len\": N, \"class\": name})")
    w.add_argument("--token-range", type=_token_range, default=None, metavar="A-B",
                   help="token ids of synthetic prompts (default: 32-126, printable ASCII)")
    w.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    o = p.add_argument_group("output")
    o.add_argument("--output", default=None, metavar="JSON", help="write the full results JSON here")
    o.add_argument("--plot", default=None, metavar="PNG",
                   help="latency CDFs per class, throughput and queue over time (needs hybridserve[bench])")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_throughput_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory, or tiny:PRESET for a generated tiny model (e.g. tiny:moe-bench, "
                        "64 experts, 4 routed + shared; default: the embedded ~10M-parameter tiny model)")
    e = p.add_argument_group("engine")
    e.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16 or float16; auto is the checkpoint's on CUDA, on a CPU the "
                        "checkpoint's bfloat16 where the CPU has native bfloat16, else float32 (default: auto)")
    e.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto (default: cpu)")
    e.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the engine's choice)")
    from hybridserve import cli_args

    cli_args.add_block_size(e)
    cli_args.add_kv_cache_dtype(e)
    cli_args.add_speculative_config(e)
    e.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="tokenizer directory, if not the checkpoint's (default: the checkpoint's)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (workers on this host, or torchrun's ranks) (default: 1)")
    e.add_argument("--max-num-seqs", type=int, default=None, help="default: --num-prompts, at most 256")
    e.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens in one step's batch (default: 2048)")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    cli_args.add_memory_budget(e, old_spelling="--kv-cache-memory",
                               default_help="the engine's: from device memory, or a fraction of host memory")
    e.add_argument("--admission-policy", choices=["paged", "reserve_max"], default="paged",
                   help="paged, or reserve_max (each sequence reserves max_model_len up front: the pre-paging "
                        "baseline) (default: paged)")
    e.add_argument("--no-prefix-caching", action="store_true",
                   help="turn off prefix caching (cached KV blocks and DeltaNet state checkpoints) (default: on)")
    e.add_argument("--breakdown", action="store_true",
                   help="also time the scheduler, runner and sampler shares of the run")
    h = p.add_argument_group("HF transformers baseline")
    h.add_argument("--compare-hf", action="store_true",
                   help="run the same requests through HF generate (static batches, then one at a time) "
                        "and check greedy tokens are identical")
    h.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the baseline (default: 16)")
    s = p.add_argument_group("seed scenario (paged vs reserve-max on a pool sized like the seed's)")
    s.add_argument("--seed-scenario", action="store_true",
                   help="long sessions under both admission policies on the seed's pool scaled to this model")
    s.add_argument("--scenario-context", type=int, default=None,
                   help="session tokens (default: max_position_embeddings / 8)")
    s.add_argument("--scenario-output", type=int, default=None, help="output tokens per session (default: 1/8)")
    s.add_argument("--scenario-sessions", type=int, default=None, help="sessions (default: 2x the paged capacity)")
    _add_workload_arguments(p)


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--no-class-fields", action="store_true",
                   help="do not send 'priority' and 'request_class' (for servers that refuse them)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--metrics-interval", type=float, default=0.25, help="seconds between /metrics polls")
    _add_workload_arguments(p)


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench_mode", metavar="MODE", required=True)
    t = sub.add_parser("throughput", help="offline: the in-process engine",
                       description="Serve a seeded workload on an in-process engine and report latencies and throughput.")
    _add_throughput_arguments(t)
    s = sub.add_parser("serve", help="online: a live OpenAI-compatible server over HTTP (streaming)",
                       description="Send a seeded workload to a live OpenAI-compatible server and report latencies.")
    _add_serve_arguments(s)


# ------------------------------------------------------------------------------- runs


def _workload(args: argparse.Namespace) -> Any:
    from hybridserve.bench import workload as wl

    classes = [wl.parse_class(s, default_prompt=args.prompt_len, default_output=args.output_len)
               for s in args.classes] or None
    return wl.generate_workload(
        num_prompts=args.num_prompts, seed=args.seed, classes=classes, request_rate=args.request_rate,
        prompt_len=args.prompt_len, output_len=args.output_len,
        token_range=args.token_range or wl.DEFAULT_TOKEN_RANGE,
        dataset=wl.load_dataset(args.dataset) if args.dataset else None,
    )


def _finish(report: dict[str, Any], args: argparse.Namespace, extra_text: list[str],
            table_printed: bool = False) -> int:
    from hybridserve.bench.report import downsample, render_table

    if args.plot:
        from hybridserve.bench.plot import write_plot

        write_plot(report, args.plot)
    report["timeline"] = downsample(report["timeline"])
    if not table_printed:
        print(render_table(report))
    for block in extra_text:
        print()
        print(block)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    if report["overall"]["completed"] == 0:
        print("hybridserve bench: no request completed", file=sys.stderr)
        return 1
    return 0


def _config(args: argparse.Namespace, workload: Any, threads: int | None) -> dict[str, Any]:
    skip = {"_run", "_parser", "command", "bench_mode", "_given"}
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items() if k not in skip}
    if getattr(args, "speculative_config", None) is not None:
        cfg["speculative_config"] = args.speculative_config.to_dict()
    cfg["request_rate"] = workload.description["request_rate"]
    cfg["workload"] = workload.description
    cfg["torch_threads"] = threads
    return cfg


def run_bench_throughput(args: argparse.Namespace) -> int:
    import torch

    from hybridserve.engine.args import EngineArgs
    from hybridserve.cli_args import resolve_model

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    model = resolve_model(args.model)
    progress = not args.no_progress
    engine_kwargs: dict[str, Any] = dict(
        dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs or min(args.num_prompts, 256),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if "cpu_threads" in EngineArgs.field_names() and args.threads is not None:
        engine_kwargs["cpu_threads"] = args.threads  # the engine's own setting, where it has one
    if args.kv_cache_memory_bytes:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    engine_kwargs.update(kv_cache_dtype=args.kv_cache_dtype, tokenizer=args.tokenizer)
    if args.speculative_config is not None:
        engine_kwargs["speculative_config"] = args.speculative_config.to_dict()

    if args.seed_scenario:
        print(f"torch intra-op threads: {threads}", file=sys.stderr)
        return _run_scenario(args, model, engine_kwargs, threads, progress)

    workload = _workload(args)
    if args.compare_hf:
        if math.isfinite(args.request_rate) or any(c.rate is not None and math.isfinite(c.rate) for c in workload.classes):
            raise ConfigError("--compare-hf compares offline throughput: send all requests at once "
                              "(no --request-rate, no class rate)")
        if any(isinstance(r.prompt, str) for r in workload.requests):
            raise ConfigError("--compare-hf needs token-id prompts (synthetic, or token lists in --dataset)")
        if args.temperature != 0:
            raise ConfigError("--compare-hf checks greedy tokens: leave --temperature at 0")
    # One arena: nothing to split for the workload's lengths.
    engine_kwargs.update(max_model_len=args.max_model_len, admission_policy=args.admission_policy)
    from hybridserve import LLM
    from hybridserve.bench.engine_runner import run_engine
    from hybridserve.bench.report import build_report

    llm = LLM(model, **engine_kwargs)
    threads = torch.get_num_threads()  # the engine may set its own (issue 9's cpu_threads)
    print(f"torch intra-op threads: {threads}", file=sys.stderr)
    _warm_up(llm.engine)
    records, server, timeline, duration = run_engine(
        llm.engine, workload, temperature=args.temperature, keep_tokens=args.compare_hf,
        progress=progress, breakdown=args.breakdown,
    )
    server["engine"] = {"num_pages": llm.engine.num_pages, "state_pages": llm.engine.state_pages,
                        "max_num_seqs": engine_kwargs["max_num_seqs"], "device": str(llm.engine.device),
                        "dtype": str(llm.engine.dtype).removeprefix("torch.")}
    cfg = _config(args, workload, threads)
    cfg["model"] = model
    report = build_report(records, duration=duration, class_names=workload.class_names, mode="throughput",
                          config=cfg, server=server, timeline=timeline)
    extra = []
    if args.compare_hf:
        from hybridserve.bench.report import render_table

        print(render_table(report), flush=True)  # the baseline takes a while: show ours now
        del llm  # free the engine's pools before HF allocates
        report["compare_hf"] = compare_hf(model, workload, records, report, args.hf_batch_size, progress)
        extra.append(render_compare(report["compare_hf"]))
    report["seed_scenario"] = None
    return _finish(report, args, extra, table_printed=args.compare_hf)


def _warm_up(engine: Any) -> None:
    """One short request through every code path before the clock starts."""
    from hybridserve.sampling import SamplingParams

    engine.add_request("bench-warmup", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def compare_hf(model_dir: str, workload: Any, records: list[Any], report: dict[str, Any],
               batch_size: int, progress: bool) -> dict[str, Any]:
    from hybridserve.bench.hf_baseline import compare_tokens, hf_generate, load_hf_model

    hf = load_hf_model(model_dir)
    reqs = workload.requests
    hf_generate(hf, reqs[:1], batch_size=1)  # warm-up, like the engine's
    static = hf_generate(hf, reqs, batch_size=batch_size, progress=progress)
    single = hf_generate(hf, reqs, batch_size=1, progress=progress)
    ours = {r.request_id: r.token_ids for r in records if r.token_ids is not None}
    useful = sum(r.output_len for r in reqs)
    ours_tps = useful / max(report["duration_s"], 1e-9)
    hs_ok = report["overall"]["completed"] == len(reqs)
    return {
        "requests": len(reqs),
        "useful_output_tokens": useful,
        "hybridserve": {"wall_s": report["duration_s"], "output_throughput_tok_s": ours_tps, "completed_all": hs_ok},
        "hf_static": {k: v for k, v in static.items() if k != "tokens"},
        "hf_single": {k: v for k, v in single.items() if k != "tokens"},
        "ratio_vs_hf_static": ours_tps / static["output_throughput_tok_s"],
        "ratio_vs_hf_single": ours_tps / single["output_throughput_tok_s"],
        "tokens_vs_hf_single": compare_tokens(ours, single["tokens"]),
        "tokens_vs_hf_static": compare_tokens(ours, static["tokens"]),
    }


def render_compare(c: dict[str, Any]) -> str:
    rows = [["system", "wall s", "useful out tok/s", "hybridserve is", "greedy tokens identical"]]
    rows.append(["hybridserve (continuous batching)", f"{c['hybridserve']['wall_s']:.2f}",
                 f"{c['hybridserve']['output_throughput_tok_s']:.1f}", "1.00x", "-"])
    for key, name, tok in (("hf_static", f"HF generate, static batches of {c['hf_static']['batch_size']}",
                            "tokens_vs_hf_static"),
                           ("hf_single", "HF generate, one at a time", "tokens_vs_hf_single")):
        r, t = c[key], c[tok]
        rows.append([name, f"{r['wall_s']:.2f}", f"{r['output_throughput_tok_s']:.1f}",
                     f"{c['ratio_vs_' + key]:.2f}x", f"{t['identical']}/{t['requests']}"])
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"vs HF transformers: {c['requests']} requests, {c['useful_output_tokens']:,} useful output tokens"]
    lines += ["  ".join(x.rjust(n) if i else x.ljust(n) for i, (x, n) in enumerate(zip(r, w))) for r in rows]
    for tok in ("tokens_vs_hf_single", "tokens_vs_hf_static"):
        for m in c[tok]["mismatches"][:5]:
            lines.append(f"MISMATCH ({tok.removeprefix('tokens_vs_')}) {m['request_id']}: first differing "
                         f"token at index {m['first_diff']} (ours {m.get('ours')}, HF {m.get('hf')})")
    return "\n".join(lines)


def _run_scenario(args: argparse.Namespace, model: str, engine_kwargs: dict[str, Any], threads: int,
                  progress: bool) -> int:
    from hybridserve.bench.scenario import render_scenario, run_seed_scenario
    from hybridserve.config import ModelConfig
    from hybridserve.engine.device import _resolve_device, _resolve_model_dtype

    if args.compare_hf:
        raise ConfigError("--seed-scenario and --compare-hf are separate runs; give one")
    config = ModelConfig.from_json(model)
    dtype = _resolve_model_dtype(args.dtype, config, _resolve_device(args.device))
    s = run_seed_scenario(
        model, dtype_name=str(dtype).removeprefix("torch."), engine_kwargs=engine_kwargs,
        context_len=args.scenario_context, output_len=args.scenario_output,
        num_sessions=args.scenario_sessions, seed=args.seed, progress=progress,
    )
    print(render_scenario(s))
    if args.output:
        cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
               if k not in {"_run", "_parser", "command", "bench_mode"}}
        cfg.update(model=model, torch_threads=threads)
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump({"mode": "seed-scenario", "config": cfg, "seed_scenario": s}, f, indent=1)
    return 0


def run_bench_serve(args: argparse.Namespace) -> int:
    import asyncio

    from hybridserve.bench.http_runner import run_http
    from hybridserve.bench.report import build_report

    workload = _workload(args)
    try:
        records, server, timeline, duration = asyncio.run(run_http(
            args.base_url, workload, model=args.model, temperature=args.temperature,
            send_class_fields=not args.no_class_fields, max_concurrency=args.max_concurrency,
            metrics_interval=args.metrics_interval, progress=not args.no_progress,
        ))
    except ConnectionError as e:
        raise ConfigError(str(e)) from None
    cfg = _config(args, workload, None)
    report = build_report(records, duration=duration, class_names=workload.class_names, mode="serve",
                          config=cfg, server=server, timeline=timeline)
    return _finish(report, args, [])


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_mode == "throughput":
        return run_bench_throughput(args)
    return run_bench_serve(args)
