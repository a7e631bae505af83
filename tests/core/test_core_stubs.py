"""The typed stubs (_core.pyi) describe the compiled module: every class and
method the stub declares exists at runtime, and every public runtime method of
a stubbed class is declared (so type checkers see the real surface)."""

import ast
from pathlib import Path

import hybridserve
import hybridserve._core as core

STUB = Path(hybridserve.__file__).with_name("_core.pyi")


def test_stub_matches_runtime():
    tree = ast.parse(STUB.read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert {"BlockAllocator", "BlockTable", "KvCacheManager", "Scheduler", "SchedulerOutput", "StepUpdate"} <= {c.name for c in classes}
    for node in classes:
        assert hasattr(core, node.name), f"stub declares {node.name}, the module lacks it"
        cls = getattr(core, node.name)
        declared = {i.name for i in node.body if isinstance(i, ast.FunctionDef)}
        runtime = {n for n in dir(cls) if not n.startswith("_")}
        assert declared - {"__init__"} - runtime == set(), f"{node.name}: stubbed but missing at runtime"
        assert runtime - declared == set(), f"{node.name}: runtime methods missing from the stub"
