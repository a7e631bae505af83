"""Random streams of seeded samples: a counter-based generator (splitmix64).

A seeded sample's noise depends only on (seed, sample index, number of draws so far),
never on which other requests share the batch: element ``(r, j)`` of a draw is a pure
function of the row's stream key, its draw offset and the vocabulary index ``j``,
computed in int64 torch ops for every seeded row at once. Columns can be produced in
slices (``start``), so a draw never needs int64 ``[rows, vocab]`` temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def signed64(x: int) -> int:
    """``x`` mod 2**64 as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_MASKS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic). The mask is a 0-d
    tensor made once per device (a Python int operand is wrapped anew every call)."""
    mask = _MASKS.get((x.device, s))
    if mask is None:
        mask = _MASKS[(x.device, s)] = torch.tensor((1 << (64 - s)) - 1, dtype=torch.int64, device=x.device)
    return (x >> s).bitwise_and_(mask)


def _mix64_t(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (products wrap mod 2**64, as in C)."""
    x = x ^ _srl(x, 30)
    x = x * signed64(_MIX1)
    x = x ^ _srl(x, 27)
    x = x * signed64(_MIX2)
    return x ^ _srl(x, 31)


def row_states(keys: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]`` state of each row's next draw: ``splitmix64(key ^ splitmix64(offset))``."""
    gamma = signed64(_GOLDEN)
    row = _mix64_t(offsets + gamma)
    return _mix64_t((keys ^ row) + gamma)


def uniform_columns(states: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """float32 ``[R, stop - start]`` uniforms in (0, 1]: columns ``start..stop`` of the
    draws whose row states are ``states`` (from :func:`row_states`)."""
    gamma = signed64(_GOLDEN)
    j = torch.arange(start + 1, stop + 1, dtype=torch.int64, device=states.device) * gamma
    h = _mix64_t(states.unsqueeze(1) + j.unsqueeze(0))
    return (_srl(h, 40) + 1).to(torch.float32) * (2.0**-24)


def uniform_at(states: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """float32 uniforms of single elements: element ``i`` is column ``cols[i]`` of the
    draw whose row state is ``states[i]`` (int64, same shape as ``cols``), i.e. the
    number :func:`uniform_columns` gives that row at that column."""
    gamma = signed64(_GOLDEN)
    h = _mix64_t(states + (cols + 1) * gamma)
    return (_srl(h, 40) + 1).to(torch.float32) * (2.0**-24)


# The same hash on numpy uint64 arrays (the CPU candidate draw: numpy's per-call
# cost is a fraction of torch's at a few thousand elements). Wrapping arithmetic and
# logical shifts on uint64 give the very bits of the int64 torch functions above.
_U = np.uint64
_GOLDEN_U, _MIX1_U, _MIX2_U = _U(_GOLDEN), _U(_MIX1), _U(_MIX2)


def _mix64_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> _U(30))
    x *= _MIX1_U
    x ^= x >> _U(27)
    x *= _MIX2_U
    return x ^ (x >> _U(31))


def row_states_np(keys: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """:func:`row_states` on uint64 arrays (the same bits)."""
    with np.errstate(over="ignore"):
        row = _mix64_np(offsets.astype(np.uint64) + _GOLDEN_U)
        return _mix64_np((keys.astype(np.uint64) ^ row) + _GOLDEN_U)


def uniform_at_np(states: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """:func:`uniform_at` on numpy arrays (uint64 ``states``, integer ``cols``): the
    same float32 numbers."""
    with np.errstate(over="ignore"):
        h = _mix64_np(states + (cols.astype(np.uint64) + _U(1)) * _GOLDEN_U)
    return ((h >> _U(40)) + _U(1)).astype(np.float32) * np.float32(2.0**-24)


def counter_uniform(keys: torch.Tensor, offsets: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 ``[R, vocab]`` uniforms in (0, 1] from int64 stream ``keys`` ``[R]`` and
    draw ``offsets`` ``[R]``: element ``(r, j)`` is a pure function of
    ``(keys[r], offsets[r], j)``.

    The row state is ``splitmix64(key ^ splitmix64(offset))``; element j is the j-th
    output of the splitmix64 sequence started there (state + (j+1)·γ, finalised), whose
    top 24 bits make the float. Equal to :func:`counter_uniform_reference`.
    """
    return uniform_columns(row_states(keys, offsets), 0, vocab)


def counter_uniform_reference(key: int, offset: int, j: int) -> float:
    """Plain-Python value of ``counter_uniform(key, offset)[j]`` (the tests' oracle)."""
    row = _splitmix64((key ^ _splitmix64(offset & _MASK64)) & _MASK64)
    h = _splitmix64((row + j * _GOLDEN) & _MASK64)
    return ((h >> 40) + 1) * 2.0**-24


@dataclass
class SeedStream:
    """The random stream of one seeded sample: a 64-bit ``key`` and the number of
    draws taken so far (``offset``; the sampler advances it by one per draw)."""

    key: int
    offset: int = 0


def make_generator(
    seed: int | None, sample_index: int, device: torch.device | str | None = None
) -> SeedStream | None:
    """The stream of sample ``sample_index`` of a request with ``seed``; None if unseeded.

    Sample 0's key is ``seed`` itself (mod 2**64); sample i > 0 gets a splitmix64 hash
    of (seed, i), so the n samples of one request are independent streams. ``device``
    is accepted for compatibility and unused (the stream is two integers).
    """
    if seed is None:
        return None
    if sample_index < 0:
        raise ValueError(f"sample_index must be >= 0, got {sample_index}")
    value = seed & _MASK64
    if sample_index > 0:
        value = _splitmix64(value ^ _splitmix64(sample_index))
    return SeedStream(value)


__all__ = ["SeedStream", "make_generator", "counter_uniform", "counter_uniform_reference", "row_states",
           "row_states_np", "uniform_at", "uniform_at_np", "uniform_columns", "signed64"]
