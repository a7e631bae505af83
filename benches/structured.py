"""Structured-output costs: grammar engines head to head, the mask per sequence-step,
and constrained vs unconstrained decoding end to end.

    python benches/structured.py [--vocab qwen|tiny|both] [--skip-e2e] [--batch 16]

Parts (one run prints them all):

1. **Engines at Qwen's vocabulary**: xgrammar and llguidance compile the bench's JSON
   schema for the same tokenizer (llama.cpp's shipped Qwen BPE, 151,936 tokens, padded
   to Qwen3.5's 248,320 rows, the bench tokenizer of ``benches/llamacpp``), then walk
   ``--batch`` sequences through valid documents token by token, filling each step's
   bitmask for the whole batch (each engine's batched, multi-threaded fill) and
   applying it to a float32 ``[batch, 248320]`` logits tensor. Reported per
   sequence-step: fill, apply, and both.
2. **End to end**: ``--batch`` concurrent requests through the engine (CPU), each with
   the JSON schema, against the same requests unconstrained; time per output token.
   On the default tiny model (byte vocabulary) and on a tiny model with Qwen's vocabulary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city"], "additionalProperties": False},
        "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
DOCS = [
    {"name": "Alice Smith", "age": 31, "email": "alice@example.com", "kind": "admin", "tags": ["a", "ops"],
     "address": {"city": "Paris", "zip": 75001}, "score": 0.75},
    {"name": "Bob", "age": 7, "kind": "guest", "tags": [], "score": None},
    {"name": "Carla Gómez", "age": 55, "email": "cg@mail.es", "kind": "user", "tags": ["x", "yy", "zzz"],
     "address": {"city": "Sevilla"}},
    {"name": "Dmitri", "age": 140, "kind": "user", "score": 12},
]
QWEN_VOCAB_SIZE = 248_320


def qwen_tokenizer_dir(work: Path) -> Path:
    """Qwen's BPE vocabulary padded to 248,320 as a tokenizer directory (llama.cpp's tree)."""
    from llamacpp import checkpoint
    from llamacpp.build import source_tree

    out = work / "qwen-vocab"
    if not (out / "tokenizer.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        tokens, types, merges = checkpoint.read_vocab(source_tree(), QWEN_VOCAB_SIZE)
        checkpoint.write_tokenizer(out, tokens, types, merges)
    return out


def _walks(tok, batch: int) -> list[list[int]]:
    # Properties in the schema's order: the grammar keeps the declared order.
    docs = [json.dumps(DOCS[i % len(DOCS)], ensure_ascii=False) for i in range(batch)]
    return [tok.encode(d, add_special_tokens=False) for d in docs]


def bench_xgrammar(tok, vocab: int, eos: int, walks: list[list[int]], reps: int) -> dict:
    import xgrammar as xgr

    from hybridserve.structured.grammar import GrammarCompiler
    from hybridserve.structured.params import StructuredOutputsParams

    t0 = time.perf_counter()
    comp = GrammarCompiler(tok, vocab, [eos])
    t_info = time.perf_counter() - t0
    compile_s = []
    for i in range(reps):
        spec = StructuredOutputsParams(json={**SCHEMA, "title": f"s{i}"})  # a cache miss each time
        t0 = time.perf_counter()
        g = comp.compile(spec)
        compile_s.append(time.perf_counter() - t0)
    B = len(walks)
    logits = torch.randn(B, vocab)
    bm = xgr.allocate_token_bitmask(B, vocab)
    batch = xgr.BatchGrammarMatcher(max_threads="auto")
    from hybridserve.structured.engine_hook import apply_bitmask

    fills, applies, natives = [], [], []
    for _ in range(reps):
        ms = [xgr.GrammarMatcher(g) for _ in range(B)]
        steps = max(len(w) for w in walks)
        for t in range(steps):
            live = [i for i, w in enumerate(walks) if t < len(w)]
            t0 = time.perf_counter()
            batch.batch_fill_next_token_bitmask([ms[i] for i in live], bm, indices=live)
            t1 = time.perf_counter()
            xgr.apply_token_bitmask_inplace(logits, bm, indices=live, backend="cpu")
            t2 = time.perf_counter()
            apply_bitmask(logits, bm, live, vocab)  # the engine's (native kernel)
            t3 = time.perf_counter()
            fills.append((t1 - t0) / len(live))
            applies.append((t2 - t1) / len(live))
            natives.append((t3 - t2) / len(live))
            for i in live:
                assert ms[i].accept_token(walks[i][t]), "the document does not fit the grammar"
    return {"engine": "xgrammar", "tokenizer_info_s": t_info, "compile_ms": statistics.median(compile_s) * 1e3,
            "fill_us": statistics.median(fills) * 1e6, "apply_us": statistics.median(applies) * 1e6,
            "fill_mean_us": statistics.mean(fills) * 1e6, "native_apply_us": statistics.median(natives) * 1e6}


def bench_llguidance(tok, vocab: int, eos: int, walks: list[list[int]], reps: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
    t_info = time.perf_counter() - t0
    compile_s = []
    grammar = None
    for i in range(reps):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps({**SCHEMA, "title": f"s{i}"}))
        m = llguidance.LLMatcher(lltok, grammar)  # llguidance compiles lazily; the first mask counts
        bm0 = lt.allocate_token_bitmask(1, vocab)
        lt.fill_next_token_bitmask(m, bm0, 0)
        compile_s.append(time.perf_counter() - t0)
    B = len(walks)
    logits = torch.randn(B, vocab)
    bm = lt.allocate_token_bitmask(B, vocab)
    ex = llguidance.LLExecutor()
    fills, applies = [], []
    for _ in range(reps):
        ms = [llguidance.LLMatcher(lltok, grammar) for _ in range(B)]
        steps = max(len(w) for w in walks)
        for t in range(steps):
            live = [i for i, w in enumerate(walks) if t < len(w)]
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask_par(ex, [(ms[i], i) for i in live], bm)
            t1 = time.perf_counter()
            lt.apply_token_bitmask_inplace(logits[live], bm[live])
            t2 = time.perf_counter()
            fills.append((t1 - t0) / len(live))
            applies.append((t2 - t1) / len(live))
            for i in live:
                assert ms[i].consume_token(walks[i][t]), ms[i].get_error()
    return {"engine": "llguidance", "tokenizer_info_s": t_info, "compile_ms": statistics.median(compile_s) * 1e3,
            "fill_us": statistics.median(fills) * 1e6, "apply_us": statistics.median(applies) * 1e6,
            "fill_mean_us": statistics.mean(fills) * 1e6}


def engines(tok_dir: Path, batch: int, reps: int) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    walks = _walks(tok, batch)
    rows = [bench_xgrammar(tok, QWEN_VOCAB_SIZE, eos, walks, reps)]
    try:
        rows.append(bench_llguidance(tok, QWEN_VOCAB_SIZE, eos, walks, reps))
    except ImportError:
        print("llguidance is not installed: pip install llguidance to compare", file=sys.stderr)
    return rows


def end_to_end(model_dir: str, batch: int, max_tokens: int, reps: int = 3) -> dict:
    from hybridserve import LLM, SamplingParams

    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=batch, max_model_len=1024)
    prompts = [f"Record {i} as JSON:" for i in range(batch)]
    out: dict = {}
    # Alternated, medians of `reps` runs each: this machine's load moves between runs.
    runs: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    order = [("warm", {"structured_outputs": {"json": SCHEMA}})]
    order += [("unconstrained", {}), ("constrained", {"structured_outputs": {"json": SCHEMA}})] * reps
    for name, extra in order:
        sp = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, **extra)
        t0 = time.perf_counter()
        res = llm.generate(prompts, sp)
        dt = time.perf_counter() - t0
        ntok = sum(len(c.token_ids) for r in res for c in r.outputs)
        if name in runs:
            runs[name].append(dt / ntok * 1e3)
    for name, v in runs.items():
        out[name] = {"ms_per_token": statistics.median(v), "all": v}
    st = llm.engine.stats()["structured"]
    # The grammar's cost on the engine thread (starting the mask job, waiting for it
    # after the forward, applying it), per constrained sequence-step: what constraining
    # adds to a step whatever the text (the two runs' texts differ: noise vs JSON).
    crit = st["mask_submit_seconds"] + st["mask_wait_seconds"] + st["mask_apply_seconds"]
    out["critical_us_per_seq_step"] = crit / max(st["mask_sequence_steps"], 1) * 1e6
    out["mask_us_per_seq_step"] = st["mask_seconds"] / max(st["mask_sequence_steps"], 1) * 1e6
    out["mask_wait_s"] = st["mask_wait_seconds"]
    out["apply_s"] = st["mask_apply_seconds"]
    out["ratio"] = out["constrained"]["ms_per_token"] / out["unconstrained"]["ms_per_token"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", choices=["qwen", "tiny", "both"], default="both")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--work", default=None, help="folder for the tokenizer and models (default: a temp dir)")
    a = ap.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="structured-bench-"))
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}")
    if a.vocab in ("qwen", "both"):
        tok_dir = qwen_tokenizer_dir(work)
        if not a.skip_engines:
            print(f"\n## grammar engines, Qwen vocabulary ({QWEN_VOCAB_SIZE} rows), batch {a.batch}, per sequence-step")
            print("| engine | tokenizer setup (s) | compile (ms) | fill median (us) | fill mean (us) | "
                  "its apply (us) | native apply (us) |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for r in engines(tok_dir, a.batch, a.reps):
                nat = f"{r['native_apply_us']:.1f}" if "native_apply_us" in r else "-"
                print(f"| {r['engine']} | {r['tokenizer_info_s']:.2f} | {r['compile_ms']:.1f} | {r['fill_us']:.1f} | "
                      f"{r['fill_mean_us']:.1f} | {r['apply_us']:.1f} | {nat} |")
    if a.skip_e2e:
        return 0
    from hybridserve.model.tiny import write_tiny_checkpoint

    models = []
    if a.vocab in ("tiny", "both"):
        models.append(("tiny test-a (272 tokens)", write_tiny_checkpoint(work / "tiny", preset="test-a", qwen_chat=True)))
    if a.vocab in ("qwen", "both"):
        d = write_tiny_checkpoint(work / "tiny-qwen", preset="test-a", vocab_size=QWEN_VOCAB_SIZE)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (Path(d) / f).write_bytes((tok_dir / f).read_bytes())
        models.append((f"test-a with Qwen's vocabulary ({QWEN_VOCAB_SIZE})", d))
    print(f"\n## end to end, {a.batch} concurrent requests, max_tokens {a.max_tokens}, CPU")
    print("| model | unconstrained ms/token | constrained ms/token | ratio | mask fill us/seq-step (on the thread) |"
          " grammar on the engine thread us/seq-step | (as % of unconstrained ms/token) | wait for masks (s) |"
          " apply (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, d in models:
        r = end_to_end(d, a.batch, a.max_tokens, a.reps)
        print(f"| {name} | {r['unconstrained']['ms_per_token']:.3f} | {r['constrained']['ms_per_token']:.3f} | "
              f"{r['ratio']:.2f} | {r['mask_us_per_seq_step']:.1f} | {r['critical_us_per_seq_step']:.1f} | "
              f"{r['critical_us_per_seq_step'] / 10 / r['unconstrained']['ms_per_token']:.1f}% | "
              f"{r['mask_wait_s']:.3f} | {r['apply_s']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
