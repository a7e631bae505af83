"""Logit processors, in vLLM v1's order, applied in place to the work buffer.

``x`` is the one float32 ``[samples, vocab]`` work buffer of a call (a copy of the
logits). Every processor writes into it in place; what a processor needs beyond
per-row numbers (masks, gathered rows of the count tables, exponentials) is made one
column slice at a time (:func:`column_slices`), so no other ``[rows, vocab]`` tensor
exists. The one exception is top-p over rows without a small top-k: it sorts those
rows (torch's sort returns values and indices of the rows' full width).

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
    """Repetition, frequency and presence penalties of the penalty rows, in place."""
    idx, pslots = prep.v["pen"], prep.v["pen_pslots"]
    f = fp.index_select(0, idx)
    rep = f[:, F_REP : F_REP + 1]
    freq = f[:, F_FREQ : F_FREQ + 1]
    pres = f[:, F_PRES : F_PRES + 1]
    for sl in column_slices(len(prep.pen), x.shape[1], 16):
        counts = t.counts[:, sl].index_select(0, pslots)
        in_output = counts > 0
        seen = t.prompt_seen[:, sl].index_select(0, pslots) | in_output
        cols = x[:, sl]
        sub = cols.index_select(0, idx)
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * counts
        sub = sub - pres * in_output.to(torch.float32)
        cols.index_copy_(0, idx, sub)


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
    top-k of that size holds them all (ties aside, handled below); otherwise the
    top-p rows are sorted. Probabilities are normalised over the whole row, so the
    kept set does not depend on which route ran, and tokens tied with the last kept
    logit are kept too (as top_k keeps ties): the kept set then depends on the logit
    values only, not on how a sort orders equal values. No host reads.
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
    else:
        rows = x if every else x.index_select(0, idx)
        values = rows.sort(dim=-1, descending=True).values
    lse = row_logsumexp(x)
    ps = fp[:, F_TOPP]
    if not every:
        lse, ps = lse.index_select(0, idx), ps.index_select(0, idx)
    probs = (values - lse).exp_()
    # Mass strictly before each token in descending order (an exclusive cumsum);
    # a token is kept iff that mass is < p, so the top token (mass 0 < p) stays.
    cumulative = probs.cumsum(dim=-1)
    before = torch.zeros_like(cumulative)
    before[:, 1:] = cumulative[:, :-1]
    # `before` is non-decreasing, so the kept tokens are a prefix of `values`; a
    # token beyond a top-k list is tied with or below its last value.
    last_kept = values.masked_fill(before >= ps.unsqueeze(1), float("inf")).amin(dim=-1, keepdim=True)
    if not every:
        full = torch.full((x.shape[0], 1), float("-inf"), device=x.device)
        last_kept = full.index_copy_(0, idx, last_kept)
    for sl in column_slices(x.shape[0], vocab, 1):
        cols = x[:, sl]
        cols.masked_fill_(cols < last_kept, float("-inf"))


def process(x: torch.Tensor, prep: Prepared, t: RowTables) -> None:
    """Steps 0-7 on the work buffer ``x`` (greedy rows: 0-2), in place."""
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
    top_k = apply_top_k(x, prep, t) if any(prep.top_ks) else None
    if prep.topp:
        apply_top_p(x, prep, fp, top_k)


__all__ = ["process", "column_slices", "row_logsumexp", "SLICE_BYTES"]
