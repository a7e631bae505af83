#!/usr/bin/env bash
# The project's test command (README): installs what it needs, builds and installs
# the real wheel, then runs the Rust tests (unit, proptest, stress, loom, the CPU
# kernels') and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# PYTHON: the interpreter to install into and test with (default: the first python3 on
# the PATH). The script pip-installs pinned packages and the wheel into it: activate a
# virtual environment first, or set PYTHON to one.
PY=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ "$("$PY" -c 'import sys; print(sys.prefix != sys.base_prefix)')" != "True" ]; then
    echo "warning: $(command -v "$PY") is not in a virtual environment; pinned packages go into it" \
         "(activate a venv first, or set PYTHON=/path/to/venv/bin/python)" >&2
fi
echo "== pip: pinned test requirements"
"$PY" -m pip install --quiet --disable-pip-version-check -r requirements/test.txt

echo "== wheel: pip install . (maturin, release build)"
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall .

echo "== cargo test (core: unit, proptest, stress; CPU kernels against their formulas)"
cargo test --release -p hybridserve-core -p hybridserve-cpu-kernels

echo "== cargo test under loom (bounded model check of the lock-free allocator)"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
    cargo test --release -p hybridserve-core --test loom_allocator

echo "== pytest"
# Run from the repository root with importlib mode: tests import the installed
# wheel, never the source tree (which has no compiled _core).
"$PY" -m pytest -q tests
