"""Load test of the one arena: 256 streaming clients on the default model.

Each client streams one request (random prompt length and output length, some
sharing a prefix) through the AsyncEngine. After every step the test checks,
from the step's own stats, that nothing waits while the arena could take it:
when requests are left waiting, the step's admission stopped at max_num_seqs,
at the token budget, or at pages, and then the pages that could still be had
(free + cached + evictable checkpoints) are fewer than the waiting head needs
at least (its DeltaNet state pages + one KV block). At the end every client has
its tokens and every page is back: no KV block or running state is held, and
everything else is free or reclaimable.

Two budgets: plenty (max_num_seqs is the only limit) and tight (pages are).
"""

from __future__ import annotations

import asyncio
import random

import pytest

from hybridserve.engine.args import EngineArgs
from hybridserve.engine.async_engine import AsyncEngine
from hybridserve.engine.llm_engine import LLMEngine
from hybridserve.sampling import SamplingParams
from hybridserve.server.serve import default_model_dir

CLIENTS = 256
MAX_NUM_SEQS = 128
SHARED = 48
MAX_PROMPT = SHARED + 60


def _check_step(engine: LLMEngine, violations: list[str], peak: list[int]) -> None:
    st = engine.stats()
    peak[0] = max(peak[0], st["num_running_seqs"])
    pages = (st["free_pages"] + st["kv_pages"] + st["running_state_pages"] + st["checkpoint_pages"]
             + st["cached_pages"])
    if pages != st["num_pages"]:
        violations.append(f"step {st['steps']}: pages by use sum to {pages}, not {st['num_pages']}")
    if st["num_waiting_requests"] == 0:
        return
    limit = st["last_admission_limit"]
    running, available = st["last_admission_running_seqs"], st["last_admission_available_pages"]
    if limit == "max_num_seqs":
        if running < MAX_NUM_SEQS:
            violations.append(f"step {st['steps']}: limited by max_num_seqs with {running} running")
    elif limit == "pages":
        # The head needs its state + the blocks of its first chunk (prompts <= MAX_PROMPT tokens).
        need = st["pages_per_state"] + -(-MAX_PROMPT // 16)
        if available >= need:
            violations.append(f"step {st['steps']}: refused for pages with {available} obtainable, need <= {need}")
    elif limit != "token_budget" and st["preemptions"] == 0:
        violations.append(f"step {st['steps']}: {st['num_waiting_requests']} waiting, admission never stopped")


async def _client(aengine: AsyncEngine, i: int, rng: random.Random, shared: list[int]) -> int:
    prompt = (shared if i % 4 == 0 else []) + [rng.randrange(3, 200) for _ in range(rng.randint(4, MAX_PROMPT - SHARED))]
    params = SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True, temperature=0.0)
    stream = await aengine.generate(f"c{i}", prompt, params)
    n = 0
    try:
        async for out in stream:
            n = len(out.outputs[0].token_ids)
            if out.finished:
                break
    finally:
        stream.close()
    assert n == params.max_tokens, f"client {i} got {n} of {params.max_tokens} tokens"
    return n


@pytest.mark.parametrize("budget_mib", [64, 3])
def test_256_streaming_clients_never_wait_for_free_pages(budget_mib):
    engine = LLMEngine(EngineArgs(
        model=default_model_dir(), dtype="float32", device="cpu", max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=2048, kv_cache_memory_bytes=budget_mib << 20,
    ))
    violations: list[str] = []
    peak = [0]
    aengine = AsyncEngine(engine, on_step=lambda e, _outs: _check_step(e, violations, peak))
    rng = random.Random(budget_mib)
    shared = [rng.randrange(3, 200) for _ in range(SHARED)]

    async def main() -> list[int]:
        return await asyncio.gather(*(_client(aengine, i, random.Random(i), shared) for i in range(CLIENTS)))

    try:
        got = asyncio.run(asyncio.wait_for(main(), timeout=600))
    finally:
        aengine.shutdown()
    assert len(got) == CLIENTS
    assert violations == [], violations[:5]
    st = engine.stats()
    assert st["num_waiting_requests"] == 0 and st["num_running_seqs"] == 0
    assert st["kv_pages"] == 0 and st["running_state_pages"] == 0, "pages still held after every client finished"
    assert st["available_pages"] == st["num_pages"], "a page is neither free nor reclaimable"
    if budget_mib == 64:
        assert peak[0] == MAX_NUM_SEQS, f"with pages to spare the engine ran at most {peak[0]} at once"
    else:
        assert st["admission_limited_pages"] > 0, "the tight budget never limited admission"
