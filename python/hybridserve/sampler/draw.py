"""The draw itself: the exponential race over processed logits, and logprobs.

A categorical draw from ``softmax(x)`` is ``argmax(p / q)`` with ``q ~ Exp(1)`` per
token; since the row's normaliser is a positive constant, ``argmax(exp(x - max) / q)``
picks the same token. It is computed one column slice at a time (the noise, seeded
or not, included), keeping each row's best value and index so far, so a draw makes no
``[rows, vocab]`` tensor.

When every sampled row has a small top_k (the usual serving setting), only the tokens
that can survive it can win the race: :func:`race_top_k` takes each row's top-k list
once and runs top-k, top-p and the race on those ``[rows, kmax]`` candidates (the
noise of a token is a pure function of its column, so a candidate gets exactly the
number the whole-row race would give it), instead of about twenty passes over the
whole vocabulary.
"""

from __future__ import annotations

import numpy as np
import torch

import hybridserve.sampler.processors as processors
from hybridserve.sampler.processors import column_slices, nucleus_cut
from hybridserve.sampler.rows import F_TOPP, I_KEY, I_OFF, Prepared, RowTables
from hybridserve.sampler.streams import row_states, row_states_np, uniform_at_np, uniform_columns


def race(x: torch.Tensor, prep: Prepared, t: RowTables) -> torch.Tensor:
    """int64 ``[len(prep.rand)]`` tokens drawn for the sampled rows of work buffer ``x``;
    seeded streams advance by one draw (on the device; the host mirrors it)."""
    v = prep.v
    rand = v["rand"]
    every = len(prep.rand) == x.shape[0]
    n = len(prep.rand)
    m = x.amax(dim=-1, keepdim=True)
    m = m if every else m.index_select(0, rand)
    states = None
    if prep.seeded:
        seeded_slots = v["slots"].index_select(0, rand.index_select(0, v["seeded"]))
        ip = t.ip.index_select(0, seeded_slots)
        states = row_states(ip[:, I_KEY], ip[:, I_OFF])
    best_val = torch.full((n,), -1.0, dtype=torch.float32, device=x.device)
    best_idx = torch.zeros(n, dtype=torch.int64, device=x.device)
    tiny = torch.finfo(torch.float32).tiny
    # Noise slices hold a few int64 temporaries per element.
    for sl in column_slices(n, x.shape[1], 40):
        cols = x[:, sl] if every else x[:, sl].index_select(0, rand)
        if not prep.seeded:
            q = torch.empty_like(cols).exponential_()
        else:
            q = torch.empty_like(cols)
            q.index_copy_(0, v["seeded"], -torch.log(uniform_columns(states, sl.start, sl.stop)))
            if prep.unseeded:
                q.index_copy_(0, v["unseeded"], torch.empty(len(prep.unseeded), cols.shape[1],
                                                             device=cols.device).exponential_())
        # q == 0 would make p/q inf (or NaN for p == 0).
        q.clamp_(min=tiny)
        score = (cols - m).exp_().div_(q)
        val, arg = score.max(dim=-1)
        better = val > best_val
        best_val = torch.where(better, val, best_val)
        best_idx = torch.where(better, arg + sl.start, best_idx)
    if prep.seeded:
        # Each seeded stream has drawn once more.
        t.ip[:, I_OFF].index_add_(0, seeded_slots, torch.ones_like(seeded_slots))
    return best_idx


