"""The default model's tokenizer: a byte-level BPE trained with ``tokenizers`` on the
training split of the corpus, with Qwen3.5's pre-tokenizer pattern (digits one by one,
runs of spaces kept together, which suits indented code), Qwen3.5's special tokens as
single ids, and Qwen3.5's real chat template (``chat_template.jinja``, copied from the
released checkpoints' template).
"""

from __future__ import annotations

import json
import os
from typing import Iterable

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Qwen2/Qwen3/Qwen3.5's pre-tokenizer split.
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "chat_template.jinja")


def chat_template() -> str:
    with open(CHAT_TEMPLATE_PATH, encoding="utf-8") as f:
        return f.read()


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A ``tokenizers.Tokenizer``; the special tokens take the ids after the merges."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS), min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def save_tokenizer(tok, out_dir: str, model_max_length: int = 32768) -> None:
    """``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) so that
    ``AutoTokenizer.from_pretrained(out_dir)`` works offline."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": chat_template(),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")


def load_tokenizer(path: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path)
