"""The tokenizer and chat template of a checkpoint directory, through transformers."""

from __future__ import annotations

import os
from typing import Any, Sequence

from hybridserve.errors import CheckpointError


def load_tokenizer(model_dir: str | os.PathLike[str]):
    """``transformers.AutoTokenizer`` for ``model_dir``, offline (no hub lookups); for a
    ``.gguf`` file, the tokenizer its metadata describes
    (:func:`hybridserve.quant.gguf.tokenizer.gguf_tokenizer`)."""
    from transformers import AutoTokenizer

    model_dir = os.fspath(model_dir)
    if model_dir.endswith(".gguf"):
        # A GGUF file carries its tokenizer and chat template in its metadata.
        from hybridserve.quant.gguf.reader import GGUFFile
        from hybridserve.quant.gguf.tokenizer import gguf_tokenizer

        return gguf_tokenizer(GGUFFile(model_dir))
    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad directory
        raise CheckpointError(
            f"cannot load a tokenizer from {model_dir!r} ({type(e).__name__}: {e}); the directory "
            "needs tokenizer.json (or the files of a slow tokenizer) and tokenizer_config.json"
        ) from e


def apply_chat_template(tokenizer, messages: Sequence[dict[str, Any]],
                        add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                        **template_kwargs: Any) -> list[int]:
    """Token ids of ``messages`` rendered with the checkpoint's chat template
    (``tools`` and ``template_kwargs``, e.g. ``enable_thinking``, go to the template)."""
    if not getattr(tokenizer, "chat_template", None):
        raise CheckpointError("this checkpoint's tokenizer has no chat_template; send a plain prompt")
    if tools is not None:
        template_kwargs["tools"] = tools
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                        tokenize=True, **template_kwargs)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)
