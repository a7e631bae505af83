"""Incremental detokenization and stop conditions against brute-force oracles: the
tokenizer's own full decode, Python's str.find over the whole text, and vLLM's rules
for token-level stops written out as a table."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybridserve.detokenizer import (
    REPLACEMENT_CHAR,
    CompletionText,
    IncrementalDetokenizer,
    StopChecker,
    check_stop_token,
)
from hybridserve.sampling import SamplingParams

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "Stop here. END of story; the end.",
    "naïve café déjà vu",
]

TEXTS = [
    "hello world",
    "héllo wörld, ça va?",
    "emoji 😀🎉 and 世界 mixed with ascii",
    "🎉",
    "a  b\n\tc",
    "ÿ€𝄞 κόσμε",
]


def gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable-character map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


@pytest.fixture(scope="module")
def raw_tokenizer() -> Tokenizer:
    # A small vocabulary trained on mostly-ASCII text, so multi-byte characters are
    # split across several byte tokens.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_tokenizer(raw_tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, eos_token="<|endoftext|>")


def byte_token(tok, byte: int) -> int:
    return tok.get_vocab()[gpt2_byte_chars()[byte]]


def stream(tok, prompt_ids, output_ids, skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens)
    deltas = [d.append(t) for t in output_ids]
    return d, deltas


@pytest.mark.parametrize("which", ["hf", "raw"])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode_and_never_split_characters(which, text, request):
    tok = request.getfixturevalue("hf_tokenizer" if which == "hf" else "raw_tokenizer")
    encode = (lambda s: tok.encode(s).ids) if which == "raw" else (lambda s: tok.encode(s))
    prompt = encode("Stop here. ")
    out = encode(text)
    d, deltas = stream(tok, prompt, out)
    assert d.flush() == ""
    assert "".join(deltas) == d.output_text == tok.decode(out) == text
    for delta in deltas:
        assert REPLACEMENT_CHAR not in delta
    # Text is emitted as soon as it is complete: after i tokens the stream holds the
    # full decode of those tokens minus only a trailing incomplete character.
    for i in range(1, len(out) + 1):
        assert "".join(deltas[:i]) == tok.decode(out[:i]).rstrip(REPLACEMENT_CHAR)


def test_multibyte_characters_really_are_split(raw_tokenizer):
    # Guards the test above: it only means something if some characters span tokens.
    ids = raw_tokenizer.encode("😀世").ids
    assert len(ids) >= 4
    _, deltas = stream(raw_tokenizer, [], ids)
    assert deltas.count("") >= 2


def test_random_texts_round_trip(hf_tokenizer):
    rng = random.Random(0)
    alphabet = list("abc XYZ.,\n") + ["é", "ß", "😀", "世", "𝄞", "Ω"]
    for _ in range(30):
        prompt_text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 10)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 25)))
        out = hf_tokenizer.encode(text)
        _, deltas = stream(hf_tokenizer, hf_tokenizer.encode(prompt_text), out)
        assert "".join(deltas) == text
        assert all(REPLACEMENT_CHAR not in x for x in deltas)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(hf_tokenizer, skip):
    eos = hf_tokenizer.eos_token_id
    out = hf_tokenizer.encode("hello") + [eos] + hf_tokenizer.encode(" world")
    _, deltas = stream(hf_tokenizer, [], out, skip_special_tokens=skip)
    assert "".join(deltas) == hf_tokenizer.decode(out, skip_special_tokens=skip)
    assert ("<|endoftext|>" in "".join(deltas)) is not skip


def test_generation_ending_mid_character_is_flushed(raw_tokenizer):
    ids = raw_tokenizer.encode("ok 世").ids[:-1]  # drop the last byte of 世
    d, deltas = stream(raw_tokenizer, [], ids)
    assert "".join(deltas) == "ok "
    tail = d.flush()
    assert tail.endswith(REPLACEMENT_CHAR)
    assert "".join(deltas) + tail == raw_tokenizer.decode(ids)
    assert d.flush() == ""


def test_invalid_utf8_does_not_stall_the_stream(raw_tokenizer):
    # Lone continuation bytes can never complete a character: text must still come
    # out within 4 tokens, and everything decodes as the full decode does.
    bad = byte_token(raw_tokenizer, 0x80)
    ids = [bad] * 9 + raw_tokenizer.encode("ab").ids
    d, deltas = stream(raw_tokenizer, [], ids)
    run = 0
    for delta in deltas:
        run = 0 if delta else run + 1
        assert run < 4
    assert "".join(deltas) + d.flush() == raw_tokenizer.decode(ids)


# ---------------------------------------------------------------- stop strings
def brute_force_stop(chunks, stop, include):
    """Feed chunks one by one; at the first chunk after which any stop string occurs
    in the whole text, truncate at the earliest occurrence (ties: first in list)."""
    text = ""
    for chunk in chunks:
        text += chunk
        found = [(text.find(s), k, s) for k, s in enumerate(stop) if s in text]
        if found:
            idx, _, s = min(found)
            return s, text[: idx + len(s)] if include else text[:idx]
    return None, text


def test_stop_checker_matches_brute_force():
    rng = random.Random(1)
    for _ in range(400):
        text = "".join(rng.choice("abcab ") for _ in range(rng.randrange(0, 30)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 8)))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])] if text else []
        stop = ["".join(rng.choice("abc ") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 4))]
        include = rng.random() < 0.5
        checker = StopChecker(stop, include)
        got = (None, "")
        acc = ""
        for chunk in chunks:
            acc += chunk
            hit, truncated = checker.check(acc)
            got = (hit, truncated)
            if hit:
                break
        assert got == brute_force_stop(chunks, stop, include), (chunks, stop, include)


def test_stream_holdback_never_leaks_a_stop_string():
    rng = random.Random(2)
    for _ in range(200):
        text = "".join(rng.choice("xyz") for _ in range(rng.randrange(1, 25)))
        stop = ["".join(rng.choice("xyz") for _ in range(rng.randrange(2, 5)))]
        checker = StopChecker(stop, include_stop_str_in_output=False)
        acc, streamed, hit = "", "", None
        for ch in text:
            acc += ch
            hit, acc = checker.check(acc)
            end = checker.stream_safe_length(acc, finished=hit is not None)
            streamed += acc[len(streamed):max(end, len(streamed))]
            if hit:
                break
        if hit is None:
            streamed += acc[len(streamed):]
        assert streamed == brute_force_stop(list(text), stop, False)[1]
        for k in range(len(streamed)):
            assert stop[0] not in streamed[: k + 1]


def test_stop_checker_with_many_overlapping_stops_matches_brute_force():
    """Many stop strings that are prefixes, suffixes and infixes of each other (the
    cases where an automaton's failure and output links matter)."""
    rng = random.Random(3)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(0, 12)))) if len(text) > 1 else []
        chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])] if text else []
        stop = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 30))]
        include = rng.random() < 0.5
        checker = StopChecker(stop, include)
        got, acc = (None, ""), ""
        for chunk in chunks:
            acc += chunk
            got = checker.check(acc)
            if got[0]:
                break
        assert got == brute_force_stop(chunks, stop, include), (chunks, stop, include)


