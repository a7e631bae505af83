"""One random-weight checkpoint served by both engines.

The HF checkpoint is :func:`hybridserve.model.tiny.write_tiny_checkpoint`'s (a ``peer-*``
preset), with its byte-level tokenizer replaced by a real BPE vocabulary: llama.cpp's
converter and loader need one whose size is the model's (the embedding's rows), and
with a real vocabulary most sampled tokens decode to text on both servers, so each
streamed token is one SSE chunk for the client on both. The vocabulary is llama.cpp's
shipped Qwen BPE (``models/ggml-vocab-qwen35.gguf``: 151,936 tokens and their merges),
padded with ``[PAD<id>]`` tokens up to the model's vocabulary (248,320 for the 0.8B
shape), written as a ``tokenizer.json`` for hybridserve/HF and copied into the GGUF by
a converter whose ``set_vocab`` reads the same file.

The GGUFs come from the tree's own ``convert_hf_to_gguf.py`` (``--no-mtp``), at f32
and bf16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

QWEN_VOCAB = "models/ggml-vocab-qwen35.gguf"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
# Qwen2's pre-tokenizer split (only used to encode text; the bench sends token ids).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types


def read_vocab(tree: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, llama.cpp token types, merges) of the shipped Qwen vocabulary, padded
    to ``vocab_size``."""
    sys.path.insert(0, str(tree / "gguf-py"))
    import gguf

    r = gguf.GGUFReader(tree / QWEN_VOCAB, "r")
    f_tok, f_typ, f_mrg = (r.get_field(k) for k in (gguf.Keys.Tokenizer.LIST, gguf.Keys.Tokenizer.TOKEN_TYPE,
                                                     gguf.Keys.Tokenizer.MERGES))
    tokens = [bytes(f_tok.parts[i]).decode("utf-8") for i in f_tok.data]
    types = [int(f_typ.parts[i][0]) for i in f_typ.data]
    merges = [bytes(f_mrg.parts[i]).decode("utf-8") for i in f_mrg.data]
    if vocab_size < len(tokens):
        raise ValueError(f"vocab_size {vocab_size} is below the Qwen vocabulary's {len(tokens)} tokens")
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(USER_DEFINED)
    return tokens, types, merges


def write_tokenizer(out_dir: Path, tokens: list[str], types: list[int], merges: list[str]) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` of the vocabulary (byte-level BPE)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    normal = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty not in (CONTROL, USER_DEFINED)}
    tok = Tokenizer(models.BPE(vocab=normal, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Added tokens take the next free ids in order: the vocabulary's are contiguous
    # after the normal ones, so each gets its GGUF id (checked below).
    first_added = len(normal)
    added = [AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
             for i in range(first_added, len(tokens))]
    tok.add_tokens([a for a in added])
    for probe in (first_added, len(tokens) - 1, tokens.index(IM_END)):
        if tok.token_to_id(tokens[probe]) != probe:
            raise RuntimeError(f"token {tokens[probe]!r} got id {tok.token_to_id(tokens[probe])}, not {probe}")
    tok.save(str(out_dir / "tokenizer.json"))
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
                   "pad_token": ENDOFTEXT, "unk_token": None, "model_max_length": 4096}, f, indent=2)


def hf_checkpoint(tree: Path, work: Path, preset: str, seed: int = 0) -> Path:
    """The HF checkpoint of ``preset`` with the real vocabulary (written once)."""
    from hybridserve.model.tiny import text_config, write_tiny_checkpoint

    out = work / preset / "hf"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    vocab_size = text_config(preset)["vocab_size"]
    tokens, types, merges = read_vocab(tree, vocab_size)
    write_tiny_checkpoint(out, preset=preset, seed=seed, dtype="float32",
                          eos_token_id=tokens.index(IM_END), pad_token_id=tokens.index(ENDOFTEXT))
    write_tokenizer(out, tokens, types, merges)
    return out


# Run by a child Python inside the tree: the tree's converter with set_vocab reading the
# shipped Qwen vocabulary (the checkpoint's tokenizer.json has no pre-tokenizer hash the
# converter knows), padded as read_vocab pads it.
_SHIM = r"""
import runpy, sys
tree, vocab, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.argv = [tree + "/convert_hf_to_gguf.py"] + sys.argv[4:]
sys.path[0:0] = [tree, tree + "/gguf-py"]
import gguf
from conversion import qwen

def set_vocab(self):
    r = gguf.GGUFReader(vocab, "r")
    get = r.get_field
    toks = [bytes(get(gguf.Keys.Tokenizer.LIST).parts[i]) for i in get(gguf.Keys.Tokenizer.LIST).data]
    types = [int(get(gguf.Keys.Tokenizer.TOKEN_TYPE).parts[i][0]) for i in get(gguf.Keys.Tokenizer.TOKEN_TYPE).data]
    toks += [f"[PAD{i}]".encode() for i in range(len(toks), size)]
    types += [int(gguf.TokenType.USER_DEFINED)] * (size - len(types))
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(bytes(get(gguf.Keys.Tokenizer.PRE).parts[-1]).decode())
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges([bytes(get(gguf.Keys.Tokenizer.MERGES).parts[i]) for i in get(gguf.Keys.Tokenizer.MERGES).data])
    w.add_eos_token_id(toks.index(b"<|im_end|>"))
    w.add_pad_token_id(toks.index(b"<|endoftext|>"))
    w.add_add_bos_token(False)

qwen.Qwen3_5TextModel.set_vocab = set_vocab
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def gguf_file(tree: Path, hf_dir: Path, outtype: str) -> Path:
    """``hf_dir`` converted by the tree's ``convert_hf_to_gguf.py`` (``f32`` / ``bf16``)."""
    from hybridserve.model.tiny import text_config  # noqa: F401 (the package must import)

    out = hf_dir.parent / f"model-{outtype}.gguf"
    if out.is_file():
        return out
    size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    tmp = out.with_suffix(".tmp")
    cmd = [sys.executable, "-c", _SHIM, str(tree), str(tree / QWEN_VOCAB), str(size),
           str(hf_dir), "--outtype", outtype, "--outfile", str(tmp), "--no-mtp"]
    log = hf_dir.parent / f"convert-{outtype}.log"
    print(f"converting {hf_dir} to {outtype} GGUF (log: {log})", flush=True)
    with open(log, "wb") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {rc}):\n" +
                           "\n".join(log.read_text(errors="replace").splitlines()[-25:]))
    tmp.rename(out)
    return out
