"""The same command under torchrun (the multi-host launch, here 2 processes on one
host): rank 0 returns HF-identical tokens, the other rank exits 0 with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch


SCRIPT = os.path.join(os.path.dirname(__file__), "tp_torchrun_script.py")


def test_llm_under_torchrun_two_processes(tp_dirs):
    path = tp_dirs["moe-kv1"]
    # --standalone: a rendezvous on a free local port (what --nnodes N --rdzv-endpoint
    # HOST:PORT is across hosts).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", "2", SCRIPT, path]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:  # never leave the ranks running
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    lines = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    assert [l["rank"] for l in lines] == [0], out  # only the driver returns from LLM()
    import transformers

    hf = transformers.Qwen3_5MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, got in zip([[1, 2, 3, 4, 5], [7, 8, 9]], lines[0]["tokens"]):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                              min_new_tokens=6)[0, len(prompt):].tolist()
        assert got == ref
