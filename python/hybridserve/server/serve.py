"""``hybridserve serve``: build the engine, start the aiohttp server, drain on SIGTERM.

Without a model directory it serves the default model shipped in the wheel
(:mod:`hybridserve.default_model`, trained on the Python standard library) under the
name ``hybridserve-stdlib-5m``. The random-weight tiny checkpoints of
:func:`default_model_dir` (generated once into ``$HYBRIDSERVE_CACHE`` or
``~/.cache/hybridserve``) stay for tests and benches.

Start-up order: bind the port first (a port in use is one clear line, before seconds
of model loading), then load the engine, then serve on the bound socket and print
``serving ... on http://HOST:PORT``. SIGTERM or SIGINT stops accepting connections,
lets in-flight requests finish for up to ``--shutdown-timeout`` seconds, then aborts
the rest (a stream gets a final SSE error event and ``[DONE]``), frees everything and
exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import socket
from typing import Any

from hybridserve import cli_args
from hybridserve.argtypes import non_negative_int, non_negative_seconds, positive_int, positive_seconds, positive_size
from hybridserve.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
DEFAULT_MODEL_PRESET = "bench"
DEFAULT_MODEL_SEED = 0
API_KEY_ENV = "HYBRIDSERVE_API_KEY"


def _upgrade_default_tokenizer(path: str) -> None:
    """A default checkpoint cached before it had Qwen's chat template gets its tokenizer
    files rewritten (same byte ids; the markers are added tokens after the specials)."""
    import json
    import tempfile

    from hybridserve.model.tiny import write_tokenizer

    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            if "<tool_call>" in (json.load(f).get("chat_template") or ""):
                return
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return
    with tempfile.TemporaryDirectory(dir=path) as tmp:
        write_tokenizer(tmp, cfg["vocab_size"], cfg.get("max_position_embeddings", 4096), qwen_chat=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            os.replace(os.path.join(tmp, name), os.path.join(path, name))


def default_model_dir(preset: str = DEFAULT_MODEL_PRESET) -> str:
    """Path of the embedded default checkpoint (or of another tiny preset's, e.g.
    ``moe-bench``), written on first use."""
    from hybridserve.model.tiny import PRESETS, write_tiny_checkpoint

    if preset not in PRESETS:
        raise ConfigError(f"unknown tiny model {preset!r}; choose one of {sorted(PRESETS)}")
    root = os.environ.get("HYBRIDSERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "hybridserve"
    )
    path = os.path.join(root, f"tiny-{preset}-seed{DEFAULT_MODEL_SEED}")
    if os.path.exists(os.path.join(path, "config.json")):
        _upgrade_default_tokenizer(path)
    else:
        tmp = path + f".tmp{os.getpid()}"
        # Qwen3.5's real chat template and markers: tools, thinking and structured
        # outputs take their real paths on a newcomer's first request.
        write_tiny_checkpoint(tmp, preset=preset, seed=DEFAULT_MODEL_SEED, qwen_chat=True)
        os.makedirs(root, exist_ok=True)
        try:
            os.replace(tmp, path)
        except OSError:  # another process won the race; theirs is identical
            pass
    return path


def shipped_model_dir() -> str:
    """The trained default model in the wheel (what ``serve`` serves without a model)."""
    from hybridserve import default_model
    return default_model.path()


def shipped_model_name() -> str:
    from hybridserve import default_model
    return default_model.NAME


def parse_port(text: str | int) -> int:
    """The --port value, or a one-line ConfigError (checked in run_serve, not by
    argparse, so that the error is one line rather than the whole usage)."""
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"--port {text!r} is not a port number; write e.g. 8000") from None
    if not 0 <= value <= 65535:
        raise ConfigError(f"--port {value} is out of range; use 1-65535 (0 picks a free port)")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (config.json + safetensors + tokenizer), or tiny:PRESET for a "
                        "generated random-weight tiny model (e.g. tiny:moe-bench); default: the shipped "
                        "hybridserve-stdlib-5m, a small Qwen3.5 trained on the Python stdlib")
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    net.add_argument("--port", default=8000,
                     help="TCP port, 1-65535; 0 picks a free one (default: %(default)s)")
    net.add_argument("--served-model-name", default=None,
                     help="the model name clients send and /v1/models lists (default: the checkpoint "
                          "folder's name)")
    net.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                          f"(default: ${API_KEY_ENV} if set, else no key)")
    net.add_argument("--metrics-require-key", action="store_true",
                     help="also require the API key on /metrics (default: /metrics is open)")
    net.add_argument("--max-request-body-bytes", type=positive_size, default=16 << 20, metavar="SIZE",
                     help="largest request body accepted, e.g. 16MiB; larger gets 413 (default: %(default)s)")
    net.add_argument("--request-read-timeout", type=positive_seconds, default=60.0, metavar="S",
                     help="seconds a client may take to send its request body; slower gets 408 "
                          "(default: %(default)s)")
    net.add_argument("--keepalive-timeout", type=positive_seconds, default=75.0, metavar="S",
                     help="seconds an idle keep-alive connection stays open (default: %(default)s)")
    net.add_argument("--no-access-log", dest="access_log", action="store_false",
                     help="turn off the access log: one INFO line per request on the hybridserve.access "
                          "logger with method, path, status, duration, prompt and output tokens and the "
                          "request id (default: on)")
    net.add_argument("--max-stop-strings", type=positive_int, default=64, metavar="N",
                     help="most stop strings one request may give; more gets 400 (default: %(default)s)")
    net.add_argument("--max-stop-string-chars", type=positive_int, default=256, metavar="N",
                     help="longest stop string in characters; longer gets 400 (default: %(default)s)")
    net.add_argument("--request-classes", default=None, metavar="A,B,...",
                     help="the request_class values /metrics labels by name; any other is counted as "
                          "'other' (default: the first --max-request-classes values seen)")
    net.add_argument("--max-request-classes", type=positive_int, default=16, metavar="N",
                     help="without --request-classes, the first N distinct request_class values get their "
                          "own /metrics label and later ones count as 'other' (default: %(default)s)")
    net.add_argument("--shutdown-timeout", type=non_negative_seconds, default=30.0, metavar="S",
                     help="on SIGTERM/SIGINT, seconds in-flight requests may finish before they are "
                          "aborted (default: %(default)s)")
    net.add_argument("--reasoning-parser", default="auto", metavar="NAME",
                     help="split <think> reasoning into reasoning_content: qwen3, none, or auto "
                          "(from the chat template; default)")
    net.add_argument("--tool-call-parser", default="auto", metavar="NAME",
                     help="parse tool calls into message.tool_calls: qwen3_coder (Qwen3.5's XML), hermes "
                          "(Qwen3's JSON), none, or auto (from the chat template; default)")
    eng = p.add_argument_group("engine")
    eng.add_argument("--dtype", default="auto",
                     help="auto, float32, bfloat16 or float16; auto is the checkpoint's on CUDA, and on a CPU "
                          "the checkpoint's bfloat16 where the CPU has native bfloat16 (AMX/AVX512-BF16), "
                          "else float32; the start-up log says which (default: %(default)s)")
    eng.add_argument("--device", default="auto", help="auto, cpu or cuda[:N] (default: %(default)s)")
    cli_args.add_block_size(eng)
    cli_args.add_seed_and_tokenizer(eng)
    cli_args.add_kv_cache_dtype(eng)
    cli_args.add_speculative_config(eng)
    eng.add_argument("--max-num-seqs", type=positive_int, default=None,
                     help="most sequences in one step's batch (default: from the memory plan, the sequences "
                          "the cache arena holds at once, at most 256)")
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048,
                     help="most tokens in one step's batch (default: %(default)s)")
    eng.add_argument("--max-model-len", type=int, default=None,
                     help="longest prompt + output in tokens, at most the model's max_position_embeddings "
                          "(default: that)")
    eng.add_argument("--max-waiting-requests", type=positive_int, default=4096,
                     help="waiting-queue cap in requests; beyond it requests get 503 (default: %(default)s)")
    eng.add_argument("--max-waiting-tokens", type=positive_int, default=1 << 24,
                     help="waiting-queue cap in prompt tokens; beyond it requests get 503 (default: %(default)s)")
    eng.add_argument("--max-sequences-per-request", type=positive_int, default=256,
                     help="one request's prompts x n (the sequences it becomes); beyond it the request gets "
                          "400 (default: %(default)s)")
    eng.add_argument("--max-consecutive-step-failures", type=non_negative_int, default=3,
                     help="failed engine steps in a row after which every open request fails and the server "
                          "exits non-zero (a failed step alone is rolled back and its requests retried once; "
                          "0: never for this reason; default: %(default)s)")
    eng.add_argument("--num-pages", type=positive_int, default=None,
                     help="exact pages of the cache arena (KV blocks, DeltaNet state and checkpoints share "
                          "them; default: sized from the memory budget)")
    eng.add_argument("--num-gpu-blocks", type=int, default=None,
                     help="deprecated (the pre-arena split): with --num-state-slots, read as the same bytes "
                          "in pages, with a warning; use --num-pages (default: unset)")
    eng.add_argument("--num-state-slots", type=int, default=None,
                     help="deprecated (the pre-arena split), see --num-gpu-blocks (default: unset)")
    cli_args.add_memory_budget(eng, old_spelling="--kv-cache-memory",
                               default_help="from device memory; on CPU a fraction of the memory available")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                     help="fraction of device memory to use (default: %(default)s)")
    eng.add_argument("--expected-context-len", type=int, default=None,
                     help="removed: it sized the KV/state split, and there is one arena now; "
                          "giving it is an error that says so (default: unset)")
    eng.add_argument("--admission-policy", choices=["paged", "reserve_max"], default="paged",
                     help="paged, or reserve_max (each sequence reserves max_model_len; the pre-paging "
                          "baseline) (default: %(default)s)")
    eng.add_argument("--enforce-eager", action="store_true",
                     help="run every step eagerly: no CUDA graphs for decode steps (default: graphs on CUDA)")
    eng.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N",
                     help="split the model over N ranks: N-1 workers started on this host, or the ranks "
                          "torchrun started (MASTER_ADDR/RANK/WORLD_SIZE...) (default: %(default)s)")
    eng.add_argument("--cpu-threads", type=positive_int, default=None, metavar="N",
                     help="torch intra-op threads (default: the physical cores this process may use)")
    eng.add_argument("--no-enable-prefix-caching", "--no-prefix-caching", dest="no_prefix_caching",
                     action="store_true",
                     help="turn off prefix caching: cached KV blocks and DeltaNet state checkpoints "
                          "(default: on)")
    eng.add_argument("--prefix-checkpoint-interval", type=int, default=0, metavar="TOKENS",
                     help="also checkpoint the DeltaNet state every this many prompt tokens (a multiple of "
                          "--block-size); each kept checkpoint holds one reclaimable state slot; 0 = only at "
                          "prompt ends and branch points (default: %(default)s)")
    eng.add_argument("--priority-preemption-threshold", type=int, default=1, metavar="LEVELS",
                     help="a waiting request that does not fit preempts running requests whose effective "
                          "priority is worse by more than this many levels (default: %(default)s)")
    eng.add_argument("--max-priority-preemptions-per-step", type=int, default=4, metavar="N",
                     help="at most this many priority preemptions per step; 0 turns priority preemption "
                          "off (default: %(default)s)")
    eng.add_argument("--long-prefill-token-threshold", type=int, default=0,
                     help="prompts longer than this are prefilled in chunks of at most this many tokens; "
                          "0 = no limit (default: %(default)s)")
    p.add_argument("--log-level", default="info",
                   help=f"{', '.join(LOG_LEVELS[:-1])} or {LOG_LEVELS[-1]} (default: %(default)s)")


def check_log_level(level: str) -> str:
    """The logging level name, or a one-line ConfigError."""
    if level.lower() not in LOG_LEVELS:
        raise ConfigError(f"--log-level {level!r} is not a level; use one of {', '.join(LOG_LEVELS)}")
    return level.upper()


def check_device(device: str) -> None:
    """A one-line ConfigError for a --device this machine cannot give (checked before
    seconds of model loading, instead of torch's traceback from deep inside it)."""
    import torch

    if device == "auto" or device == "cpu":
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"--device {device!r} is not a device; use auto, cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is visible to this process "
                          "(torch.cuda.is_available() is false); use --device cpu or auto")
    if index and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")


