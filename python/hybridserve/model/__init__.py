"""The Qwen3.5 hybrid model for serving: batch inputs, cache pools, layers, loading."""

from hybridserve.model.batch import ForwardBatch
from hybridserve.model.cache import HybridCache, resolve_dtype
from hybridserve.model.loader import load_model
from hybridserve.model.qwen3_5 import Qwen3_5ForServing

__all__ = ["ForwardBatch", "HybridCache", "Qwen3_5ForServing", "load_model", "resolve_dtype"]
