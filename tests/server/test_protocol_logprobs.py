"""Logprob bodies for tokens whose text collides: byte-level tokens that are half a
UTF-8 character all decode to U+FFFD, yet each must stay distinct.

Oracle: the GPT-2 byte-level alphabet (each vocabulary character is one byte), and
the token ids given (one entry per id, none lost).
"""

from __future__ import annotations

from hybridserve.outputs import Logprob
from hybridserve.server import protocol
from hybridserve.tokenizer import load_tokenizer


def test_colliding_byte_tokens_stay_distinct(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    tt = protocol.TokenText(tok)
    a, b, c = 200, 201, 128  # spelt "È", "É", "Ģ": bytes 0xC8, 0xC9, 0x80, each half a character
    assert tok.decode([a]) == tok.decode([b]) == tok.decode([c]) == "\ufffd"
    entry = {a: Logprob(-0.5, rank=1), b: Logprob(-1.0, rank=2), c: Logprob(-2.0, rank=3)}

    chat = protocol.chat_logprobs(tt, [a], [entry], 3)["content"][0]
    assert chat["bytes"] == [0xC8]
    assert [t["bytes"] for t in chat["top_logprobs"]] == [[0xC8], [0xC9], [0x80]]
    assert [t["logprob"] for t in chat["top_logprobs"]] == [-0.5, -1.0, -2.0]

    comp = protocol.completion_logprobs(tt, [a], [entry], 3, 0)
    top = comp["top_logprobs"][0]
    assert len(top) == 3  # one key per token id, none overwritten
    assert sorted(top.values()) == [-2.0, -1.0, -0.5]
    assert top["\ufffd"] == -0.5 and top[f"token_id:{b}"] == -1.0 and top[f"token_id:{c}"] == -2.0


def _echo_output(tt):
    """A finished request with prompt logprobs over a few slices, special tokens inside
    (skipped from the text), a None first entry and a -inf logprob."""
    import random

    from hybridserve.outputs import CompletionOutput, RequestOutput

    rng = random.Random(3)
    specials = sorted(tt.special_ids)
    n = protocol.LOGPROBS_SLICE * 3 + 17

    def entry(t):
        alts = rng.sample(range(250), 5)
        e = {t: Logprob(rng.uniform(-9, 0) if rng.random() > 0.02 else float("-inf"), rank=rng.randint(1, 9))}
        for r, a in enumerate(alts, start=1):
            e.setdefault(a, Logprob(-rng.random() * r, rank=r))
        return e

    prompt = [rng.randrange(250) for _ in range(n)]
    prompt[protocol.LOGPROBS_SLICE + 3] = specials[0] if specials else prompt[0]
    out_ids = [rng.randrange(250) for _ in range(40)] + ([specials[0]] if specials else [])
    plp = [None] + [entry(t) for t in prompt[1:]]
    c = CompletionOutput(0, "xyz", out_ids, -3.0, [entry(t) for t in out_ids], "length", None)
    return RequestOutput("r", None, prompt, [c], True, prompt_logprobs=plp)


def test_lazy_logprobs_encode_to_the_same_text_as_the_whole_body(tiny_dir):
    """A large body is built and encoded a slice of positions at a time: the pieces add
    up to exactly ``json.dumps`` of the body built whole (the oracle), across slice
    edges, with special tokens skipped from a position inside a slice, a None first
    entry, a -inf logprob, and both endpoints' block shapes."""
    import json

    from hybridserve.sampling import SamplingParams

    tt = protocol.TokenText(load_tokenizer(tiny_dir))
    out = _echo_output(tt)
    for skip in (True, False):
        params = SamplingParams(max_tokens=40, logprobs=5, skip_special_tokens=skip)
        whole = protocol.completion_body("id", "m", [out], tt, params, ["echo "])
        lazy = protocol.completion_body("id", "m", [out], tt, params, ["echo "], lazy=True)
        lazy["created"] = whole["created"]
        assert "".join(protocol.json_pieces(lazy)) == json.dumps(whole)
        chat_whole = protocol.chat_body("id", "m", out, tt, params)
        chat_lazy = protocol.chat_body("id", "m", out, tt, params, lazy=True)
        chat_lazy["created"] = chat_whole["created"]
        assert "".join(protocol.json_pieces(chat_lazy)) == json.dumps(chat_whole)


def test_sliced_encoding_hands_the_loop_back_between_slices(tiny_dir, monkeypatch):
    """In the "sliced-loop" mode, a large body is encoded on the event loop a slice at a
    time and every other task runs between slices (counted, not timed); the chunks add
    up to the whole body."""
    import asyncio
    import json

    from hybridserve.sampling import SamplingParams
    from hybridserve.server import app as app_mod
    from hybridserve.server import large_bodies

    monkeypatch.setattr(large_bodies, "LARGE_BODY_MODE", "sliced-loop")
    monkeypatch.setattr(large_bodies, "LARGE_BODY_SLICE_S", 0.0)  # yield at every slice's end
    monkeypatch.setattr(large_bodies, "LARGE_BODY_CHUNK", 4096)
    tt = protocol.TokenText(load_tokenizer(tiny_dir))
    out = _echo_output(tt)
    params = SamplingParams(max_tokens=40, logprobs=5)
    whole = protocol.completion_body("id", "m", [out], tt, params, ["echo "])
    lazy = protocol.completion_body("id", "m", [out], tt, params, ["echo "], lazy=True)
    lazy["created"] = whole["created"]

    async def run():
        ticks, done = [0], [False]

        async def neighbour():
            while not done[0]:
                ticks[0] += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(neighbour())
        await asyncio.sleep(0)
        start = ticks[0]
        chunks = await app_mod._encode_sliced(None, lazy)
        done[0] = True
        await t
        return chunks, ticks[0] - start

    chunks, ticks = asyncio.run(run())
    assert b"".join(chunks) == json.dumps(whole).encode()
    positions = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
    assert ticks >= positions // protocol.LOGPROBS_SLICE  # the neighbour ran between slices
    assert len(chunks) > 2


def test_sliced_thread_build_shortens_the_switch_interval_and_restores_it(tiny_dir, monkeypatch):
    """On the pool ("sliced-thread"), the GIL's switch interval is short while the body is
    built (threads waiting for the GIL get it sooner) and back to what it was after,
    also when the build fails; the chunks add up to the whole body."""
    import asyncio
    import json
    import sys

    from hybridserve.sampling import SamplingParams
    from hybridserve.server import app as app_mod
    from hybridserve.server import large_bodies

    monkeypatch.setattr(large_bodies, "LARGE_BODY_MODE", "sliced-thread")
    tt = protocol.TokenText(load_tokenizer(tiny_dir))
    out = _echo_output(tt)
    params = SamplingParams(max_tokens=40, logprobs=5)
    whole = protocol.completion_body("id", "m", [out], tt, params, ["echo "])
    lazy = protocol.completion_body("id", "m", [out], tt, params, ["echo "], lazy=True)
    lazy["created"] = whole["created"]
    seen: list[float] = []
    real = protocol.json_pieces

    def watched(obj):
        for p in real(obj):
            seen.append(sys.getswitchinterval())
            yield p

    class Engine:
        async def run_off_engine(self, fn):
            return await asyncio.to_thread(fn)

    class Request:
        app = {app_mod.ENGINE_KEY: Engine()}

    before = sys.getswitchinterval()
    monkeypatch.setattr(protocol, "json_pieces", watched)
    chunks = asyncio.run(app_mod._encode_sliced(Request(), lazy))
    assert b"".join(chunks) == json.dumps(whole).encode()
    assert seen and max(seen) == min(large_bodies.LARGE_BODY_SWITCH_S, before)
    assert sys.getswitchinterval() == before

    def broken(obj):
        yield "{"
        raise RuntimeError("boom")

    monkeypatch.setattr(protocol, "json_pieces", broken)
    try:
        asyncio.run(app_mod._encode_sliced(Request(), lazy))
    except RuntimeError:
        pass
    else:
        raise AssertionError("the build's error was lost")
    assert sys.getswitchinterval() == before
