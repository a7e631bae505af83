"""Opening GGUF files (one, or the ``*-00001-of-0000N.gguf`` parts of a split one) with
the ``gguf`` package's :class:`gguf.GGUFReader`, llama.cpp's own reader (memory-mapped).

:class:`GGUFFile` gives the metadata of the first part (where llama.cpp's
``gguf-split`` keeps it) and every part's tensors by name. A tensor of a type hybridserve
does not serve is refused with a :class:`~hybridserve.errors.CheckpointError` naming the
tensor and the type, when the file is opened (before any weight is read).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridserve.errors import CheckpointError
from hybridserve.quant.ggml import GGML_BY_ID, GGMLWeight

# Plain tensors (read as torch tensors) and the block types kept as blocks.
PLAIN_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}  # F32, F16, BF16
PLAIN_NAMES = {0: "F32", 1: "F16", 30: "BF16"}
SERVED_TYPE_NAMES = sorted([*PLAIN_NAMES.values(), *(t.name.upper() for t in GGML_BY_ID.values())])

_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")


def split_parts(path: str) -> list[str]:
    """The files of the GGUF at ``path``: every part of a split GGUF (whichever part is
    named), in order, or ``[path]``. CheckpointError when a part is missing."""
    m = _SPLIT.match(path)
    if not m:
        return [path]
    n = int(m["n"])
    parts = [f"{m['stem']}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    missing = [p for p in parts if not os.path.exists(p)]
    if missing:
        raise CheckpointError(f"split GGUF {path!r} is missing its part(s) {missing}")
    return parts


def is_gguf_path(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file (what ``LLM`` / ``serve`` / ``load_model`` dispatch on)."""
    return os.fspath(path).endswith(".gguf")


@dataclass
class Tensor:
    """One GGUF tensor: ``shape`` in torch order (GGUF stores it reversed), ``type_id``
    its GGML type, ``raw`` the reader's numpy view (bytes ``[..., row_bytes]`` for a block
    type, elements for a plain one)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    raw: np.ndarray

    @property
    def quantized(self) -> bool:
        return self.type_id in GGML_BY_ID

    @property
    def type_name(self) -> str:
        if self.type_id in PLAIN_NAMES:
            return PLAIN_NAMES[self.type_id]
        return GGML_BY_ID[self.type_id].name.upper()

    def plain(self) -> torch.Tensor:
        """A plain tensor's values (a copy, in its stored dtype), shaped ``shape``."""
        if self.quantized:
            raise TypeError(f"tensor {self.name!r} is {self.type_name}, not a plain tensor")
        arr = np.ascontiguousarray(self.raw)
        if self.type_id == 30:  # numpy has no bfloat16: the reader hands uint16 bits
            t = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
        else:
            t = torch.from_numpy(arr.copy())
        return t.reshape(self.shape)

    def blocks(self) -> torch.Tensor:
        """A block tensor's bytes (a copy), ``uint8 [*shape[:-1], row_bytes]``."""
        if not self.quantized:
            raise TypeError(f"tensor {self.name!r} is {self.type_name}, not a block type")
        t = GGML_BY_ID[self.type_id]
        row_bytes = self.shape[-1] // t.block_size * t.block_bytes
        arr = np.ascontiguousarray(self.raw).reshape(*self.shape[:-1], row_bytes)
        return torch.from_numpy(arr.copy())

    def dequantize(self) -> torch.Tensor:
        """A block tensor's values as float32 ``shape`` (gguf's reference dequantize)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        out = dequantize(np.ascontiguousarray(self.raw), GGMLQuantizationType(self.type_id))
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)

    def weight(self) -> GGMLWeight:
        """A 2-D block tensor as a :class:`GGMLWeight` ``[out, in]``."""
        if len(self.shape) != 2:
            raise CheckpointError(f"tensor {self.name!r} has shape {list(self.shape)}, expected 2-D")
        return GGMLWeight(GGML_BY_ID[self.type_id].name, self.blocks(), self.shape)


class GGUFFile:
    """A GGUF checkpoint (all parts of a split one): metadata and tensors by name."""

    def __init__(self, path: str | os.PathLike[str]):
        from gguf import GGUFReader

        path = os.fspath(path)
        if not os.path.isfile(path):
            raise CheckpointError(f"GGUF file {path!r} does not exist")
        self.path = path
        self.parts = split_parts(path)
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        for i, part in enumerate(self.parts):
            try:
                reader = GGUFReader(part, "r")
            except ValueError as e:
                # The reader refuses a tensor type id it does not know at all.
                raise CheckpointError(f"{part!r} is not a GGUF file hybridserve can read: {e}") from None
            if i == 0:
                self.fields = {name: _field_value(f) for name, f in reader.fields.items()}
            for t in reader.tensors:
                type_id = int(t.tensor_type)
                if type_id not in PLAIN_TYPES and type_id not in GGML_BY_ID:
                    raise CheckpointError(
                        f"tensor {t.name!r} in {os.path.basename(part)} has GGML type "
                        f"{getattr(t.tensor_type, 'name', type_id)}, which hybridserve does not serve; "
                        f"served types: {', '.join(SERVED_TYPE_NAMES)} (re-quantize with llama-quantize "
                        "to Q8_0, Q4_0, Q4_K_M, Q5_K_M or Q6_K)")
                if t.name in self.tensors:
                    raise CheckpointError(f"tensor {t.name!r} appears twice in {path!r}")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                self.tensors[t.name] = Tensor(t.name, shape, type_id, t.data)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.fields:
            raise CheckpointError(f"GGUF {self.path!r} has no metadata key {key!r}")
        return self.fields[key]

    @property
    def architecture(self) -> str:
        return str(self.need("general.architecture"))


def _field_value(field) -> Any:
    """A metadata field as a Python value (arrays as lists, strings as str)."""
    from gguf import GGUFValueType

    types = list(field.types)
    if not types:
        return None
    if types[0] == GGUFValueType.ARRAY:
        sub = types[1] if len(types) > 1 else None
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]
