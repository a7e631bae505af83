"""Perplexity and KL divergence of GGUF files, llama.cpp's and hybridserve's, on the same
file and the same token windows (issue 35; not CI).

The model is the trained default model (``python/hybridserve/default_model``) converted
by llama.cpp's own ``convert_hf_to_gguf.py`` to BF16 (the base) and quantized by
``llama-quantize`` (Q8_0, Q4_K_M by default); the text is its held-out split (the
stdlib documents ``hybridserve.train.corpus.is_heldout`` picks, never trained on),
joined into one file.

**llama.cpp's numbers** come from ``llama-perplexity``:

1. ``llama-perplexity -m BF16.gguf -f heldout.txt -c N -b N --chunks K
   --kl-divergence-base base.kld`` tokenizes the text, cuts ``K`` chunks of ``N``
   tokens, runs each chunk from an empty cache, scores the second half of the chunk
   (logits at positions ``N/2 .. N-2`` against tokens ``N/2+1 .. N-1``) and saves the
   tokens and the base's log-probabilities (uint16 over ``[max-16, max]`` per row) in
   ``base.kld``;
2. ``llama-perplexity -m Q.gguf --kl-divergence-base base.kld --kl-divergence`` reruns
   the same windows on the quantized file and prints PPL(Q), PPL(base) and the mean KL
   divergence KL(base || Q) against the saved base.

**Ours** reads the token windows from ``base.kld`` itself (so the tokens are the same,
whatever the tokenizers do), runs each chunk through hybridserve on the same GGUF file
(``load_model(file.gguf)``: one prefill of ``N`` tokens from an empty cache), and
computes the same statistics with llama.cpp's formulas (``tools/perplexity``:
``log_softmax`` / ``kl_divergence``), against the same saved base log-probabilities.
``--ours-base`` also scores hybridserve's own BF16 run of the HF checkpoint as a check of
the harness (no GGUF loader needed).

Target: hybridserve's PPL and KLD within 1 % of llama.cpp's on each file.

Two things to know when reading the numbers:

* the default model is 192 wide: llama-quantize's Q4_K_M recipe cannot put a 256-weight
  k-quant block on a 192-long row, so it falls back (Q4_K to Q5_0, Q6_K to Q8_0) for the
  projections that read the hidden state; only ``attn_output``, ``ssm_out`` and
  ``ffn_down`` (rows of 256 / 512) keep Q4_K / Q6_K. That is the file a llama.cpp user of
  this model gets; serving it needs Q5_0 besides the types issue 35 lists;
* the KL divergences are small (Q8_0 ~5e-5 nats): the same BF16 weights run by
  hybridserve already differ from llama.cpp's saved base by a KLD of that order
  (``--ours-base``), so "within 1 %" of llama.cpp's KLD is met only where the
  quantization's KLD is well above that floor.

    python benches/gguf_fidelity.py --types Q8_0,Q4_K_M --chunks 64 --ctx 512
    python benches/gguf_fidelity.py --only llama           # llama.cpp's side alone
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llamacpp import build, gguf_files  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "python" / "hybridserve" / "default_model"


# ---- the text ---------------------------------------------------------------------

def heldout_text(max_bytes: int) -> str:
    """The held-out stdlib documents in corpus order, joined by blank lines, capped at
    ``max_bytes`` (whole documents; 0: all)."""
    from hybridserve.train import corpus

    _, held = corpus.split(corpus.documents())
    out, total = [], 0
    for d in held:
        n = len(d.text.encode("utf-8"))
        if max_bytes and out and total + n > max_bytes:
            break
        out.append(d.text)
        total += n
    return "\n\n".join(out)


# ---- llama.cpp's side -------------------------------------------------------------

def run_llama_perplexity(exe: Path, args: list[str], log: Path, threads: int) -> str:
    cmd = [str(exe), *args, "-t", str(threads), "-tb", str(threads)]
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        f.write((" ".join(cmd) + "\n").encode())
        f.flush()
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text(errors="replace")
    if rc != 0:
        raise RuntimeError(f"llama-perplexity failed (exit {rc}); last lines of {log}:\n"
                           + "\n".join(text.splitlines()[-25:]))
    print(f"  llama-perplexity {' '.join(a for a in args if not a.startswith('/'))[:80]}... "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return text


def _num(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def parse_base(text: str) -> dict:
    return {"ppl": _num(r"Final estimate: PPL = ([0-9.]+)", text)}


def parse_kld(text: str) -> dict:
    return {
        "ppl": _num(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text),
        "ppl_base": _num(r"Mean PPL\(base\)\s*:\s*([0-9.]+)", text),
        "kld": _num(r"Mean\s+KLD:\s*([-0-9.e]+)", text),
        "same_top": _num(r"Same top p:\s*([0-9.]+)", text),
    }


# ---- the base file ----------------------------------------------------------------

class KLDBase:
    """``--kl-divergence-base`` file: ``_logits_``, n_ctx (u32), n_vocab (i32), n_chunk (i32),
    the chunks' tokens (i32), then per chunk ``n_ctx - 1 - n_ctx/2`` rows of ``nv`` uint16:
    two floats (scale, min log-prob) then one uint16 per vocabulary entry."""

    def __init__(self, path: Path):
        raw = path.read_bytes()
        if raw[:8] != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity --kl-divergence-base file")
        self.n_ctx, self.n_vocab, self.n_chunk = struct.unpack_from("<Iii", raw, 8)
        off = 20
        n_tok = self.n_ctx * self.n_chunk
        self.tokens = np.frombuffer(raw, dtype=np.int32, count=n_tok, offset=off)
        off += 4 * n_tok
        self.nv = 2 * ((self.n_vocab + 1) // 2) + 4
        self.rows = self.n_ctx - 1 - self.n_ctx // 2
        self.log_probs = np.frombuffer(raw, dtype=np.uint16, count=self.n_chunk * self.rows * self.nv,
                                       offset=off).reshape(self.n_chunk, self.rows, self.nv)

    def chunk_tokens(self, i: int) -> np.ndarray:
        return self.tokens[i * self.n_ctx:(i + 1) * self.n_ctx]

    def base_log_probs(self, i: int) -> np.ndarray:
        """float32 [rows, n_vocab]: the base's log-probabilities as llama.cpp decodes them."""
        blk = self.log_probs[i]
        head = np.ascontiguousarray(blk[:, :4]).view(np.float32)  # [rows, 2]: scale, min
        return head[:, :1] * blk[:, 4:4 + self.n_vocab].astype(np.float32) + head[:, 1:2]


