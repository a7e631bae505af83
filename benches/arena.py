"""One memory arena vs the old KV/state split: sequences running at once against
what the bytes hold, and first-turn time to first token with caching on vs off.

One engine per side, one fixed byte budget (``--budget``), no hint (no
``expected_context_len``, no slot count), on the CPU with the default model
(the embedded tiny checkpoint) and ``--threads`` torch threads. Two phases run
back to back on the same engine:

* **chats**: ``--chats`` requests of ``--chat-prompt`` prompt tokens and
  ``--chat-out`` generated tokens, all submitted at once (state-bound);
* **documents**: ``--docs`` requests of ``--doc-prompt`` prompt tokens and
  ``--doc-out`` generated tokens, all submitted at once (KV-bound).

For each phase: the peak number of sequences running at once (the scheduler's
``num_running_seqs`` after each step) against what the bytes hold: the budget's
pages (``ArenaLayout.num_pages``) over the pages one sequence of the phase holds
at its full length (its DeltaNet state pages + its KV blocks). The same "holds"
number is used for both sides, so the two ratios compare directly.

``--before REV`` also runs the phases against the package as of git revision
``REV`` (the old split: its own Rust extension is built once with maturin into
``~/.cache/hybridserve-before/REV``), side by side in one invocation.

``--ttft N`` also measures first-turn time to first token: N distinct prompts of
``--chat-prompt`` tokens, one at a time (``max_tokens=1``), on an engine with
prefix caching on and one with it off (on both sides with ``--before``); median of
each and the ratio on / off.

    python benches/arena.py --threads 1 --before 6c663d6 --ttft 20
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import zipfile

import torch


def _model_dir() -> str:
    from hybridserve.server.serve import default_model_dir

    return default_model_dir()


def _holds(model: str, budget: int, tokens: int) -> tuple[int, int]:
    """(pages in the budget, sequences of ``tokens`` tokens those pages hold), by
    this tree's layout arithmetic (used for both sides)."""
    from hybridserve.config import ModelConfig
    from hybridserve.memory.layout import arena_layout

    layout = arena_layout(ModelConfig.from_json(model), 16, "float32")
    pages = layout.num_pages(budget)
    return pages, pages // layout.pages_for_sequence(tokens)


def _engine(model: str, budget: int, max_num_seqs: int, caching: bool):
    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.llm_engine import LLMEngine

    # Only options both the split and the arena engine take: one budget, no hint.
    return LLMEngine(EngineArgs(
        model=model, dtype="float32", device="cpu", block_size=16, kv_cache_memory_bytes=budget,
        max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, enable_prefix_caching=caching,
        cpu_threads=torch.get_num_threads(),
    ))


