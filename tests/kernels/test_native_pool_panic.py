"""A panic inside a native kernel task becomes a Python exception after the
parallel region, on the OpenMP pool (torch's libgomp workers) as on rayon;
it must never abort the process. Each pool runs in its own interpreter (the
OpenMP switch is process-wide), and the child's exit status is the oracle:
an abort would kill it with SIGABRT."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import sys
    from hybridserve.kernels import native
    k = native._k
    assert native._OPENMP == (sys.argv[1] == "openmp"), native._OPENMP
    k.set_kernel_threads(4)
    try:
        k._panic_in_task(64, 5)
    except BaseException as e:  # PyO3's PanicException derives from BaseException
        assert "kernel task 5 panicked" in str(e), e
        print("raised", type(e).__name__)
    else:
        raise SystemExit("no exception")
    # The pool keeps working after the panic.
    assert k._panic_in_task(64, 1 << 40) == 64
    print("ok")
    """
)


@pytest.mark.parametrize("pool", ["openmp", "rayon"])
def test_kernel_task_panic_is_an_exception(pool):
    from hybridserve.kernels import native

    if native._k is None:
        pytest.fail("the native kernels are not built")
    env = dict(os.environ)
    env.pop("HYBRIDSERVE_KERNEL_POOL", None)
    if pool == "rayon":
        env["HYBRIDSERVE_KERNEL_POOL"] = "rayon"
    elif not native._OPENMP:
        pytest.skip("torch's libgomp was not found in this process: no OpenMP pool to test")
    r = subprocess.run([sys.executable, "-c", CHILD, pool], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-2000:]}"
    assert "raised PanicException" in r.stdout and "ok" in r.stdout, r.stdout