class Stats:
    """llama.cpp's kl_divergence_result, accumulated the same way (float32 per-row
    terms summed in float64)."""

    def __init__(self):
        self.nll = self.nll2 = self.nll_base = self.kld = self.kld2 = 0.0
        self.same_top = self.count = 0
        self.kld_values: list[np.ndarray] = []

    def add(self, logits: np.ndarray, targets: np.ndarray, base: np.ndarray) -> None:
        logits = logits.astype(np.float32)
        mx = logits.max(axis=1, keepdims=True)
        lse = np.log(np.exp((logits - mx).astype(np.float64)).sum(axis=1, keepdims=True)).astype(np.float32)
        logp = logits - mx - lse
        nll = -logp[np.arange(len(targets)), targets]
        self.nll += float(nll.astype(np.float64).sum())
        self.nll2 += float((nll.astype(np.float64) ** 2).sum())
        self.nll_base += float(-base[np.arange(len(targets)), targets].astype(np.float64).sum())
        # llama.cpp: sum over entries with base log-prob > -16 of p_base * (log p_base - log p).
        mask = base > -16.0
        p_base = np.where(mask, np.exp(base), 0.0)
        kld = (p_base * np.where(mask, base - logp, 0.0)).astype(np.float64).sum(axis=1)
        self.kld += float(kld.sum())
        self.kld2 += float((kld ** 2).sum())
        self.kld_values.append(kld)
        self.same_top += int((logits.argmax(axis=1) == base.argmax(axis=1)).sum())
        self.count += len(targets)

    def result(self) -> dict:
        n = max(1, self.count)
        return {"ppl": math.exp(self.nll / n), "ppl_base": math.exp(self.nll_base / n), "kld": self.kld / n,
                "same_top": 100.0 * self.same_top / n, "tokens_scored": self.count,
                "kld_median": float(np.median(np.concatenate(self.kld_values))) if self.kld_values else None}


