"""Stop strings: what many of them cost per token, and what they cost a neighbour.

1. Matching, per generated token (4 characters at a time over 20,000 characters of
   text), one automaton over all stop strings (``hybridserve.detokenizer.StopChecker``)
   against the scan the server did before issue 21 (each stop string searched for in
   the new text plus its own length - 1 of the old), for 1, 64 and 1,000 stop strings
   of 12 characters and for the server's limit (64 of 256 characters). Both run
   alternately, 5 repeats, medians.
2. A live server (tiny test model): the median inter-token latency of one streamed
   200-token request next to 4 concurrent loops of 50-token requests without stop
   strings, and next to the same loops with 64 stop strings of 256 characters each
   (the server's limits), alternately, medians of 3 rounds (the issue's bound: the
   second within 1.2x of the first).

    python benches/stop_strings.py
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import threading
import time

import torch

from hybridserve.detokenizer import StopChecker


def old_scan(stops: list[str]):
    """The pre-issue-21 check: a find per stop string per new piece of text."""

    def check(text: str, num_new: int):
        best = None
        for s in stops:
            idx = text.find(s, max(0, len(text) - num_new - len(s) + 1))
            if idx != -1 and (best is None or idx < best):
                best = idx
        return best

    return check


def bench_matching() -> None:
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(20_000))
    cases = [(1, 12), (64, 12), (1000, 12), (64, 256)]
    print("| stop strings x chars | automaton (us/token) | per-string scan (us/token) | scan / automaton |")
    print("|---|---|---|---|")
    for n, length in cases:
        stops = ["".join(rng.choice("abcdefgh") for _ in range(length - 1)) + "#" for _ in range(n)]
        auto_t, scan_t = [], []
        for _ in range(5):
            checker = StopChecker(stops, automaton=None)
            t0 = time.perf_counter()
            for i in range(4, len(text) + 1, 4):
                checker.check(text[:i])
            auto_t.append(time.perf_counter() - t0)
            scan = old_scan(stops)
            t0 = time.perf_counter()
            for i in range(4, len(text) + 1, 4):
                scan(text[:i], 4)
            scan_t.append(time.perf_counter() - t0)
        tokens = len(text) // 4
        a, s = statistics.median(auto_t) / tokens * 1e6, statistics.median(scan_t) / tokens * 1e6
        print(f"| {n} x {length} | {a:.2f} | {s:.2f} | {s / a:.1f}x |")


def bench_neighbour() -> None:
    sys.path.insert(0, "tests/server")
    from conftest import LiveServer  # the test suite's in-process live server

    from hybridserve.model.tiny import write_tiny_checkpoint

    d = write_tiny_checkpoint(tempfile.mkdtemp() + "/m", preset="test-a", seed=5)
    live = LiveServer(d)
    rng = random.Random(1)
    stops = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(256)) for _ in range(64)]

    def neighbour_itl() -> float:
        conn = live.connect()
        conn.request("POST", "/v1/completions", body=json.dumps({
            "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        times = []
        while True:
            line = resp.readline()
            if not line or line.startswith(b"data: [DONE]"):
                break
            if line.startswith(b"data: "):
                times.append(time.perf_counter())
        conn.close()
        gaps = [b - a for a, b in zip(times, times[1:])]
        return statistics.median(gaps)

    def heavy(stop_event: threading.Event, with_stops: bool) -> None:
        body = {"prompt": [8, 9], "max_tokens": 50, "ignore_eos": True, **({"stop": stops} if with_stops else {})}
        while not stop_event.is_set():
            assert live.post("/v1/completions", body).status_code == 200

    def beside(with_stops: bool) -> float:
        ev = threading.Event()
        threads = [threading.Thread(target=heavy, args=(ev, with_stops)) for _ in range(4)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        try:
            return neighbour_itl()
        finally:
            ev.set()
            for t in threads:
                t.join()

    plain, stopped = [], []
    neighbour_itl()  # warm-up
    for _ in range(3):
        plain.append(beside(False))
        stopped.append(beside(True))
    live.stop()
    a, b = statistics.median(plain), statistics.median(stopped)
    print(f"neighbour median ITL beside 4 request loops: without stop strings {a * 1e3:.2f} ms, with 64 stop "
          f"strings x 256 chars each {b * 1e3:.2f} ms, ratio {b / a:.2f}")


if __name__ == "__main__":
    torch.set_num_threads(2)
    print(f"torch threads {torch.get_num_threads()}")
    bench_matching()
    bench_neighbour()
