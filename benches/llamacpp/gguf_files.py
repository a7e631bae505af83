"""GGUF files made the way llama.cpp users make them: the tree's own
``convert_hf_to_gguf.py`` (F16 / BF16 / F32) then ``llama-quantize`` (Q8_0, Q4_K_M, ...).

The converter names a BPE tokenizer's pre-tokenizer by hashing how the tokenizer splits
a fixed text; a vocabulary it has never seen (the trained default model's 8K BPE, the
fixtures' cut of it) has an unknown hash and the converter stops. Those vocabularies use
Qwen3.5's split regex exactly (llama.cpp's ``qwen35`` pre-tokenizer: compare
``tokenizer.json``'s ``Split`` pattern with ``LLAMA_VOCAB_PRE_TYPE_QWEN35`` in
``src/llama-vocab.cpp``), so :func:`convert` runs the converter with its hash lookup
replaced by that declared name; everything else (tensor names and layouts, metadata,
merges, chat template) is the converter's own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

# Child-Python shim: the tree's converter with the pre-tokenizer name given, not hashed.
_SHIM = r"""
import runpy, sys
tree, pre = sys.argv[1], sys.argv[2]
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[3:]
sys.path[0:0] = [tree, tree + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# llama-quantize's type names for the file types the project serves.
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K")
CONVERT_TYPES = ("f32", "f16", "bf16")


def _split_regex(hf_dir: Path) -> str | None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    pre = tok.get("pre_tokenizer") or {}
    for p in pre.get("pretokenizers", [pre]):
        if p.get("type") == "Split":
            return p["pattern"].get("Regex")
    return None


# The split of Qwen3.5's tokenizer.json (what llama.cpp's qwen35 pre-tokenizer implements).
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def convert(tree: Path, hf_dir: Path, outtype: str, out: Path, *, pre: str = "qwen35", no_mtp: bool = True,
            log: Path | None = None) -> Path:
    """``hf_dir`` -> ``out`` by the tree's converter at ``outtype`` (f32 / f16 / bf16).

    ``pre`` is the llama.cpp pre-tokenizer name written to the file; for ``qwen35`` the
    checkpoint's split regex is checked to be Qwen3.5's first (a mismatch would make
    llama.cpp tokenize text differently from HF)."""
    if outtype not in CONVERT_TYPES:
        raise ValueError(f"outtype {outtype!r} is not one of {CONVERT_TYPES}")
    if pre == "qwen35" and _split_regex(hf_dir) != QWEN35_SPLIT:
        raise ValueError(f"{hf_dir}/tokenizer.json does not split text with Qwen3.5's regex; "
                         "declare the pre-tokenizer that matches it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    cmd = [sys.executable, "-c", _SHIM, str(tree), pre, str(hf_dir), "--outtype", outtype, "--outfile", str(tmp)]
    if no_mtp:
        cmd.append("--no-mtp")
    log = log or out.with_suffix(".convert.log")
    with open(log, "wb") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {rc}); last lines of {log}:\n"
                           + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    tmp.replace(out)
    return out


def quantize(exe: Path, src: Path, qtype: str, out: Path, *, threads: int = 1, log: Path | None = None) -> Path:
    """``llama-quantize src out qtype`` (no imatrix: the recipe alone decides each tensor's type)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    log = log or out.with_suffix(".quantize.log")
    with open(log, "wb") as f:
        rc = subprocess.call([str(exe), str(src), str(tmp), qtype, str(threads)], stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"llama-quantize {qtype} failed (exit {rc}); last lines of {log}:\n"
                           + "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    tmp.replace(out)
    return out


def tensor_types(path: Path, tree: Path | None = None) -> dict[str, str]:
    """Tensor name -> ggml type name of a GGUF file (the ``gguf`` reader)."""
    if tree is not None and str(tree / "gguf-py") not in sys.path:
        sys.path.insert(0, str(tree / "gguf-py"))
    import gguf

    r = gguf.GGUFReader(str(path), "r")
    return {t.name: t.tensor_type.name for t in r.tensors}