# ---- hybridserve's side -----------------------------------------------------------

def whole_prompt_logits(model, config, prompt: list[int], block_size: int = 16):
    """Logits ``[n, vocab]`` of one prompt in one forward from an empty cache (blocks and
    state pages numbered in order)."""
    import torch

    from hybridserve.memory.layout import arena_layout
    from hybridserve.model import ForwardBatch
    from hybridserve.model.cache import dtype_name

    n = len(prompt)
    nb = -(-n // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    batch = ForwardBatch.from_lists(
        input_ids=prompt, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=[list(range(nb))], state_pages=[list(range(nb, nb + pages))],
        has_initial_state=[False], logits_indices=range(n), device="cpu")
    with torch.no_grad():
        return model(batch, cache).float()


def ours(model_path: Path, base: KLDBase, dtype: str) -> dict:
    from hybridserve.model import load_model

    t0 = time.perf_counter()
    model, config = load_model(str(model_path), dtype=dtype, progress=False)
    if config.vocab_size != base.n_vocab:
        raise RuntimeError(f"{model_path}: vocabulary {config.vocab_size} != the base file's {base.n_vocab}")
    stats = Stats()
    first = base.n_ctx // 2
    for i in range(base.n_chunk):
        toks = base.chunk_tokens(i)
        logits = whole_prompt_logits(model, config, [int(t) for t in toks]).numpy()
        stats.add(logits[first:base.n_ctx - 1], toks[first + 1:].astype(np.int64), base.base_log_probs(i))
    res = stats.result()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    return res


