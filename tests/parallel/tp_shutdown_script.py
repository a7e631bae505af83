"""Run by test_tp_shutdown.py: a TP=2 LLM that is dropped, or waits for a signal."""

import gc
import json
import os
import signal
import sys
import time

# Ctrl-C at a terminal raises KeyboardInterrupt. Python installs that handler only when
# it starts with SIGINT at its default, and a background job of a non-interactive
# shell (a CI runner's `cmd &`, nohup) starts everything under it with SIGINT ignored:
# the driver then slept through the test's Ctrl-C.
signal.signal(signal.SIGINT, signal.default_int_handler)

from hybridserve import LLM, SamplingParams  # noqa: E402

path, how = sys.argv[1], sys.argv[2]
llm = LLM(path, dtype="float32", cpu_threads=1, num_pages=64, tensor_parallel_size=2)
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))
launcher = llm.engine.parallel.launcher
info = {"worker_pid": launcher.procs[1].pid, "port": launcher.port}
if how == "drop":
    proc = launcher.procs[1]
    del llm, launcher
    gc.collect()
    t0 = time.monotonic()
    while proc.poll() is None and time.monotonic() - t0 < 20:
        time.sleep(0.05)
    info["worker_exit"] = proc.poll()  # the worker's exit code, seen before this script ends
    print(json.dumps(info), flush=True)
else:
    print(json.dumps(info), flush=True)
    time.sleep(600)  # until the test's signal
