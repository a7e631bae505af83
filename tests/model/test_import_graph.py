"""The modules of ``hybridserve.model`` import each other in a DAG.

A cycle among them only works while every module on it defers one of its imports
into a function body; such imports hide the dependency, run on a hot path's first
call and break as soon as someone lifts one to the top. The graph here is read from
the source with ``ast`` (imports inside functions and classes included, not only the
ones Python runs at import time), restricted to the package's own modules.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest


def import_graph(package_dir: Path, package: str) -> dict[str, dict[str, list[int]]]:
    """``module -> {imported module of the same package -> line numbers}`` for every
    ``.py`` file directly in ``package_dir`` (the package ``__init__`` is ``package``)."""
    modules = {}
    for path in sorted(package_dir.glob("*.py")):
        name = package if path.stem == "__init__" else f"{package}.{path.stem}"
        modules[name] = path
    graph: dict[str, dict[str, list[int]]] = {}
    for name, path in modules.items():
        edges: dict[str, set[int]] = {}
        # The package a relative import starts from.
        here = name if path.stem == "__init__" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                # ``from pkg import mod`` imports the submodule; ``from pkg.mod import X``
                # imports the module X is defined in.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                # ``import pkg.mod.sub`` runs pkg.mod.sub; cut to the longest module of ours.
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    edges.setdefault(t, set()).add(node.lineno)
        graph[name] = {t: sorted(lines) for t, lines in edges.items()}
    return graph


def cycle_in(graph: dict[str, dict[str, list[int]]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter({m: set(e) for m, e in graph.items()}).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def test_graph_reader_sees_a_cycle_through_a_function_level_import(tmp_path):
    """The reader itself: a cycle closed only by an import inside a function (the
    pattern this test exists to catch) and one through a relative import are found;
    the same modules without the deferred import are a DAG."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("from pkg.b import B\n\nclass A:\n    pass\n")
    (pkg / "b.py").write_text("import os\n\ndef make():\n    from pkg.a import A\n    return A()\n\nclass B:\n    pass\n")
    (pkg / "c.py").write_text("from . import b\nfrom .a import A\nimport pkg.b\n")
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.b"] == {"pkg.a": [4]}
    assert graph["pkg.c"] == {"pkg.b": [1, 3], "pkg.a": [2]}
    assert graph["pkg"] == {"pkg.a": [1]}
    assert set(cycle_in(graph)) == {"pkg.a", "pkg.b"}

    (pkg / "b.py").write_text("import os\n\nclass B:\n    pass\n")
    assert cycle_in(import_graph(pkg, "pkg")) is None


def test_model_package_imports_form_a_dag():
    # The source next to this test, not whichever copy of the package is installed.
    package_dir = Path(__file__).resolve().parents[2] / "python" / "hybridserve" / "model"
    graph = import_graph(package_dir, "hybridserve.model")
    # The reader found the package's modules and the edges everyone relies on.
    assert {"hybridserve.model.qwen3_5", "hybridserve.model.moe", "hybridserve.model.native_decode"} <= set(graph)
    assert "hybridserve.model.qwen3_5" in graph["hybridserve.model.loader"]
    cycle = cycle_in(graph)
    if cycle is not None:
        hops = [f"{a} -> {b} (line {', '.join(map(str, graph[a][b]))})" for a, b in zip(cycle, cycle[1:])]
        pytest.fail("hybridserve.model imports in a circle:\n  " + "\n  ".join(hops))

