"""hybridserve: a serving engine for hybrid attention/Gated-DeltaNet language models.

The Rust core (``hybridserve._core``) owns all bookkeeping: KV blocks, block tables,
the prefix cache, DeltaNet state slots and the continuous-batching scheduler. The
Python side owns tensors: the model, the runner, the sampler, the engines.
"""

from hybridserve.errors import (
    CheckpointError,
    ConfigError,
    HybridServeError,
    InvalidBlock,
    InvalidRequest,
    InvalidSlot,
    OutOfBlocks,
    OutOfSlots,
    QueueFull,
    RequestRejected,
    UnknownRequest,
)

__version__ = "0.1.0"

# The engine pulls in torch; import it on first use so that `hybridserve plan` and
# the Rust core's bindings stay light.
_LAZY = {
    "LLM": "hybridserve.engine.llm",
    "LLMEngine": "hybridserve.engine.llm_engine",
    "EngineArgs": "hybridserve.engine.args",
    "SamplingParams": "hybridserve.sampling",
    "BeamSearchParams": "hybridserve.beam_search",
    "BeamSearchOutput": "hybridserve.beam_search",
    "RequestOutput": "hybridserve.outputs",
    "CompletionOutput": "hybridserve.outputs",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "__version__",
    "LLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "BeamSearchParams",
    "BeamSearchOutput",
    "RequestOutput",
    "CompletionOutput",
    "CheckpointError",
    "ConfigError",
    "HybridServeError",
    "InvalidBlock",
    "InvalidRequest",
    "InvalidSlot",
    "OutOfBlocks",
    "OutOfSlots",
    "QueueFull",
    "RequestRejected",
    "UnknownRequest",
]