def _brute_force_pending(text, stop):
    """The longest suffix of text that is a prefix of some stop string."""
    return max((k for k in range(len(text) + 1) for s in stop if s.startswith(text[len(text) - k:])), default=0)


def test_stream_holdback_is_only_a_possible_stop_prefix():
    """Text is held back only while its tail could still grow into a stop string: a
    50-character stop string does not delay text that cannot start it."""
    rng = random.Random(4)
    for _ in range(300):
        text = "".join(rng.choice("xyz") for _ in range(rng.randrange(1, 30)))
        stop = ["".join(rng.choice("xyz") for _ in range(rng.randrange(2, 6))) for _ in range(rng.randrange(1, 4))]
        checker = StopChecker(stop)
        acc = ""
        for ch in text:
            acc += ch
            hit, acc = checker.check(acc)
            if hit:
                break
            assert checker.stream_safe_length(acc, finished=False) == len(acc) - _brute_force_pending(acc, stop)
    long_stop = StopChecker(["<" + "=" * 49])
    acc = ""
    for word in ["Hello", " world", ", no stop", " here <", "=="]:
        acc += word
        assert long_stop.check(acc) == (None, acc)
    # Everything before the "<==" that could start the stop string is released.
    assert long_stop.stream_safe_length(acc, finished=False) == len(acc) - 3


def test_stop_checker_cost_does_not_grow_with_the_number_of_stops():
    """One automaton reads each character once: 64 stop strings cost about what one
    does (a scan per string per token would cost 64x)."""
    import time as _time

    rng = random.Random(5)
    text = "".join(rng.choice("abcdefgh ") for _ in range(60_000))
    many = ["".join(rng.choice("abcdefgh") for _ in range(12)) + "#" for _ in range(64)]

    def run(stop):
        best = float("inf")
        for _ in range(3):
            checker = StopChecker(stop)
            acc = ""
            t0 = _time.perf_counter()
            for i in range(0, len(text), 4):  # ~a token at a time
                acc = text[: i + 4]
                checker.check(acc)
            best = min(best, _time.perf_counter() - t0)
        return best

    one, sixty_four = run(many[:1]), run(many)
    assert sixty_four < 3 * one, (one, sixty_four)


