"""Quantized weights, kept in the form they were stored in.

A quantized checkpoint's projections keep their bytes: the point of Q4_K or FP8 is that
decode reads fewer of them. Each format is one class with the same small contract
(:class:`QuantizedWeight`); :class:`hybridserve.model.layers.Projection` holds one in
place of its ``weight`` and sends its inputs to :meth:`QuantizedWeight.linear`.

- :mod:`.weight`: the contract (``rows`` / ``cols``: the slices fused projections and
  tensor parallelism take), fused parts (:class:`ConcatWeight`), float parts
  (:class:`FloatWeight`) and FP8's column window (:class:`ColumnWindowWeight`).
- :mod:`.ggml`: llama.cpp's block formats (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K; F32/F16/BF16
  come in as plain tensors), as GGUF files store them.
- :mod:`.fp8`: Qwen's official FP8 checkpoints (e4m3, 128 x 128 block scales).
- :mod:`.awq`: AWQ int4 checkpoints (GEMM layout, group scales and zero points).
- :mod:`.checkpoint`: reading and checking a safetensors checkpoint's
  ``quantization_config`` and quantized tensors (FP8, AWQ); :mod:`.tiny` writes tiny
  ones for tests, the device check and benches.
"""

from hybridserve.quant.weight import ColumnWindowWeight, ConcatWeight, FloatWeight, QuantizedWeight, SliceError

__all__ = ["ColumnWindowWeight", "ConcatWeight", "FloatWeight", "QuantizedWeight", "SliceError"]
