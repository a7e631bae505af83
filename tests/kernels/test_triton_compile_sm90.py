"""Every Triton kernel compiles for a real GPU target (sm_90, H100/H200), no GPU needed.

The interpreter runs kernels as numpy and accepts programs the compiler rejects (type
mismatches between branches, loop-carried types, unsupported dot shapes), so the
other tests here cannot catch those. This one compiles each kernel ahead of time, at
the shapes of the seed's 27B model (attention: 24 query heads over 4 KV heads of dim
256, bf16; DeltaNet: 48 value heads over 16 key heads, K = V = 128; conv width 4)
through Triton's own ptxas to a cubin, in a subprocess with the interpreter off
(``triton.jit`` picks interpreter or compiler when a module is imported).
"""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hybridserve.kernels import causal_conv1d_triton as cc
    from hybridserve.kernels import cache_write_triton as cw
    from hybridserve.kernels import gated_delta_rule_triton as gd
    from hybridserve.kernels import paged_attention_triton as pa

    INT_PTRS = {"query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
                "slot_mapping_ptr": "*i64", "table_ptr": "*i32", "ck_table_ptr": "*i32", "ck_pos_ptr": "*i32",
                "has_initial_state_ptr": "*i8", "ro_ptr": "*i8"}
    FP32_PTRS = {"part_acc_ptr", "part_ml_ptr", "state_ptr", "g_ptr"}  # g is float32 in the model

    def build(fn, consts, num_warps, scalars=(), dt="bf16"):
        sig = {}
        for n in fn.arg_names:
            if n in consts:
                sig[n] = "constexpr"
            elif n.endswith("_ptr"):
                sig[n] = INT_PTRS.get(n, "*fp32" if n in FP32_PTRS else "*" + dt)
            else:
                sig[n] = "fp32" if n in scalars else "i32"
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
        assert k.asm["cubin"], fn.__name__
        print("compiled", fn.__name__)

    attn = dict(HEAD_DIM=256, HEAD_PAD=256, GROUP=6, BLOCK_Q=2, BLOCK_M=16, TILE_N=32, DOT_PRECISION="tf32")
    for splits in (1, 8):
        build(pa._paged_attention_kernel, dict(attn, NUM_SPLITS=splits), 8, scalars=("scale_log2",))
    # The prefill-heavy configuration: 64 rows per program.
    build(pa._paged_attention_kernel, dict(attn, BLOCK_Q=10, BLOCK_M=64, NUM_SPLITS=1), 8, scalars=("scale_log2",))
    build(pa._merge_splits_kernel, dict(HEAD_DIM=256, HEAD_PAD=256, NUM_SPLITS=8), 4)
    build(cw._write_kv_kernel, dict(HEAD_DIM=256, HEAD_PAD=256), 2)
    build(gd._gated_delta_rule_recurrent_kernel,
          dict(HEAD_RATIO=3, K_DIM=128, V_DIM=128, K_PAD=128, BLOCK_V=32, USE_L2NORM=True, PER_PAGE=16,
               HAS_CKPT=True, HAS_RO=True), 4, scalars=("scale",))
    build(gd._gated_delta_rule_chunked_kernel,
          dict(HEAD_RATIO=3, K_DIM=128, V_DIM=128, K_PAD=128, BLOCK_V=64, CHUNK=16, USE_L2NORM=True,
               DOT_PRECISION="tf32", PER_PAGE=16, HAS_CKPT=True, HAS_RO=True), 8, scalars=("scale",))
    build(gd._gated_delta_rule_chunked_kernel,
          dict(HEAD_RATIO=1, K_DIM=128, V_DIM=128, K_PAD=128, BLOCK_V=64, CHUNK=16, USE_L2NORM=True,
               DOT_PRECISION="tf32x3", PER_PAGE=16, HAS_CKPT=False, HAS_RO=False), 8, scalars=("scale",), dt="fp32")  # a float32 model
    build(cc._causal_conv1d_kernel, dict(WIDTH=4, HAS_BIAS=False, SILU=True, BLOCK_C=256, PER_PAGE=17,
                                              HAS_CKPT=True, HAS_RO=True), 4)
    build(cc._causal_conv1d_tokens_kernel, dict(WIDTH=4, HAS_BIAS=True, SILU=True, BLOCK_T=32, BLOCK_C=128,
                                                     PER_PAGE=17, HAS_CKPT=False, HAS_RO=False), 4)
    build(cc._conv_state_update_kernel, dict(WIDTH=4, BLOCK_C=128, PER_PAGE=17, HAS_CKPT=True, HAS_RO=True), 4)
    """
)


def test_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1")
    import hybridserve

    # Import the same hybridserve the tests use (source tree or installed wheel).
    pkg_root = os.path.dirname(os.path.dirname(hybridserve.__file__))
    env["PYTHONPATH"] = pkg_root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == 11, proc.stdout
