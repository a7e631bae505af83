"""llama.cpp's block formats (GGML types), as GGUF files store them.

A weight ``[out, in]`` of a block type is ``out`` rows of ``in / block_size`` blocks,
each ``block_bytes`` long; rows are independent, so a row range is a byte range and
fused projections stack by rows. :class:`GGMLWeight` keeps those bytes (a ``uint8``
tensor ``[out, row_bytes]``) and nothing else.

The reference (``dequantize``) is the ``gguf`` package's own ``gguf.quants.dequantize``,
llama.cpp's reader: the oracle the native kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GGMLType:
    name: str          # lower-case, as hybridserve names it ("q4_k")
    ggml_id: int       # gguf.GGMLQuantizationType value
    block_size: int    # weights per block
    block_bytes: int   # bytes per block


# The block types served (what llama-quantize writes for Q8_0, Q4_0, Q4_K_M, Q5_K_M, Q6_K;
# Q5_0 / Q5_1 are its fallbacks in the k-quant files for rows not a multiple of 256).
GGML_TYPES: dict[str, GGMLType] = {t.name: t for t in (
    GGMLType("q8_0", 8, 32, 34),
    GGMLType("q4_0", 2, 32, 18),
    GGMLType("q5_0", 6, 32, 22),
    GGMLType("q5_1", 7, 32, 24),
    GGMLType("q4_k", 12, 256, 144),
    GGMLType("q5_k", 13, 256, 176),
    GGMLType("q6_k", 14, 256, 210),
)}
GGML_BY_ID: dict[int, GGMLType] = {t.ggml_id: t for t in GGML_TYPES.values()}

# Prefill's path on CPUs with AVX-512 VNNI: the many-row int8 GEMM
# (``quant.matmul_prefill``: weight tiles unpacked once to bytes), which rounds the
# activations as llama.cpp does and measured at least as fast as the dequantized tiles
# into torch's bfloat16 GEMM (faster at a few hundred rows, where the tiles'
# dequantization weighs most). Elsewhere (AVX2, where the int8 path would be the few-row
# kernel) the tiles, on unquantized activations.
PREFILL_INT8_ISAS = ("avx512_vnni",)


class GGMLWeight:
    """A ``[out, in]`` weight in one GGML block type; ``data`` is ``uint8 [out, row_bytes]``."""

    def __init__(self, qtype: str, data: torch.Tensor, shape: tuple[int, int]):
        if qtype not in GGML_TYPES:
            raise ValueError(f"unknown GGML block type {qtype!r}; known: {sorted(GGML_TYPES)}")
        t = GGML_TYPES[qtype]
        out, inp = (int(s) for s in shape)
        if inp % t.block_size:
            raise ValueError(f"{qtype} rows hold whole blocks of {t.block_size}; in_features {inp} is not a multiple")
        row_bytes = inp // t.block_size * t.block_bytes
        if data.dtype != torch.uint8 or tuple(data.shape) != (out, row_bytes):
            raise ValueError(f"{qtype} data for shape {[out, inp]} must be uint8 [{out}, {row_bytes}], "
                             f"got {data.dtype} {list(data.shape)}")
        self.qtype = qtype
        self.type = t
        self.data = data
        self.shape = (out, inp)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``W`` as ``dtype`` through the ``gguf`` package's reference (numpy)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        w = dequantize(self.data.numpy(), GGMLQuantizationType(self.type.ggml_id))
        return torch.from_numpy(np.ascontiguousarray(w)).reshape(self.shape).to(dtype)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` in ``x``'s dtype (:func:`hybridserve.quant.tiles.cpu_linear`). Up to
        ``native_max_rows(qtype)`` rows (decode, MoE experts): the native GEMM on the
        blocks, ``x`` quantized per row as llama.cpp does (Q8_0 / Q8_K). More rows
        (prefill), on a CPU in :data:`PREFILL_INT8_ISAS`: the many-row int8 GEMM
        (:meth:`prefill`), with the same activation rounding; elsewhere tiles of weight
        rows dequantized natively into ``x``'s dtype and torch's GEMM, ``x`` unquantized.
        Without the native kernels (or off the CPU), the reference: ``F.linear`` on
        :meth:`dequantize`."""
        from hybridserve.kernels import quant as qk
        from hybridserve.quant.tiles import cpu_linear

        if (not qk.available() or x.device.type != "cpu"
                or x.dtype not in (torch.float32, torch.bfloat16)):
            return F.linear(x, self.dequantize(x.dtype).to(x.device))
        return cpu_linear(self, x)

    def native(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 @ W.T`` (``x2`` ``[T, in]`` float32 / bfloat16) by the block GEMM."""
        from hybridserve.kernels import quant as qk

        return qk.matmul(x2, self._blocks(), self.type.ggml_id)

    def dequantize_tile(self, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start:stop`` of ``W`` as ``dtype`` by the native dequantizer (exactly
        the reference's values; bfloat16 rounds them once)."""
        from hybridserve.kernels import quant as qk

        return qk.dequantize(self._blocks()[start:stop], self.type.ggml_id, self.shape[1], dtype)

    def prefill(self, x2: torch.Tensor) -> torch.Tensor | None:
        """``x2 @ W.T`` by the many-row int8 GEMM (weight tiles unpacked once to bytes,
        the activations rounded as the few-row kernel and llama.cpp round them), on a
        CPU in :data:`PREFILL_INT8_ISAS`; None elsewhere (then the tiles)."""
        from hybridserve.kernels import quant as qk

        if qk.isa() not in PREFILL_INT8_ISAS:
            return None
        return qk.matmul_prefill(x2, self._blocks(), self.type.ggml_id)

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ``ids`` of ``W`` (an embedding table ``[vocab, hidden]``) as ``dtype``
        (float32 or bfloat16), shaped ``ids.shape + (hidden,)``: only those rows'
        blocks are read and dequantized (natively where the extension has it)."""
        from hybridserve.kernels import quant as qk

        flat = ids.reshape(-1).to(torch.int64)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
            raise IndexError(f"embedding ids must lie in [0, {self.shape[0]}), "
                             f"got {int(flat.min())}..{int(flat.max())}")
        rows = self.data.index_select(0, flat.cpu())
        if qk.available() and dtype in (torch.float32, torch.bfloat16):
            out = qk.dequantize(rows, self.type.ggml_id, self.shape[1], dtype)
        else:
            out = GGMLWeight(self.qtype, rows, (rows.shape[0], self.shape[1])).dequantize(dtype)
        return out.reshape(*ids.shape, self.shape[1])

    def _blocks(self) -> torch.Tensor:
        """The blocks as a C-contiguous CPU tensor (a row view of a bigger weight
        already is one)."""
        d = self.data
        return d if d.is_contiguous() and d.device.type == "cpu" else d.cpu().contiguous()

    def rows(self, start: int, stop: int) -> "GGMLWeight":
        if not 0 <= start <= stop <= self.shape[0]:
            raise ValueError(f"rows {start}:{stop} out of range for {self.shape[0]} rows")
        return GGMLWeight(self.qtype, self.data[start:stop], (stop - start, self.shape[1]))

    def cols(self, start: int, stop: int) -> "GGMLWeight":
        """Columns ``start:stop`` (a row-parallel shard): whole blocks only, so both ends
        must be multiples of the block size (32; 256 for the k-quants); a copy of those
        blocks' bytes (SliceError otherwise: blocks are not re-quantized)."""
        from hybridserve.quant.weight import SliceError, check_cols

        check_cols(self, start, stop)
        size = self.type.block_size
        if start % size or stop % size:
            raise SliceError(f"{self.qtype} holds blocks of {size} input columns; columns {start}:{stop} "
                             f"cut through one (a split must fall on a multiple of {size})")
        bb = self.type.block_bytes
        data = self.data[:, start // size * bb:stop // size * bb].contiguous()
        return GGMLWeight(self.qtype, data, (self.shape[0], stop - start))

    @staticmethod
    def cat_cols(parts: list["GGMLWeight"]) -> "GGMLWeight":
        """Weights of one type and as many rows, side by side along the input features
        (each part whole blocks, so each row's blocks are just concatenated)."""
        if len({p.qtype for p in parts}) != 1 or len({p.shape[0] for p in parts}) != 1:
            raise ValueError("cat_cols needs parts of one block type and as many rows")
        data = torch.cat([p.data for p in parts], dim=1)
        return GGMLWeight(parts[0].qtype, data, (parts[0].shape[0], sum(p.shape[1] for p in parts)))

    @staticmethod
    def cat_rows(parts: list["GGMLWeight"]) -> "GGMLWeight":
        """Weights of one type and as many input features stacked by rows: one weight
        whose blocks are the parts' blocks in order (every output row is its own run of
        blocks, so each row's product is the one its part gives)."""
        if len({p.qtype for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("cat_rows needs parts of one block type and as many columns")
        data = torch.cat([p.data for p in parts], dim=0)
        return GGMLWeight(parts[0].qtype, data, (sum(p.shape[0] for p in parts), parts[0].shape[1]))

    def __repr__(self) -> str:
        return f"GGMLWeight({self.qtype}, {list(self.shape)})"