# ---------------------------------------------------------------- token stops
@pytest.mark.parametrize(
    "token,n_out,kw,want",
    [
        (7, 1, {}, (None, None)),
        (2, 1, {}, ("stop", None)),                        # EOS
        (2, 1, {"ignore_eos": True}, (None, None)),
        (5, 3, {"stop_token_ids": [5]}, ("stop", 5)),
        (5, 1, {"stop_token_ids": [5], "min_tokens": 2}, (None, None)),
        (2, 1, {"min_tokens": 2}, (None, None)),
        (2, 2, {"min_tokens": 2}, ("stop", None)),
        (7, 16, {}, ("length", None)),                     # default max_tokens=16
        (2, 4, {"max_tokens": 4}, ("stop", None)),         # the model's stop wins over length
        (7, 4, {"max_tokens": 4, "ignore_eos": True}, ("length", None)),
    ],
)
def test_check_stop_token(token, n_out, kw, want):
    assert check_stop_token(token, n_out, SamplingParams(**kw), eos_token_id=2) == want


# ---------------------------------------------------------------- CompletionText
@pytest.mark.parametrize("include", [False, True])
def test_completion_text_stops_and_streams(hf_tokenizer, include):
    params = SamplingParams(stop=["END", "never"], include_stop_str_in_output=include)
    out = hf_tokenizer.encode("the quick fox END of story")
    ct = CompletionText(hf_tokenizer, hf_tokenizer.encode("Stop here."), params)
    streamed = ""
    hit = None
    for t in out:
        hit = ct.append(t)
        streamed += ct.take_delta(finished=hit is not None)
        if hit:
            break
    assert hit == "END"
    expected = "the quick fox END" if include else "the quick fox "
    assert ct.text == streamed == expected
    with pytest.raises(RuntimeError):
        ct.append(out[0])


@pytest.mark.parametrize("stop", [[], ["END", "é"], ["the"]])
@pytest.mark.parametrize("min_tokens", [0, 4])
def test_append_streaming_is_append_then_take_delta(hf_tokenizer, stop, min_tokens):
    """The engine's one call per running row gives what ``append`` followed by
    ``take_delta(False)`` gives (the two-call path is the oracle): the same text at
    every token, None exactly where a stop string ends the completion, and the same
    state after it (text, what a later take_delta and the final flush return). Some
    tokens are appended without taking (an engine that does not emit every step), so
    text waits unstreamed; random ids include split characters and invalid bytes."""
    rng = random.Random(len(stop) * 10 + min_tokens)
    vocab = hf_tokenizer.backend_tokenizer.get_vocab_size()
    params = SamplingParams(stop=stop, min_tokens=min_tokens)
    sequences = [hf_tokenizer.encode(t) for t in TEXTS + CORPUS]
    sequences += [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(40)]
    hits = 0
    for ids in sequences:
        one = CompletionText(hf_tokenizer, [5, 6], params)
        two = CompletionText(hf_tokenizer, [5, 6], params)
        for t in ids:
            if rng.random() < 0.2:  # not emitted this step
                assert one.append(t) == two.append(t)
            else:
                got = one.append_streaming(t)
                hit = two.append(t)
                assert got == (None if hit is not None else two.take_delta(False))
            assert one.text == two.text and one.stop_string == two.stop_string
            if one.stop_string is not None:
                hits += 1
                break
        one.finish()
        two.finish()
        assert one.take_delta(True) == two.take_delta(True)
        assert one.text == two.text
    if stop:
        assert hits > 0


def test_completion_text_min_tokens_defers_stop_strings(hf_tokenizer):
    out = hf_tokenizer.encode("END then END")
    first_end_tokens = len(hf_tokenizer.encode("END"))
    params = SamplingParams(stop=["END"], min_tokens=first_end_tokens + 1)
    ct = CompletionText(hf_tokenizer, [], params)
    hits = [ct.append(t) for t in out]
    assert hits[-1] == "END" and all(h is None for h in hits[:-1])
    assert ct.text == "END then "


