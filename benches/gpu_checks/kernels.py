"""The kernels against their references, and the GPU-only tests."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from gpu_checks.common import REPO, criterion, log, Ctx


def check_kernels(ctx: Ctx) -> dict[str, Any]:
    import torch

    from hybridserve.kernels import cuda_check

    cuda_check.RESULTS.clear()
    failures: list[str] = []
    # The CPU dry run runs float32 only: it exercises the code under the interpreter,
    # which tests/kernels already holds to the references in float32.
    dtypes = [torch.float32] if ctx.small else [torch.bfloat16] if ctx.quick else [torch.bfloat16, torch.float32]
    reps = 0 if ctx.small else 20  # the dry run checks values only: each kernel runs once
    with contextlib.redirect_stdout(sys.stderr):
        for dtype in dtypes:
            cuda_check.check_write_kv(ctx.device, dtype, ctx.small, reps, failures)
            cuda_check.check_attention(ctx.device, dtype, ctx.small, reps, failures)
            cuda_check.check_deltanet(ctx.device, dtype, ctx.small, reps, failures)
    cases = list(cuda_check.RESULTS)
    crit = [criterion("every kernel matches its plain-PyTorch reference", bool(cases) and not failures,
                      cases=len(cases), failures=len(failures))]
    return {"criteria": crit, "failures": failures, "cases": cases,
            "timings": ("median of %d, state pools not copied inside the timed calls" % reps) if reps
            else "not timed (dry run)"}


def check_gpu_tests(ctx: Ctx) -> dict[str, Any]:
    import io

    import pytest

    os.environ["HYBRIDSERVE_TEST_DEVICE"] = str(ctx.device)
    buf = io.StringIO()
    # In-process (no second interpreter start and torch import); output kept off stdout.
    with contextlib.redirect_stdout(buf):
        code = pytest.main(["-q", "-rs", "-p", "no:cacheprovider", "--import-mode=importlib",
                            "--rootdir", str(REPO / "tests_gpu"), str(REPO / "tests_gpu")])
    text = buf.getvalue()
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    log(text[-4000:])

    class r:  # noqa: N801 - the shape subprocess.run would give
        returncode = int(code)
    import re

    m = re.search(r"(\d+) skipped", tail)
    skipped = int(m.group(1)) if m else 0
    m = re.search(r"(\d+) passed", tail)
    passed = int(m.group(1)) if m else 0
    ran = passed > 0 or r.returncode not in (0, 5)
    crit = [
        # Off the device every test may skip (nothing ran: nothing to decide).
        criterion("no test failed or errored", r.returncode == 0 if (ctx.cuda or ran) else None,
                  returncode=r.returncode, tests_passed=passed),
        criterion("no test skipped on the device", skipped == 0 if ctx.cuda else None, skipped=skipped),
    ]
    return {"criteria": crit, "summary": tail, "skipped": skipped,
            "note": None if ctx.cuda else "CPU dry run: the tests need CUDA and skip here; not applicable"}
