"""Logit processors, in vLLM v1's order, applied in place to the work buffer.

``x`` is the one float32 ``[samples, vocab]`` work buffer of a call (a copy of the
logits). Every processor writes into it in place; what a processor needs beyond
per-row numbers (masks, gathered rows of the count tables, exponentials) is made one
column slice at a time (:func:`column_slices`), so no other ``[rows, vocab]`` tensor
exists. Top-p over rows without a small top-k does not sort the rows: it takes a
partial top-K of them, growing K only for rows whose nucleus is longer (see
:func:`apply_top_p`).

0. logit_bias: the request's biases added to their tokens' logits.
1. min_tokens: while a completion has fewer than ``min_tokens`` tokens, its EOS (unless
   ``ignore_eos``) and ``stop_token_ids`` get logit -inf.
2. penalties: repetition (tokens in prompt or output: positive logits divided by the
   penalty, negative ones multiplied), then frequency (times the token's count in the
   output) and presence (once if the token is in the output), both subtracted.
3. greedy rows (temperature < 1e-5) stop here (their argmax is the token).
4. temperature: logits divided by it.
5. min_p: tokens with probability < min_p * (top probability) dropped.
6. top_k: tokens whose logit is below the k-th largest dropped (ties at the k-th kept).
7. top_p: in descending probability order, a token is kept iff the probability mass of
   the tokens strictly before it is < top_p (so the most likely token always stays);
   tokens tied with the last kept one are kept too.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hybridserve.sampler.rows import F_FREQ, F_MINP, F_PRES, F_REP, F_TEMP, F_TOPP, I_TOPK, Prepared, RowTables

# Bytes of temporaries one column slice may use per processor (a few tensors of
# rows x columns): bounds the sampler's memory beyond the logits and the work buffer.
SLICE_BYTES = 32 << 20


def column_slices(rows: int, vocab: int, bytes_per_elem: int = 8) -> Iterator[slice]:
    """Column ranges of at most SLICE_BYTES of ``bytes_per_elem``-byte temporaries."""
    width = max(1024, SLICE_BYTES // max(1, rows * bytes_per_elem))
    for lo in range(0, vocab, width):
        yield slice(lo, min(vocab, lo + width))


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """``[R, 1]`` log-sum-exp of each row, accumulated over column slices."""
    m = x.amax(dim=-1, keepdim=True)
    # A row that is all -inf has m = -inf; shift by 0 there (its sum is then 0: lse -inf).
    shift = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    total = torch.zeros_like(m)
    for sl in column_slices(x.shape[0], x.shape[1], 4):
        total += (x[:, sl] - shift).exp_().sum(dim=-1, keepdim=True)
    return shift + total.log()


def apply_bias(x: torch.Tensor, prep: Prepared, t: RowTables) -> None:
    """Adds each biased row's (token, bias) pairs, in place ([rows, bias width] indices)."""
    idx = prep.v["bias"]
    b_slots = prep.v["slots"].index_select(0, idx)
    toks = t.bias_tok.index_select(0, b_slots)
    rows = idx.unsqueeze(1).expand_as(toks)
    x.index_put_((rows, toks), t.bias_val.index_select(0, b_slots), accumulate=True)


def apply_bans(x: torch.Tensor, prep: Prepared, t: RowTables) -> None:
    # A device scalar made once: a host scalar here would be a blocking copy.
    x.index_put_((prep.v["ban_rows"], prep.v["ban_toks"]), t.neg_inf)


