"""Run under torchrun by test_tp_torchrun.py: every rank runs this same script."""

import json
import os
import sys

from hybridserve import LLM, SamplingParams

llm = LLM(sys.argv[1], dtype="float32", cpu_threads=1, num_pages=64, tensor_parallel_size=2)
# Only rank 0 gets here: the other rank's LLM serves rank 0's steps and exits.
outs = llm.generate([[1, 2, 3, 4, 5], [7, 8, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
print(json.dumps({"rank": int(os.environ["RANK"]), "tokens": [o.outputs[0].token_ids for o in outs]}), flush=True)
