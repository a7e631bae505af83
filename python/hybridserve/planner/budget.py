"""The one byte budget the arena gets: what a device leaves after weights and runtime.

The engine measures what is in use once the weights are loaded and passes it as
``weights``; ``hybridserve plan`` passes the weights it counted. Both go through
:func:`pool_from_device`, so the two agree whenever their inputs do.
"""

from __future__ import annotations

from hybridserve.errors import ConfigError
from hybridserve.planner.units import GiB, format_bytes, format_number

#: Device memory of accelerators people plan for, as their vendors state it (decimal GB).
DEVICE_MEMORY = {
    "a100-40gb": 40 * 10**9,
    "a100": 80 * 10**9,
    "h100": 80 * 10**9,
    "h200": 141 * 10**9,
    "b200": 180 * 10**9,
}


def device_memory_bytes(name: str) -> int | None:
    """Bytes of a named device (``h200``), or None when the name is not one of
    :data:`DEVICE_MEMORY` (case-insensitive)."""
    return DEVICE_MEMORY.get(str(name).strip().lower())


def pool_from_device(
    device_memory: int, weights: int, *, utilization: float = 0.9, reserve: int = 2 * GiB
) -> int:
    """Bytes left for the arena: ``floor(device_memory x utilization) - weights - reserve``.

    ``reserve`` covers the runtime (activations, CUDA context, allocator slack).
    Raises :class:`ConfigError` saying what to change if nothing is left.
    """
    pool = usable_after_weights(device_memory, weights, utilization=utilization, reserve=reserve)
    if pool <= 0:
        usable = int(device_memory * utilization)
        raise ConfigError(
            f"no memory left for the KV and state arena: {format_bytes(usable)} usable "
            f"({format_bytes(device_memory)} x {utilization}) - weights {format_bytes(weights)} "
            f"- reserve {format_bytes(reserve)} = {format_bytes(pool)}; use a larger device "
            "(or more of them), a higher utilization, a smaller reserve, or give the arena "
            "size explicitly"
        )
    return pool


def usable_after_weights(
    device_memory: int, weights: int, *, utilization: float = 0.9, reserve: int = 2 * GiB
) -> int:
    """``floor(device_memory x utilization) - weights - reserve``, negative when the
    weights do not fit (for device counts, where "does not fit" is an answer)."""
    if not 0.0 < utilization <= 1.0:
        raise ConfigError(
            f"gpu memory utilization must be in (0, 1], got {utilization}; e.g. 0.9"
        )
    if reserve < 0:
        raise ConfigError(f"runtime reserve cannot be negative, got {reserve}")
    return int(device_memory * utilization) - weights - reserve


def describe_budget(device_memory: int, utilization: float, weights: int, reserve: int) -> str:
    """``"141 GB x 0.9 - weights 69.3 GB - reserve 2 GiB"``: where a budget came from."""
    return (
        f"{format_number(device_memory / 1e9)} GB x {utilization} - weights "
        f"{format_number(round(weights / 1e9, 2))} GB - reserve {format_bytes(reserve)}"
    )
