"""End-to-end offline throughput on the CPU, against HF transformers: issue 9's workload.

A thin caller of ``hybridserve bench throughput`` (the one benchmark code path): 64
requests, seeded prompt lengths 64-512 and output lengths 16-128, EOS ignored, all
at once, on the embedded ~10M-parameter ``bench`` model, 2 torch threads; then the
same requests through HF ``generate`` in static left-padded batches of 16 and one at
a time, with greedy-token identity checked per request, and the scheduler / runner /
sampler shares of the engine's wall time. Extra arguments are passed through (later
ones win), e.g. ``--output results.json``, ``--threads 1`` or a checkpoint directory.

    python benches/engine_throughput.py
    # = hybridserve bench throughput --num-prompts 64 --prompt-len 64-512 --output-len 16-128 \
    #       --seed 0 --threads 2 --compare-hf --hf-batch-size 16 --breakdown
"""

from __future__ import annotations

import sys

from hybridserve.cli import main

ISSUE_9_WORKLOAD = [
    "--num-prompts", "64", "--prompt-len", "64-512", "--output-len", "16-128", "--seed", "0",
    "--threads", "2", "--compare-hf", "--hf-batch-size", "16", "--breakdown",
]

if __name__ == "__main__":
    sys.exit(main(["bench", "throughput", *ISSUE_9_WORKLOAD, *sys.argv[1:]]))