def _rel(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{100.0 * (a - b) / b:+.2f} %"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q8_0,Q4_K_M", help="llama-quantize types to compare against the BF16 base")
    ap.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    ap.add_argument("--chunks", type=int, default=64, help="chunks scored (llama-perplexity --chunks)")
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="held-out text written (whole documents)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", choices=("both", "llama", "hybridserve"), default="both")
    ap.add_argument("--ours-dtype", default="float32", help="hybridserve's compute dtype for the GGUF files")
    ap.add_argument("--ours-base", action="store_true",
                    help="also score hybridserve on the HF checkpoint (bfloat16 weights, the BF16 file's) "
                         "against the same base: a check of this harness that needs no GGUF loader")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)

    import torch

    torch.set_num_threads(a.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(a.threads))
    print(f"threads: llama-perplexity -t {a.threads}; hybridserve torch.get_num_threads() {torch.get_num_threads()}",
          flush=True)
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    tree = build.source_tree()
    work = build.cache_root() / "work" / "fidelity"
    work.mkdir(parents=True, exist_ok=True)
    exe_q, exe_p = build.llama_quantize(), build.llama_perplexity()

    files = {"BF16": work / "default-BF16.gguf"}
    if not files["BF16"].is_file():
        gguf_files.convert(tree, DEFAULT_MODEL, "bf16", files["BF16"], log=work / "convert-bf16.log")
    for t in types:
        files[t] = work / f"default-{t}.gguf"
        if not files[t].is_file():
            log = work / f"quantize-{t}.log"
            gguf_files.quantize(exe_q, files["BF16"], t, files[t], log=log)
            n_fb = log.read_text(errors="replace").count("falling back")
            if n_fb:
                print(f"  note: llama-quantize fell back to another type for {n_fb} tensors of {t} "
                      f"(rows not a multiple of its block); see {log}", flush=True)
    for name, path in files.items():
        kinds = sorted(set(gguf_files.tensor_types(path, tree).values()))
        print(f"{name}: {path} ({path.stat().st_size / 2**20:.2f} MiB; tensor types {', '.join(kinds)})", flush=True)

    text_path = work / f"heldout-{a.max_bytes}.txt"
    if not text_path.is_file():
        text_path.write_text(heldout_text(a.max_bytes), encoding="utf-8")
    base_path = work / f"base-c{a.ctx}-k{a.chunks}.kld"
    report: dict = {"ctx": a.ctx, "chunks": a.chunks, "text": str(text_path), "threads": a.threads,
                    "files": {k: str(v) for k, v in files.items()}, "llama": {}, "hybridserve": {}}
    common = ["-c", str(a.ctx), "-b", str(a.ctx), "--chunks", str(a.chunks)]
    if a.only != "hybridserve" or not base_path.is_file():
        out = run_llama_perplexity(exe_p, ["-m", str(files["BF16"]), "-f", str(text_path), *common,
                                           "--kl-divergence-base", str(base_path)], work / "ppl-BF16.log", a.threads)
        report["llama"]["BF16"] = parse_base(out)
    base = KLDBase(base_path)
    print(f"base: {base.n_chunk} chunks of {base.n_ctx} tokens, vocabulary {base.n_vocab}, "
          f"{base.n_chunk * base.rows} tokens scored", flush=True)
    if a.only == "hybridserve":
        # llama.cpp's numbers from its earlier runs' logs on the same base, when there are any.
        if (work / "ppl-BF16.log").is_file() and str(base_path) in (work / "ppl-BF16.log").read_text(errors="replace").splitlines()[0]:
            report["llama"]["BF16"] = parse_base((work / "ppl-BF16.log").read_text(errors="replace"))
        for t in types:
            log = work / f"kld-{t}.log"
            if log.is_file() and str(base_path) in log.read_text(errors="replace").splitlines()[0]:
                report["llama"][t] = parse_kld(log.read_text(errors="replace"))
    else:
        for t in types:
            out = run_llama_perplexity(exe_p, ["-m", str(files[t]), *common, "--kl-divergence-base", str(base_path),
                                               "--kl-divergence"], work / f"kld-{t}.log", a.threads)
            report["llama"][t] = parse_kld(out)
    if a.only != "llama":
        if a.ours_base:
            report["hybridserve"]["HF bf16 (harness check)"] = ours(DEFAULT_MODEL, base, "bfloat16")
        for name in ["BF16", *types]:
            try:
                report["hybridserve"][name] = ours(files[name], base, a.ours_dtype)
            except Exception as e:  # noqa: BLE001 - reported per file, the others still run
                report["hybridserve"][name] = {"error": f"{type(e).__name__}: {e}"}

    print("(llama.cpp's KLD and top-1 are against the BF16 file's saved log-probs; ours are computed from our "
          "logits against the same saved log-probs; the BF16 row's llama PPL is llama-perplexity's own)")
    print(f"\nperplexity and KL divergence on {base.n_chunk} x {base.n_ctx}-token chunks of held-out text "
          f"(second half of each chunk scored), {a.threads} threads")
    print(f"{'file':>24}  {'llama PPL':>10}  {'hs PPL':>10}  {'PPL diff':>9}  {'llama KLD':>10}  {'hs KLD':>10}  "
          f"{'KLD diff':>9}  {'llama top1':>10}  {'hs top1':>8}")
    for name in sorted(set(report["llama"]) | set(report["hybridserve"]), key=lambda n: (n != "BF16", n)):
        ll, hs = report["llama"].get(name, {}), report["hybridserve"].get(name, {})
        error = hs.pop("error", None) if isinstance(hs, dict) else None
        f = lambda x, s="{:.4f}": "-" if x is None else s.format(x)  # noqa: E731
        if error:
            report["hybridserve"][name] = {"error": error}
        print(f"{name:>24}  {f(ll.get('ppl')):>10}  {f(hs.get('ppl')):>10}  {_rel(hs.get('ppl'), ll.get('ppl')):>9}  "
              f"{f(ll.get('kld'), '{:.6f}'):>10}  {f(hs.get('kld'), '{:.6f}'):>10}  "
              f"{_rel(hs.get('kld'), ll.get('kld')):>9}  {f(ll.get('same_top'), '{:.2f}%'):>10}  "
              f"{f(hs.get('same_top'), '{:.2f}%'):>8}" + (f"   hybridserve: {error[:160]}" if error else ""))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
