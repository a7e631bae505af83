"""Device check of the Triton kernels: correctness against the references and timings.

Run on a GPU machine as ``python -m hybridserve.kernels.cuda_check`` (a few seconds
plus Triton compilation). Each case prints the largest absolute error against the
plain-PyTorch reference (run on the same device) and the kernel's median time. The
shapes follow the seed's 27B model per layer (attention: 24 query heads over 4 KV heads
of dim 256, blocks of 16; DeltaNet: 48 value heads, 16 key heads, K = V = 128; conv
over 10,240 channels, width 4) at small batch sizes. Exit status 1 when an error
exceeds its tolerance.

``--small`` shrinks every shape so that the script also runs under
``TRITON_INTERPRET=1`` on the CPU (``--device cpu``), which is how it is kept working
without a GPU.
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridserve.kernels.cache_write import write_kv_ref
from hybridserve.kernels.cache_write_triton import write_kv_triton
from hybridserve.kernels.causal_conv1d import causal_conv1d_ref
from hybridserve.kernels.causal_conv1d_triton import causal_conv1d_triton
from hybridserve.kernels.gated_delta_rule import gated_delta_rule_recurrent_ref
from hybridserve.kernels.gated_delta_rule_triton import gated_delta_rule_triton
from hybridserve.kernels.paged_attention import paged_attention_ref
from hybridserve.kernels.paged_attention_triton import paged_attention_triton

# Max abs error allowed per dtype (outputs are O(1)).
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _time(fn, device, reps):
    fn()  # compile / warm up (and, for some cases, the call whose output is checked)
    if reps <= 0:  # correctness only (the CPU dry run under the interpreter)
        return 0.0
    if device.type == "cuda":
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# Every case's result, for callers that want them as data (benches/gpu_check.py).
RESULTS: list[dict] = []


def _report(name, got, want, dtype, seconds, failures):
    err = (got.float() - want.float()).abs().max().item()
    ok = err <= TOL[dtype]
    if not ok:
        failures.append(name)
    RESULTS.append({"case": name, "ok": ok, "max_abs_err": err, "tol": TOL[dtype],
                    "median_us": round(seconds * 1e6, 1)})
    print(f"{'ok ' if ok else 'BAD'} {name:<58} max|err| {err:.2e}  {seconds * 1e6:9.1f} us")


def _qsl(lens, device):
    return torch.tensor([0] + list(lens), device=device).cumsum(0).to(torch.int32)


def check_attention(device, dtype, small, reps, failures):
    hq, hkv, d, bs = (8, 2, 64, 16) if small else (24, 4, 256, 16)
    cases = [
        [(40, 1)] * 4 if small else [(2048, 1)] * 8,  # decodes: split-KV territory
        [(33, 33), (50, 17), (20, 1)] if small else [(512, 512), (3000, 256)] + [(1500, 1)] * 6,  # mixed
    ]
    gen = torch.Generator(device=device).manual_seed(0)
    for seqs in cases:
        label = f"B={len(seqs)} q_len<={max(q for _, q in seqs)} ctx<={max(s for s, _ in seqs)}"
        nblk = [-(-s // bs) for s, _ in seqs]
        num_blocks = sum(nblk) + 4
        perm = torch.randperm(num_blocks, generator=gen, device=device)
        tables = torch.zeros(len(seqs), max(nblk), dtype=torch.int32, device=device)
        used = 0
        for i, n in enumerate(nblk):
            tables[i, :n] = perm[used : used + n].to(torch.int32)
            used += n
        kc = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
        vc = torch.randn(num_blocks, bs, hkv, d, generator=gen, device=device).to(dtype)
        qsl = _qsl([q for _, q in seqs], device)
        lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device)
        q = torch.randn(int(qsl[-1]), hq, d, generator=gen, device=device).to(dtype)
        want = paged_attention_ref(q, kc, vc, qsl, lens, tables, d**-0.5)
        out = {}

        def run():
            out["o"] = paged_attention_triton(q, kc, vc, qsl, lens, tables, d**-0.5)

        sec = _time(run, device, reps)
        _report(f"paged_attention {label} {str(dtype)[6:]}", out["o"], want, dtype, sec, failures)


def check_write_kv(device, dtype, small, reps, failures):
    t, hkv, d, bs, nb = (24, 2, 64, 16, 8) if small else (4096, 4, 256, 16, 1024)
    gen = torch.Generator(device=device).manual_seed(1)
    key = torch.randn(t, hkv, d, generator=gen, device=device).to(dtype)
    val = torch.randn(t, hkv, d, generator=gen, device=device).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen, device=device)[:t]
    slots[::7] = -1
    kc, vc = torch.zeros(nb, bs, hkv, d, dtype=dtype, device=device), torch.zeros(nb, bs, hkv, d, dtype=dtype, device=device)
    kr, vr = kc.clone(), vc.clone()
    write_kv_ref(key, val, kr, vr, slots)
    sec = _time(lambda: write_kv_triton(key, val, kc, vc, slots), device, reps)
    _report(f"write_kv T={t} {str(dtype)[6:]}", torch.cat([kc, vc]), torch.cat([kr, vr]), dtype, sec, failures)


def _paged_pool(n_seqs, n_items, item_shape, dtype, gen, device, scale=1.0):
    """A paged state pool as the arena lays it out: items in pages with padding after
    them, each sequence's pages (and its checkpoint's) scattered. Returns (pool view,
    state page table rows, checkpoint page rows, item base)."""
    item = 1
    for d in item_shape:
        item *= d
    per_page, base = 3, 2
    page = per_page * item + 16
    cols = -(-(base + n_items) // per_page)
    num_pages = 2 * n_seqs * cols + 1
    buf = (torch.randn(num_pages * page, generator=gen, device=device) * scale).to(dtype)
    strides = [1]
    for d in reversed(item_shape[1:]):
        strides.insert(0, strides[0] * d)
    pool = buf.as_strided((num_pages, per_page, *item_shape), (page, item, *strides))
    perm = torch.randperm(num_pages, generator=gen, device=device).to(torch.int32)
    n = n_seqs * cols
    return pool, perm[:n].view(n_seqs, cols), perm[n:2 * n].view(n_seqs, cols), base


def check_deltanet(device, dtype, small, reps, failures):
    h, hk, kd, vd, c = (4, 2, 32, 32, 96) if small else (48, 16, 128, 128, 10240)
    gen = torch.Generator(device=device).manual_seed(2)
    for lens in ([1] * 4 if small else [1] * 16, [40, 20] if small else [512, 512]):
        t, b = sum(lens), len(lens)
        label = f"B={b} T={t}"
        qsl = _qsl(lens, device)
        init = torch.arange(b, device=device) % 2 == 0
        # A checkpoint inside every other run (mid-run for prefills, the token for decodes).
        ck = torch.tensor([(n + 1) // 2 if i % 2 else -1 for i, n in enumerate(lens)], dtype=torch.int32,
                          device=device)
        # Conv.
        x = torch.randn(t, c, generator=gen, device=device).to(dtype)
        w = torch.randn(c, 4, generator=gen, device=device).to(dtype) * 0.5
        cs, table, ck_table, base = _paged_pool(b, 1, (c, 3), dtype, gen, device)
        kw = dict(item_base=base, checkpoint_positions=ck, checkpoint_pages=ck_table)
        cs_ref = cs.clone()
        want = causal_conv1d_ref(x, w, None, cs_ref, qsl, table, init, **kw)
        got = causal_conv1d_triton(x, w, None, cs, qsl, table, init, **kw)
        # Timed on a scratch copy of the state made once, outside the timed call (the
        # kernel updates it in place; its values do not change the work done).
        cs_t = cs_ref.clone()
        _report(f"causal_conv1d {label} {str(dtype)[6:]}", got, want, dtype,
                _time(lambda: causal_conv1d_triton(x, w, None, cs_t, qsl, table, init, **kw), device, reps),
                failures)
        _report(f"causal_conv1d {label} states + checkpoints", cs, cs_ref, dtype, 0.0, failures)
        # Delta rule (state in float32 whatever the dtype).
        q = torch.randn(t, hk, kd, generator=gen, device=device).to(dtype)
        k = torch.randn(t, hk, kd, generator=gen, device=device).to(dtype)
        v = torch.randn(t, h, vd, generator=gen, device=device).to(dtype)
        g = -torch.rand(t, h, generator=gen, device=device) * 0.5
        beta = torch.rand(t, h, generator=gen, device=device).to(dtype)
        st, table, ck_table, base = _paged_pool(b, h, (kd, vd), torch.float32, gen, device, 0.1)
        kw = dict(item_base=base, checkpoint_positions=ck, checkpoint_pages=ck_table)
        st_ref = st.clone()
        rep = h // hk
        want = gated_delta_rule_recurrent_ref(q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g,
                                              beta, st_ref, qsl, table, init, kd**-0.5, **kw)
        st0 = st.clone()
        got = gated_delta_rule_triton(q, k, v, g, beta, st, qsl, table, init, kd**-0.5, **kw)
        _report(f"gated_delta_rule {label} {str(dtype)[6:]}", got, want, dtype,
                _time(lambda: gated_delta_rule_triton(q, k, v, g, beta, st0, qsl, table, init, kd**-0.5, **kw),
                      device, reps), failures)
        _report(f"gated_delta_rule {label} final states + checkpoints", st, st_ref,
                torch.float32 if dtype == torch.float32 else dtype, 0.0, failures)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (for TRITON_INTERPRET=1 on the CPU)")
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    failures: list[str] = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        check_write_kv(device, dtype, args.small, args.reps, failures)
        check_attention(device, dtype, args.small, args.reps, failures)
        check_deltanet(device, dtype, args.small, args.reps, failures)
    print("FAILED: " + ", ".join(failures) if failures else "all kernels match their references")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
