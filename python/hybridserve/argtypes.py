"""argparse ``type=`` callables shared by the command lines (``plan``, ``serve``,
``bench``). Each turns bad text into ``argparse.ArgumentTypeError`` with a message that
says what to write instead; argparse prints it with the usage and exits 2."""

from __future__ import annotations

import argparse

from hybridserve.errors import HybridServeError


def positive_int(text: str) -> int:
    """A whole number > 0; ``,`` and ``_`` separators allowed (``32,768``)."""
    try:
        value = int(text.replace(",", "").replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; write e.g. 32768") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number")
    return value


def non_negative_int(text: str) -> int:
    if text.strip() == "0":
        return 0
    return positive_int(text)


def size(text: str) -> int:
    """A byte size with a unit (``80GB``, ``2GiB``), as the planner reads it."""
    from hybridserve.planner import parse_size

    try:
        return parse_size(text)
    except HybridServeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size(text: str) -> int:
    """Plain bytes (``16777216``) or a size with a unit; > 0."""
    value = int(text) if text.isdigit() else size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive size")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def non_negative_seconds(text: str) -> float:
    if text.strip() in ("0", "0.0"):
        return 0.0
    return positive_seconds(text)
