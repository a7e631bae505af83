"""Incremental outputs: a running request reports only what is new each step (tokens,
their logprobs, and text safe to stream), the finished one its whole result once.

The oracle is the text itself: a scripted sampler makes the engine generate the UTF-8
bytes of known strings (the tiny checkpoints' tokenizer is byte-level: token b is byte
b), so the expected text, its truncation at a stop string and its multi-byte
characters are known without running our own code. Real sampling (n > 1, logprobs)
is checked against the same requests run offline, where only the whole result exists.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.beam_search import BeamSearchParams
from hybridserve.outputs import DeltaCursor
from hybridserve.detokenizer import REPLACEMENT_CHAR
from hybridserve.sampler import SamplerOutput
from hybridserve.sampling import SamplingParams


def _engine(model_dir, **kw):
    args = dict(dtype="float32", device="cpu", num_gpu_blocks=256, num_state_slots=16, max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=512)
    args.update(kw)
    return LLMEngine(EngineArgs(model=str(model_dir), **args))


class ScriptedSampler:
    """Returns the scripted next token of each (request, sample) key."""

    def __init__(self, scripts: dict[tuple[str, int], list[int]]) -> None:
        self.scripts = scripts
        self.pos: dict[tuple[str, int], int] = defaultdict(int)

    def __call__(self, logits, rows):
        toks = []
        for row in rows:
            for key in (row.keys if row.keys is not None else [row.key]):
                toks.append(self.scripts[key][self.pos[key]])
                self.pos[key] += 1
        return SamplerOutput(token_ids=toks)

    def release(self, key) -> None:
        pass


def _collect(engine):
    """Steps to the end; per request, its outputs in order."""
    outs = defaultdict(list)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


TEXTS = [
    "héllo wörld → 日本語 and 🎉 fin",        # 2-, 3- and 4-byte characters
    "naïve café STOP never shown",          # a stop string
    "ab STO STOP€",                         # a stop-string prefix that is not one, then one
]


def test_text_deltas_split_nowhere_and_hold_back_stop_strings(tiny_dirs):
    engine = _engine(tiny_dirs["test-a"])
    scripts = {}
    for i, text in enumerate(TEXTS):
        scripts[(f"r{i}", 0)] = list(text.encode("utf-8"))
        engine.add_request(f"r{i}", [5, 6, 7], SamplingParams(
            max_tokens=len(scripts[(f"r{i}", 0)]), ignore_eos=True, stop=["STOP"], temperature=0))
    engine.sampler = ScriptedSampler(scripts)
    outs = _collect(engine)
    for i, text in enumerate(TEXTS):
        expected = text.split("STOP")[0]
        seq = outs[f"r{i}"]
        assert [o.finished for o in seq] == [False] * (len(seq) - 1) + [True]
        assert all(o.delta for o in seq[:-1]) and not seq[-1].delta
        final = seq[-1].outputs[0]
        assert final.text == expected
        deltas = [o.outputs[0] for o in seq[:-1]]
        # One new token per running step (never the history), no half characters.
        assert all(len(d.token_ids) == 1 for d in deltas)
        assert not any(REPLACEMENT_CHAR in d.text for d in deltas)
        # Every prefix of what was streamed is a prefix of the final text (nothing
        # streamed is ever taken back by a stop string).
        so_far = ""
        for d in deltas:
            so_far += d.text
            assert expected.startswith(so_far)
        cursor = DeltaCursor()
        streamed = "".join(cursor.new_part(o.outputs[0], o.delta)[0] for o in seq)
        assert streamed == expected
        streamed_ids = []
        cur = DeltaCursor()
        for o in seq:
            streamed_ids += cur.new_part(o.outputs[0], o.delta)[1]
        assert streamed_ids == final.token_ids
    # A multi-byte character arriving over several steps shows up as steps with a new
    # token and no text (held until it is complete), then the whole character.
    r0 = [o.outputs[0] for o in outs["r0"][:-1]]
    assert any(d.token_ids and not d.text for d in r0)
    assert "".join(d.text for d in r0).startswith("héllo wörld → 日本語")
    # The stop-string request never streamed any of it, nor what followed.
    assert "STOP" not in "".join(o.outputs[0].text for o in outs["r1"])
    st = engine.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0


def test_n_samples_report_only_changed_samples_and_finish_whole(tiny_dirs):
    engine = _engine(tiny_dirs["test-a"])
    a, b = "short é", "a longer one ✓ here"
    scripts = {("r", 0): list(a.encode()), ("r", 1): list(b.encode())}
    # Both samples run to max_tokens of the longer script; sample 0 stops on "é".
    engine.add_request("r", [9, 8, 7, 6], SamplingParams(n=2, max_tokens=len(scripts[("r", 1)]),
                                                          ignore_eos=True, stop=["é"], temperature=0))
    scripts[("r", 0)] += [ord("x")] * 64
    engine.sampler = ScriptedSampler(scripts)
    seq = _collect(engine)["r"]
    final = seq[-1]
    assert final.finished and not final.delta
    assert [c.text for c in final.outputs] == ["short ", b]
    cursor = DeltaCursor()
    texts, ids = defaultdict(str), defaultdict(list)
    finished_in_delta = set()
    for o in seq:
        for c in o.outputs:
            if c.index in finished_in_delta:
                continue
            t, toks, _ = cursor.new_part(c, o.delta)
            texts[c.index] += t
            ids[c.index] += toks
            if o.delta and c.finish_reason is not None:
                finished_in_delta.add(c.index)
    assert [texts[0], texts[1]] == [c.text for c in final.outputs]
    assert [ids[0], ids[1]] == [c.token_ids for c in final.outputs]
    # Sample 0 finished in a delta; the deltas after it hold sample 1 alone.
    assert finished_in_delta == {0}
    done_at = next(j for j, o in enumerate(seq) if any(c.index == 0 and c.finish_reason for c in o.outputs))
    assert done_at < len(seq) - 2
    assert all([c.index for c in o.outputs] == [1] for o in seq[done_at + 1:-1])


def test_deltas_with_real_sampling_match_the_offline_result(tiny_dirs):
    params = [SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=14, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.8, seed=5, max_tokens=9, stop=["a"], logprobs=0)]
    prompts = [[11, 12, 13, 14], [40, 41, 42]]
    offline = _engine(tiny_dirs["test-a"])
    offline.emit_unfinished = False
    streaming = _engine(tiny_dirs["test-a"])
    for eng in (offline, streaming):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(f"q{i}", p, sp)
    want = {rid: seq[-1] for rid, seq in _collect(offline).items()}
    got = _collect(streaming)
    for rid, seq in got.items():
        final = seq[-1]
        assert [c.token_ids for c in final.outputs] == [c.token_ids for c in want[rid].outputs]
        assert [c.text for c in final.outputs] == [c.text for c in want[rid].outputs]
        cursor = DeltaCursor()
        ids, lps, texts = defaultdict(list), defaultdict(list), defaultdict(str)
        for o in seq:
            for c in o.outputs:
                t, toks, lp = cursor.new_part(c, o.delta)
                texts[c.index] += t
                ids[c.index] += toks
                lps[c.index] += lp
        for c in final.outputs:
            assert ids[c.index] == c.token_ids and texts[c.index] == c.text
            assert [sorted(e) for e in lps[c.index]] == [sorted(e) for e in c.logprobs]


def test_beam_requests_report_once_finished(tiny_dirs):
    engine = _engine(tiny_dirs["test-a"])
    engine.add_request("b", [3, 4, 5, 6], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    seq = _collect(engine)["b"]
    assert len(seq) == 1 and seq[0].finished and not seq[0].delta
    assert len(seq[0].outputs) == 3 and all(len(c.token_ids) == 6 for c in seq[0].outputs)


def test_async_engine_streams_deltas(tiny_dirs):
    engine = _engine(tiny_dirs["test-a"])
    text = "streamed ✓ text STOP x"
    engine.sampler = ScriptedSampler({("s", 0): list(text.encode())})
    aengine = AsyncEngine(engine)

    async def main():
        stream = await aengine.generate("s", [1, 2, 3], SamplingParams(
            max_tokens=len(text.encode()), ignore_eos=True, stop=["STOP"], temperature=0))
        seen = []
        try:
            async for out in stream:
                seen.append(out)
        finally:
            stream.close()
        return seen

    try:
        seen = asyncio.run(main())
    finally:
        aengine.shutdown()
    assert seen[-1].finished and seen[-1].outputs[0].text == "streamed ✓ text "
    assert all(o.delta and len(o.outputs[0].token_ids) <= 1 for o in seen[:-1])
    cursor = DeltaCursor()
    assert "".join(cursor.new_part(o.outputs[0], o.delta)[0] for o in seen) == "streamed ✓ text "
