"""Which drafts a verify step keeps, and the target's token after them.

The drafter proposes its argmax (a one-hot draft distribution q = delta(d), as vLLM's
MTP proposer does). For a one-hot q, Leviathan et al.'s rule -- accept d with
probability min(1, p(d) / q(d)) = p(d), and on a rejection draw from the residual
max(p - q, 0) normalised, which is p without d -- has exactly the law of this simpler
one, which is what is implemented:

    draw t_j from the target's processed distribution at verify row j (the same
    sampler, processors, seeded stream and penalty counts as a non-speculative step);
    keep going while t_j equals draft j+1.

Each drawn token is therefore distributed as the non-speculative step's token given the
same history, for every sampling parameter (temperature, top-k/p, min-p, penalties,
logit_bias, min_tokens), and a seeded request draws each of its tokens with the same
stream offset as without speculation: its output is the same token for token, not only
in distribution. Greedy rows keep the draft while it equals the argmax, so greedy output
is identical too. Every token drawn is emitted (the accepted drafts and one correction
or bonus token), so streams and penalty counts never need rewinding.

Rounds: round 0 is the step's ordinary sampler call (row 0 of a verify entry is where
a plain decode would sample). Round j >= 1 draws row j of the entries still matching;
an entry stops at its first mismatch or after its last draft (the bonus row). Batches
whose verify rows are all plain greedy (no penalties, bias, bans or logprobs) take one
argmax over every row instead of k calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from hybridserve.sampler.rows import SamplingRow


@dataclass
class VerifyEntry:
    """One sequence whose decode row carried drafts this step.

    ``rows``: the logits rows (of the verify logits tensor) of its draft rows 1..d, in
    order; ``row``: its round-0 sampler row (the sample's persistent row)."""

    drafts: list[int]
    rows: list[int]
    row: SamplingRow
    history: list[int]
    # (request id, sample index): the grammar's key for constrained requests.
    key: tuple | None = None
    # Filled by accept(): the tokens drawn (accepted drafts, then the target's token),
    # and per drawn token its (logprob, rank, top list) when the row asked for logprobs.
    tokens: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int | None, list]] = field(default_factory=list)


def plain_greedy(row: SamplingRow, extra: int) -> bool:
    """Whether the row's token at each of its next ``extra`` positions is the argmax of
    the raw logits (nothing processes a greedy row's logits, no logprobs asked)."""
    p = row.params
    if not p.greedy or p.logit_bias or p.has_penalties or p.logprobs is not None:
        return False
    if getattr(p, "structured_outputs", None) is not None:
        return False  # a grammar masks each row
    if p.min_tokens and len(row.output_token_ids) < p.min_tokens + extra:
        return False  # min_tokens bans EOS / stop ids on some of those rows
    allowed = getattr(p, "allowed_token_ids", None)
    bad = getattr(p, "bad_words", None)
    return not allowed and not bad


def _argmax(x: torch.Tensor) -> np.ndarray:
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.float().contiguous()
    if x.device.type == "cpu":
        return np.argmax(x.numpy(), axis=-1)
    return x.argmax(dim=-1).cpu().numpy()


def accept(sampler: Any, logits: torch.Tensor, entries: Sequence[VerifyEntry], first: Sequence[int],
           first_logprobs: Sequence[tuple | None] | None = None, masker: Any = None) -> None:
    """Fills each entry's ``tokens`` (and ``logprobs``): ``first[i]`` is the token round 0
    drew for entry i (and ``first_logprobs[i]`` its logprob record, or None);
    ``logits`` holds the draft rows (``VerifyEntry.rows`` index it). ``masker(alive,
    logits_rows)``, if given, masks each round's rows in place before the draw (a
    grammar's allowed tokens after the entry's tokens so far)."""
    for i, e in enumerate(entries):
        e.tokens = [int(first[i])]
        e.logprobs = [first_logprobs[i]] if first_logprobs is not None and first_logprobs[i] is not None else []
    alive = [e for e in entries if e.drafts and e.tokens[0] == e.drafts[0]]
    if not alive:
        return
    if all(plain_greedy(e.row, len(e.drafts) + 1) for e in alive):
        rows = [r for e in alive for r in e.rows]
        if rows == list(range(logits.shape[0])):
            top = _argmax(logits)  # (every entry still matching: all the rows, no gather)
        else:
            top = _argmax(logits.index_select(0, torch.tensor(rows, dtype=torch.int64, device=logits.device)))
        at = 0
        for e in alive:
            d = len(e.drafts)
            for j in range(1, d + 1):
                t = int(top[at + j - 1])
                e.tokens.append(t)
                if j == d or t != e.drafts[j]:
                    break
            at += d
        return
    j = 1
    while alive:
        rows = [replace(e.row, output_token_ids=e.history + e.tokens) for e in alive]
        idx = torch.tensor([e.rows[j - 1] for e in alive], dtype=torch.int64, device=logits.device)
        lg = logits.index_select(0, idx)
        if masker is not None:
            masker(alive, lg)
        out = sampler(lg, rows)
        nxt = []
        for s, (e, t) in enumerate(zip(alive, out.token_ids)):
            t = int(t)
            e.tokens.append(t)
            if out.logprobs is not None and e.row.params.logprobs is not None:
                e.logprobs.append((out.logprobs[s], out.ranks[s] if out.ranks else None, out.top_logprobs[s]))
            if j < len(e.drafts) and t == e.drafts[j]:
                nxt.append(e)
        alive = nxt
        j += 1
