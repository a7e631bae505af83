"""How long a large response body stalls the other streams on the server's event loop.

One in-process server on the tiny model (its config's max_position_embeddings raised so
a 32K-token prompt fits). A neighbour streams tokens while one client asks for a
32,768-token prompt echoed with 20 logprobs per token (tens of MB of JSON). Measured
over that request's lifetime, for each way of building the body
(``server.app.LARGE_BODY_MODE``: "loop", "thread", "sliced-thread", "sliced-loop"),
round-robin in one process:

* loop lag: the longest the event loop was late for a 1 ms timer (what every stream on
  it waits, beyond the engine);
* neighbour gap: the longest gap between two of the neighbour's chunks (includes the
  engine's prefill steps of the big prompt, the same in both modes);
* gc pause: the longest cyclic-collector pause (it holds the GIL: every thread waits),
  what is left of the loop's lag once the body is built off it.

    python benches/echo_stall.py [--tokens 32768] [--logprobs 20] [--reps 2] [--modes loop,thread,...]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path


def _tiny(root: Path, max_len: int) -> str:
    from hybridserve.model.tiny import write_tiny_checkpoint

    d = write_tiny_checkpoint(root / "m", preset="test-a", seed=5)
    cfg_path = Path(d) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    for c in (cfg, cfg.get("text_config") or {}):
        if "max_position_embeddings" in c:
            c["max_position_embeddings"] = max_len
    cfg_path.write_text(json.dumps(cfg))
    return str(d)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--logprobs", type=int, default=20)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--modes", default="none,loop,thread,sliced-thread,sliced-loop",
                    help="'none': the neighbour alone for 3 s (the machine's floor in that round)")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)

    from aiohttp import web

    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.metrics import EngineMetrics
    from hybridserve.server import app as app_mod
    from hybridserve.server import large_bodies
    from hybridserve.server import protocol

    root = Path(tempfile.mkdtemp(prefix="echo-stall-"))
    max_len = args.tokens + 64
    model = _tiny(root, max_len)
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", device="cpu", num_pages=args.tokens // 16 + 200,
                                  max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=max_len,
                                  cpu_threads=1))
    aengine = AsyncEngine(engine)
    app = app_mod.build_app(aengine, EngineMetrics(), "tiny", app_mod.ServerSettings(max_request_body_bytes=64 << 20))

    lags: list[tuple[float, float]] = []
    # Collector pauses (they hold the GIL, so every thread, the loop's included, waits):
    # (end time, seconds, generation).
    gc_pauses: list[tuple[float, float, int]] = []
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_pauses.append((time.monotonic(), time.perf_counter() - gc_start[0], info["generation"]))

    gc.callbacks.append(on_gc)
    started = threading.Event()
    port_box: list[int] = []

    def serve() -> None:
        async def run() -> None:
            runner = web.AppRunner(app, **app_mod.runner_kwargs(app_mod.ServerSettings()))
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port_box.append(site._server.sockets[0].getsockname()[1])  # noqa: SLF001
            started.set()
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(0.001)
                lags.append((time.monotonic(), loop.time() - t - 0.001))

        asyncio.run(run())

    threading.Thread(target=serve, daemon=True).start()
    started.wait(60)
    port = port_box[0]

    def neighbour(stop: threading.Event, arrivals: list[float]) -> None:
        while not stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True}),
                headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            while not stop.is_set():
                line = r.readline()
                if not line:
                    break
                if line.startswith(b"data: {"):
                    arrivals.append(time.monotonic())
            conn.close()

    prompt = [(7 * i) % 250 + 1 for i in range(args.tokens)]
    big_body = json.dumps({"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": args.logprobs})
    rows = []
    # The floor: the neighbour alone for a few seconds (what the machine's load and the
    # engine's own steps cost the loop without any large body).
    stop, arrivals = threading.Event(), []
    th = threading.Thread(target=neighbour, args=(stop, arrivals), daemon=True)
    th.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    time.sleep(5.0)
    t1 = time.monotonic()
    stop.set()
    th.join(30)
    window = [a for a in arrivals if t0 <= a <= t1]
    during = sorted(v for t, v in lags if t0 <= t <= t1)
    floor_lag = during[-1] if during else 0.0
    rows.append(("none", 0, t1 - t0, t1 - t0, floor_lag, floor_lag, during[int(0.99 * (len(during) - 1))],
                 sum(v > 0.05 for v in during),
                 max((b - a for a, b in zip(window, window[1:])), default=float("nan")),
                 max((p for t, p, g in gc_pauses if t0 <= t <= t1), default=0.0)))
    modes = args.modes.split(",")
    switch_default = large_bodies.LARGE_BODY_SWITCH_S
    # When the body starts being built (the engine is done with the request): every mode
    # makes the body through protocol.completion_body.
    build_starts: list[float] = []
    real_body = protocol.completion_body

    def timed_body(*a, **k):
        build_starts.append(time.monotonic())
        return real_body(*a, **k)

    protocol.completion_body = timed_body
    answers: list[tuple[str, dict]] = []
    for mode in modes * args.reps:
        stop, arrivals = threading.Event(), []
        th = threading.Thread(target=neighbour, args=(stop, arrivals), daemon=True)
        th.start()
        time.sleep(1.0)
        if mode == "none":  # the floor again, in this round: the machine's load moves
            t0 = time.monotonic()
            time.sleep(3.0)
            t1 = time.monotonic()
            stop.set()
            th.join(30)
            window = [a for a in arrivals if t0 <= a <= t1]
            during = sorted(v for t, v in lags if t0 <= t <= t1)
            floor_lag = during[-1] if during else 0.0
            rows.append(("none", 0, t1 - t0, t1 - t0, floor_lag, floor_lag, during[int(0.99 * (len(during) - 1))],
                         sum(v > 0.05 for v in during),
                         max((b - a for a, b in zip(window, window[1:])), default=float("nan")),
                         max((p for t, p, g in gc_pauses if t0 <= t <= t1), default=0.0)))
            continue
        # "sliced-thread-5ms": the sliced build with the GIL's default switch interval.
        large_bodies.LARGE_BODY_MODE = "sliced-thread" if mode == "sliced-thread-5ms" else mode
        large_bodies.LARGE_BODY_SWITCH_S = None if mode == "sliced-thread-5ms" else switch_default
        build_starts.clear()
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body=big_body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        t1 = time.monotonic()
        conn.close()
        time.sleep(0.3)
        stop.set()
        th.join(30)
        assert r.status == 200, data[:300]
        if not answers:
            answers.append((mode, json.loads(data)["choices"]))
        elif mode not in [m for m, _ in answers]:
            answers.append((mode, json.loads(data)["choices"]))
        tb = build_starts[0]
        lag_all = max((v for t, v in lags if t0 <= t <= t1), default=0.0)
        lag = max((v for t, v in lags if tb <= t <= t1), default=0.0)
        during = sorted(v for t, v in lags if tb <= t <= t1)
        p99 = during[int(0.99 * (len(during) - 1))] if during else 0.0
        over = sum(v > 0.05 for v in during)
        window = [a for a in arrivals if tb <= a <= t1 + 0.3]
        gap = max((b - a for a, b in zip(window, window[1:])), default=float("nan"))
        pause = max((p for t, p, g in gc_pauses if tb <= t <= t1), default=0.0)
        rows.append((mode, len(data), t1 - t0, t1 - tb, lag_all, lag, p99, over, gap, pause))
    print(f"{args.tokens}-token echo, logprobs={args.logprobs}; tiny model, CPU, torch threads "
          f"{torch.get_num_threads()}")
    print("| body built | body MB | request s | build+send s | max loop lag, whole request (ms) | "
          "max loop lag while built (ms) | p99 (ms) | lags > 50 ms | neighbour max gap while built (ms) | "
          "max gc pause while built (ms) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode, size, secs, build, lag_all, lag, p99, over, gap, pause in rows:
        what = "no big body (neighbour alone)" if mode == "none" else mode
        print(f"| {what} | {size / 1e6:.1f} | {secs:.2f} | {build:.2f} | {lag_all * 1e3:.1f} | {lag * 1e3:.1f} | "
              f"{p99 * 1e3:.1f} | {over} | {gap * 1e3:.1f} | {pause * 1e3:.1f} |")
    by_mode: dict[str, list[float]] = {}
    for row in rows:
        by_mode.setdefault(row[0], []).append(row[5])
    print("median over rounds of the max loop lag while built (ms): "
          + ", ".join(f"{m} {statistics.median(v) * 1e3:.1f}" for m, v in by_mode.items()))
    # The same answer in every mode: tokens and offsets exactly; the logprobs to float
    # noise (the neighbour shares the prompt's prefill batches differently each run).
    ref = answers[0][1][0]["logprobs"]
    for mode, ch in answers[1:]:
        lp = ch[0]["logprobs"]
        for key in ("tokens", "text_offset"):  # the prompt's part (the generated token is sampled)
            bad = [i for i, (a, b) in enumerate(zip(lp[key][:args.tokens], ref[key][:args.tokens])) if a != b]
            assert len(lp[key]) == len(ref[key]) and not bad, (
                f"{mode}: {key} differ from position {bad[:1]}: {lp[key][bad[0]:bad[0] + 3] if bad else ''} vs "
                f"{ref[key][bad[0]:bad[0] + 3] if bad else ''} (lengths {len(lp[key])}, {len(ref[key])})")
        n = args.tokens
        diff = max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:n], ref["token_logprobs"][1:n]))
        alts = sum(set(a) != set(b) for a, b in zip(lp["top_logprobs"][1:n], ref["top_logprobs"][1:n]))
        print(f"{mode} vs {answers[0][0]}: same prompt tokens and offsets; prompt token logprobs differ by at most {diff:.2e}; "
              f"{alts} positions with other top-{args.logprobs} alternatives (near-ties)")
    aengine.shutdown()


if __name__ == "__main__":
    main()
