"""write_kv_ref + paged_attention_ref against dense causal attention (HF eager math)."""

import pytest
import torch

from hybridserve.kernels.cache_write import write_kv_ref
from hybridserve.kernels.paged_attention import paged_attention_ref


def _dense_causal(q, k, v, scale):
    """q [L, Hq, D] are the last queries of k/v [N, Hkv, D]; plain masked softmax."""
    lq, hq, _ = q.shape
    n, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(n - lq, n)[:, None]
    s = s.masked_fill(torch.arange(n)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("block_size,hq,hkv", [(4, 4, 2), (16, 6, 1), (8, 3, 3)])
def test_paged_matches_dense(block_size, hq, hkv):
    gen = torch.Generator().manual_seed(block_size)
    d = 8
    seq_lens = [9, 1, 23, 16]
    q_lens = [9, 1, 4, 1]  # a full prefill, a 1-token prompt, a chunk continuing, a decode
    num_blocks = 40
    k_cache = torch.zeros(num_blocks, block_size, hkv, d)
    v_cache = torch.zeros(num_blocks, block_size, hkv, d)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # non-contiguous block ids
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    # Padding past each sequence's blocks is garbage on purpose: it must never be read.
    tables = torch.full((len(seq_lens), max_blocks), 10_000, dtype=torch.int32)
    full_k, full_v = [], []
    for b, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[b, :nb] = torch.tensor([perm.pop() for _ in range(nb)], dtype=torch.int32)
        kk = torch.randn(n, hkv, d, generator=gen)
        vv = torch.randn(n, hkv, d, generator=gen)
        slots = torch.tensor([int(tables[b, i // block_size]) * block_size + i % block_size for i in range(n)])
        # A padding row (slot -1) in the same call must be ignored.
        write_kv_ref(torch.cat([kk, torch.full((1, hkv, d), 99.0)]),
                     torch.cat([vv, torch.full((1, hkv, d), 99.0)]),
                     k_cache, v_cache, torch.cat([slots, torch.tensor([-1])]))
        full_k.append(kk)
        full_v.append(vv)
    assert not (k_cache == 99.0).any()
    qs = [torch.randn(ql, hq, d, generator=gen) for ql in q_lens]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    out = paged_attention_ref(torch.cat(qs), k_cache, v_cache, qsl,
                              torch.tensor(seq_lens, dtype=torch.int32), tables, d ** -0.5)
    for b in range(len(seq_lens)):
        ref = _dense_causal(qs[b], full_k[b], full_v[b], d ** -0.5)
        torch.testing.assert_close(out[qsl[b]:qsl[b + 1]], ref, rtol=1e-5, atol=1e-5)


def test_output_dtype_follows_q():
    k_cache = torch.randn(2, 4, 1, 4, dtype=torch.bfloat16)
    q = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    out = paged_attention_ref(q, k_cache, k_cache.clone(), torch.tensor([0, 3]), torch.tensor([5]),
                              torch.tensor([[1, 0]]), 0.5)
    assert out.dtype == torch.bfloat16
    ref = _dense_causal(q.float(), k_cache[[1, 0]].reshape(-1, 1, 4)[:5].float(),
                        k_cache[[1, 0]].reshape(-1, 1, 4)[:5].float(), 0.5)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
