"""Structured-output costs: grammar engines head to head, the mask per sequence-step,
and constrained vs unconstrained decoding end to end.

    python benches/structured.py [--vocab qwen|tiny|both] [--skip-e2e] [--batch 16]
        [--skip-llguidance] [--compare-unfused]

Parts (one run prints them all):

1. **Engines at Qwen's vocabulary**: xgrammar and llguidance compile the bench's JSON
   schema for the same tokenizer (llama.cpp's shipped Qwen BPE, 151,936 tokens, padded
   to Qwen3.5's 248,320 rows, the bench tokenizer of ``benches/llamacpp``), then walk
   ``--batch`` sequences through valid documents token by token, filling each step's
   bitmask for the whole batch (each engine's batched, multi-threaded fill) and
   applying it to a float32 ``[batch, 248320]`` logits tensor. Reported per
   sequence-step: fill, apply, and both; and the CPU draw of the masked batch (greedy
   and seeded), the mask applied before the native draw against fused into it.
2. **End to end**: ``--batch`` concurrent requests through the engine (CPU), each with
   the JSON schema, against the same requests unconstrained, each of those made to
   produce exactly as many tokens as its constrained twin (see ``end_to_end``); time
   per output token, mask time per sequence-step (wall and CPU on the mask thread),
   compile time per schema. On the default tiny model (byte vocabulary) and on a tiny
   model with Qwen's vocabulary. ``--compare-unfused`` adds a third run per pair with
   the masks applied to the logits before the draw (the path before the fused mask).
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
            "fill_mean_us": statistics.mean(fills) * 1e6, "native_apply_us": statistics.median(natives) * 1e6,
            "draw": bench_masked_draw(g, vocab, walks, reps)}


def bench_masked_draw(grammar, vocab: int, walks: list[list[int]], reps: int) -> dict:
    """The CPU draw of a masked batch, per sequence-step: the mask applied to the logits
    then the native draw (the unfused path), against the mask fused into the draw
    (``Sampler.fuse_token_mask``), and the unmasked draw for scale; greedy and seeded
    (temperature 1). The masks are the walk's real ones (fresh logits each step)."""
    import xgrammar as xgr

    from hybridserve.sampler import Sampler, SamplingRow, make_generator
    from hybridserve.sampling import SamplingParams
    from hybridserve.structured.engine_hook import apply_bitmask

    B = len(walks)
    steps = min(len(w) for w in walks)
    g = torch.Generator().manual_seed(0)
    out = {}
    for how, kw in (("greedy", dict(temperature=0.0)), ("seeded", dict(temperature=1.0))):
        times: dict[str, list[float]] = {"plain": [], "apply+draw": [], "fused": []}
        for _ in range(reps):
            ms = [xgr.GrammarMatcher(grammar) for _ in range(B)]
            bm = xgr.allocate_token_bitmask(B, vocab)
            samplers = {k: Sampler(native=True, steady_rows=True) for k in times}
            outs = {k: [[] for _ in range(B)] for k in times}
            rows = {k: [SamplingRow(params=SamplingParams(seed=i + 1, **kw), prompt_token_ids=[1],
                                    output_token_ids=outs[k][i], generator=make_generator(i + 1, 0), key=i)
                        for i in range(B)] for k in times}
            live = list(range(B))
            for t in range(steps):
                for i in live:
                    ms[i].fill_next_token_bitmask(bm, i)
                base = torch.randn(B, vocab, generator=g)
                for k in times:
                    logits = base.clone()
                    s = samplers[k]
                    prep = s.plan(rows[k], vocab, torch.device("cpu"))
                    t0 = time.perf_counter()
                    if k == "apply+draw":
                        apply_bitmask(logits, bm, live, vocab)
                    elif k == "fused":
                        assert s.fuse_token_mask(logits, bm, live, vocab)
                    tok = s.sample_planned(logits, prep).token_ids
                    times[k].append((time.perf_counter() - t0) / B)
                    for i in range(B):
                        outs[k][i].append(tok[i])
                assert outs["fused"] == outs["apply+draw"], "the fused draw must draw the unfused tokens"
                for i in live:
                    assert ms[i].accept_token(walks[i][t]), "the document does not fit the grammar"
        out[how] = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return out


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


