"""The native conv1d on decode steps (one row per sequence: rust/kernels/src/conv1d/decode.rs)
against the plain-PyTorch reference, and bit for bit against the kernel's general path
(the same sequences with one multi-row sequence added, which sends the call there):
sequences fresh and continued, empty runs, checkpoints, bias or none, float32 and
bfloat16, inputs a column range of a wider buffer."""

import pytest
import torch

from hybridserve.kernels import native
from hybridserve.kernels.causal_conv1d import causal_conv1d_ref

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernels are not built")


def _conv(dtype):
    return native.causal_conv1d_bf16 if dtype == torch.bfloat16 else native.causal_conv1d


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_decode_rows_equal_the_reference_and_the_general_path(seed, dtype, paged_pool):
    gen = torch.Generator().manual_seed(100 + seed)
    lens = [[1], [1, 0, 1, 1], [1] * 16, [0, 1, 1, 0, 1]][seed]
    c, w = [(2048, 4), (40, 3), (300, 4), (17, 2)][seed]
    n, t = len(lens), sum(lens)
    init = torch.rand(n + 1, generator=gen) < 0.7
    ck = torch.tensor([1 if m and bool(torch.rand(1, generator=gen) < 0.5) else -1 for m in lens] + [-1])
    x = torch.randn(t + 2, c + 7, generator=gen).to(dtype)[:, 3:3 + c]
    weight = torch.randn(c, w, generator=gen).to(dtype)
    bias = torch.randn(c, generator=gen).to(dtype) if seed % 2 else None
    pool = paged_pool(n + 1, 1, (c, w - 1), gen, per_page=2, item_base=3, dtype=dtype)
    dec, gen_path, ref = pool.clone(), pool.clone(), pool.clone()
    ref.buf = ref.buf.float()
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    kw = dict(checkpoint_positions=ck[:n], checkpoint_pages=pool.ck_table[:n])
    # The decode call (every sequence with rows has one) ...
    y = _conv(dtype)(x[:t], weight, bias, dec.pool, native.Varlen(qsl, dec.table[:n], init[:n], **kw), "silu",
                     item_base=3)
    # ... the reference on the same values ...
    y_ref = causal_conv1d_ref(x[:t].float(), weight.float(), None if bias is None else bias.float(), ref.pool, qsl,
                              ref.table[:n], init[:n], "silu", item_base=3, **kw)
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    else:
        assert ((y.float() - y_ref).abs() <= 2 ** -8 * y_ref.abs() + 1e-6).all()
    # ... and the general path: the same sequences and a two-row one in one call.
    qsl2 = torch.cat([qsl, qsl[-1:] + 2])
    kw2 = dict(checkpoint_positions=ck, checkpoint_pages=pool.ck_table)
    y2 = _conv(dtype)(x, weight, bias, gen_path.pool, native.Varlen(qsl2, gen_path.table, init, **kw2), "silu",
                      item_base=3)
    assert torch.equal(y, y2[:t])
    for b in range(n):  # every decode sequence's state and checkpoint, bit for bit
        assert torch.equal(dec.buf[dec._flat(b, 0)], gen_path.buf[gen_path._flat(b, 0)])
        assert torch.equal(dec.buf[dec._flat(b, 0)].float(), ref.buf[ref._flat(b, 0)])
        if ck[b] >= 0:
            assert torch.equal(dec.buf[dec._flat(b, 0, checkpoint=True)], gen_path.buf[gen_path._flat(b, 0, checkpoint=True)])
            assert torch.equal(dec.buf[dec._flat(b, 0, checkpoint=True)], dec.buf[dec._flat(b, 0)])
