"""A live server on a loopback port, in a background thread, for clients that need a
real socket (the official ``openai`` client, hostile raw bodies, disconnects).

It runs :func:`hybridserve.server.serve.serve_app` itself (the code ``serve`` runs,
drain included), minus signal handling, which only the main thread may install.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from typing import Any

import pytest

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.metrics import EngineMetrics
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.server.app import ServerSettings, build_app
from hybridserve.server.serve import bind_socket, serve_app


class Response:
    def __init__(self, status: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


class LiveServer:
    def __init__(self, model_dir, settings: ServerSettings | None = None, shutdown_timeout: float = 5.0,
                 **engine_kwargs) -> None:
        kwargs = dict(dtype="float32", device="cpu", num_pages=256 + 3 * 8,
                      max_num_seqs=8, max_num_batched_tokens=128, max_model_len=2048)
        kwargs.update(engine_kwargs)
        self.engine = LLMEngine(EngineArgs(model=str(model_dir), **kwargs))
        self.metrics = EngineMetrics()
        self.aengine = AsyncEngine(self.engine, on_step=self.metrics.observe_step)
        self.settings = settings or ServerSettings()
        self.app = build_app(self.aengine, self.metrics, "tiny", self.settings)
        self.shutdown_timeout = shutdown_timeout
        self._ready = threading.Event()
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.port = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "live server did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        async def main() -> None:
            self.loop = asyncio.get_running_loop()
            self.stop_event = asyncio.Event()

            def ready(port: int) -> None:
                self.port = port
                self._ready.set()

            await serve_app(self.app, bind_socket("127.0.0.1", 0), name="tiny",
                            shutdown_timeout=self.shutdown_timeout, stop=self.stop_event,
                            handle_signals=False, ready=ready)

        try:
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e
            self._ready.set()
        finally:
            self._done.set()

    def begin_shutdown(self) -> None:
        """What SIGTERM does: stop accepting, drain, abort, exit."""
        self.loop.call_soon_threadsafe(self.stop_event.set)

    def stop(self, timeout: float = 30.0) -> None:
        if not self._done.is_set():
            self.begin_shutdown()
        assert self._done.wait(timeout), "live server did not shut down"
        if self.error is not None:
            raise self.error

    def connect(self, timeout: float = 60.0) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, json_body: Any = None, content: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60.0) -> Response:
        """One request on a fresh connection; 4xx/5xx are returned, not raised."""
        h = dict(headers or {})
        if json_body is not None:
            content = json.dumps(json_body).encode()
        if content is not None:
            h.setdefault("Content-Type", "application/json")
        conn = self.connect(timeout)
        try:
            try:
                conn.request(method, path, body=content, headers=h)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered before reading all of a body it refuses
            r = conn.getresponse()
            return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            conn.close()

    def post(self, path: str, body: Any, **kw: Any) -> Response:
        return self.request("POST", path, json_body=body, **kw)

    def metric_values(self) -> dict[str, float]:
        text = self.request("GET", "/metrics", headers=self.auth_headers(), timeout=10).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("hybridserve:") and " " in line}

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}

    def wait_idle_and_whole(self, timeout: float = 15.0) -> dict[str, float]:
        """Wait until the engine holds no request, then check every block and slot is free."""
        deadline = time.monotonic() + timeout
        while True:
            vals = self.metric_values()
            if (vals.get("hybridserve:num_seqs_running", 1) == 0
                    and vals.get("hybridserve:num_requests_waiting", 1) == 0
                    and self.aengine.num_in_flight == 0):
                break
            assert time.monotonic() < deadline, vals
            time.sleep(0.05)
        assert vals["hybridserve:kv_blocks_used"] == 0, vals
        assert vals['hybridserve:arena_pages{use="running_state"}'] == 0, vals
        return vals


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("live") / "m", preset="test-a", seed=5)


@pytest.fixture(scope="session")
def hf_tiny(tiny_dir):
    import torch
    import transformers

    return transformers.Qwen3_5ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def live_server_cls():
    return LiveServer


@pytest.fixture(scope="module")
def live(tiny_dir):
    server = LiveServer(tiny_dir)
    yield server
    server.stop()
