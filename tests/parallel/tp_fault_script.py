"""Run by test_tp_faults.py in a fresh interpreter: a TP=2 engine whose worker is
killed (or stopped) mid-generation. Prints one JSON line with what happened."""

import json
import os
import signal
import sys

from hybridserve import LLM, SamplingParams
from hybridserve.parallel import TensorParallelError

path, how = sys.argv[1], sys.argv[2]
llm = LLM(path, dtype="float32", cpu_threads=1, num_pages=64, tensor_parallel_size=2)
eng = llm.engine
worker = eng.parallel.launcher.procs[1]
port = eng.parallel.launcher.port
for i in range(2):
    eng.add_request(f"r{i}", [1, 2, 3, 4, 5 + i], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
steps, error, again = 0, None, None
try:
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        if steps == 3:
            os.kill(worker.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
except TensorParallelError as e:
    error = {"message": str(e), "ranks": list(e.ranks)}
    try:  # the engine stays failed: the next step raises the same error at once
        eng.step()
    except TensorParallelError as e2:
        again = str(e2)
print(json.dumps({"steps": steps, "error": error, "again": again, "worker_pid": worker.pid, "port": port}),
      flush=True)
