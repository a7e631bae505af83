"""Log-probabilities of prompt and sampled tokens, recorded per request after a step.

Only requests that asked for them pay: the engine calls these when some request in
the step wants prompt logprobs, or when the sampler returned logprobs at all.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridserve.engine.request_state import RequestState
from hybridserve.outputs import Logprob

# Rows of prompt logits turned into log-probabilities at a time (bounds the float32 copy).
PROMPT_LOGPROB_SLICE = 256

# request id -> (k alternatives wanted, one row per prompt position; None before computed):
# a row is (token, logprob, rank, top ids, top logprobs), see outputs.PromptLogprobList.
PromptLogprobs = tuple[int, list[tuple | None]]


def prompt_logprob_rows(prompt_logprobs: dict[str, PromptLogprobs], plan: Any) -> list[int]:
    """Batch indices of sequences still prefilling positions whose prompt logprobs
    are wanted (a position p yields the logprob of prompt token p + 1)."""
    rows = []
    computed = plan.num_computed_tokens
    for b, rid in enumerate(plan.request_ids):
        entry = prompt_logprobs.get(rid)
        if entry is not None and int(computed[b]) < len(entry[1]) - 1:
            rows.append(b)
    return rows


def record_prompt_logprobs(requests: dict[str, RequestState], prompt_logprobs: dict[str, PromptLogprobs],
                           plan: Any, step: Any) -> None:
    """Fills the prompt-logprob entries of the positions this step prefilled."""
    for b, row0, count in step.prompt_spans:
        k, entries = prompt_logprobs[plan.request_ids[b]]
        state = requests[plan.request_ids[b]]
        start = int(plan.num_computed_tokens[b])
        # Positions start..start+count-1 predict prompt tokens start+1..; stop at the prompt's end.
        m = min(count, len(entries) - 1 - start)
        if m <= 0:
            continue
        target = torch.tensor(state.prompt_token_ids[start + 1:start + 1 + m],
                              device=step.prompt_logits.device)
        chosen_l: list[float] = []
        ranks_l: list[int] = []
        tv: list[list[float]] = []
        ti: list[list[int]] = []
        # In slices: a float32 log-softmax of a whole chunk over a 250k vocabulary
        # would be gigabytes on top of the logits.
        for lo in range(0, m, PROMPT_LOGPROB_SLICE):
            hi = min(m, lo + PROMPT_LOGPROB_SLICE)
            lps = torch.log_softmax(step.prompt_logits[row0 + lo:row0 + hi].float(), dim=-1)
            chosen = lps.gather(1, target[lo:hi, None])[:, 0]
            chosen_l += chosen.tolist()
            ranks_l += ((lps > chosen[:, None]).sum(dim=1) + 1).tolist()
            if k:
                top_v, top_i = lps.topk(k, dim=-1)
                tv += top_v.tolist()
                ti += top_i.tolist()
        # Compact rows (outputs.PromptLogprobList reads them as {token: Logprob}): plain
        # tuples of numbers, which the cyclic collector stops tracking.
        for j in range(m):
            tok = state.prompt_token_ids[start + 1 + j]
            entries[start + 1 + j] = (tok, chosen_l[j], ranks_l[j], tuple(ti[j]) if k else (),
                                      tuple(tv[j]) if k else ())


def record_logprobs(requests: dict[str, RequestState], plan: Any, step: Any, out: Any) -> None:
    """Appends each sampled token's logprob (and its top alternatives) to its sample."""
    if out.logprobs is None:
        return
    j = 0
    req_ids = plan.request_ids
    for b, k in zip(step.batch_index.tolist(), step.num_samples.tolist()):
        state = requests[req_ids[b]]
        base = int(plan.sample_indices[b])
        for i in range(k):
            si = i if k > 1 else base
            sample = state.samples[si]
            if sample.logprobs is not None:
                tok = out.token_ids[j]
                entry = {tok: Logprob(out.logprobs[j], rank=out.ranks[j] if out.ranks else None)}
                for rank, (alt, lp) in enumerate(out.top_logprobs[j], start=1):
                    entry.setdefault(alt, Logprob(lp, rank=rank))
                sample.logprobs.append(entry)
                sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + out.logprobs[j]
            j += 1