def test_completion_text_finish_flushes_partial_character(raw_tokenizer):
    ids = raw_tokenizer.encode("hi 😀").ids[:-2]
    ct = CompletionText(raw_tokenizer, [], SamplingParams(stop=["zzz"]))
    streamed = ""
    for t in ids:
        assert ct.append(t) is None
        streamed += ct.take_delta(finished=False)
    # "hi " cannot start "zzz": all of it streams; the half emoji is held back.
    assert streamed == "hi "
    ct.finish()
    streamed += ct.take_delta(True)
    assert streamed == ct.text == raw_tokenizer.decode(ids)


def test_sentencepiece_style_leading_space_uses_prompt_context():
    # Metaspace ("▁word") decoders drop the leading space of the first token decoded:
    # the first generated token's space only survives with the prompt as left context.
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        CORPUS * 20, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    )
    ids = tok.encode("hello world the fox").ids
    for split in range(1, len(ids)):
        _, deltas = stream(tok, ids[:split], ids[split:])
        assert tok.decode(ids[:split]) + "".join(deltas) == tok.decode(ids)


def test_a_tokenizer_with_space_clean_up_is_decoded_through_its_own_decode(raw_tokenizer):
    """The detokenizer calls a fast tokenizer's Rust backend directly, except when the
    tokenizer cleans up spaces after decoding (the backend does not): then its own
    ``decode``, so the stream still equals it."""
    tok = PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, eos_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=True)
    out = tok.encode("Hello , world . It 's done .")
    d, deltas = stream(tok, tok.encode("Stop here. "), out)
    d.flush()
    assert d._decode_fn == tok.decode
    assert "".join(deltas) == d.output_text == tok.decode(out)
    # Without the clean-up the backend is used, and gives the same text.
    plain = PreTrainedTokenizerFast(tokenizer_object=raw_tokenizer, eos_token="<|endoftext|>",
                                    clean_up_tokenization_spaces=False)
    d2, deltas2 = stream(plain, plain.encode("Stop here. "), out)
    d2.flush()
    assert d2._decode_fn == plain.backend_tokenizer.decode
    assert "".join(deltas2) == plain.decode(out)


@pytest.mark.parametrize("which", ["hf", "raw"])
@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_fast_path_gives_the_two_decode_deltas(which, skip, request):
    """A byte-level tokenizer's token that is whole text on its own is emitted from a
    per-token table (no decode), and a pending window's prefix text is kept while the
    offsets stay; every delta, and the flush, must be the ones the plain two-decode
    algorithm gives. Random ids over the whole vocabulary (lone continuation
    bytes, truncated characters, special tokens) and real text, from several
    prompts."""
    tok = request.getfixturevalue("hf_tokenizer" if which == "hf" else "raw_tokenizer")
    raw = tok if which == "raw" else tok.backend_tokenizer
    vocab = raw.get_vocab_size()
    encode = (lambda s: tok.encode(s).ids) if which == "raw" else (lambda s: tok.encode(s))
    rng = random.Random(5)
    fast_hits = 0
    sequences = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(60)]
    sequences += [encode(t) for t in TEXTS + CORPUS]
    for ids in sequences:
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        fast = IncrementalDetokenizer(tok, prompt, skip)
        slow = IncrementalDetokenizer(tok, prompt, skip)
        assert fast._texts is not None
        slow._texts = None  # the two-decode path only,
        slow._bytes = None  # each decode by the tokenizer itself
        for t in ids:
            before = fast._read_offset == len(fast._ids)
            slow._prefix_text = None  # and both decodes every time: the plain algorithm
            assert fast.append(t) == slow.append(t)
            fast_hits += before and fast._texts.get(t) is not None
        assert fast.flush() == slow.flush()
        assert fast.output_text == slow.output_text
    assert fast_hits > 100


def _tokenizer(which, request, tmp_path):
    """The tokenizer under test and its backend ``tokenizers.Tokenizer``: the HF one, the
    raw one, or the bench checkpoint's byte-level one (one token per byte)."""
    if which == "bench":
        from hybridserve.model.tiny import write_tokenizer
        from hybridserve.tokenizer import load_tokenizer

        write_tokenizer(str(tmp_path), 272)
        tok = load_tokenizer(str(tmp_path))
    else:
        tok = request.getfixturevalue("hf_tokenizer" if which == "hf" else "raw_tokenizer")
    return tok, (tok if isinstance(tok, Tokenizer) else tok.backend_tokenizer)