def apply_penalties(x: torch.Tensor, prep: Prepared, t: RowTables, fp: torch.Tensor) -> None:
    """Repetition, frequency and presence penalties of the penalty rows, in place.

    Float arithmetic only (no boolean masks: on the CPU a bool->float promotion or
    comparison costs 4-5x a float op of the same size): a token's "in the output"
    is ``sign(count)`` (counts are >= 0) and its "seen" is the larger of that and the
    prompt table's byte, both exactly 0.0 or 1.0, so every product below is the
    number the boolean formulation gave (``pres * 1.0``, ``rep * 1.0 + 0.0``)."""
    idx, pslots = prep.v["pen"], prep.v["pen_pslots"]
    f = fp.index_select(0, idx)
    rep = f[:, F_REP : F_REP + 1]
    freq = f[:, F_FREQ : F_FREQ + 1]
    pres = f[:, F_PRES : F_PRES + 1]
    every = len(prep.pen) == x.shape[0]
    span = prep.pen_span
    for sl in column_slices(len(prep.pen), x.shape[1], 16):
        if span is not None:
            # The rows' count-table rows are consecutive (the steady state): a view.
            counts = t.counts[span[0]:span[1], sl]
            prompt = t.prompt_seen[span[0]:span[1], sl]
        else:
            counts = t.counts[:, sl].index_select(0, pslots)
            prompt = t.prompt_seen[:, sl].index_select(0, pslots)
        in_output = counts.sign()
        seen = torch.maximum(prompt.view(torch.uint8).to(torch.float32), in_output)
        cols = x[:, sl]
        # Every row penalised (the usual batch): work on the buffer's columns directly.
        sub = cols if every else cols.index_select(0, idx)
        # Repetition without torch.where (several times slower than arithmetic on
        # the CPU): each seen token's factor is rep (exactly: seen * rep + (1 - seen)),
        # a positive logit is divided by it and a negative one multiplied, both
        # exactly as before (a term with the other sign is an exact zero).
        factor = (seen * rep).add_(seen.neg_().add_(1.0))
        neg = sub.clamp(max=0).mul_(factor)
        out = sub.clamp(min=0).div_(factor).add_(neg)
        out.sub_(counts * freq)
        out.sub_(in_output.mul_(pres))
        cols.copy_(out) if every else cols.index_copy_(0, idx, out)


def apply_temperature(x: torch.Tensor, fp: torch.Tensor) -> None:
    # Greedy rows' table temperature is 1.0: dividing is a no-op for them.
    x.div_(fp[:, F_TEMP : F_TEMP + 1])


def apply_min_p(x: torch.Tensor, fp: torch.Tensor) -> None:
    """Drops tokens with probability < min_p * top probability, i.e. with logit below
    max + log(min_p) (rows without min_p have log(0) = -inf: nothing dropped)."""
    m = x.amax(dim=-1, keepdim=True)
    lse = row_logsumexp(x)
    top = (m - lse).exp()
    threshold = top * fp[:, F_MINP : F_MINP + 1]
    for sl in column_slices(x.shape[0], x.shape[1], 4):
        cols = x[:, sl]
        cols.masked_fill_((cols - lse).exp_() < threshold, float("-inf"))


def apply_top_k(x: torch.Tensor, prep: Prepared, t: RowTables) -> tuple[torch.Tensor, torch.Tensor]:
    """Drops tokens below each row's k-th largest logit; returns (the top-kmax values
    before the cut, each row's k-th value) for top-p to reuse."""
    vocab = x.shape[1]
    kmax = max(prep.top_ks)
    k = t.ip.index_select(0, prep.v["slots"])[:, I_TOPK]
    no_k = (k <= 0) | (k >= vocab)
    values = torch.topk(x, kmax, dim=-1).values
    kth = values.gather(1, (k.clamp(1, kmax) - 1).unsqueeze(1))
    # Rows without top_k compare against -inf: nothing is dropped.
    kth.masked_fill_(no_k.unsqueeze(1), float("-inf"))
    for sl in column_slices(x.shape[0], vocab, 1):
        cols = x[:, sl]
        cols.masked_fill_(cols < kth, float("-inf"))
    return values, kth


