"""The draw itself: the exponential race over processed logits, and logprobs.

A categorical draw from ``softmax(x)`` is ``argmax(p / q)`` with ``q ~ Exp(1)`` per
token; since the row's normaliser is a positive constant, ``argmax(exp(x - max) / q)``
picks the same token. It is computed one column slice at a time (the noise, seeded
or not, included), keeping each row's best value and index so far, so a draw makes no
``[rows, vocab]`` tensor.
"""

from __future__ import annotations

import torch

from hybridserve.sampler.processors import column_slices
from hybridserve.sampler.rows import I_KEY, I_OFF, Prepared, RowTables
from hybridserve.sampler.streams import row_states, uniform_columns


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


def logprob_parts(source: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[torch.Tensor]:
    """Chosen-token logprobs, ranks and the top-k alternatives of ``log_softmax(source)``,
    as float64 pieces to cat into the one device->host transfer. ``source`` is the
    raw logits (any float dtype) or the work buffer; the log-softmax is never built
    whole: logprob = logit - logsumexp, and ranks and top-k are taken on the logits."""
    rows = source.shape[0]
    lse = torch.zeros(rows, 1, dtype=torch.float32, device=source.device)
    m = source.amax(dim=-1, keepdim=True).to(torch.float32)
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    for sl in column_slices(rows, source.shape[1], 4):
        lse += (source[:, sl].to(torch.float32) - shift).exp_().sum(dim=-1, keepdim=True)
    lse = shift + lse.log()
    chosen_logit = source.gather(1, tokens.unsqueeze(1)).to(torch.float32)
    chosen = (chosen_logit - lse).squeeze(1)
    ranks = torch.zeros(rows, dtype=torch.int64, device=source.device)
    for sl in column_slices(rows, source.shape[1], 1):
        ranks += (source[:, sl].to(torch.float32) > chosen_logit).sum(dim=-1)
    parts = [tokens.double(), chosen.double(), (ranks + 1).double()]
    kmax = max(ks)
    if kmax > 0:
        top_v, top_i = torch.topk(source, kmax, dim=-1)
        parts += [top_i.double().flatten(), (top_v.to(torch.float32) - lse).double().flatten()]
    return parts


__all__ = ["race", "logprob_parts"]
