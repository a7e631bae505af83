"""The training corpus: the Python standard library of the interpreter doing the training.

Every machine that runs hybridserve has it, under the PSF license. The documents are
the stdlib's ``.py`` sources without its test suites, plus the English prose of
``pydoc_data/topics.py`` (one document per help topic). The file list is sorted and
filtered by :func:`_excluded`; a fixed ~5 % of documents, chosen by a hash of their
relative path (:func:`is_heldout`), is held out and never trained on.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

# Directory names whose contents are test suites (test/, tests/, idlelib/idle_test,
# lib2to3/tests, ...), and installed third-party packages.
_EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages",
                            "__pycache__"})
TOPICS_RELPATH = "pydoc_data/topics.py"
HELDOUT_PER_10000 = 500  # 5 %


@dataclass(frozen=True)
class Document:
    relpath: str  # relative to the stdlib root, '/'-separated; prose topics add '#topic'
    text: str


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _excluded(relpath: str) -> bool:
    parts = relpath.split("/")
    if any(p in _EXCLUDED_DIRS for p in parts[:-1]):
        return True
    name = parts[-1]
    # Stray test modules at other places (e.g. a test_*.py beside the code it tests).
    return name.startswith("test_") or relpath == TOPICS_RELPATH


def is_heldout(relpath: str) -> bool:
    """Whether a document is in the held-out split: a hash of its relative path, so the
    split of one file never depends on which other files exist."""
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return h % 10_000 < HELDOUT_PER_10000


def source_files(root: str | None = None) -> list[str]:
    """Sorted relative paths of the stdlib ``.py`` files in the corpus."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                rel = rel_dir + fn
                if not _excluded(rel):
                    out.append(rel)
    return sorted(out)


def _topics(root: str) -> dict[str, str]:
    """The help topics of ``pydoc_data/topics.py``, read without importing it."""
    path = os.path.join(root, *TOPICS_RELPATH.split("/"))
    if not os.path.exists(path):
        return {}
    ns: dict = {}
    with open(path, encoding="utf-8") as f:
        exec(compile(f.read(), path, "exec"), ns)  # a dict literal, part of the stdlib
    return dict(ns.get("topics", {}))


def documents(root: str | None = None) -> list[Document]:
    """Every corpus document, in a deterministic order: sources, then prose topics."""
    root = root or stdlib_root()
    docs = []
    for rel in source_files(root):
        with open(os.path.join(root, *rel.split("/")), "rb") as f:
            raw = f.read()
        text = raw.decode("utf-8", errors="replace")
        if text.strip():
            docs.append(Document(rel, text))
    for key in sorted(_topics_cache(root)):
        docs.append(Document(f"{TOPICS_RELPATH}#{key}", _topics_cache(root)[key]))
    return docs


_TOPICS: dict[str, dict[str, str]] = {}


def _topics_cache(root: str) -> dict[str, str]:
    if root not in _TOPICS:
        _TOPICS[root] = _topics(root)
    return _TOPICS[root]


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """(train, heldout)."""
    train = [d for d in docs if not is_heldout(d.relpath)]
    held = [d for d in docs if is_heldout(d.relpath)]
    return train, held
