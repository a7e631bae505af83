"""How long a large response body stalls the other streams on the server's event loop.

One in-process server on the tiny model (its config's max_position_embeddings raised so
a 32K-token prompt fits). A neighbour streams tokens while one client asks for a
32,768-token prompt echoed with 20 logprobs per token (tens of MB of JSON). Measured
over that request's lifetime, once with the body built on the event loop and once off it
(``server.app.BUILD_LARGE_BODIES_OFF_LOOP``), in one process:

* loop lag: the longest the event loop was late for a 1 ms timer (what every stream on
  it waits, beyond the engine);
* neighbour gap: the longest gap between two of the neighbour's chunks (includes the
  engine's prefill steps of the big prompt, the same in both modes).

    python benches/echo_stall.py [--tokens 32768] [--logprobs 20]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
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
    args = ap.parse_args()

    from aiohttp import web

    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.metrics import EngineMetrics
    from hybridserve.server import app as app_mod

    root = Path(tempfile.mkdtemp(prefix="echo-stall-"))
    max_len = args.tokens + 64
    model = _tiny(root, max_len)
    engine = LLMEngine(EngineArgs(model=model, dtype="float32", device="cpu", num_pages=args.tokens // 16 + 200,
                                  max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=max_len))
    aengine = AsyncEngine(engine)
    app = app_mod.build_app(aengine, EngineMetrics(), "tiny", app_mod.ServerSettings(max_request_body_bytes=64 << 20))

    lags: list[tuple[float, float]] = []
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
    for off_loop in (False, True, False, True):
        app_mod.BUILD_LARGE_BODIES_OFF_LOOP = off_loop
        stop, arrivals = threading.Event(), []
        th = threading.Thread(target=neighbour, args=(stop, arrivals), daemon=True)
        th.start()
        time.sleep(1.0)
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
        lag = max((v for t, v in lags if t0 <= t <= t1), default=0.0)
        window = [a for a in arrivals if t0 <= a <= t1]
        gap = max((b - a for a, b in zip(window, window[1:])), default=float("nan"))
        rows.append((off_loop, len(data), t1 - t0, lag, gap))
    print(f"{args.tokens}-token echo, logprobs={args.logprobs}; tiny model, CPU")
    print(f"{'body built':<12} {'body MB':>8} {'request s':>10} {'max loop lag ms':>16} {'neighbour max gap ms':>21}")
    for off_loop, size, secs, lag, gap in rows:
        print(f"{'off loop' if off_loop else 'on loop':<12} {size / 1e6:8.1f} {secs:10.2f} {lag * 1e3:16.1f} "
              f"{gap * 1e3:21.1f}")
    aengine.shutdown()


if __name__ == "__main__":
    main()
