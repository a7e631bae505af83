"""The steady-batch pass over a step's common rows (``engine.common_rows.steady_row_outputs``):
a decode batch that repeats reuses the last step's per-row objects instead of looking
each request up. Checked under churn that could leave those objects stale: a request
aborted and re-added under the same id (the same string object, so the batch's id list
compares equal), a long prompt whose prefill ends while the others decode (the batch
grows with no request added that step), stop strings ending rows mid-batch, and
aborts.

The oracle is the scripted text (the tiny checkpoints' tokenizer is byte-level: token b
is byte b): per request incarnation, the concatenated delta texts and tokens plus the
final output must be the script's bytes up to the stop string, with one delta per
running step, no matter which pass produced them.
"""

from __future__ import annotations

from collections import defaultdict

from hybridserve.engine.args import EngineArgs
from hybridserve.engine import output_processor
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.sampler import SamplerOutput
from hybridserve.sampling import SamplingParams


class _Scripted:
    """The next scripted token of each (request, sample); scripts can be replaced when
    a request id is reused."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[int]] = {}
        self.pos: dict[str, int] = defaultdict(int)

    def __call__(self, logits, rows):
        toks = []
        for row in rows:
            rid = row.key[0]
            toks.append(self.scripts[rid][self.pos[rid]])
            self.pos[rid] += 1
        return SamplerOutput(token_ids=toks)

    def release(self, key) -> None:
        pass


def _expected(text: str) -> str:
    return text.split("STOP")[0]


def test_steady_rows_stay_right_under_churn(tiny_dirs, monkeypatch):
    engine = LLMEngine(EngineArgs(model=str(tiny_dirs["test-a"]), dtype="float32", device="cpu",
                                  num_gpu_blocks=256, num_state_slots=16, max_num_seqs=8,
                                  max_num_batched_tokens=64, max_model_len=512))
    sampler = engine.sampler = _Scripted()
    steady_calls = [0]
    inner = output_processor.steady_row_outputs

    def counted(*a):
        steady_calls[0] += 1
        return inner(*a)

    monkeypatch.setattr(output_processor, "steady_row_outputs", counted)
    # Per incarnation (request id, n-th add): its outputs; which incarnation an id is.
    got: dict[tuple[str, int], list] = defaultdict(list)
    incarnation: dict[str, int] = defaultdict(int)
    texts: dict[tuple[str, int], str] = {}
    aborted: set[tuple[str, int]] = set()
    rid_a = "a"  # one string object, reused for every add of "a"

    def add(rid, text, prompt=(5, 6, 7)):
        incarnation[rid] += 1
        key = (rid, incarnation[rid])
        texts[key] = text
        sampler.scripts[rid] = list(text.encode("utf-8"))
        sampler.pos[rid] = 0
        engine.add_request(rid, list(prompt), SamplingParams(
            max_tokens=len(sampler.scripts[rid]), ignore_eos=True, stop=["STOP"], temperature=0))

    def step(n=1):
        for _ in range(n):
            running = {r for r in engine.requests}
            outs = engine.step()
            seen = [o.request_id for o in outs]
            assert len(seen) == len(set(seen)), "one output per request per step"
            for o in outs:
                got[(o.request_id, incarnation[o.request_id])].append(o)
            # Every decoding request reports each step (the prompt of each fits in one chunk
            # except the long one's, which reports from its first token).
            for r in running:
                key = (r, incarnation[r])
                if sampler.pos[r] > 0:
                    assert r in seen, f"{key} was scheduled and reported nothing"

    # A lone request, aborted and re-added under the same id object: the next batch's id
    # list equals the last one, only the epoch tells the rows apart.
    add(rid_a, "first incarnation of a, long enough to steady")
    step(6)
    engine.abort_request(rid_a)
    aborted.add((rid_a, 1))
    add(rid_a, "second: ünïcode → 日本 STOP hidden")
    step(4)
    # More requests; one with a stop string early, one with a prompt longer than a step's
    # token budget (its prefill ends while the others decode steadily).
    add("b", "bravo STOP")
    add("c", "charlie 🎉 delta echo foxtrot golf")
    step(5)
    add("long", "from a long prompt", prompt=[(3 * i) % 200 + 1 for i in range(150)])
    step(4)
    engine.abort_request("c")
    aborted.add(("c", 1))
    step(3)
    # Re-add "a" again while others run (same object again).
    engine.abort_request(rid_a)
    aborted.add((rid_a, 2))
    add(rid_a, "third a")
    while engine.has_unfinished_requests():
        step()

    assert steady_calls[0] >= 10, "the steady pass was not exercised"
    for key, text in texts.items():
        outs = got[key]
        if key in aborted:
            # What was streamed before the abort is a prefix of the script's text.
            streamed = "".join(o.outputs[0].text for o in outs)
            assert _expected(text).startswith(streamed), (key, streamed)
            assert all(o.delta and not o.finished for o in outs), key
            continue
        assert outs and outs[-1].finished and not outs[-1].delta, key
        deltas, final = outs[:-1], outs[-1].outputs[0]
        assert all(o.delta and not o.finished for o in deltas), key
        expected = _expected(text)
        assert final.text == expected, (key, final.text)
        want_tokens = list(text.encode("utf-8"))[:len(final.token_ids)]
        assert final.token_ids == want_tokens, key
        assert expected.encode("utf-8") == bytes(want_tokens[:len(expected.encode("utf-8"))])
        streamed_text = "".join(o.outputs[0].text for o in deltas)
        streamed_tokens = [t for o in deltas for t in o.outputs[0].token_ids]
        assert expected.startswith(streamed_text), (key, streamed_text)
        assert final.token_ids[:len(streamed_tokens)] == streamed_tokens, key
        if "STOP" not in text:
            # No stop string: every token streams as it comes, one per step.
            assert streamed_tokens == final.token_ids[:len(streamed_tokens)]
            assert [len(o.outputs[0].token_ids) for o in deltas] == [1] * len(deltas), key
            assert len(deltas) >= len(final.token_ids) - 1, key