def check_max_model_len(requested: int | None, model_dir: str) -> None:
    """Refuse a --max-model-len above what the model was trained for (the engine would
    otherwise lower it silently)."""
    from hybridserve.config import ModelConfig

    if requested is None:
        return
    if requested < 1:
        raise ConfigError(f"--max-model-len {requested} must be a positive number of tokens")
    limit = ModelConfig.from_json(model_dir).max_position_embeddings
    if requested > limit:
        raise ConfigError(f"--max-model-len {requested} is above this model's max_position_embeddings "
                          f"({limit}); give at most {limit}, or leave it out")


def _resident_bytes() -> int:
    """This process's resident set now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensor_bytes(root: Any) -> int:
    """Bytes of the distinct tensor storages reachable from ``root``'s attributes (and
    their lists, tuples and dicts), counted once however many views share them."""
    import torch

    seen: dict[int, int] = {}
    stack, visited = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in visited:
            continue
        visited.add(id(obj))
        if isinstance(obj, torch.Tensor):
            st = obj.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif obj is root or type(obj).__module__.startswith("hybridserve."):
            stack.extend(getattr(obj, "__dict__", {}).values())
    return sum(seen.values())


def _quantized_bytes(model: Any) -> int:
    """Bytes of a quantized checkpoint's weights (a GGUF's blocks), which are no
    parameters: projections' and the embedding's ``qweight`` (a tied head shares the
    embedding's: counted once), MoE experts kept in blocks (``quantized`` modules)."""
    seen: dict[int, int] = {}
    for m in model.modules():
        q = getattr(m, "qweight", None)
        if q is not None:
            seen[id(q)] = int(q.nbytes)
        elif getattr(m, "quantized", False) and hasattr(m, "nbytes"):
            seen[id(m)] = int(m.nbytes)
    return sum(seen.values())


def memory_held(engine: Any) -> dict[str, Any]:
    """What the process holds once the engine is up: the weights (every parameter and
    buffer of the model, and a quantized checkpoint's blocks), the KV and DeltaNet state pools (the cache's tensors), and
    the runtime (everything else: torch and its allocator, the tokenizer, step
    buffers, CUDA graphs and context). On CUDA the device's memory, with the host's
    resident set reported beside it; on CPU the resident set."""
    import torch

    tensors = list(engine.model.parameters()) + list(engine.model.buffers())
    weights = sum(t.numel() * t.element_size() for t in tensors) + _quantized_bytes(engine.model)
    pools = _tensor_bytes(engine.cache)
    rss = _resident_bytes()
    device = engine.device
    if device.type == "cuda":
        # torch's reserved bytes leave out the CUDA context and libraries; the device's
        # used memory includes them (and other processes' on a shared GPU).
        free, total = torch.cuda.mem_get_info(device)
        held = max(torch.cuda.memory_reserved(device), total - free)
        where = str(device)
    else:
        held = rss
        where = "host"
    runtime = max(0, held - weights - pools)
    return {"where": where, "weights": weights, "pools": pools, "runtime": runtime,
            "total": weights + pools + runtime, "host_resident": rss}


def memory_held_line(engine: Any) -> str:
    """The start-up log line of :func:`memory_held`."""
    from hybridserve.planner import format_mib

    m = memory_held(engine)
    line = (f"memory held ({m['where']}): {format_mib(m['total'])} = weights {format_mib(m['weights'])} + "
            f"cache arena {format_mib(m['pools'])} + runtime {format_mib(m['runtime'])}")
    if m["where"] != "host":
        line += f"; host resident set {format_mib(m['host_resident'])}"
    return line


class _BindError(ConfigError):
    """The listening socket could not be opened (port in use, bad address)."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, or a one-line :class:`ConfigError` saying what to change."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise _BindError(f"cannot listen on host {host!r}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise _BindError(f"port {port} on {host} is already in use; stop the other server or pick "
                             "another --port") from None
        if e.errno in (errno.EACCES, errno.EPERM):
            raise _BindError(f"no permission to listen on port {port}; ports below 1024 need privileges, "
                             "pick another --port") from None
        raise _BindError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.setblocking(False)
    return sock


def check_model_dir(path: str) -> None:
    """A checkpoint must be a directory or a GGUF file; say so plainly when it is another
    file or missing."""
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ConfigError(f"no GGUF file at {path!r}")
        return
    if os.path.isfile(path):
        raise ConfigError(
            f"{path!r} is a file, not a directory: give the checkpoint directory that holds "
            "config.json, the *.safetensors files and the tokenizer"
        )
    if not os.path.isdir(path):
        raise ConfigError(f"no checkpoint directory at {path!r}")


async def serve_app(app, sock: socket.socket, *, name: str, shutdown_timeout: float,
                    stop: asyncio.Event | None = None, handle_signals: bool = True,
                    ready: Any = None) -> None:
    """Serve ``app`` on the bound ``sock`` until SIGTERM/SIGINT (or ``stop`` is set),
    then drain: stop accepting, wait for in-flight requests up to ``shutdown_timeout``,
    abort the rest, clean up."""
    from aiohttp import web

    from hybridserve.engine.async_engine import ServerShuttingDown
    from hybridserve.server.access_log import ACCESS_LOGGER, AccessLogger
    from hybridserve.server.app import ENGINE_KEY, SETTINGS_KEY, STATE_KEY, runner_kwargs
    from hybridserve.server.http_protocol import AppRunner

    log = logging.getLogger("hybridserve.server")
    engine = app[ENGINE_KEY]
    settings = app[SETTINGS_KEY]
    runner = AppRunner(app, handle_signals=False, access_log=ACCESS_LOGGER if settings.access_log else None,
                       access_log_class=AccessLogger, shutdown_timeout=5.0, **runner_kwargs(settings))
    await runner.setup()
    site = web.SockSite(runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"hybridserve: serving {name} on http://{shown}:{port} "
          "(POST /v1/completions, /v1/chat/completions; GET /v1/models, /health, /metrics)", flush=True)

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    force = asyncio.Event()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        (stop if signals == 1 else force).set()

    sigs = (signal.SIGTERM, signal.SIGINT) if handle_signals else ()
    for sig in sigs:
        loop.add_signal_handler(sig, on_signal)
    if ready is not None:
        ready(port)

    async def stop_on_rank_failure() -> None:
        # An engine thread that stopped (a fatal fault, faults in a row, a tensor-parallel
        # rank that died or hung) is gone for good: every open request already got its
        # error, new ones get 503, and the server exits non-zero within seconds.
        parallel = getattr(engine.engine, "parallel", None)
        while not stop.is_set():
            # The engine thread died, or the driver's heartbeat found a dead rank while idle.
            failure = parallel.failure if parallel is not None else None
            if not engine.is_alive or failure is not None:
                # (The engine logged its fatal fault; a rank found dead while idle is said here.)
                (log.error if failure is not None else log.info)(
                    "engine failed (%s): shutting down", failure or getattr(engine, "_dead", None))
                stop.set()
                return
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(stop_on_rank_failure())
    try:
        await stop.wait()
        app[STATE_KEY]["draining"] = True
        await site.stop()  # no new connections
        n = engine.num_in_flight
        log.info("shutting down: %d request(s) in flight, waiting up to %gs", n, shutdown_timeout)
        # A dead engine produces nothing more: the streams have their errors, and only
        # their writes are waited for.
        deadline = loop.time() + (shutdown_timeout if engine.is_alive else min(shutdown_timeout, 2.0))
        while engine.num_in_flight and loop.time() < deadline and not force.is_set():
            await asyncio.sleep(0.05)
        if engine.num_in_flight:
            log.warning("aborting %d request(s) still running at shutdown", engine.num_in_flight)
            engine.abort_all(ServerShuttingDown(
                "the server shut down before this request finished (serve --shutdown-timeout)"))
            grace = loop.time() + 5.0
            while engine.num_in_flight and loop.time() < grace:
                await asyncio.sleep(0.02)
    finally:
        watcher.cancel()
        for sig in sigs:
            loop.remove_signal_handler(sig)
        await runner.cleanup()  # closes connections; the app's cleanup stops the engine
    log.info("shut down")


def server_settings(args: argparse.Namespace, environ: Any = None) -> Any:
    """The HTTP front's settings from the options (the API key from $HYBRIDSERVE_API_KEY
    when --api-key is not given)."""
    from hybridserve.server.app import ServerSettings

    environ = os.environ if environ is None else environ
    settings = ServerSettings(
        api_key=args.api_key or environ.get(API_KEY_ENV) or None,
        metrics_require_key=args.metrics_require_key,
        max_request_body_bytes=args.max_request_body_bytes,
        request_read_timeout=args.request_read_timeout,
        keepalive_timeout=args.keepalive_timeout,
        access_log=getattr(args, "access_log", True),
        max_stop_strings=getattr(args, "max_stop_strings", 64),
        max_stop_string_chars=getattr(args, "max_stop_string_chars", 256),
        max_sequences_per_request=getattr(args, "max_sequences_per_request", 256),
        reasoning_parser=_parser_flag(getattr(args, "reasoning_parser", "auto")),
        tool_call_parser=_parser_flag(getattr(args, "tool_call_parser", "auto")),
    )
    if settings.metrics_require_key and not settings.api_key:
        raise ConfigError(f"--metrics-require-key needs --api-key (or ${API_KEY_ENV})")
    return settings


def _parser_flag(value: str | None) -> str | None:
    return None if value in (None, "none", "") else value


def run_serve(args: argparse.Namespace) -> int:
    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.async_engine import AsyncEngine
    from hybridserve.engine.llm_engine import LLMEngine
    from hybridserve.metrics import EngineMetrics
    from hybridserve.server.app import build_app

    level = check_log_level(args.log_level)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model is not None and not args.model.startswith(cli_args.TINY_PREFIX):
        check_model_dir(args.model)
    check_device(args.device)
    settings = server_settings(args)
    classes = [c.strip() for c in args.request_classes.split(",") if c.strip()] \
        if args.request_classes else None
    from hybridserve.parallel.group import env_rank

    # Under torchrun every rank runs this command; only rank 0 serves HTTP (the other
    # ranks' engines serve the driver's steps and exit inside LLMEngine).
    tp_worker = getattr(args, "tensor_parallel_size", 1) > 1 and (env_rank() or 0) > 0
    sock = None if tp_worker else bind_socket(args.host, parse_port(args.port))
    try:
        model = shipped_model_dir() if args.model is None else cli_args.resolve_model(args.model)
        check_max_model_len(args.max_model_len, model)
        async_engine = None
        engine_args = EngineArgs(
            model=model,
            dtype=args.dtype,
            device=args.device,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            num_pages=args.num_pages,
            num_gpu_blocks=args.num_gpu_blocks,
            num_state_slots=args.num_state_slots,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            kv_cache_dtype=args.kv_cache_dtype,
            speculative_config=args.speculative_config,
            seed=args.seed,
            tokenizer=args.tokenizer,
            gpu_memory_utilization=args.gpu_memory_utilization,
            expected_context_len=args.expected_context_len,
            admission_policy=args.admission_policy,
            enable_prefix_caching=not args.no_prefix_caching,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            prefix_checkpoint_interval=args.prefix_checkpoint_interval,
            priority_preemption_threshold=args.priority_preemption_threshold,
            max_priority_preemptions_per_step=args.max_priority_preemptions_per_step,
            max_waiting_requests=args.max_waiting_requests,
            max_waiting_tokens=args.max_waiting_tokens,
            enforce_eager=args.enforce_eager,
            cpu_threads=args.cpu_threads,
            tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
            max_consecutive_step_failures=getattr(args, "max_consecutive_step_failures", 3),
        )
        engine = LLMEngine(engine_args)
        logging.getLogger("hybridserve.server").info(memory_held_line(engine))
        metrics = EngineMetrics(request_classes=classes, max_request_classes=args.max_request_classes)
        async_engine = AsyncEngine(engine, on_step=metrics.observe_step)
        name = args.served_model_name or (
            shipped_model_name() if args.model is None else os.path.basename(os.path.normpath(model)))
        app = build_app(async_engine, metrics, name, settings)
        asyncio.run(serve_app(app, sock, name=name, shutdown_timeout=args.shutdown_timeout))
    finally:
        if sock is not None:
            sock.close()
    if async_engine is not None and async_engine._dead is not None:
        # The engine stopped (FatalEngineError, faults in a row, a dead rank): non-zero
        # so a supervisor restarts the process.
        from hybridserve.errors import FatalEngineError

        if not isinstance(async_engine._dead, FatalEngineError):  # that one the engine logged, once
            logging.getLogger("hybridserve.server").error("exiting: the engine failed: %s", async_engine._dead)
        return 1
    if engine.parallel is not None and engine.parallel.failure is not None:
        # A failed rank: the server stopped itself (new requests got 503 meanwhile);
        # non-zero so a supervisor restarts it.
        logging.getLogger("hybridserve.server").error("exiting: %s", engine.parallel.failure)
        return 1
    return 0


__all__ = ["add_serve_arguments", "run_serve", "serve_app", "bind_socket", "default_model_dir"]
