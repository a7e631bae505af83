"""Output processing: a step's new tokens to text and :class:`RequestOutput` s.

After the scheduler's update the engine core hands the update here: each new token is
appended to its sample, detokenized, checked against the stop strings (a hit finishes
the sequence in the core at once), and the changed requests' outputs are built, deltas
for running ones, the whole result once for finished ones (beam requests: the search's
best, decoded, once). Finished requests are retired through the core.

The common row (a running one-sample request that is not a beam, wants no prompt
logprobs and does not finish now) takes the short path of
:mod:`hybridserve.engine.common_rows`; a batch of only such rows, unchanged since the
last step, reuses the last step's row objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hybridserve.engine.common_rows import common_row_output, steady_row_outputs
from hybridserve.engine.request_state import RequestState
from hybridserve.outputs import Logprob, CompletionOutput, PromptLogprobList, RequestOutput


class OutputProcessor:
    """Builds a step's outputs over the core's request table.

    ``core`` gives the tables (``requests``, ``beams``, ``prompt_logprobs``,
    ``requests_epoch``) and two actions: ``finish(rid, sample, reason)`` (a stop string
    ended a sequence) and ``retire(rid, state)`` (a finished request leaves)."""

    def __init__(self, core: Any, tokenizer: Any) -> None:
        self.core = core
        self.tokenizer = tokenizer
        # Streaming consumers want every changed request each step; an offline loop
        # only wants finished ones, and skipping the rest keeps a step from copying
        # every running request's tokens (O(generated) per request per step).
        self.emit_unfinished = True
        # The last step's common output rows: (epoch, the update's request ids, per row
        # its request's objects), reused while the batch stays.
        self._steady_rows: tuple | None = None

    def forget_steady_rows(self) -> None:
        self._steady_rows = None

    def process(self, update: Any, changed: dict[str, set[int]], beams_ended: Any, now: float,
                extra_logprobs: dict | None = None) -> list[RequestOutput]:
        """The outputs of the scheduler's ``update``; ``changed`` holds the requests the
        step changed before it (request id -> sample indices) and gets this step's.

        ``extra_logprobs`` (a speculative step, see hybridserve.spec; None otherwise):
        a sample may get several tokens this step; ``extra_logprobs[(rid, si)]`` holds
        the logprob records of its tokens after the first, appended for the tokens it
        keeps. A stop string ends a sample at the token that completes it and the
        step's later tokens of that sample are dropped."""
        multi = extra_logprobs is not None
        core = self.core
        requests = core.requests
        # Outputs of this step. A running single-sample request that is not a beam,
        # wants no prompt logprobs and does not finish now gets its delta output in
        # this one pass over the new tokens (the common row); every other changed
        # request is collected in `changed` and handled below.
        outputs: list[RequestOutput] = []
        fast = self.emit_unfinished
        finishing = set(update.finished_request_ids) if len(update.finished_request_ids) else ()
        beams, plp = core.beams, core.prompt_logprobs
        ids = update.request_ids
        tokens = np.asarray(update.token_ids).tolist()
        steady, self._steady_rows = self._steady_rows, None
        rows: list[tuple] | None = None
        if multi:
            # Several tokens per sample: the general path, one delta per request.
            fast = False
            rows = None
            general: Any = zip(ids, np.asarray(update.sample_indices).tolist(), tokens)
            kept: dict[tuple[str, int], int] = {}
        elif (steady is not None and fast and not finishing and steady[0] == core.requests_epoch
                and steady[1] == ids):
            # The same common rows as the last step (no request added, aborted or
            # finished since, the same batch in the same order): their objects are
            # known, so the rows need no lookups and no checks of what kind they are.
            if steady_row_outputs(core, steady[2], tokens, now, outputs, changed):
                rows = steady[2]
            general: Any = ()
        else:
            # This step's common rows, kept for the next step if every row is one.
            rows = [] if fast and not finishing and not beams and not plp else None
            general = zip(ids, np.asarray(update.sample_indices).tolist(), tokens)
        for rid, si, tok in general:
            state = requests.get(rid)
            if state is None:
                continue
            samples = state.samples
            sample = samples[si]
            if multi:
                if sample.finish_reason is not None:
                    continue  # a stop string ended it at an earlier token of this step
                kept[(rid, si)] = kept.get((rid, si), 0) + 1
            token_ids = sample.token_ids
            token_ids.append(tok)
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            completion = sample.completion
            if sample.finish_reason is None:
                if (fast and len(samples) == 1 and rid not in finishing and not (beams and rid in beams)
                        and not (plp and rid in plp)):
                    # The common row: the text to stream and the delta output in one
                    # pass (SampleState.delta_output's fields, built here).
                    text = completion.append_streaming(tok) if completion is not None else ""
                    if text is not None:
                        outputs.append(common_row_output(rid, state.prompt, state.prompt_token_ids, sample,
                                                         token_ids, tok, text, m))
                        if rows is not None:
                            rows.append((rid, sample, token_ids, m, completion, state.prompt,
                                         state.prompt_token_ids))
                        continue
                    hit = completion.stop_string
                elif completion is not None:
                    hit = completion.append(tok)
                else:
                    hit = None
                if hit is not None:
                    sample.finish_reason, sample.stop_reason = "stop", hit
                    core.finish(rid, si, "stop")
            got = changed.get(rid)
            if got is None:
                changed[rid] = {si}
            else:
                got.add(si)
        if multi and extra_logprobs:
            for key, records in extra_logprobs.items():
                state = requests.get(key[0])
                n = kept.get(key, 0) - 1
                if state is None or n <= 0:
                    continue
                sample = state.samples[key[1]]
                if sample.logprobs is None:
                    continue
                for lp, rank, top in records[:n]:
                    entry = {sample.token_ids[len(sample.logprobs)]: Logprob(lp, rank=rank)}
                    for r, (alt, alp) in enumerate(top, start=1):
                        entry.setdefault(alt, Logprob(alp, rank=r))
                    sample.logprobs.append(entry)
                    sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + lp
        for rid, si, reason in zip(
            update.finished_request_ids, update.finished_sample_indices, update.finished_reasons
        ):
            state = requests.get(rid)
            if state is None:
                continue
            sample = state.samples[int(si)]
            if sample.finish_reason is None:
                sample.finish_reason = reason
                # A stop token (not EOS) is reported as the stop reason, as vLLM does.
                last = sample.token_ids[-1] if sample.token_ids else None
                if reason == "stop" and last in state.params.stop_token_ids:
                    sample.stop_reason = last
                if sample.completion is not None:
                    sample.completion.finish()
            changed.setdefault(rid, set()).add(int(si))

        for rid in beams_ended:
            # The search is over before max_tokens: no running beam can beat the
            # finished ones. Every block and slot of the W beams goes back.
            state = requests.get(rid)
            if state is not None and not state.finished:
                # Finished, not aborted: /metrics counts client aborts separately.
                for i in range(len(state.samples)):
                    core.finish(rid, i, "stop")
                for sample in state.samples:
                    sample.finish_reason = sample.finish_reason or "stop"
                changed.setdefault(rid, set())

        # Running requests report only what is new (delta outputs); a finished one
        # reports its whole result once.
        emit = self.emit_unfinished
        for rid, changed_samples in changed.items():
            state = requests.get(rid)
            if state is None:
                continue
            finished = state.finished
            if finished:
                state.metrics.finished_time = now
                core.retire(rid, state)
            elif not emit or rid in beams:
                continue  # beams are reported once, finished (their order changes every step)
            if beams and rid in beams:
                outputs.append(self.beam_output(rid, state, beams.pop(rid)))
                continue
            out_ = state.to_output() if finished else state.delta_output(changed_samples)
            if plp and rid in plp:
                out_.prompt_logprobs = PromptLogprobList(plp[rid][1])
                if finished:
                    del plp[rid]
            outputs.append(out_)
        if rows and len(rows) == len(ids):
            self._steady_rows = (core.requests_epoch, ids, rows)
        return outputs

    def beam_output(self, rid: str, state: RequestState, search: Any) -> RequestOutput:
        """A finished beam request's result: the search's best beams, decoded."""
        outs = []
        for i, (score, cum, toks, reason) in enumerate(search.results()):
            text = self.tokenizer.decode(toks, skip_special_tokens=True) if self.tokenizer is not None else ""
            outs.append(CompletionOutput(index=i, text=text, token_ids=list(toks), cumulative_logprob=cum,
                                         logprobs=None, finish_reason=reason))
        return RequestOutput(request_id=rid, prompt=state.prompt, prompt_token_ids=list(state.prompt_token_ids),
                             outputs=outs, finished=True, metrics=state.metrics)
