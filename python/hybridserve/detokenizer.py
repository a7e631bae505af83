"""Incremental detokenization and stop conditions, per sample.

Decoding one token at a time is wrong for byte-level and SentencePiece tokenizers: a
token can be half of a UTF-8 character (decoding it alone gives U+FFFD) and a token's
leading space can depend on the token before it. ``IncrementalDetokenizer`` therefore
decodes a short window of trailing tokens twice (without and with the new tokens) and
emits the difference, and holds text back while it ends in an incomplete character.

``StopChecker`` finds stop strings in the growing text; ``check_stop_token`` decides
the token-level finish (EOS, stop_token_ids, max_tokens); ``CompletionText`` ties the
three together for one completion and yields stream-safe deltas.
"""

from __future__ import annotations

from typing import Any, Sequence

from hybridserve.sampling import SamplingParams
from hybridserve.stop_strings import StopAutomaton

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded as left context for the first generated token (vLLM's
# INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET): enough for SentencePiece's leading-space
# rule and for byte-level merges across the prompt/output boundary.
_CONTEXT_TOKENS = 5

# The longest left-context tail the pending-bytes path decodes with each token (a
# context ending in more continuation bytes than this takes the two-decode path).
_MAX_TAIL_BYTES = 8

# One character is at most 4 UTF-8 bytes, so at most 4 byte-level tokens. When more
# pending tokens still decode to a trailing U+FFFD, the model produced invalid UTF-8
# (or U+FFFD itself): emit it rather than stall the stream forever.
_MAX_PENDING_TOKENS = 4


def _byte_level_backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when its decoding is pure
    byte-level BPE (one ``ByteLevel`` decoder, no clean-up of spaces), else None.

    There the text of a token sequence is the UTF-8 decoding of its tokens' bytes
    concatenated, so a token whose own bytes are complete UTF-8 text, decoded after
    text that ended on a character boundary, adds exactly its own text."""
    from tokenizers import Tokenizer, decoders

    backend = tokenizer if isinstance(tokenizer, Tokenizer) else getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend if isinstance(backend.decoder, decoders.ByteLevel) else None


# Per byte-level tokenizer (and skip_special_tokens): token id -> its text when that
# text stands alone (non-empty, no U+FFFD), else None. Keyed by id() with the
# tokenizer held, so the id is never reused; a server has one tokenizer.
_TOKEN_TEXT: dict[tuple[int, bool], tuple[Any, dict[int, str | None]]] = {}


def _token_texts(backend: Any, skip_special_tokens: bool) -> dict[int, str | None]:
    entry = _TOKEN_TEXT.get((id(backend), skip_special_tokens))
    if entry is None:
        entry = _TOKEN_TEXT[(id(backend), skip_special_tokens)] = (backend, {})
    return entry[1]


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's): printable character -> the byte it stands for.
    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to
    U+0100 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars.values():
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


# Per byte-level tokenizer and skip_special_tokens: token id -> the bytes the ByteLevel
# decoder turns it into; b"" for a special token that is skipped (the tokenizer drops
# it before decoding); None for any other added token (the tokenizer decodes those its
# own way) and for a token with a character outside the byte alphabet. Keyed by id()
# with the tokenizer held, as _TOKEN_TEXT.
_TOKEN_BYTES: dict[tuple[int, bool], tuple[Any, list[bytes | None]]] = {}


def _token_bytes(backend: Any, skip_special_tokens: bool) -> list[bytes | None]:
    entry = _TOKEN_BYTES.get((id(backend), skip_special_tokens))
    if entry is None:
        chars = _byte_level_chars()
        added = backend.get_added_tokens_decoder()
        table: list[bytes | None] = [None] * backend.get_vocab_size(with_added_tokens=True)
        for token, i in backend.get_vocab(with_added_tokens=False).items():
            if i in added or i >= len(table):
                continue
            try:
                table[i] = bytes([chars[c] for c in token])
            except KeyError:  # not a byte-level token: left to the tokenizer
                pass
        if skip_special_tokens:
            for i, tok in added.items():
                if tok.special and i < len(table):
                    table[i] = b""
        entry = _TOKEN_BYTES[(id(backend), skip_special_tokens)] = (backend, table)
    return entry[1]


class IncrementalDetokenizer:
    """Turns one sample's token ids into text, one token at a time.

    ``tokenizer`` is anything with ``decode(ids, skip_special_tokens=...)`` (a
    transformers tokenizer or a ``tokenizers.Tokenizer``). Each ``append`` decodes at
    most a few trailing tokens (O(window), not O(length)). The concatenation of all
    deltas plus ``flush()`` equals ``tokenizer.decode(output_ids)`` for text that is
    valid UTF-8; a delta never ends in half a character while more tokens may complete it.
    """

    __slots__ = ("tokenizer", "skip_special_tokens", "_decode_fn", "_ids", "_prefix_offset", "_read_offset",
                 "_emitted", "_texts", "_bytes", "_prefix_text", "_pending", "_tail", "_skip")

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
        keep_text: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A transformers fast tokenizer's decode is its Rust backend's plus Python
        # plumbing (3x the cost per call; this runs twice per generated token) and an
        # optional space clean-up: call the backend directly when there is no clean-up.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode_fn = backend.decode
        else:
            self._decode_fn = tokenizer.decode
        # Only the context window of the prompt is kept; the sample's own tokens are
        # needed from prefix_offset on.
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if prompt_token_ids else []
        self._ids: list[int] = context
        self._prefix_offset = 0          # start of the left-context window in _ids
        self._read_offset = len(context)  # first token whose text is not emitted yet
        # Emitted text as pieces: `str +=` on an attribute copies the whole string,
        # O(generated) per token; joined only when read. None (keep_text=False) when
        # the caller keeps the text itself (CompletionText: one list per sample to
        # grow and to touch each step, not two).
        self._emitted: list[str] | None = [] if keep_text else None
        # Byte-level BPE (Qwen's): a token that is whole text on its own, arriving when
        # nothing is pending, is its own delta (one dictionary lookup instead of two
        # decodes); anything else takes the two-decode path below.
        byte_level = _byte_level_backend(tokenizer)
        self._texts = _token_texts(byte_level, skip_special_tokens) if byte_level is not None else None
        # The same tokenizers' decode of a window of tokens is the UTF-8 decoding, with
        # U+FFFD for each maximal invalid subsequence (Rust's from_utf8_lossy; Python's
        # "replace" handler follows the same Unicode rule), of their bytes joined: done
        # here from a per-token byte table, a few times cheaper than a call into the
        # tokenizer. A window holding an added token that is not skipped goes to the
        # tokenizer.
        self._bytes = _token_bytes(byte_level, skip_special_tokens) if byte_level is not None else None
        # The text of the window before the read offset while the offsets stay put
        # (tokens pending: an incomplete character), so a pending step decodes once.
        self._prefix_text: str | None = None
        # Byte-level windows (the window's text is its tokens' bytes decoded with
        # U+FFFD for each maximal invalid subpart): the decoder is back at a character
        # boundary before any byte that is not a continuation byte, so the window's
        # text is the text of its bytes up to the left context's last such byte
        # followed by the text of the rest. The rest is ``_pending``: that tail of the
        # left context (``_tail`` bytes, ``_skip`` characters of text alone) and the
        # pending tokens' bytes; the difference of the two decodes below is then the
        # rest's text past ``_skip`` characters: one decode of a few bytes per token
        # instead of two window joins and decodes (a split character's every byte).
        # None: the two-decode path (a token outside the table, a long tail).
        self._pending: bytes | None = None
        self._tail = self._skip = 0
        self._set_context(context)

    def _set_context(self, window: list[int] | None, context: bytes | None = None) -> None:
        """The left context is now ``window``'s tokens (or the bytes ``context``) and
        nothing is pending: set ``_pending``, ``_tail`` and ``_skip`` for it."""
        table = self._bytes
        if context is None:
            if table is None:
                self._pending = None
                return
            n = len(table)
            try:
                context = b"".join([table[i] if i < n else b"" for i in window])
            except TypeError:  # an added token in the window
                self._pending = None
                return
        for k in range(1, min(len(context), _MAX_TAIL_BYTES) + 1):
            if context[-k] & 0xC0 != 0x80:  # not a continuation byte: a boundary before it
                tail = context[-k:]
                break
        else:
            if len(context) > _MAX_TAIL_BYTES:
                self._pending = None
                return
            tail = context  # short and all continuation bytes: the whole context
        self._pending = tail
        self._tail = len(tail)
        self._skip = len(tail.decode("utf-8", "replace"))

    @property
    def output_text(self) -> str:
        """All text emitted so far (the deltas joined)."""
        if self._emitted is None:
            raise RuntimeError("this detokenizer was made with keep_text=False: its caller keeps the text")
        if len(self._emitted) > 1:
            self._emitted[:] = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def _decode(self, ids: list[int]) -> str:
        table = self._bytes
        if table is not None:
            try:
                return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
            except (TypeError, IndexError):  # an added token (None) or an id past the table
                pass
        return self._decode_fn(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (may be "")."""
        token_id = int(token_id)
        texts = self._texts
        if texts is not None and self._read_offset == len(self._ids):
            text = texts.get(token_id, REPLACEMENT_CHAR)
            if text is REPLACEMENT_CHAR:  # not looked at yet
                text = self._decode([token_id])
                text = texts[token_id] = text if text and REPLACEMENT_CHAR not in text else None
            if text is not None:
                # What the two decodes below would give: the window is text that ended
                # on a character boundary, and this token's bytes are whole characters.
                # The window becomes this one token, as there.
                ids = self._ids
                ids.clear()
                ids.append(token_id)
                self._prefix_offset, self._read_offset = 0, 1
                self._prefix_text = None
                # The token's bytes are whole characters: a boundary at their end.
                self._pending, self._tail, self._skip = b"", 0, 0
                if self._emitted is not None:
                    self._emitted.append(text)
                return text
        pending, table = self._pending, self._bytes
        if pending is not None and table is not None:
            # An id past the tokenizer's vocabulary (a model's padded vocabulary) has
            # no token: the tokenizer's decode leaves it out, as its bytes b"" do.
            piece = table[token_id] if token_id < len(table) else b""
            if piece is not None:
                return self._append_pending(token_id, pending + piece)
            self._pending = None  # an added token: the tokenizer decodes this window
        self._ids.append(token_id)
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        if len(new_text) <= len(prefix_text) or (
            new_text.endswith(REPLACEMENT_CHAR) and pending < _MAX_PENDING_TOKENS
        ):
            self._prefix_text = prefix_text  # the offsets stay: the same window next time
            return ""
        self._prefix_text = None
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # The window only needs the tokens from _prefix_offset on: keep memory bounded.
        if self._prefix_offset > 0:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._set_context(self._ids)
        if self._emitted is not None:
            self._emitted.append(delta)
        return delta

    def _append_pending(self, token_id: int, pending: bytes) -> str:
        """:meth:`append`'s two-decode step from the context's tail and the pending
        bytes alone (see ``_pending``): the same delta."""
        ids = self._ids
        ids.append(token_id)
        text = pending.decode("utf-8", "replace")
        self._prefix_text = None
        skip = self._skip
        if len(text) <= skip or (text[-1] == REPLACEMENT_CHAR and len(ids) - self._read_offset < _MAX_PENDING_TOKENS):
            self._pending = pending
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(ids)
        if self._prefix_offset > 0:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        # The pending tokens are the next left context.
        self._set_context(None, pending[self._tail:])
        delta = text[skip:]
        if self._emitted is not None:
            self._emitted.append(delta)
        return delta

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character at the end of the
        generation, decoded with U+FFFD); call once when the sample finishes."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        self._prefix_text = None
        self._set_context(None, b"")  # an empty left context
        delta = new_text[len(prefix_text) :]
        if self._emitted is not None:
            self._emitted.append(delta)
        return delta


