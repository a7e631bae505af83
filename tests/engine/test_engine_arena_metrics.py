"""The arena in the engine's stats and /metrics: pages by use, padding bytes and what
limited admission, against numbers derived here from the model shape by hand and from
what the test made the engine do."""

from __future__ import annotations

import math

from hybridserve import LLM, SamplingParams
from hybridserve.metrics import EngineMetrics


def _metrics(engine) -> dict[str, float]:
    m = EngineMetrics()
    m.refresh(engine)
    out = {}
    for line in m.render().decode().splitlines():
        if line.startswith("hybridserve:"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_pages_by_use_padding_and_admission_limits(tiny_dirs):
    # test-a, float32, 16-token blocks: a page is one block of the one attention layer.
    llm = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", num_pages=30, max_num_seqs=2,
              max_num_batched_tokens=128)
    eng = llm.engine
    c = eng.model_config
    page = 2 * c.num_full_attention_layers * c.num_key_value_heads * c.head_dim * 4 * 16
    rec = c.linear_key_head_dim * c.linear_value_head_dim * 4
    conv = c.linear_conv_dim * (c.linear_conv_kernel_dim - 1) * 4
    D, H = c.num_linear_attention_layers, c.linear_num_value_heads
    state_pages = math.ceil(D * H / (page // rec)) + math.ceil(D / (page // conv))
    state_padding = state_pages * page - D * (H * rec + conv)
    assert eng.state_pages == state_pages

    # Three requests, two at a time (max_num_seqs): the third waits for a sequence.
    for i in range(3):
        eng.add_request(f"r{i}", [10 + i] * 40, SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    st = eng.stats()
    assert st["num_running_seqs"] == 2 and st["num_waiting_requests"] == 1
    assert st["last_admission_limit"] == "max_num_seqs" and st["admission_limited_seqs"] == 1
    # Each running sequence: its state + 3 blocks for 40 tokens (+ a checkpoint after
    # its last full block, written inside the chunk: one state's pages).
    assert st["running_state_pages"] == 2 * state_pages
    assert st["kv_pages"] == 2 * 3
    assert st["checkpoint_pages"] == 2 * state_pages
    assert st["free_pages"] == 30 - 2 * 3 - 4 * state_pages - st["cached_pages"]
    # Padding: a KV page of this shape has none (a page is exactly one block); every
    # state (running or checkpoint) has state_padding bytes.
    assert st["page_bytes"] == page
    assert st["padding_bytes"] == 4 * state_padding
    m = _metrics(eng)
    for use, key in (("kv", "kv_pages"), ("running_state", "running_state_pages"),
                     ("checkpoint", "checkpoint_pages"), ("cached", "cached_pages"), ("free", "free_pages")):
        assert m[f'hybridserve:arena_pages{{use="{use}"}}'] == st[key]
    assert sum(m[f'hybridserve:arena_pages{{use="{u}"}}'] for u in
               ("kv", "running_state", "checkpoint", "cached", "free")) == m["hybridserve:arena_pages_total"] == 30
    assert m['hybridserve:admission_limited_total{limit="max_num_seqs"}'] == 1
    assert m["hybridserve:arena_padding_bytes"] == 4 * state_padding

    # Now pages: a request whose state alone takes what is left waits for pages.
    while eng.has_unfinished_requests():
        eng.step()
    big = LLM(tiny_dirs["test-a"], dtype="float32", device="cpu", num_pages=2 * state_pages + 4,
              max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    e2 = big.engine
    for i in range(3):
        e2.add_request(f"p{i}", [20 + i] * 20, SamplingParams(max_tokens=2, ignore_eos=True))
    e2.step()
    st = e2.stats()
    # Two sequences of 2 blocks + a state each fill the arena; the third cannot get a state.
    assert st["num_running_seqs"] == 2 and st["last_admission_limit"] == "pages"
    assert st["last_admission_available_pages"] == 0 < state_pages + 2
    assert _metrics(e2)['hybridserve:admission_limited_total{limit="pages"}'] == 1
    while e2.has_unfinished_requests():
        e2.step()
    st = e2.stats()
    assert st["free_pages"] == st["num_pages"] and st["padding_bytes"] == 0
