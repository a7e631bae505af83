"""causal_conv1d_ref against HF's whole-sequence conv (zero left padding), fed in pieces."""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from hybridserve.kernels.causal_conv1d import causal_conv1d_ref


def test_pieces_match_whole_sequence():
    gen = torch.Generator().manual_seed(0)
    c, w = 10, 4
    weight = torch.randn(c, w, generator=gen)
    bias = torch.randn(c, generator=gen)
    seqs = [torch.randn(n, c, generator=gen) for n in (1, 2, 9, 30)]
    # Oracle: HF's causal_conv1d_fn on each complete sequence.
    refs = [hf.causal_conv1d_fn(s.t()[None], weight, bias, activation="silu")[0].t() for s in seqs]
    pool = torch.randn(7, c, w - 1, generator=gen)  # garbage: has_initial_state=False must ignore it
    slots = [6, 2, 0, 3]
    pool[slots] = float("nan")
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
        y = causal_conv1d_ref(torch.cat(xs), weight, bias, pool, torch.tensor(qsl),
                              torch.tensor([slots[b] for b in bs]), torch.tensor(init))
        for i, b in enumerate(bs):
            outs[b].append(y[qsl[i]:qsl[i + 1]])
    for b, s in enumerate(seqs):
        torch.testing.assert_close(torch.cat(outs[b]), refs[b], rtol=1e-5, atol=1e-6)
        # The stored state is the last W-1 inputs, left-padded with zeros for short sequences.
        expect = F.pad(s.t(), (w - 1, 0))[:, -(w - 1):]
        torch.testing.assert_close(pool[slots[b]], expect)


def test_no_bias_no_activation():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, generator=gen)
    weight = torch.randn(3, 2, generator=gen)
    pool = torch.zeros(1, 3, 1)
    y = causal_conv1d_ref(x, weight, None, pool, torch.tensor([0, 5]), torch.tensor([0]),
                          torch.tensor([False]), activation=None)
    ref = F.conv1d(x.t()[None], weight[:, None], padding=1, groups=3)[0, :, :5].t()
    torch.testing.assert_close(y, ref)


@pytest.mark.parametrize("width", [2, 3, 4])
def test_cpu_path_matches_reference_on_random_mixed_batches(width):
    """Prompts, continued chunks, decodes and an empty run in one call, fresh slots
    holding NaN, a strided input (a column slice of a wider projection), bias or not."""
    from hybridserve.kernels.causal_conv1d import causal_conv1d_cpu

    gen = torch.Generator().manual_seed(width)
    lens = [5, 1, 0, 37, 1, 2, 1, 1, 16]
    c = 6
    wide = torch.randn(sum(lens), c + 3, generator=gen)
    x = wide[:, 2:2 + c]
    weight = torch.randn(c, width, generator=gen)
    bias = torch.randn(c, generator=gen) if width != 3 else None
    pool = torch.randn(12, c, width - 1, generator=gen)
    slots = torch.tensor([3, 0, 9, 5, 6, 1, 8, 11, 2])
    init = torch.tensor([True, False, True, False, True, True, False, True, False])
    pool[slots[~init]] = float("nan")
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    want_pool, got_pool = pool.clone(), pool.clone()
    want = causal_conv1d_ref(x, weight, bias, want_pool, qsl, slots, init)
    got = causal_conv1d_cpu(x, weight, bias, got_pool, qsl, slots, init)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_pool, want_pool, equal_nan=True)
