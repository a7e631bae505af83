"""Byte units: reading sizes people write (``80GB``, ``23859MiB``) and writing them back.

Pure Python; every other planner module and the command lines' ``size`` argument type
read sizes through :func:`parse_size`.
"""

from __future__ import annotations

import re
from typing import Any

from hybridserve.errors import ConfigError

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": KiB,
    "MIB": MiB,
    "GIB": GiB,
    "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]+)\s*$")
_SIZE_HINT = (
    "write a number with a unit: decimal KB/MB/GB/TB (80GB = 80,000,000,000 bytes), "
    "binary KiB/MiB/GiB/TiB (80GiB, 23859MiB) or B for bytes"
)


def parse_size(text: str) -> int:
    """Bytes in a human size: ``"80GB"`` (decimal), ``"80GiB"``, ``"23859MiB"``, ``"512B"``.

    Units are case-insensitive; a fractional value (``"23.3GiB"``) is rounded down to
    whole bytes. A bare number or a bare ``G``/``M`` is refused because it is ambiguous
    (decimal or binary?). Raises :class:`ConfigError` whose message says what to write.
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(f"cannot read size {text!r}: {_SIZE_HINT}")
    value, unit = m.group(1), m.group(2).upper()
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"unknown unit {m.group(2)!r} in size {text!r}: {_SIZE_HINT}")
    # Exact for integers; fractional values go through the decimal digits so that
    # "1.5GiB" is exactly 1.5 * 2**30 rather than a float approximation.
    whole, _, frac = value.partition(".")
    scale = _SIZE_UNITS[unit]
    nbytes = int(whole) * scale + (int(frac) * scale // 10 ** len(frac) if frac else 0)
    if nbytes <= 0:
        raise ConfigError(f"size {text!r} must be positive: {_SIZE_HINT}")
    return nbytes


def format_bytes(nbytes: int | float) -> str:
    """A byte count in the largest binary unit that keeps it >= 1: ``2.8125 MiB``, ``16 GiB``.

    Up to 4 decimals, trailing zeros dropped, thousands separated. For a fixed unit
    (pools are quoted in MiB) use :func:`format_mib`.
    """
    n = float(nbytes)
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{format_number(n / scale)} {unit}"
    return f"{format_number(n)} B"


def format_mib(nbytes: int | float) -> str:
    """A byte count in MiB (``23,859 MiB``), the unit the seed uses for pools."""
    return f"{format_number(nbytes / MiB)} MiB"


def format_number(x: float) -> str:
    """Up to 4 decimals, trailing zeros dropped, thousands separated (``2,192.8125``)."""
    s = f"{x:,.4f}".rstrip("0").rstrip(".")
    return s if s != "-0" else "0"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is an int > 0 (not a bool), else ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value
