"""The common row of a decode step: a running one-sample request that is not a beam,
wants no prompt logprobs and does not finish this step. Nearly every row of a steady
decode batch is one, so its delta output is built straight from the sample's fields
(what ``SampleState.delta_output`` would give) and, while the batch stays the same, the
engine walks the rows' objects kept from the last step (:func:`steady_row_outputs`)
instead of looking each request up again (see ``OutputProcessor.process``)."""

from __future__ import annotations

from typing import Any

from hybridserve.outputs import CompletionOutput, RequestOutput


def common_row_output(rid: str, prompt: Any, prompt_ids: list[int], sample: Any, token_ids: list[int],
                      tok: int, text: str, metrics: Any) -> RequestOutput:
    """The delta output of a common row whose newest token is ``tok`` (already appended
    to ``token_ids``) and whose new text is ``text``; marks the tokens as streamed."""
    n0 = sample.streamed_tokens
    n = len(token_ids)
    sample.streamed_tokens = n
    lps = sample.logprobs
    return RequestOutput(
        rid, prompt, prompt_ids,
        [CompletionOutput(sample.index, text, [tok] if n0 == n - 1 else token_ids[n0:],
                          sample.cumulative_logprob, lps[n0:] if lps is not None else None, None, None)],
        False, metrics, None, True)


def steady_row_outputs(scheduler: Any, rows: list[tuple], tokens: list[int], now: float,
                       outputs: list[RequestOutput], changed: dict[str, set[int]]) -> bool:
    """The common-row pass over a batch of known common rows (each has had a token
    before, so its first-token time is set): appends each row's token and delta output.
    A row that hits a stop string is finished in ``scheduler`` and recorded in
    ``changed`` for the engine's general pass. True when every row is still a common
    row after this step."""
    all_common = True
    for (rid, sample, token_ids, m, completion, prompt, prompt_ids), tok in zip(rows, tokens):
        token_ids.append(tok)
        m.last_token_time = now
        if sample.finish_reason is None:
            text = completion.append_streaming(tok) if completion is not None else ""
            if text is not None:
                outputs.append(common_row_output(rid, prompt, prompt_ids, sample, token_ids, tok, text, m))
                continue
            sample.finish_reason, sample.stop_reason = "stop", completion.stop_string
            scheduler.finish(rid, sample.index, "stop")
        all_common = False
        got = changed.get(rid)
        if got is None:
            changed[rid] = {sample.index}
        else:
            got.add(sample.index)
    return all_common