@pytest.mark.parametrize("which", ["hf", "raw", "bench"])
@pytest.mark.parametrize("skip", [True, False])
def test_byte_table_decode_equals_the_tokenizers_decode(which, skip, request, tmp_path):
    """The detokenizer decodes a byte-level window from its per-token byte table
    (bytes joined, decoded with U+FFFD for invalid sequences); the tokenizer's own
    decode is the oracle. The bench checkpoint's tokenizer has one token per byte, so
    its random ids are arbitrary byte strings: lone continuation bytes, truncated and
    overlong sequences, surrogates, bytes F5-FF, and special tokens among them."""
    tok, raw = _tokenizer(which, request, tmp_path)
    vocab = raw.get_vocab_size()
    d = IncrementalDetokenizer(tok, [], skip)
    assert d._bytes is not None
    rng = random.Random(11)
    tricky = [0xC0, 0xC1, 0xC2, 0xE0, 0xED, 0xA0, 0xBF, 0x80, 0xF0, 0xF4, 0x90, 0x8F, 0xF5, 0xFF, 0x41]
    by_byte = {b[0]: i for i, b in enumerate(d._bytes) if b is not None and len(b) == 1}
    tried = 0
    for n in range(3000):
        if n % 2:
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        else:  # runs of the bytes where UTF-8's rules have their edges
            ids = [by_byte[rng.choice(tricky)] if rng.random() < 0.8 else rng.randrange(vocab)
                   for _ in range(rng.randrange(1, 9))]
        want = raw.decode(ids, skip_special_tokens=skip)
        assert d._decode(ids) == want, (ids, want)
        tried += "\ufffd" in want
    assert tried > 500  # invalid sequences were really among them


def test_tokenizers_without_a_byte_level_decoder_take_the_two_decode_path():
    from tokenizers import Tokenizer, decoders, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.Metaspace()
    assert IncrementalDetokenizer(tok, [], True)._texts is None


@pytest.mark.parametrize("which", ["hf", "raw", "bench"])
@pytest.mark.parametrize("skip", [True, False])
def test_pending_bytes_path_gives_the_two_decode_deltas(which, skip, request, tmp_path):
    """A split character whose left context is whole text is decoded from the pending
    tokens' bytes alone; every delta and the flush must be the plain two-decode
    algorithm's (the tokenizer's own decode of both windows, no tables). Runs of the
    bytes at UTF-8's edges (truncated and overlong sequences, surrogates, lone
    continuations, F5-FF), special tokens among them, from prompts that end
    mid-character or not, characters cut by special tokens, and ids past the
    tokenizer's vocabulary (which its decode leaves out)."""
    tok, raw = _tokenizer(which, request, tmp_path)
    vocab = raw.get_vocab_size(with_added_tokens=True)
    probe = IncrementalDetokenizer(tok, [], skip)
    by_byte = {b[0]: i for i, b in enumerate(probe._bytes) if b is not None and len(b) == 1}
    specials = [i for i in range(vocab) if probe._bytes[i] is None or probe._bytes[i] == b""]
    tricky = [0xC0, 0xC2, 0xE0, 0xE4, 0xED, 0xA0, 0xB8, 0xBF, 0x80, 0xF0, 0xF4, 0x90, 0x8F, 0xF5, 0xFF,
              0x41, 0x20, 0xEF, 0xBD]
    rng = random.Random(23)
    pending_steps = 0
    # Directed: a character cut by skipped special tokens (four pending tokens emit
    # its first bytes as U+FFFD) and completed after, so the next left context starts
    # with continuation bytes.
    directed = [[by_byte[lead]] + [sp] * 3 + [by_byte[c] for c in conts] + [by_byte[0x41]]
                for sp in specials[:2] for lead, conts in ((0xE4, (0xB8, 0xAD)), (0xF0, (0x9F, 0x98, 0x80)),
                                                           (0xC3, (0xA9,)))]
    for n in range(400 + len(directed)):
        def draw():
            r = rng.random()
            if r < 0.75:
                return by_byte[rng.choice(tricky)]
            if r < 0.8 and specials:
                return rng.choice(specials)
            if r < 0.85:  # past the vocabulary (a padded model vocabulary): no token
                return vocab + rng.randrange(20)
            return rng.randrange(vocab)
        prompt = [draw() for _ in range(rng.randrange(0, 7))]
        ids = directed[n - 400] if n >= 400 else [draw() for _ in range(rng.randrange(1, 30))]
        fast = IncrementalDetokenizer(tok, prompt, skip)
        slow = IncrementalDetokenizer(tok, prompt, skip)
        slow._texts = slow._bytes = slow._pending = None
        for t in ids:
            pending_steps += fast._pending is not None and fast._read_offset < len(fast._ids)
            slow._prefix_text = None
            assert fast.append(t) == slow.append(t), (prompt, ids)
        assert fast.flush() == slow.flush()
        assert fast.output_text == slow.output_text
    assert pending_steps > 500  # the path was really taken