def race_top_k(x: torch.Tensor, prep: Prepared, t: RowTables, fp: torch.Tensor) -> torch.Tensor | None:
    """The tokens of :func:`race` for a CPU work buffer processed up to min-p (not
    cut), when every sampled row has ``0 < top_k <= kmax``. Each row's ``kmax + 1``
    largest logits (numpy's SIMD partition, then a sort of those few: torch's CPU
    topk and sort are several times slower at these shapes) give its k-th logit and
    its nucleus; the race then runs over the tokens at or above both cuts only.
    Returns None (nothing advanced) when a row's list cannot decide (a logit tied
    with its k-th lies past the list): the caller then cuts the whole buffer and
    runs :func:`race`.

    Same kept sets as the whole-row stages (ties at the k-th and at the nucleus's
    end included); top-p's probabilities are normalised over the tokens top-k keeps,
    as the whole-row top-p does after the cut (the sums differ only in rounding).
    A kept token's noise is the number the whole-row race gives its column, and
    ties of the race's score go to the lowest token id, as the column-order scan of
    :func:`race` does, so a seeded draw is the same token.

    The host work is numpy on the buffer's memory (a numpy call costs a fraction of
    a torch op's dispatch at these few-thousand-element shapes); the exponentials
    and logarithms stay torch's, the functions the whole-row race uses, so a score
    is the very number it computes. The row's top_k comes from the host's copy of
    the parameters: nothing here reads the device tables but the seeded streams'
    counters.
    """
    v = prep.v
    every = len(prep.rand) == x.shape[0]
    vocab = x.shape[1]
    kmax = max(prep.top_ks)
    n = len(prep.rand)
    width = min(vocab, kmax + 1)
    xs = x.numpy()
    rand_np = None if every else np.asarray(prep.rand, dtype=np.int64)
    # Row blocks bound the temporaries (the partition's copy, the gathered rows of a
    # batch with greedy rows, the kept mask) to processors.SLICE_BYTES.
    block = max(1, processors.SLICE_BYTES // (4 * vocab))

    def row_block(lo: int) -> np.ndarray:
        return xs[lo:lo + block] if every else xs[rand_np[lo:lo + block]]

    def leading(b: np.ndarray) -> np.ndarray:
        # A small row sorts whole faster than numpy partitions it (its SIMD sort).
        if vocab <= 4096:
            return np.sort(b, axis=-1)[:, vocab - width:]
        return np.sort(np.partition(b, vocab - width, axis=-1)[:, vocab - width:], axis=-1)

    top = np.concatenate([leading(row_block(lo)) for lo in range(0, n, block)]) if n > block \
        else leading(row_block(0))
    values = np.ascontiguousarray(top[:, ::-1])  # descending
    k = np.asarray(prep.top_ks, dtype=np.int64)
    if not every:
        k = k[rand_np]
    rows_n = np.arange(n)
    kth = values[rows_n, k - 1]
    # A k-th logit of -inf (min-p or bans left fewer than k tokens) is no tie: all
    # the row's finite logits are in the list.
    if width > kmax and bool(((values[:, kmax] >= kth) & (kth > -np.inf)).any()):
        return None  # a token tied with the k-th may lie past the list
    m = values[:, :1]
    cut = kth
    if prep.topp:
        vt = torch.from_numpy(values[:, :kmax])
        kth_t = torch.from_numpy(kth).unsqueeze(1)
        vt = vt.masked_fill(vt < kth_t, float("-inf"))
        m_t = torch.from_numpy(m)
        ps = fp[:, F_TOPP] if every else fp[:, F_TOPP].index_select(0, v["rand"])
        lse = m_t + (vt - m_t).exp_().sum(dim=-1, keepdim=True).log_()
        last = nucleus_cut(vt, lse, ps)
        # Rows without top_p keep all top-k keeps.
        last.masked_fill_((ps >= 1.0).unsqueeze(1), float("-inf"))
        cut = np.maximum(kth, last.view(-1).numpy())
    # The kept tokens, as (row, column) pairs: about top_k per row (never the -inf
    # ones: they cannot win).
    cut = np.maximum(cut, np.finfo(np.float32).min).astype(np.float32)[:, None]
    # flatnonzero (one index array, 8x faster than a 2-D nonzero here), rows by
    # division; the pairs come out row-major, as a 2-D nonzero gives them.
    parts = []
    for lo in range(0, n, block):
        sub = np.ascontiguousarray(row_block(lo))
        flat = np.flatnonzero(sub >= cut[lo:lo + block])
        br = flat // vocab
        parts.append((br + lo, flat - br * vocab, sub.ravel()[flat]))
    r, c, kept = (np.concatenate(z) for z in zip(*parts)) if len(parts) > 1 else parts[0]
    if prep.seeded:
        seeded_slots = v["slots"].index_select(0, v["rand"].index_select(0, v["seeded"]))
        ip = t.ip.index_select(0, seeded_slots).numpy()
        states = np.zeros(n, dtype=np.uint64)
        states[np.asarray(prep.seeded, dtype=np.int64)] = row_states_np(ip[:, I_KEY].view(np.uint64), ip[:, I_OFF])
        q = torch.from_numpy(uniform_at_np(states[r], c)).log_().neg_()
        if prep.unseeded:
            is_unseeded = np.zeros(n, dtype=bool)
            is_unseeded[np.asarray(prep.unseeded, dtype=np.int64)] = True
            sel = torch.from_numpy(is_unseeded[r])
            q[sel] = torch.empty(int(sel.sum()), dtype=torch.float32).exponential_()
    else:
        q = torch.empty(len(r), dtype=torch.float32).exponential_()
    q.clamp_(min=torch.finfo(torch.float32).tiny)
    score = torch.from_numpy(kept - m[r, 0]).exp_().div_(q)
    counts = np.bincount(r, minlength=n)
    if counts.all():
        # Every row has candidates (the pairs are row-major): per-row segments.
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        sc = score.numpy()
        best = np.maximum.reduceat(sc, starts)
        # Among a row's best scores, the lowest column.
        cols = np.where(sc == np.repeat(best, counts), c, vocab)
        tokens = torch.from_numpy(np.minimum.reduceat(cols, starts).astype(np.int64))
    else:  # a row with nothing to draw from (all -inf) gets token `vocab`, as before
        r_t = torch.from_numpy(r)
        best_t = torch.full((n,), -1.0).scatter_reduce_(0, r_t, score, "amax")
        cols_t = torch.from_numpy(c.astype(np.int64)).masked_fill_(score != best_t.index_select(0, r_t), vocab)
        tokens = torch.full((n,), vocab, dtype=torch.int64).scatter_reduce_(0, r_t, cols_t, "amin")
    if prep.seeded:
        t.ip[:, I_OFF].index_add_(0, seeded_slots, torch.ones_like(seeded_slots))
    return tokens


def logprob_parts(source: torch.Tensor, tokens: torch.Tensor, ks: list[int],
                  row_of: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Chosen-token logprobs, ranks and the top-k alternatives of ``log_softmax(source)``,
    as float64 pieces to cat into the one device->host transfer. ``source`` is the
    raw logits (any float dtype) or the work buffer; the log-softmax is never built
    whole: logprob = logit - logsumexp, and ranks and top-k are taken on the logits.
    ``row_of`` (a fork row's samples share its logits row): each sample's row of
    ``source``; the per-row numbers are computed once per row and gathered, and the
    ranks read column slices of the rows, so no ``[samples, vocab]`` copy is made."""
    rows = source.shape[0]
    lse = torch.zeros(rows, 1, dtype=torch.float32, device=source.device)
    m = source.amax(dim=-1, keepdim=True).to(torch.float32)
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    for sl in column_slices(rows, source.shape[1], 4):
        lse += (source[:, sl].to(torch.float32) - shift).exp_().sum(dim=-1, keepdim=True)
    lse = shift + lse.log()
    if row_of is not None:
        lse = lse.index_select(0, row_of)
    per_row = source if row_of is None else None
    n = tokens.shape[0]
    if row_of is None:
        chosen_logit = source.gather(1, tokens.unsqueeze(1)).to(torch.float32)
    else:
        chosen_logit = source[row_of, tokens].unsqueeze(1).to(torch.float32)
    chosen = (chosen_logit - lse).squeeze(1)
    ranks = torch.zeros(n, dtype=torch.int64, device=source.device)
    for sl in column_slices(n, source.shape[1], 1):
        cols = source[:, sl] if per_row is not None else source[:, sl].index_select(0, row_of)
        ranks += (cols.to(torch.float32) > chosen_logit).sum(dim=-1)
    parts = [tokens.double(), chosen.double(), (ranks + 1).double()]
    kmax = max(ks)
    if kmax > 0:
        top_v, top_i = torch.topk(source, kmax, dim=-1)
        if row_of is not None:
            top_v, top_i = top_v.index_select(0, row_of), top_i.index_select(0, row_of)
        parts += [top_i.double().flatten(), (top_v.to(torch.float32) - lse).double().flatten()]
    return parts


__all__ = ["race", "race_top_k", "logprob_parts"]