def apply_top_p(x: torch.Tensor, prep: Prepared, fp: torch.Tensor,
                top_k: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Nucleus filter of rows already cut by min_p/top_k (dropped = -inf), in place.

    Only the survivors need ordering: when every top-p row also has a small top_k, a
    top-k of that size holds them all (ties aside, handled below). Otherwise the
    rows are not sorted: a partial top-K (K = :data:`TOP_P_FIRST_K`, then 8x more
    while some row's K most likely tokens hold less than its p) gives the same
    leading values a sort would, which is all the nucleus reads, so the kept set is
    exactly the sort's. That route reads one bool per round on the host (a device
    sync on a GPU; a full-vocabulary sort per row costs more there). Probabilities
    are normalised over the whole row, so the kept set does not depend on which
    route ran, and tokens tied with the last kept logit are kept too (as top_k keeps
    ties): the kept set then depends on the logit values only, not on how a sort
    orders equal values.
    """
    vocab = x.shape[1]
    kp = max(prep.top_p_limits)
    kp = kp if kp <= vocab // 4 else None
    every = len(prep.topp) == x.shape[0]
    idx = prep.v["topp"]
    if kp is not None:
        if top_k is not None and top_k[0].shape[1] >= kp:
            # The top-k stage's list, cut as it cut the row: the same values as a
            # new top-k of the cut row, without sorting again.
            values, kth = top_k
            values = values[:, :kp].masked_fill(values[:, :kp] < kth, float("-inf"))
        else:
            values = torch.topk(x, kp, dim=-1).values
        if not every:
            values = values.index_select(0, idx)
    lse = row_logsumexp(x)
    ps = fp[:, F_TOPP]
    if not every:
        lse, ps = lse.index_select(0, idx), ps.index_select(0, idx)
    if kp is not None:
        last_kept = nucleus_cut(values, lse, ps)
    else:
        rows = x if every else x.index_select(0, idx)
        k = min(vocab, TOP_P_FIRST_K)
        while True:
            values = torch.topk(rows, k, dim=-1).values
            if k == vocab:
                break
            cumulative = (values - lse).exp_().cumsum(dim=-1)
            # The list decides a row once its mass reaches p: the token after it
            # (mass before it >= p) and all below are dropped, ties aside.
            if not bool((cumulative[:, -1] < ps).any()):
                break
            k = min(vocab, 8 * k)
        last_kept = nucleus_cut(values, lse, ps)
    if not every:
        full = torch.full((x.shape[0], 1), float("-inf"), device=x.device)
        last_kept = full.index_copy_(0, idx, last_kept)
    for sl in column_slices(x.shape[0], vocab, 1):
        cols = x[:, sl]
        cols.masked_fill_(cols < last_kept, float("-inf"))


def nucleus_cut(values: torch.Tensor, lse: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    """``[R, 1]`` the smallest logit top-p keeps, from each row's leading logits in
    descending order (``values``, at least up to the first token top-p drops), the
    row's log-sum-exp and its p: a token is kept iff the probability mass strictly
    before it is < p (an exclusive cumsum), so the top token (mass 0 < p) stays."""
    probs = (values - lse).exp_()
    cumulative = probs.cumsum(dim=-1)
    before = torch.zeros_like(cumulative)
    before[:, 1:] = cumulative[:, :-1]
    # `before` is non-decreasing, so the kept tokens are a prefix of `values`; a
    # token beyond the list is tied with or below its last value.
    return values.masked_fill(before >= ps.unsqueeze(1), float("inf")).amin(dim=-1, keepdim=True)


# First partial top-K of top-p rows without a small top_k (grown 8x while short).
TOP_P_FIRST_K = 256


def process(x: torch.Tensor, prep: Prepared, t: RowTables, cut: bool = True) -> None:
    """Steps 0-7 on the work buffer ``x`` (greedy rows: 0-2), in place; with
    ``cut=False`` steps 0-5 (the draw then cuts top-k/top-p on its candidate lists,
    see :func:`~hybridserve.sampler.draw.race_top_k`)."""
    if prep.bias:
        apply_bias(x, prep, t)
    if prep.bans:
        apply_bans(x, prep, t)
    need_fp = prep.pen or (prep.rand and (prep.any_temp or prep.any_min_p or prep.topp))
    fp = t.fp.index_select(0, prep.v["slots"]) if need_fp else None
    if prep.pen:
        apply_penalties(x, prep, t, fp)
    if not prep.rand:
        return
    if prep.any_temp:
        apply_temperature(x, fp)
    if prep.any_min_p:
        apply_min_p(x, fp)
    if cut:
        cut_top_k_top_p(x, prep, t, fp)


def cut_top_k_top_p(x: torch.Tensor, prep: Prepared, t: RowTables, fp: torch.Tensor) -> None:
    """Steps 6-7 (top-k, top-p) on the whole work buffer, in place."""
    top_k = apply_top_k(x, prep, t) if any(prep.top_ks) else None
    if prep.topp:
        apply_top_p(x, prep, fp, top_k)


__all__ = ["process", "cut_top_k_top_p", "nucleus_cut", "column_slices", "row_logsumexp", "SLICE_BYTES",
           "TOP_P_FIRST_K"]
