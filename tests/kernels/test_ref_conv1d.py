"""causal_conv1d_ref against HF's whole-sequence conv (zero left padding), fed in pieces,
with the conv state in scattered pages of a pool; the CPU path against the reference;
checkpoints inside a run against feeding the run's first k tokens alone."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from hybridserve.kernels.causal_conv1d import causal_conv1d_cpu, causal_conv1d_ref


def test_pieces_match_whole_sequence(paged_pool):
    gen = torch.Generator().manual_seed(0)
    c, w = 10, 4
    weight = torch.randn(c, w, generator=gen)
    bias = torch.randn(c, generator=gen)
    seqs = [torch.randn(n, c, generator=gen) for n in (1, 2, 9, 30)]
    # Oracle: HF's causal_conv1d_fn on each complete sequence.
    refs = [hf.causal_conv1d_fn(s.t()[None], weight, bias, activation="silu")[0].t() for s in seqs]
    pool = paged_pool(len(seqs), 1, (c, w - 1), gen)
    pool.nan_fill(range(len(seqs)))  # has_initial_state=False must ignore it
    pieces = [[1], [1, 1], [2, 7], [13, 1, 16]]
    outs = [[] for _ in seqs]
    pos = [0] * len(seqs)
    for step in range(3):
        xs, qsl, bs, init = [], [0], [], []
        for b, plan in enumerate(pieces):
            if step < len(plan):
                n = plan[step]
                xs.append(seqs[b][pos[b]:pos[b] + n])
                qsl.append(qsl[-1] + n)
                bs.append(b)
                init.append(pos[b] > 0)
                pos[b] += n
        y = causal_conv1d_ref(torch.cat(xs), weight, bias, pool.pool, torch.tensor(qsl),
                              pool.table[bs], torch.tensor(init), item_base=pool.item_base)
        for i, b in enumerate(bs):
            outs[b].append(y[qsl[i]:qsl[i + 1]])
    for b, s in enumerate(seqs):
        torch.testing.assert_close(torch.cat(outs[b]), refs[b], rtol=1e-5, atol=1e-6)
        # The stored state is the last W-1 inputs, left-padded with zeros for short sequences.
        expect = F.pad(s.t(), (w - 1, 0))[:, -(w - 1):]
        torch.testing.assert_close(pool.items(b)[0], expect)


def test_no_bias_no_activation(paged_pool):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, generator=gen)
    weight = torch.randn(3, 2, generator=gen)
    pool = paged_pool(1, 1, (3, 1), gen)
    y = causal_conv1d_ref(x, weight, None, pool.pool, torch.tensor([0, 5]), pool.table,
                          torch.tensor([False]), activation=None, item_base=pool.item_base)
    ref = F.conv1d(x.t()[None], weight[:, None], padding=1, groups=3)[0, :, :5].t()
    torch.testing.assert_close(y, ref)


def _mixed(width, gen, paged_pool):
    lens = [5, 1, 0, 37, 1, 2, 1, 1, 16]
    c = 6
    wide = torch.randn(sum(lens), c + 3, generator=gen)
    x = wide[:, 2:2 + c]
    weight = torch.randn(c, width, generator=gen)
    bias = torch.randn(c, generator=gen) if width != 3 else None
    pool = paged_pool(len(lens), 1, (c, width - 1), gen, per_page=2, item_base=5)
    init = torch.tensor([True, False, True, False, True, True, False, True, False])
    ck = torch.tensor([3, -1, -1, 37, 1, -1, -1, 1, 10], dtype=torch.int32)
    pool.nan_fill([b for b in range(len(lens)) if not init[b]], [b for b in range(len(lens)) if ck[b] >= 0])
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return lens, x, weight, bias, pool, init, ck, qsl


@pytest.mark.parametrize("width", [2, 3, 4])
def test_cpu_path_matches_reference_on_random_mixed_batches(width, paged_pool):
    """Prompts, continued chunks, decodes and an empty run in one call, fresh pages
    holding NaN, a strided input (a column slice of a wider projection), bias or not,
    checkpoints at the first, last and middle tokens."""
    gen = torch.Generator().manual_seed(width)
    lens, x, weight, bias, want, init, ck, qsl = _mixed(width, gen, paged_pool)
    got = want.clone()
    kw = dict(item_base=want.item_base, checkpoint_positions=ck, checkpoint_pages=want.ck_table)
    y_want = causal_conv1d_ref(x, weight, bias, want.pool, qsl, want.table, init, **kw)
    y_got = causal_conv1d_cpu(x, weight, bias, got.pool, qsl, got.table, init, **kw)
    torch.testing.assert_close(y_got, y_want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.buf, want.buf, equal_nan=True)


@pytest.mark.parametrize("impl", ["ref", "cpu"])
def test_checkpoint_equals_feeding_the_first_k_tokens(impl, paged_pool):
    gen = torch.Generator().manual_seed(9)
    lens, x, weight, bias, pool, init, ck, qsl = _mixed(4, gen, paged_pool)
    fn = causal_conv1d_ref if impl == "ref" else causal_conv1d_cpu
    plain, with_ck = pool.clone(), pool.clone()
    y_plain = fn(x, weight, bias, plain.pool, qsl, plain.table, init, item_base=pool.item_base)
    y_ck = fn(x, weight, bias, with_ck.pool, qsl, with_ck.table, init, item_base=pool.item_base,
              checkpoint_positions=ck, checkpoint_pages=with_ck.ck_table)
    torch.testing.assert_close(y_ck, y_plain)
    for b in range(len(lens)):
        torch.testing.assert_close(with_ck.items(b), plain.items(b), equal_nan=True)
        if ck[b] < 0:  # no checkpoint asked: its checkpoint row's pages untouched
            assert torch.equal(with_ck.items(b, checkpoint=True), pool.items(b, checkpoint=True))
            continue
        prefix = pool.clone()
        s, kk = int(qsl[b]), int(ck[b])
        causal_conv1d_ref(x[s:s + kk], weight, bias, prefix.pool, torch.tensor([0, kk]), prefix.table[b:b + 1],
                          init[b:b + 1], item_base=pool.item_base)
        torch.testing.assert_close(with_ck.items(b, checkpoint=True), prefix.items(b))


def test_checkpoint_position_outside_the_run_is_refused(paged_pool):
    gen = torch.Generator().manual_seed(2)
    lens, x, weight, bias, pool, init, ck, qsl = _mixed(4, gen, paged_pool)
    ck = ck.clone()
    ck[0] = 6  # the run has 5 tokens
    for fn in (causal_conv1d_ref, causal_conv1d_cpu):
        with pytest.raises(ValueError, match="must lie in 1..5"):
            fn(x, weight, bias, pool.pool, qsl, pool.table, init, item_base=pool.item_base,
               checkpoint_positions=ck, checkpoint_pages=pool.ck_table)
