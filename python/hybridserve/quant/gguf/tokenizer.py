"""The tokenizer and chat template of a GGUF file, from its ``tokenizer.ggml.*`` metadata.

transformers (5.23) builds tokenizers from GGUF only for the architectures it knows,
and ``qwen35`` is not one of them, so the byte-level BPE is built here with
``tokenizers`` from what llama.cpp's converter stores (``_set_vocab_gpt2``):

- ``tokenizer.ggml.model`` ``gpt2``: byte-level BPE; ``tokens`` (id order) and ``merges``;
- ``token_type``: CONTROL tokens are special added tokens (``<|im_end|>``), USER_DEFINED
  ones non-special added tokens (``<think>``, ``<tool_call>``: they stay in decoded text);
- ``tokenizer.ggml.pre``: the pre-tokenizer; Qwen's are a regex split (the pattern of
  Qwen's ``tokenizer.json``, as llama.cpp's ``llama-vocab.cpp`` records it per pre type),
  then byte-level mapping;
- ``bos/eos/padding_token_id``, ``add_bos_token``; ``tokenizer.chat_template``.
"""

from __future__ import annotations

from hybridserve.errors import ConfigError
from hybridserve.quant.gguf.reader import GGUFFile

# tokenizer.json's split pattern of each pre-tokenizer type.
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_PATTERNS = {"qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "qwen35": _QWEN35}

# gguf.TokenType values.
_CONTROL, _USER_DEFINED = 3, 4


def gguf_tokenizer(f: GGUFFile):
    """A ``transformers.PreTrainedTokenizerFast`` equal to the file's tokenizer, with its
    chat template and special token ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"GGUF {f.path!r} has tokenizer model {kind!r}; hybridserve builds byte-level BPE "
                          "('gpt2', what Qwen's GGUFs carry) tokenizers only")
    pre = f.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_PATTERNS:
        raise ConfigError(f"GGUF {f.path!r} has pre-tokenizer {pre!r}; known: {sorted(PRE_PATTERNS)} (Qwen's)")
    tokens: list[str] = f.need("tokenizer.ggml.tokens")
    types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in (f.get("tokenizer.ggml.merges") or [])]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_PATTERNS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    def token(key: str) -> str | None:
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    bos = token("bos")
    if f.get("tokenizer.ggml.add_bos_token") and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    arch = f.get("general.architecture")
    ctx = f.get(f"{arch}.context_length")
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos if f.get("tokenizer.ggml.add_bos_token") else None,
        eos_token=token("eos"), pad_token=token("padding"), unk_token=None,
        model_max_length=int(ctx) if ctx else None, clean_up_tokenization_spaces=False)
    template = f.get("tokenizer.chat_template")
    if template:
        out.chat_template = template
    return out