class StopChecker:
    """Finds the first stop string in a completion's growing text.

    One :class:`~hybridserve.stop_strings.StopAutomaton` reads each character once, so
    the cost per new character does not grow with the number of stop strings. Matches
    may straddle old and new text. When several stop strings end in the same new text,
    the one that starts earliest wins (ties: the first in ``stop``).

    The checker reads the text in order: pass the whole text each time, grown by the
    new characters (``check`` to look for stop strings, ``skip`` to read without
    matching, as before ``min_tokens``).
    """

    __slots__ = ("stop", "include", "automaton", "max_len", "_state", "_read")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False,
                 automaton: StopAutomaton | None = None) -> None:
        self.stop = [s for s in stop if s]
        self.include = include_stop_str_in_output
        self.automaton = automaton if automaton is not None else StopAutomaton(self.stop)
        self.max_len = self.automaton.max_len
        self._state = 0
        self._read = 0  # characters of the text read so far

    def _feed(self, text: str):
        if len(text) <= self._read:
            return None
        return self.feed(text[self._read:])

    def feed(self, new_text: str):
        """Read ``new_text`` (the characters after those read so far) and return the
        :class:`~hybridserve.stop_strings.StopMatch` of the earliest-starting stop string
        ending in it, or None. Its ``start`` is an absolute character offset. O(new text)."""
        if not self.stop or not new_text:
            self._read += len(new_text)
            return None
        self._state, match = self.automaton.feed(self._state, new_text, self._read)
        self._read += len(new_text)
        return match

    def held_back(self) -> int:
        """Trailing characters of the text read so far that could still grow into a stop
        string and so must not be streamed yet (0 when include_stop_str_in_output)."""
        if self.include or not self.stop:
            return 0
        return self.automaton.pending(self._state)

    def skip(self, text: str) -> None:
        """Read the characters of ``text`` not read yet without looking for a stop."""
        if self.stop:
            self._feed(text)

    def check(self, text: str) -> tuple[str | None, str]:
        """Look for a stop string that ends within the characters not read yet.

        Returns (the stop string, the text truncated before it, or after it when
        include_stop_str_in_output) or (None, text). Amortised O(new characters).
        """
        if not self.stop:
            return None, text
        match = self._feed(text)
        if match is None:
            return None, text
        end = match.start + len(match.text)
        return match.text, text[:end] if self.include else text[: match.start]

    def stream_safe_length(self, text: str, finished: bool) -> int:
        """How many leading characters of ``text`` (read by check/skip) may be streamed
        now: all when finished; otherwise all but the longest suffix that is a prefix of
        some stop string, which must not reach the client if the stop string completes.
        Text that cannot become a stop string is never held back."""
        if finished or self.include or not self.stop:
            return len(text)
        return max(0, min(len(text), self._read) - self.automaton.pending(self._state))