def _prompts(n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _phase(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    from hybridserve.sampling import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    for p in prompts:
        engine.add_request(None, p, sp)
    peak = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        peak = max(peak, int(engine.stats()["num_running_seqs"]))
    st = engine.stats()
    return {"peak_running": peak, "steps": steps, "seconds": round(time.perf_counter() - t0, 2),
            "preemptions": int(st.get("preemptions", 0))}


def measure(args) -> dict:
    model = _model_dir()
    vocab = __import__("hybridserve.config", fromlist=["ModelConfig"]).ModelConfig.from_json(model).vocab_size
    engine = _engine(model, args.budget, args.max_num_seqs, caching=True)
    out = {}
    for name, n, plen, olen, seed in (("chats", args.chats, args.chat_prompt, args.chat_out, 1),
                                      ("documents", args.docs, args.doc_prompt, args.doc_out, 2)):
        out[name] = _phase(engine, _prompts(n, plen, seed, vocab), olen)
    st = engine.stats()
    # What the engine ended with: every page (block / slot) back.
    out["end"] = {k: st[k] for k in ("free_pages", "kv_pages", "running_state_pages", "free_blocks",
                                     "used_blocks", "used_slots", "num_blocks") if k in st}
    return out


def ttft(args) -> dict:
    from hybridserve.sampling import SamplingParams

    model = _model_dir()
    vocab = __import__("hybridserve.config", fromlist=["ModelConfig"]).ModelConfig.from_json(model).vocab_size
    prompts = _prompts(args.ttft, args.chat_prompt, 3, vocab)
    res = {}
    for caching in (False, True):
        engine = _engine(model, args.budget, args.max_num_seqs, caching=caching)
        engine.add_request(None, _prompts(1, args.chat_prompt, 4, vocab)[0], SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():  # warm-up
            engine.step()
        times = []
        for p in prompts:
            t0 = time.perf_counter()
            engine.add_request(None, p, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
            while engine.has_unfinished_requests():
                engine.step()
            times.append(time.perf_counter() - t0)
        res["on" if caching else "off"] = statistics.median(times) * 1e3
    res["ratio"] = res["on"] / res["off"]
    return res


def _build_before(rev: str) -> str:
    """The package as of ``rev`` with its own Rust extension; returns its python dir."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", rev], check=True, capture_output=True,
                         text=True).stdout.strip()
    home = os.path.join(os.path.expanduser("~"), ".cache", "hybridserve-before", sha)
    pkg = os.path.join(home, "python", "hybridserve")
    if os.path.isdir(pkg) and any(f.startswith("_core") and f.endswith(".so") for f in os.listdir(pkg)):
        return os.path.join(home, "python")
    shutil.rmtree(home, ignore_errors=True)
    os.makedirs(home)
    archive = subprocess.run(["git", "-C", root, "archive", sha], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", home], input=archive, check=True)
    wheels = os.path.join(home, "wheels")
    print(f"building the extension of {sha} (once) ...", file=sys.stderr)
    subprocess.run([shutil.which("maturin") or "maturin", "build", "--release", "-q", "-o", wheels,
                    "-i", sys.executable], cwd=home, check=True,
                   env=dict(os.environ, CARGO_TARGET_DIR=os.path.join(home, "target")))
    (whl,) = [os.path.join(wheels, w) for w in os.listdir(wheels) if w.endswith(".whl")]
    with zipfile.ZipFile(whl) as z:
        for name in z.namelist():
            if os.path.basename(name).startswith("_core") and name.endswith(".so"):
                with z.open(name) as src, open(os.path.join(pkg, os.path.basename(name)), "wb") as dst:
                    shutil.copyfileobj(src, dst)
    shutil.rmtree(os.path.join(home, "target"), ignore_errors=True)
    return os.path.join(home, "python")


def _before(rev: str, argv: list[str]) -> dict:
    pydir = _build_before(rev)
    env = dict(os.environ, PYTHONPATH=pydir)
    cmd = [sys.executable, os.path.abspath(__file__), "--json", "--expect-root", pydir] + argv
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--budget", type=int, default=24 << 20, help="the one byte budget (default: 24 MiB)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--chats", type=int, default=160)
    ap.add_argument("--chat-prompt", type=int, default=64)
    ap.add_argument("--chat-out", type=int, default=16)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-prompt", type=int, default=1516)
    ap.add_argument("--doc-out", type=int, default=16)
    ap.add_argument("--ttft", type=int, default=0, metavar="N", help="also the TTFT ratio over N prompts")
    ap.add_argument("--before", metavar="REV", help="also run the phases against the package as of REV")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--expect-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.expect_root:
        import hybridserve

        assert os.path.abspath(hybridserve.__file__).startswith(args.expect_root), hybridserve.__file__
    if args.json:
        res = measure(args)
        if args.ttft:
            res["ttft"] = ttft(args)
        print(json.dumps(res))
        return
    passthrough = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
        "threads", "budget", "max_num_seqs", "chats", "chat_prompt", "chat_out", "docs", "doc_prompt", "doc_out",
        "ttft")]
    before = _before(args.before, passthrough) if args.before else None
    after = measure(args)
    model = _model_dir()
    print(f"torch intra-op threads: {torch.get_num_threads()}; budget {args.budget / 2**20:.1f} MiB; "
          f"model {model}; max_num_seqs {args.max_num_seqs}")
    head = "| phase | bytes hold | " + ("split (before): peak / % | " if before else "") + "arena: peak / % |"
    print(head)
    print("|---|---|" + ("---|" if before else "") + "---|")
    for name, plen, olen in (("chats", args.chat_prompt, args.chat_out), ("documents", args.doc_prompt, args.doc_out)):
        pages, holds = _holds(model, args.budget, plen + olen)
        cells = [f"{name} ({plen}+{olen} tokens)", f"{holds} ({pages} pages)"]
        for side in ([before] if before else []) + [after]:
            r = side[name]
            cells.append(f"{r['peak_running']} / {100 * r['peak_running'] / holds:.0f} %")
        print("| " + " | ".join(cells) + " |")
    print("end of run:", ("before " + json.dumps(before["end"]) + "; ") if before else "", "arena", json.dumps(after["end"]))
    if args.ttft:
        sides = ([("split (before)", before["ttft"])] if before else []) + [("arena", ttft(args))]
        for name, t in sides:
            print(f"first-turn TTFT, {name} ({args.ttft} prompts of {args.chat_prompt} tokens, median): "
                  f"caching off {t['off']:.1f} ms, on {t['on']:.1f} ms, ratio {t['ratio']:.3f}x")


if __name__ == "__main__":
    main()
