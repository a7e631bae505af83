"""Stop strings as one Aho–Corasick automaton per request.

A request may carry many stop strings; looking for each of them in every new piece of
text costs (number of stop strings) x (text + longest stop string) per token, which one
request with thousands of stop strings turns into seconds of engine time for everyone.
The automaton reads each character once, whatever the number of stop strings (amortised
O(1) per character: a failure-link walk never goes deeper than the characters read), and
its state says at every moment the longest suffix of the text read so far that is still a
prefix of some stop string: exactly the text a stream must hold back, and no more.

The automaton is immutable and shared by every completion of a request; a completion
keeps only its state (an int). No library on PyPI exposes a resumable state and its
depth (pyahocorasick matches whole strings), so it is written here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the text: it starts at ``start`` (an absolute character
    offset) and is ``stop[index]``."""

    start: int
    index: int
    text: str


class StopAutomaton:
    """Aho–Corasick over ``stops`` (a trie with failure links).

    Node 0 is the root (the empty string). ``_depth[n]`` is the length of node ``n``'s
    string; ``_word[n]`` the index in ``stops`` of the stop string equal to it (the
    first one when listed twice) or -1; ``_out[n]`` the node of the longest stop string
    that is a suffix of ``n``'s string, or -1.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        word = [-1]
        for i, s in enumerate(self.stops):
            node = 0
            for ch in s:
                nxt = goto[node].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][ch] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    word.append(-1)
                node = nxt
            if node and word[node] == -1:
                word[node] = i
        fail = [0] * len(goto)
        out = [-1] * len(goto)
        queue: deque[int] = deque(goto[0].values())
        while queue:  # breadth first: a node's failure target is shallower, so done
            node = queue.popleft()
            out[node] = node if word[node] >= 0 else out[fail[node]]
            for ch, nxt in goto[node].items():
                f = fail[node]
                while f and ch not in goto[f]:
                    f = fail[f]
                target = goto[f].get(ch, 0) if node else 0
                fail[nxt] = target if target != nxt else 0
                queue.append(nxt)
        self._goto = goto
        self._fail = fail
        self._depth = depth
        self._word = word
        self._out = out
        self.max_len = max((len(s) for s in self.stops), default=0)

    @property
    def num_nodes(self) -> int:
        return len(self._goto)

    def pending(self, state: int) -> int:
        """How many trailing characters of the text read so far could still grow into a
        stop string (the longest suffix that is a proper prefix of one, or a whole one)."""
        return self._depth[state]

    def feed(self, state: int, text: str, offset: int) -> tuple[int, StopMatch | None]:
        """Read ``text``, whose first character is at absolute offset ``offset``, from
        ``state``. Returns the new state and, of the stop strings that end within
        ``text``, the one that starts earliest (ties: the first in ``stops``), or None.

        Every match ending in ``text`` is considered: the longest stop string ending
        at a position is the earliest-starting one there, so one lookup per character
        finds the overall earliest start.
        """
        goto, fail, out, depth, word = self._goto, self._fail, self._out, self._depth, self._word
        best: tuple[int, int] | None = None
        for i, ch in enumerate(text):
            nxt = goto[state].get(ch)
            while nxt is None and state:
                state = fail[state]
                nxt = goto[state].get(ch)
            state = nxt or 0
            o = out[state]
            if o >= 0:
                cand = (offset + i + 1 - depth[o], word[o])
                if best is None or cand < best:
                    best = cand
        if best is None:
            return state, None
        return state, StopMatch(best[0], best[1], self.stops[best[1]])


__all__ = ["StopAutomaton", "StopMatch"]
