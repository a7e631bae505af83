"""The batched sampler: one token per sample from a step's logits.

Processing order is vLLM v1's, per sample row:

1. min_tokens: while a completion has fewer than ``min_tokens`` tokens, its EOS (unless
   ``ignore_eos``) and ``stop_token_ids`` get logit -inf.
2. penalties: repetition (tokens in prompt or output: positive logits divided by the
   penalty, negative ones multiplied), then frequency (times the token's count in the
   output) and presence (once if the token is in the output), both subtracted.
3. greedy rows (temperature < 1e-5) take the argmax here; the rest continue.
4. temperature: logits divided by it.
5. min_p: tokens with probability < min_p * (top probability) dropped.
6. top_k: tokens whose logit is below the k-th largest dropped (ties at the k-th kept).
7. top_p: in descending probability order, a token is kept iff the probability mass of
   the tokens strictly before it is < top_p (so the most likely token always stays);
   tokens tied with the last kept one are kept too.
8. sample from softmax of what is left, with the exponential race
   ``argmax(p / q), q ~ Exp(1)`` (equivalent to a categorical draw).

Everything is vectorised across rows except drawing the noise of seeded rows, which is
one ``exponential_`` call per seeded sample on that sample's own generator: a seeded
sample's token therefore depends only on (seed, sample index, step, logits), never on
which other requests share the batch (a fixed vocabulary-sized draw per step).

Logprobs: by default (``logprobs_mode="raw"``, vLLM v1's default) the reported numbers
are ``log_softmax`` of the model's logits before any processing; ``"processed"``
reports ``log_softmax`` of the logits after steps 1-7 (for greedy rows, after 1-2).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from hybridserve.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def make_generator(
    seed: int | None, sample_index: int, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """The RNG of sample ``sample_index`` of a request with ``seed``; None if unseeded.

    Sample 0 is seeded with ``seed`` itself (mod 2**64), so a seeded n=1 request draws
    from ``torch.Generator().manual_seed(seed)``; sample i > 0 gets a splitmix64 hash of
    (seed, i), so the n samples of one request are independent streams. The generator
    lives on ``device``, which must be the device of the logits it samples from.
    """
    if seed is None:
        return None
    if sample_index < 0:
        raise ValueError(f"sample_index must be >= 0, got {sample_index}")
    value = seed & _MASK64
    if sample_index > 0:
        value = _splitmix64(value ^ _splitmix64(sample_index))
    gen = torch.Generator(device=device)
    gen.manual_seed(value)
    return gen


@dataclass
class SamplingRow:
    """One row of the logits tensor and how to sample from it.

    ``num_samples`` > 1 only at the fork step of an n > 1 request: that many tokens
    are drawn independently from this row; each sample then uses its own generator,
    given as ``generators`` (one per sample, None for the global RNG). Otherwise a
    single ``generator`` (None: global RNG) is used. ``eos_token_id`` is needed only to
    enforce ``params.min_tokens``.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None = None
    num_samples: int = 1
    generators: Sequence[torch.Generator | None] | None = None
    eos_token_id: int | None = None

    def sample_generators(self) -> list[torch.Generator | None]:
        """One generator (or None) per sample of this row."""
        if self.num_samples < 1:
            raise ValueError(f"SamplingRow.num_samples must be >= 1, got {self.num_samples}")
        if self.generators is not None:
            if self.generator is not None:
                raise ValueError("give SamplingRow either generator or generators, not both")
            if len(self.generators) != self.num_samples:
                raise ValueError(
                    f"SamplingRow.generators has {len(self.generators)} entries but "
                    f"num_samples={self.num_samples}; give one generator (or None) per sample"
                )
            return list(self.generators)
        if self.num_samples > 1 and self.generator is not None:
            raise ValueError(
                "a SamplingRow with num_samples > 1 needs generators=[...] (one per sample, "
                "e.g. make_generator(seed, i, device)), not a single shared generator"
            )
        return [self.generator] * self.num_samples


