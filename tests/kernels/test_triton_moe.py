"""Triton fused MoE vs the plain-PyTorch reference (interpreter, CPU).

``fused_moe_triton`` must equal ``fused_moe_ref`` on expert counts that are not powers
of two, top-1 and top-k > 1, non-power-of-two widths (masked tiles), experts that get
no rows and experts that get more rows than a block, and float16 weights.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from hybridserve.kernels.moe import fused_moe_ref, route_ref
from hybridserve.kernels.moe_triton import align_by_expert, fused_moe_triton


def _case(t, e, k, h, i, seed, dtype=torch.float32, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    if skew:
        logits[:, 0] += 4.0  # most rows to expert 0: more than one block of it
    w, ids = route_ref(logits, k)
    w13 = torch.randn(e, h, 2 * i, generator=g) / h ** 0.5
    w2 = torch.randn(e, i, h, generator=g) / i ** 0.5
    return [a.to(dtype) if a.is_floating_point() else a for a in (x, w13, w2, w)] + [ids]


@pytest.mark.parametrize("t,e,k,h,i,skew", [
    (1, 5, 1, 32, 24, False),
    (13, 7, 3, 40, 24, False),
    (37, 6, 2, 32, 48, True),
    (9, 3, 3, 16, 16, False),   # every expert gets every token
])
def test_matches_the_reference(t, e, k, h, i, skew):
    x, w13, w2, w, ids = _case(t, e, k, h, i, seed=t, skew=skew)
    want = fused_moe_ref(x, w13, w2, w, ids)
    got = fused_moe_triton(x, w13, w2, w, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_transposed_weight_views_and_float16():
    # w13 given as a strided view (HF's [E, 2I, H] storage transposed) and float16.
    x, w13, w2, w, ids = _case(11, 5, 2, 32, 16, seed=3, dtype=torch.float16)
    w13_view = w13.transpose(1, 2).contiguous().transpose(1, 2)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), w.float(), ids)
    got = fused_moe_triton(x, w13_view, w2, w, ids)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


def test_alignment_groups_rows_by_expert_in_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 4]])
    sorted_ids, block_expert, num_padded = align_by_expert(ids, 5, 4)
    n = ids.numel()
    # Expert 0: pairs 1, 4; expert 1: pair 3; expert 2: pairs 0, 2, 5, 6; expert 4: pair 7.
    assert int(num_padded) == 16
    blocks = sorted_ids[:16].view(4, 4).tolist()
    assert blocks == [[1, 4, n, n], [3, n, n, n], [0, 2, 5, 6], [7, n, n, n]]
    assert block_expert[:4].tolist() == [0, 1, 2, 4]
    flat = ids.reshape(-1)
    for b, row in enumerate(blocks):
        assert all(flat[p] == block_expert[b] for p in row if p < n)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hybridserve.kernels import moe_triton as mt

INTS = {"sorted_ids_ptr": "*i64", "block_expert_ptr": "*i64", "num_padded_ptr": "*i64"}
for fn in (mt._moe_up_kernel, mt._moe_down_kernel):
    for dt, prec in (("bf16", "tf32"), ("fp32", "tf32x3")):
        consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32, DOT_PRECISION=prec)
        sig = {}
        for n in fn.arg_names:
            if n in consts:
                sig[n] = "constexpr"
            elif n.endswith("_ptr"):
                sig[n] = INTS.get(n, "*" + dt)
            else:
                sig[n] = "i32"
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert k.asm["cubin"]
        print("compiled", fn.__name__, dt)
"""


def test_kernels_compile_for_sm90():
    """The interpreter accepts programs the compiler rejects: compile both kernels for
    sm_90 (H100/H200) ahead of time, bf16 and float32, no GPU needed."""
    import subprocess
    import sys

    import hybridserve

    env = dict(os.environ, TRITON_INTERPRET="0")
    pkg_root = os.path.dirname(os.path.dirname(hybridserve.__file__))
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 4, proc.stdout
