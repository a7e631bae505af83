"""Model shapes shipped with hybridserve, by name, for ``hybridserve plan NAME``.

Each preset is a ``config.json`` (shape only, no weights): ``qwen3.5-27b`` is the
27B-parameter Qwen3.5 hybrid's text config that the planner's examples use; the
mixture-of-experts presets (``qwen3.5-35b-a3b``, ``qwen3.5-122b-a10b``,
``qwen3.5-397b-a17b``) are the published checkpoints' text configs, flattened to
``qwen3_5_moe_text``, each naming where its values come from in ``_source``.
``*-q4_k_m`` and ``*-fp8`` are the 27B and 35B-A3B shapes in the quantized forms people
download (a llama-quantize Q4_K_M GGUF, Qwen's FP8 checkpoint): their
``quantization_config`` makes the planner count the quantized bytes
(:func:`hybridserve.planner.weights.quantized_weight_bytes`).
"""

from __future__ import annotations

import os
from importlib import resources


def preset_names() -> list[str]:
    return sorted(
        f.name[: -len(".json")]
        for f in resources.files(__name__).iterdir()
        if f.name.endswith(".json")
    )


def preset_path(name: str) -> str | None:
    """The file of preset ``name``, or None when there is no such preset."""
    if name not in preset_names():
        return None
    return os.fspath(resources.files(__name__) / f"{name}.json")


def resolve_config(name_or_path: str) -> str:
    """A path as given when it exists, else the preset of that name; else the input
    unchanged (so the config reader reports the missing file)."""
    if os.path.exists(name_or_path):
        return name_or_path
    return preset_path(name_or_path) or name_or_path