def engines(tok_dir: Path, batch: int, reps: int, llguidance: bool = True) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    walks = _walks(tok, batch)
    rows = [bench_xgrammar(tok, QWEN_VOCAB_SIZE, eos, walks, reps)]
    if not llguidance:
        return rows
    try:
        rows.append(bench_llguidance(tok, QWEN_VOCAB_SIZE, eos, walks, reps))
    except ImportError:
        print("llguidance is not installed: pip install llguidance to compare", file=sys.stderr)
    return rows


def end_to_end(model_dir: str, batch: int, max_tokens: int, reps: int = 3, temperature: float = 1.0,
               compare_unfused: bool = False) -> dict:
    """Constrained against unconstrained decoding of the same requests, like with like.

    The constrained run ends each sequence where its JSON ends, the unconstrained one
    would run on to max_tokens (or stop at a random EOS): whole-run times would compare
    different amounts of work. So the unconstrained twin of each request is made to
    produce exactly as many tokens as the constrained one did (``max_tokens`` = that
    count, ``ignore_eos``; not ``min_tokens``, whose pending EOS ban takes the sampler
    off its steady-batch fast path every step): every step then has the same batch of
    sequences at the same positions in both runs. Seeded sampling makes the constrained
    lengths repeat from run to run (checked). The texts still differ (JSON against
    noise), and so does the detokenizer's work on them: the engine's step phases are
    reported apart, ``process_outputs`` (detokenization, stops, the grammar's advance
    over the sampled token) against the rest (schedule, inputs, forward with the mask
    fill beside it, sampling with the mask applied)."""
    from hybridserve import LLM, SamplingParams
    from hybridserve.structured.params import StructuredOutputsParams

    # A fixed KV budget: the default is a share of the host's free memory, which other
    # jobs on a shared machine move.
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_seqs=batch, max_model_len=1024,
              kv_cache_memory_bytes=1 << 30)
    prompts = [f"Record {i} as JSON:" for i in range(batch)]

    def constrained() -> list:
        return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1 + i,
                               structured_outputs={"json": SCHEMA}) for i in range(batch)]

    sd = llm.engine.structured_decoding()
    # Compile time per schema: distinct schemas (cache misses), on the engine's compiler.
    compile_s = []
    for i in range(max(reps, 3)):
        spec = StructuredOutputsParams(json={**SCHEMA, "title": f"bench-{i}"})
        t0 = time.perf_counter()
        sd.compiler.compile(spec)
        compile_s.append(time.perf_counter() - t0)
    warm = llm.generate(prompts, constrained())  # compiles SCHEMA itself, warms both paths
    lengths = [len(r.outputs[0].token_ids) for r in warm]
    matched = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature, seed=1 + i)
               for i, n in enumerate(lengths)]
    llm.generate(prompts, matched)
    # With compare_unfused a third run per pair: constrained, the masks applied to the
    # logits before the draw (the path before the mask was fused into the sampler).
    names = ("unconstrained", "constrained") + (("unfused",) if compare_unfused else ())
    runs: dict[str, list[float]] = {n: [] for n in names}
    # ms per token of the step phases but process_outputs, and of process_outputs.
    steps_ms: dict[str, list[float]] = {n: [] for n in names}
    outputs_ms: dict[str, list[float]] = {n: [] for n in names}
    # The engine's "sample" phase (the masks' wait and apply, and the draw) per token.
    sample_ms: dict[str, list[float]] = {n: [] for n in names}
    unfused_critical = [0.0, 0]
    mask = {"rows": 0, "fill_s": 0.0, "cpu_s": 0.0, "critical_s": 0.0, "fused": 0}
    # Alternated, medians of `reps` runs each: this machine's load moves between runs.
    for _ in range(reps):
        for name in names:
            sd.sampler = None if name == "unfused" else llm.engine.core.sampler
            st0 = llm.engine.stats()["structured"]
            ph0 = dict(llm.engine.stats()["step_phase_seconds"])
            t0 = time.perf_counter()
            res = llm.generate(prompts, matched if name == "unconstrained" else constrained())
            dt = time.perf_counter() - t0
            got = [len(r.outputs[0].token_ids) for r in res]
            assert got == lengths, f"{name}: token counts {got} differ from the constrained run's {lengths}"
            runs[name].append(dt / sum(lengths) * 1e3)
            ph = {k: v - ph0.get(k, 0.0) for k, v in llm.engine.stats()["step_phase_seconds"].items()}
            outputs_ms[name].append(ph.get("process_outputs", 0.0) / sum(lengths) * 1e3)
            sample_ms[name].append(ph.get("sample", 0.0) / sum(lengths) * 1e3)
            steps_ms[name].append((sum(ph.values()) - ph.get("process_outputs", 0.0)) / sum(lengths) * 1e3)
            if name == "unfused":
                st = llm.engine.stats()["structured"]
                unfused_critical[0] += sum(st[k] - st0[k] for k in ("mask_submit_seconds", "mask_wait_seconds",
                                                                     "mask_apply_seconds"))
                unfused_critical[1] += st["mask_sequence_steps"] - st0["mask_sequence_steps"]
            if name == "constrained":
                st = llm.engine.stats()["structured"]
                mask["rows"] += st["mask_sequence_steps"] - st0["mask_sequence_steps"]
                mask["fill_s"] += st["mask_seconds"] - st0["mask_seconds"]
                mask["cpu_s"] += st["mask_cpu_seconds"] - st0["mask_cpu_seconds"]
                mask["fused"] += st["mask_fused_rows"] - st0["mask_fused_rows"]
                mask["critical_s"] += sum(st[k] - st0[k] for k in ("mask_submit_seconds", "mask_wait_seconds",
                                                                    "mask_apply_seconds"))
    out: dict = {name: {"ms_per_token": statistics.median(v), "all": v} for name, v in runs.items()}
    out["tokens"] = sum(lengths)
    out["lengths"] = lengths
    out["compile_ms"] = statistics.median(compile_s) * 1e3
    # Mask fill on its thread (overlapping the forward), and what the grammar adds on the
    # engine thread (starting the job, waiting for it after the forward, applying it),
    # per constrained sequence-step.
    out["mask_us_per_seq_step"] = mask["fill_s"] / max(mask["rows"], 1) * 1e6
    out["mask_cpu_us_per_seq_step"] = mask["cpu_s"] / max(mask["rows"], 1) * 1e6
    out["fused_share"] = mask["fused"] / max(mask["rows"], 1)
    out["critical_us_per_seq_step"] = mask["critical_s"] / max(mask["rows"], 1) * 1e6
    # Each constrained run against the unconstrained run just before it (the machine's
    # load drifts less within a pair than across the whole bench).
    out["ratios"] = [c / u for c, u in zip(runs["constrained"], runs["unconstrained"])]
    out["ratio"] = statistics.median(out["ratios"])
    for name in runs:
        out[name]["steps_ms"] = statistics.median(steps_ms[name])
        out[name]["outputs_ms"] = statistics.median(outputs_ms[name])
        out[name]["sample_ms"] = statistics.median(sample_ms[name])
    if compare_unfused:
        out["unfused_ratios"] = [c / u for c, u in zip(runs["unfused"], runs["unconstrained"])]
        out["unfused_ratio"] = statistics.median(out["unfused_ratios"])
        out["unfused_critical_us_per_seq_step"] = unfused_critical[0] / max(unfused_critical[1], 1) * 1e6
    out["steps_ratio"] = out["constrained"]["steps_ms"] / out["unconstrained"]["steps_ms"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", choices=["qwen", "tiny", "both"], default="both")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--skip-e2e", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (fixed, printed)")
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0],
                    help="end to end: one row per sampling temperature (0: greedy)")
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--skip-llguidance", action="store_true",
                    help="engines: xgrammar only (llguidance's tokenizer set-up takes minutes at Qwen's vocabulary)")
    ap.add_argument("--compare-unfused", action="store_true",
                    help="end to end: a third run per pair with the masks applied to the logits before the draw "
                         "(not fused into the sampler), side by side")
    ap.add_argument("--work", default=None, help="folder for the tokenizer and models (default: a temp dir)")
    a = ap.parse_args(argv)
    work = Path(a.work or tempfile.mkdtemp(prefix="structured-bench-"))
    torch.set_num_threads(a.threads)
    print(f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if a.vocab in ("qwen", "both"):
        tok_dir = qwen_tokenizer_dir(work)
        if not a.skip_engines:
            print(f"\n## grammar engines, Qwen vocabulary ({QWEN_VOCAB_SIZE} rows), batch {a.batch}, per sequence-step")
            print("| engine | tokenizer setup (s) | compile (ms) | fill median (us) | fill mean (us) | "
                  "its apply (us) | native apply (us) |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            results = engines(tok_dir, a.batch, a.reps, not a.skip_llguidance)
            for r in results:
                nat = f"{r['native_apply_us']:.1f}" if "native_apply_us" in r else "-"
                print(f"| {r['engine']} | {r['tokenizer_info_s']:.2f} | {r['compile_ms']:.1f} | {r['fill_us']:.1f} | "
                      f"{r['fill_mean_us']:.1f} | {r['apply_us']:.1f} | {nat} |")
            print(f"\n## the CPU draw of a masked batch ({a.batch} rows of {QWEN_VOCAB_SIZE}), us per sequence-step, "
                  "medians: the mask applied then the native draw, against the mask fused into the draw")
            print("| sampling | unmasked draw | apply + draw | fused draw | fused / (apply + draw) |")
            print("| --- | --- | --- | --- | --- |")
            for how, d in results[0]["draw"].items():
                print(f"| {how} | {d['plain']:.1f} | {d['apply+draw']:.1f} | {d['fused']:.1f} | "
                      f"{d['fused'] / d['apply+draw']:.3f} |")
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
    print(f"\n## end to end, {a.batch} concurrent requests, max_tokens {a.max_tokens}, CPU, the unconstrained twin "
          "of each request held to the constrained one's token count (max_tokens = that count, ignore_eos)")
    print("| model | sampling | tokens per run | compile (ms/schema) | unconstrained ms/token | constrained ms/token | "
          "ratio (median of pairs) | ratio per pair | steps but outputs, ms/token: unconstrained / constrained (ratio) | "
          "process_outputs ms/token: unconstrained / constrained | mask fill us/seq-step (its thread, wall) | "
          "mask fill CPU us/seq-step | grammar on the engine thread us/seq-step | rows with the mask fused |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    extra = []
    for (name, d), temp in [(m, t) for m in models for t in a.temperatures]:
        r = end_to_end(d, a.batch, a.max_tokens, a.reps, temp, a.compare_unfused)
        extra.append((name, temp, r))
        u, c = r["unconstrained"], r["constrained"]
        how = "greedy" if temp == 0 else f"seeded, temperature {temp:g}"
        print(f"| {name} | {how} | {r['tokens']} | {r['compile_ms']:.1f} | {u['ms_per_token']:.3f} | "
              f"{c['ms_per_token']:.3f} | {r['ratio']:.3f} | "
              f"{', '.join(f'{x:.3f}' for x in r['ratios'])} | {u['steps_ms']:.3f} / {c['steps_ms']:.3f} "
              f"({r['steps_ratio']:.3f}) | {u['outputs_ms']:.3f} / {c['outputs_ms']:.3f} | "
              f"{r['mask_us_per_seq_step']:.1f} | {r['mask_cpu_us_per_seq_step']:.1f} | "
              f"{r['critical_us_per_seq_step']:.1f} | {r['fused_share']:.0%} |", flush=True)
    if a.compare_unfused:
        print("\n## the same runs: constrained with the mask fused into the draw against applied before it")
        print("| model | sampling | ratio fused (median of pairs) | ratio unfused | ms/token fused / unfused | "
              "sample phase ms/token: unconstrained / fused / unfused | grammar on the engine thread us/seq-step: "
              "fused / unfused |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, temp, r in extra:
            how = "greedy" if temp == 0 else f"seeded, temperature {temp:g}"
            print(f"| {name} | {how} | {r['ratio']:.3f} | {r['unfused_ratio']:.3f} | "
                  f"{r['constrained']['ms_per_token']:.3f} / {r['unfused']['ms_per_token']:.3f} | "
                  f"{r['unconstrained']['sample_ms']:.3f} / {r['constrained']['sample_ms']:.3f} / "
                  f"{r['unfused']['sample_ms']:.3f} | {r['critical_us_per_seq_step']:.1f} / "
                  f"{r['unfused_critical_us_per_seq_step']:.1f} |")
    print(f"\nload average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
