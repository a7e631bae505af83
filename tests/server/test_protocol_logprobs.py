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