@dataclass
class SamplerOutput:
    """The tokens drawn for a batch of rows.

    ``token_ids`` holds ``num_samples`` tokens per row, rows in order, a row's samples
    in sample order. ``logprobs`` (the chosen tokens' logprobs), ``ranks`` (1 = the most
    likely token) and ``top_logprobs`` (per chosen token, the ``params.logprobs`` most
    likely (token_id, logprob) pairs in descending order; empty for rows that did not
    ask) are None when no row asked for logprobs.
    """

    token_ids: list[int]
    logprobs: list[float] | None = None
    ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class _Batch:
    """Per-sample view of a list of SamplingRows (rows expanded by num_samples)."""

    row_of_sample: list[int]
    params: list[SamplingParams]
    rows: list[SamplingRow]
    generators: list[torch.Generator | None] = field(default_factory=list)


def _expand(rows: Sequence[SamplingRow]) -> _Batch:
    batch = _Batch([], [], [])
    for i, row in enumerate(rows):
        for gen in row.sample_generators():
            batch.row_of_sample.append(i)
            batch.params.append(row.params)
            batch.rows.append(row)
            batch.generators.append(gen)
    return batch


def _check_ids(ids: torch.Tensor, vocab: int, what: str) -> None:
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{what} contain a token id outside [0, {vocab}) (the logits' vocabulary); "
            f"got range [{int(ids.min())}, {int(ids.max())}]"
        )


