"""Time to first token in process on the peer-0.1b Q4_K_M file (issue 35): one prompt of
200 and of 1,000 random token ids, ``max_tokens=1``, prefix caching off (every prompt
is prefilled whole), 2 threads; prefill's quantized products through the int8 GEMM
(``PREFILL_INT8_ISAS``) or the dequantized tiles, alternated in one process. Reports
wall and process CPU time, and the share spent in ``GGMLWeight.linear`` (the rest:
DeltaNet / attention prefill, norms, host work).

    python benches/gguf_prefill_ttft.py [ROUNDS]
"""
import sys, time, collections, os, statistics, random
import torch
from hybridserve import LLM, SamplingParams
from hybridserve.quant import ggml as g
GG = os.path.expanduser("~/.cache/hybridserve/llamacpp/11434.0.0/work/peer-0.1b/model-Q4_K_M.gguf")
llm = LLM(GG, cpu_threads=2, enable_prefix_caching=False)
print("torch threads", torch.get_num_threads(), "load", os.getloadavg())
acc = collections.defaultdict(float)
orig = g.GGMLWeight.linear
def lin(self, x):
    t0 = time.perf_counter(); c0 = time.process_time(); r = orig(self, x)
    acc["lin_wall"] += time.perf_counter() - t0; acc["lin_cpu"] += time.process_time() - c0
    return r
g.GGMLWeight.linear = lin
sp = SamplingParams(max_tokens=1, temperature=0)
rng = random.Random(0)
res = collections.defaultdict(list)
modes = {"tiles": (), "int8": ("avx512_vnni",)}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for n in (200, 1000):
        for mode, isas in modes.items():
            g.PREFILL_INT8_ISAS = isas
            ids = [rng.randrange(100, 50000) for _ in range(n)]
            acc.clear()
            t0 = time.perf_counter(); c0 = time.process_time()
            llm.generate([ids], sp)
            res[(n, mode, "wall")].append(time.perf_counter() - t0)
            res[(n, mode, "cpu")].append(time.process_time() - c0)
            res[(n, mode, "lin_wall")].append(acc["lin_wall"])
            res[(n, mode, "lin_cpu")].append(acc["lin_cpu"])
print("load", os.getloadavg())
print("| prompt | path | TTFT wall ms | CPU ms | linear wall ms | linear CPU ms | rest wall ms |")
print("|---|---|---|---|---|---|---|")
for n in (200, 1000):
    for mode in modes:
        m = {k: statistics.median(res[(n, mode, k)]) * 1e3 for k in ("wall", "cpu", "lin_wall", "lin_cpu")}
        print(f"| {n} | {mode} | {m['wall']:.0f} | {m['cpu']:.0f} | {m['lin_wall']:.0f} | {m['lin_cpu']:.0f} | {m['wall'] - m['lin_wall']:.0f} |")
