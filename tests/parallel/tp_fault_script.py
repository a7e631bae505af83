"""Run by test_tp_faults.py in a fresh interpreter: a TP=2 engine whose worker is
killed (or stopped) mid-generation. Prints one JSON line with what happened."""

import json
import os
import signal
import sys

from hybridserve import LLM, SamplingParams
from hybridserve.parallel import TensorParallelError

path, how = sys.argv[1], sys.argv[2]
if how == "driver-start":
    # The driver fails after its worker started (its tokenizer breaks; the worker's
    # does not, it is another process): the worker must be stopped at once.
    import time

    import hybridserve.engine.builder as builder
    from hybridserve.parallel import launcher

    started = []
    real_init = launcher.WorkerLauncher.__init__

    def recording_init(self, *a, **kw):
        real_init(self, *a, **kw)
        started.append(self)

    def broken_tokenizer(*a, **kw):
        raise ValueError("tokenizer broken on the driver")

    launcher.WorkerLauncher.__init__ = recording_init
    builder.load_tokenizer = broken_tokenizer
    t0 = time.monotonic()
    try:
        LLM(path, dtype="float32", cpu_threads=1, num_pages=64, tensor_parallel_size=2)
        error = None
    except ValueError as e:
        error = str(e)
    seconds = time.monotonic() - t0
    # Asked here, while this driver lives: its exit would end the worker anyway
    # (PR_SET_PDEATHSIG), stopped or not.
    worker = started[0].procs[1]
    deadline = time.monotonic() + 10
    while worker.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    print(json.dumps({"error": error, "seconds": seconds, "worker_exit": worker.poll(),
                      "port": started[0].port}), flush=True)
    sys.exit(0)
if how == "stuck":
    # The driver's step blocks where no error can reach it (as a collective replayed
    # by a CUDA graph does when a peer dies: NCCL's watchdog does not see it, and on
    # gloo nothing aborts) while its worker is killed: the step watchdog must end
    # this process with EXIT_TP_STUCK within the step limit plus its grace.
    import time

    from hybridserve.runner.model_runner import ModelRunner

    llm = LLM(path, dtype="float32", cpu_threads=1, num_pages=64, tensor_parallel_size=2)
    eng = llm.engine
    worker = eng.parallel.launcher.procs[1]
    real_execute = ModelRunner.execute
    calls = [0]

    def execute(self, *a, **kw):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(worker.pid, signal.SIGKILL)
            print(json.dumps({"killed_at": time.time(), "worker_pid": worker.pid}), flush=True)
            while True:
                time.sleep(3600)
        return real_execute(self, *a, **kw)

    ModelRunner.execute = execute
    eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    print(json.dumps({"finished": True}), flush=True)
    sys.exit(0)
if how == "timeouts":
    # Sized from a byte budget, so the ranks meet in agree_num_pages before the ready
    # barrier; after start-up every collective has the step limit.
    llm = LLM(path, dtype="float32", cpu_threads=1, kv_cache_memory_bytes=8 << 20, tensor_parallel_size=2)
    g = llm.engine.parallel.group
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    print(json.dumps({"control": g.current_timeout_s("control"), "model": g.current_timeout_s("model"),
                      "tokens": len(out)}), flush=True)
    sys.exit(0)
if how == "spec-kill":
    # Speculative decoding: the worker is killed inside the drafter's chained passes
    # (the driver is about to broadcast a pass's draft ids), mid-speculation.
    from hybridserve.parallel import plan_message

    llm = LLM(path, dtype="float32", cpu_threads=1, num_pages=64, tensor_parallel_size=2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 0})
    eng = llm.engine
    worker = eng.parallel.launcher.procs[1]
    port = eng.parallel.launcher.port
    real_share = plan_message.share_ids
    calls = [0]
    steps_at_kill = [None]

    def share_ids(group, ids, n):
        calls[0] += 1
        if calls[0] == 8:
            steps_at_kill[0] = steps
            os.kill(worker.pid, signal.SIGKILL)
            worker.wait()
        return real_share(group, ids, n)

    plan_message.share_ids = share_ids
    for i in range(2):
        eng.add_request(f"r{i}", [1, 2, 3, 4, 5 + i], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    steps, error, again = 0, None, None
    try:
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
    except TensorParallelError as e:
        error = {"message": str(e), "ranks": list(e.ranks)}
        try:
            eng.step()
        except TensorParallelError as e2:
            again = str(e2)
    st = eng.stats()
    print(json.dumps({"steps": steps_at_kill[0], "error": error, "again": again, "worker_pid": worker.pid,
                      "port": port, "drafted": st["spec_draft_tokens"], "unfinished": eng.has_unfinished_requests(),
                      "errored": st["errored_requests"]}), flush=True)
    sys.exit(0)
llm = LLM(path, dtype="float32", cpu_threads=1, num_pages=64, tensor_parallel_size=2)
if how == "idle":
    # Idle for 3x the collective timeout between two generations: the heartbeat keeps
    # the waiting worker from timing out, and the second generation runs normally.
    import time

    first = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    time.sleep(3 * float(os.environ["HYBRIDSERVE_TP_TIMEOUT"]))
    second = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0))[0].outputs[0].token_ids
    print(json.dumps({"same": first == second, "failure": str(llm.engine.parallel.failure)}), flush=True)
    sys.exit(0)
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