def check_stop_token(
    token_id: int, num_output_tokens: int, params: SamplingParams, eos_token_id: int | None
) -> tuple[str | None, int | None]:
    """Token-level finish after a completion's ``num_output_tokens``-th token ``token_id``.

    Returns (finish_reason, stop_reason): ("stop", None) for EOS (unless ignore_eos),
    ("stop", token_id) for a stop_token_id, ("length", None) at max_tokens, else
    (None, None). EOS and stop tokens count only once min_tokens is reached, and win
    over length when both apply to the same token.
    """
    if num_output_tokens >= params.min_tokens:
        if eos_token_id is not None and token_id == eos_token_id and not params.ignore_eos:
            return "stop", None
        if token_id in params.stop_token_ids:
            return "stop", token_id
    if num_output_tokens >= params.max_tokens:
        return "length", None
    return None, None


class CompletionText:
    """Text, stop strings and streaming for one completion.

    Per generated token call ``append(token_id)``; it returns the stop string when one
    ends the completion (then ``text`` is already truncated per
    include_stop_str_in_output). ``take_delta(finished)`` returns the text not yet
    streamed that is safe to stream; when ``finished`` it returns everything left.

    Cost per token is O(new text), not O(text so far) nor O(number of stop strings):
    the text is kept as pieces (joined only when ``text`` is read), the request's stop
    automaton reads each new character once (its state carries matches that straddle
    tokens), and the holdback is the automaton's pending prefix: only a tail that could
    still become a stop string waits.
    """

    __slots__ = ("detokenizer", "stops", "min_tokens", "num_tokens", "_parts", "_streamed", "_unstreamed",
                 "stop_string", "_plain")

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                  keep_text=False)
        self.stops = StopChecker(params.stop, params.include_stop_str_in_output, params.stop_automaton)
        # No stop strings: append_streaming neither looks for one nor holds text back,
        # and leaves the checker (whose read count only serves stop strings) alone.
        self._plain = not self.stops.stop
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self._parts: list[str] = []
        self._streamed = 0     # characters handed out by take_delta
        self._unstreamed = ""  # text[_streamed:] (bounded by the holdback + one step's text)
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _add(self, delta: str) -> None:
        self._parts.append(delta)
        self._unstreamed += delta

    def append(self, token_id: int) -> str | None:
        if self.stop_string is not None:
            raise RuntimeError("CompletionText.append after a stop string finished the completion")
        self.num_tokens += 1
        delta = self.detokenizer.append(token_id)
        if not delta:
            return None
        self._add(delta)
        # As vLLM: stop strings are not looked for before min_tokens (their text is
        # still read: a stop string may start before min_tokens and end after).
        match = self.stops.feed(delta)
        if match is None or self.num_tokens < self.min_tokens:
            return None
        # Truncate where the stop string starts (or ends, when it is kept). A match ends
        # in the new text and only a possible stop prefix stays unstreamed, so the cut
        # never reaches streamed text.
        end = match.start + (len(match.text) if self.stops.include else 0)
        full = self.text[:end]
        self._parts[:] = [full] if full else []
        self._unstreamed = full[self._streamed:]
        self.stop_string = match.text
        return match.text

    def append_streaming(self, token_id: int) -> str | None:
        """``append(token_id)`` then ``take_delta(False)``, for a completion that keeps
        running (the engine's common row, once per step): the text that is safe to
        stream now, or None when a stop string ended the completion (nothing is taken
        then: the finished output takes the rest)."""
        if not self._plain or self.stop_string is not None:
            if self.append(token_id) is not None:
                return None
            return self.take_delta(False)
        # No stop strings: nothing is looked for and nothing is held back, so the new
        # text streams at once (append, _add and take_delta in one call).
        self.num_tokens += 1
        delta = self.detokenizer.append(token_id)
        unstreamed = self._unstreamed
        if delta:
            self._parts.append(delta)
            if unstreamed:
                delta = unstreamed + delta
                self._unstreamed = ""
        elif unstreamed:
            delta = unstreamed
            self._unstreamed = ""
        else:
            return ""
        self._streamed += len(delta)
        return delta

    def finish(self) -> None:
        """Emit held-back bytes of an incomplete final character (no stop check)."""
        if self.stop_string is None:
            rest = self.detokenizer.flush()
            if rest:
                self._add(rest)

    def take_delta(self, finished: bool) -> str:
        held = 0 if finished or self.stop_string is not None else self.stops.held_back()
        end = len(self._unstreamed) - held
        if end <= 0:
            return ""
        delta = self._unstreamed[:end]
        self._unstreamed = self._unstreamed[end:]
        self._streamed += end
        return delta


__all__ = [
    "IncrementalDetokenizer",
    "StopChecker",
    "CompletionText",
    "check_stop_token",
    "REPLACEMENT_CHAR",
]
