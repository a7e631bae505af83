"""One wheel for every CPython >= 3.10 (issue 32): the installed distribution's WHEEL
metadata carries the stable-ABI tag ``cp310-abi3`` (PyO3's ``abi3-py310``), and the
extension module Python loaded is the stable-ABI build, not a per-version one."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os


def _wheel_tags() -> list[str]:
    dist = importlib.metadata.distribution("hybridserve")
    text = dist.read_text("WHEEL")
    assert text, f"no WHEEL file in {dist._path}"  # noqa: SLF001 - where it looked, for the message
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")]


def test_installed_wheel_is_tagged_abi3():
    tags = _wheel_tags()
    assert tags, "the WHEEL metadata names no tag"
    for tag in tags:
        python, abi, _platform = tag.split("-", 2)
        assert (python, abi) == ("cp310", "abi3"), tags


def test_loaded_extension_is_the_stable_abi_build():
    import hybridserve._core as core

    name = os.path.basename(core.__file__)
    # A per-version build is _core.cpython-311-<platform>.so; the stable-ABI one
    # _core.abi3.so (.pyd on Windows, which has no ABI tag in the name).
    stable = [s for s in importlib.machinery.EXTENSION_SUFFIXES if "abi3" in s] or [".pyd"]
    assert any(name.endswith(s) for s in stable), (name, importlib.machinery.EXTENSION_SUFFIXES)
