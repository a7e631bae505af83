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

__all__ = [
    "__version__",
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
