"""hybridserve's default model, shipped in the wheel as package data.

A ~5.5M-parameter Qwen3.5 (Gated DeltaNet + gated attention, partial rotary, dense,
tied embeddings) with one MTP layer, trained here on the Python standard library by
``python -m hybridserve.train`` (README, "The default model", has the command, its wall
time and its quality). It writes Python-like code and documentation-like prose; nothing
more is claimed. ``hybridserve serve`` with no model serves it as :data:`NAME`.

This directory is an ordinary HF checkpoint: ``config.json``, ``model.safetensors``
(bfloat16, the trunk plus ``mtp.*``), ``tokenizer.json``, ``tokenizer_config.json``
(with Qwen3.5's chat template) and ``generation_config.json``.
"""

from __future__ import annotations

import os

from hybridserve.errors import ConfigError

NAME = "hybridserve-stdlib-5m"


def path() -> str:
    """The checkpoint directory (inside the installed package)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        if not os.path.exists(os.path.join(here, f)):
            raise ConfigError(f"the default model's {f} is missing from {here}; reinstall hybridserve, "
                              "or pass a model directory")
    return here
