"""GGUF checkpoints (llama.cpp's ``qwen35`` / ``qwen35moe``), served from their blocks.

- :mod:`.reader`: one or split files through the ``gguf`` package's reader; types refused
  by name;
- :mod:`.config`: metadata -> the HF config :class:`~hybridserve.config.ModelConfig` takes;
- :mod:`.tokenizer`: the tokenizer and chat template from ``tokenizer.ggml.*``;
- :mod:`.names` / :mod:`.load`: tensors -> the model, the converter's transforms undone;
- :mod:`.weights`: the embedding, experts and permuted weights served from blocks.

(The package is named after the format; ``import gguf`` inside it is still llama.cpp's
package: imports are absolute.)
"""

from hybridserve.quant.gguf.reader import is_gguf_path

__all__ = ["is_gguf_path"]