class Sampler:
    """Draws one token per sample from a step's logits; stateless across steps.

    Cost per call: O(S * V) for S samples and vocabulary V; a top-k when rows use
    top_k; for rows with top_p, a top-k over the tokens min_p/top_k left or, when
    most of the vocabulary survives, a full sort (O(V log V) per row); O(tokens) to
    count the prompt/output tokens of rows with penalties; one device->host copy of
    the tokens (plus the logprobs when asked).
    """

    def __init__(self, logprobs_mode: str = "raw") -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    # ------------------------------------------------------------------ processing
    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The logits each sample is drawn from, float32 ``[num_samples_total, V]``.

        Greedy samples get steps 1-2 of the module docstring (their argmax is the
        token); the others get steps 1-7 (dropped tokens are -inf). ``logits`` is
        ``[len(rows), V]`` and is not modified.
        """
        return self._process(logits, rows, _expand(rows))

    def _process(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], batch: _Batch
    ) -> torch.Tensor:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}"
            )
        device = logits.device
        vocab = logits.shape[1]
        num = len(batch.params)
        if num == len(rows):
            x = logits.to(torch.float32, copy=True)
        else:
            index = torch.tensor(batch.row_of_sample, device=device)
            x = logits.index_select(0, index).to(torch.float32)
        self._apply_min_tokens(x, batch, vocab)
        self._apply_penalties(x, batch, vocab)

        params = batch.params
        if all(p.greedy for p in params):
            return x
        # Greedy samples get neutral values so one vectorised pass serves the batch.
        temps = [1.0 if p.greedy else p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            x.div_(torch.tensor(temps, device=device, dtype=torch.float32).unsqueeze(1))
        min_ps = [0.0 if p.greedy else p.min_p for p in params]
        if any(m > 0 for m in min_ps):
            probs = torch.softmax(x, dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(
                min_ps, device=device, dtype=torch.float32
            ).unsqueeze(1)
            x.masked_fill_(probs < threshold, float("-inf"))
        top_ks = [vocab if p.greedy or p.top_k == 0 else min(p.top_k, vocab) for p in params]
        if any(k < vocab for k in top_ks):
            kmax = max(k for k in top_ks if k < vocab)
            values = torch.topk(x, kmax, dim=-1).values
            ks = torch.tensor([min(k, kmax) for k in top_ks], device=device) - 1
            kth = values.gather(1, ks.unsqueeze(1))
            # Rows without top_k compare against -inf: nothing is dropped.
            no_k = torch.tensor([k == vocab for k in top_ks], device=device).unsqueeze(1)
            kth.masked_fill_(no_k, float("-inf"))
            x.masked_fill_(x < kth, float("-inf"))
        p_rows = [s for s, p in enumerate(params) if not p.greedy and p.top_p < 1.0]
        if p_rows:
            top_ps = [params[s].top_p for s in p_rows]
            if len(p_rows) == num:
                x = self._top_p(x, top_ps)
            else:
                idx = torch.tensor(p_rows, device=device)
                x.index_copy_(0, idx, self._top_p(x.index_select(0, idx), top_ps))
        return x

    @staticmethod
    def _top_p(x: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
        """Nucleus filter of rows already cut by min_p/top_k (dropped = -inf).

        Only the surviving tokens need ordering, so when min_p or top_k left few of
        them a top-k over the survivors replaces the full O(V log V) sort. Tokens tied
        with the last kept logit are kept too (as top_k keeps ties): the kept set then
        depends on the logit values only, not on how a sort orders equal values, which
        bf16 logits produce often.
        """
        vocab = x.shape[1]
        survivors = int(torch.isfinite(x).sum(dim=-1).max())
        if survivors <= vocab // 4:
            values = torch.topk(x, max(survivors, 1), dim=-1).values
        else:
            values = x.sort(dim=-1, descending=True).values
        probs = values.softmax(dim=-1)
        # Mass strictly before each token in descending order (an exclusive cumsum);
        # a token is kept iff that mass is < p, so the top token (mass 0 < p) stays.
        cumulative = probs.cumsum(dim=-1)
        before = torch.zeros_like(cumulative)
        before[:, 1:] = cumulative[:, :-1]
        ps = torch.tensor(top_ps, device=x.device, dtype=torch.float32).unsqueeze(1)
        # `before` is non-decreasing, so the kept tokens are a prefix of `values`.
        last_kept = values.masked_fill(before >= ps, float("inf")).amin(dim=-1, keepdim=True)
        return x.masked_fill(x < last_kept, float("-inf"))

    @staticmethod
    def _apply_min_tokens(x: torch.Tensor, batch: _Batch, vocab: int) -> None:
        rows_idx: list[int] = []
        toks: list[int] = []
        for s, (p, row) in enumerate(zip(batch.params, batch.rows)):
            if len(row.output_token_ids) >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids or [])
            if row.eos_token_id is not None and not p.ignore_eos:
                banned.append(row.eos_token_id)
            for t in banned:
                if 0 <= t < vocab:  # a stop id beyond this model's vocab can never be drawn
                    rows_idx.append(s)
                    toks.append(t)
        if rows_idx:
            x[torch.tensor(rows_idx, device=x.device), torch.tensor(toks, device=x.device)] = float("-inf")

    @staticmethod
    def _apply_penalties(x: torch.Tensor, batch: _Batch, vocab: int) -> None:
        pen = [s for s, p in enumerate(batch.params) if p.has_penalties]
        if not pen:
            return
        device = x.device
        out_rows: list[int] = []
        out_toks: list[int] = []
        prompt_rows: list[int] = []
        prompt_toks: list[int] = []
        for j, s in enumerate(pen):
            row = batch.rows[s]
            out_toks.extend(row.output_token_ids)
            out_rows.extend([j] * len(row.output_token_ids))
            if batch.params[s].repetition_penalty != 1.0:
                prompt_toks.extend(row.prompt_token_ids)
                prompt_rows.extend([j] * len(row.prompt_token_ids))
        # Built on the CPU and checked there: a bad id must be a clear error, not a
        # device-side assert.
        out_t = torch.tensor(out_toks, dtype=torch.long)
        prompt_t = torch.tensor(prompt_toks, dtype=torch.long)
        _check_ids(out_t, vocab, "output_token_ids")
        _check_ids(prompt_t, vocab, "prompt_token_ids")

        counts = torch.zeros(len(pen), vocab, dtype=torch.float32, device=device)
        if out_toks:
            counts.index_put_(
                (torch.tensor(out_rows, device=device), out_t.to(device)),
                torch.ones(len(out_toks), device=device),
                accumulate=True,
            )
        in_output = counts > 0
        seen = in_output.clone()
        if prompt_toks:
            seen[torch.tensor(prompt_rows, device=device), prompt_t.to(device)] = True

        idx = torch.tensor(pen, device=device)
        sub = x.index_select(0, idx)
        params = [batch.params[s] for s in pen]

        def col(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        rep = col([p.repetition_penalty for p in params])
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - col([p.frequency_penalty for p in params]) * counts
        sub = sub - col([p.presence_penalty for p in params]) * in_output.to(torch.float32)
        x.index_copy_(0, idx, sub)

    # ------------------------------------------------------------------ sampling
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Draw ``rows[i].num_samples`` tokens from ``logits[i]`` for every row.

        ``logits`` is ``[len(rows), V]`` of any float dtype, on the device of the
        rows' generators. It is not modified.
        """
        if not rows:
            return SamplerOutput(token_ids=[])
        batch = _expand(rows)
        want_logprobs = any(p.logprobs is not None for p in batch.params)
        raw_logprobs = None
        if want_logprobs and self.logprobs_mode == "raw":
            if len(batch.params) == len(rows):
                raw = logits
            else:
                raw = logits.index_select(0, torch.tensor(batch.row_of_sample, device=logits.device))
            raw_logprobs = torch.log_softmax(raw.to(torch.float32), dim=-1)

        x = self._process(logits, rows, batch)
        tokens = x.argmax(dim=-1)
        random_rows = [s for s, p in enumerate(batch.params) if not p.greedy]
        if random_rows:
            tokens[random_rows] = self._draw(x, random_rows, batch.generators)

        if not want_logprobs:
            return SamplerOutput(token_ids=tokens.tolist())
        lp = raw_logprobs if raw_logprobs is not None else torch.log_softmax(x, dim=-1)
        chosen = lp.gather(1, tokens.unsqueeze(1))
        ranks = (lp > chosen).sum(dim=-1) + 1
        ks = [p.logprobs or 0 for p in batch.params]
        kmax = max(ks)
        top: list[list[tuple[int, float]]] = [[] for _ in ks]
        if kmax > 0:
            top_v, top_i = torch.topk(lp, kmax, dim=-1)
            top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
            for s, k in enumerate(ks):
                top[s] = list(zip(top_i_l[s][:k], top_v_l[s][:k]))
        return SamplerOutput(
            token_ids=tokens.tolist(),
            logprobs=chosen.squeeze(1).tolist(),
            ranks=ranks.tolist(),
            top_logprobs=top,
        )

    @staticmethod
    def _draw(
        x: torch.Tensor, sample_rows: list[int], generators: list[torch.Generator | None]
    ) -> torch.Tensor:
        probs = torch.softmax(x[sample_rows], dim=-1)
        q = torch.empty_like(probs)
        unseeded = [j for j, s in enumerate(sample_rows) if generators[s] is None]
        if unseeded:
            if len(unseeded) == len(sample_rows):
                q.exponential_()
            else:
                q[unseeded] = torch.empty(len(unseeded), q.shape[1], device=q.device).exponential_()
        for j, s in enumerate(sample_rows):
            gen = generators[s]
            if gen is not None:
                # One vocabulary-sized draw per step from the sample's own stream keeps
                # its tokens independent of the batch it is in.
                q[j].exponential_(generator=gen)
        # q == 0 would make p/q inf (or NaN for p == 0).
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return (probs / q).argmax(dim=-1)


__all__ = ["Sampler", "SamplingRow", "SamplerOutput", "make_generator"]
