"""``hybridserve serve`` as a process: bind errors, SIGTERM drain, option help.

The drain test runs the real command in a subprocess and sends it SIGTERM with one
short and one endless stream in flight: the short one must finish normally, the
endless one must end with an SSE error event and ``[DONE]``, new connections must be
refused, and the process must exit 0 soon after ``--shutdown-timeout``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from hybridserve import cli


def _events(resp: http.client.HTTPResponse):
    while True:
        line = resp.readline()
        if not line:
            return
        if line.startswith(b"data: "):
            yield line[6:].strip().decode()


def _start_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"prompt": [3, 4, 5], "max_tokens": max_tokens, "ignore_eos": True, "stream": True}),
        headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def test_sigterm_drains_in_flight_then_aborts_the_rest_and_exits_0(tiny_dir):
    # SIGINT takes the same handler; one process start (~10 s on 2 cores) covers both.
    sig = signal.SIGTERM
    cmd = [sys.executable, "-m", "hybridserve.cli", "serve", str(tiny_dir), "--port", "0",
           "--shutdown-timeout", "2", "--dtype", "float32", "--device", "cpu", "--max-model-len", "4096",
           "--num-gpu-blocks", "600", "--num-state-slots", "4", "--max-num-seqs", "4", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving \S+ on http://127\.0\.0\.1:(\d+)", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(m.group(1))

        endless_conn, endless = _start_stream(port, 4000)
        endless_events = _events(endless)
        next(endless_events)  # it is generating
        short_conn, short = _start_stream(port, 40)

        t0 = time.monotonic()
        proc.send_signal(sig)
        # The short request finishes normally during the drain.
        short_events = list(_events(short))
        assert short_events[-1] == "[DONE]"
        assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
        # No new connections while draining.
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline, "still accepting connections after the signal"
            time.sleep(0.05)
        # The endless one is aborted after the timeout with an error event, then [DONE].
        rest = list(endless_events)
        assert rest[-1] == "[DONE]", rest[-3:]
        err = json.loads(rest[-2])["error"]
        assert "shut down" in err["message"] and err["code"] == 503
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 20
        out, errs = proc.communicate()
        assert "Traceback" not in errs, errs
        endless_conn.close()
        short_conn.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_port_in_use_is_one_clear_line(tiny_dir, capsys):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        assert cli.main(["serve", str(tiny_dir), "--port", str(port)]) == 2
    finally:
        busy.close()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"port {port}" in err and "already in use" in err


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_port_out_of_range_is_a_clear_error(tiny_dir, capsys, port):
    assert cli.main(["serve", str(tiny_dir), "--port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and "--port" in err
    assert "1-65535" in err or "not a port" in err


def test_a_checkpoint_path_that_is_a_file_says_so(tiny_dir, capsys):
    assert cli.main(["serve", os.path.join(str(tiny_dir), "config.json"), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a file, not a directory" in err and "Traceback" not in err


def test_every_serve_option_has_help_and_shows_its_default():
    parser = cli.build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.items() if a[0] == "serve")[1]
    for action in serve._actions:
        if action.dest in ("help", "model") or not action.option_strings:
            continue
        assert action.help, action.option_strings
        assert "default" in action.help, (action.option_strings, action.help)


def test_sigint_in_process_aborts_a_stream_past_the_timeout_and_frees_everything(tiny_dir):
    """The same drain on SIGINT, in this process (serve_app installs the handlers)."""
    import asyncio

    import aiohttp

    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.metrics import EngineMetrics
    from hybridserve.server.app import build_app
    from hybridserve.server.serve import bind_socket, serve_app

    engine = LLMEngine(EngineArgs(model=str(tiny_dir), dtype="float32", device="cpu", num_pages=300 + 3 * 4, max_num_seqs=4, max_model_len=4096))
    metrics = EngineMetrics()
    app = build_app(AsyncEngine(engine, on_step=metrics.observe_step), metrics, "tiny")
    events: list[str] = []

    async def main() -> None:
        started = asyncio.Event()
        port: list[int] = []

        async def client() -> None:
            await started.wait()
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port[0]}/v1/completions", json={
                        "prompt": [3, 4], "max_tokens": 4000, "ignore_eos": True, "stream": True}) as r:
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip().decode())
                            if len(events) == 1:
                                os.kill(os.getpid(), signal.SIGINT)

        def ready(p: int) -> None:
            port.append(p)
            started.set()

        task = asyncio.ensure_future(client())
        await serve_app(app, bind_socket("127.0.0.1", 0), name="tiny", shutdown_timeout=0.5, ready=ready)
        await asyncio.wait_for(task, 10)

    asyncio.run(main())
    assert events[-1] == "[DONE]"
    assert "shut down" in json.loads(events[-2])["error"]["message"]
    assert not engine.requests
    stats = engine.stats()
    assert stats["used_blocks"] == 0 and stats["running_state_pages"] == 0, stats


def test_api_key_comes_from_the_option_else_the_environment(capsys, monkeypatch):
    from hybridserve.server.serve import server_settings

    monkeypatch.delenv("HYBRIDSERVE_API_KEY", raising=False)

    def settings(argv, env):
        args = cli.build_parser().parse_args(["serve"] + argv)
        return server_settings(args, env)

    assert settings([], {}).api_key is None
    assert settings([], {"HYBRIDSERVE_API_KEY": "env"}).api_key == "env"
    assert settings(["--api-key", "opt"], {"HYBRIDSERVE_API_KEY": "env"}).api_key == "opt"
    s = settings(["--max-request-body-bytes", "1MiB", "--request-read-timeout", "5", "--keepalive-timeout", "7"], {})
    assert (s.max_request_body_bytes, s.request_read_timeout, s.keepalive_timeout) == (1 << 20, 5.0, 7.0)
    assert cli.main(["serve", "--metrics-require-key", "--port", "0"]) == 2
    assert "--metrics-require-key needs --api-key" in capsys.readouterr().err
