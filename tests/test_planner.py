"""The capacity planner against independent oracles.

* The seed's table (DESIGN.md, "The seed's numbers") for the 27B shape.
* Two more configs whose every number is worked out by hand below, factor by factor.
* HF transformers' own ``Qwen3_5ForCausalLM`` (built on the meta device, no memory)
  for the parameter count.
* A brute-force model of refcounted, copy-on-write blocks for shared prefixes and
  parallel samples.
* Real safetensors files for the checkpoint's weight bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hybridserve.config import ModelConfig
from hybridserve.errors import CheckpointError, ConfigError
from hybridserve import planner as pl

KiB, MiB, GiB = 1024, 1024**2, 1024**3

FIXTURE = Path("/work/shared/fixtures/qwen3_5_27b_shape.config.json")


def _fixture_dict() -> dict:
    if FIXTURE.exists():
        return json.loads(FIXTURE.read_text())
    # The same shape, for a checkout without the shared fixtures directory.
    return {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
    }


# Config A: 8 layers, full attention every 4th (layers 3 and 7) -> 2 full + 6 DeltaNet.
CONFIG_A = {
    "model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 48,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}

# Config B: irregular explicit layer types (3 full + 3 DeltaNet), float16 weights,
# key and value head dims that differ (a swap would show), conv kernel 3.
CONFIG_B = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 384, "num_hidden_layers": 6, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 128, "linear_num_key_heads": 4,
    "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 3,
    "layer_types": ["full_attention", "linear_attention", "linear_attention",
                    "full_attention", "linear_attention", "full_attention"],
    "max_position_embeddings": 8192, "torch_dtype": "float16", "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def seed_cfg() -> ModelConfig:
    return ModelConfig.from_dict(_fixture_dict())


# ---- the seed's table --------------------------------------------------------------


def test_seed_table_exactly(seed_cfg):
    pool = 23_859 * MiB
    # KV per token: 16 layers x K,V x 4 heads x 256 x 2 B = 64 KiB.
    assert pl.kv_bytes_per_token(seed_cfg) == 16 * 2 * 4 * 256 * 2 == 64 * KiB == 65_536
    # At the native 262,144 tokens: 16 GiB per sequence.
    assert pl.reserved_sequence_bytes(seed_cfg, include_conv=False) - pl.matrix_state_bytes(
        seed_cfg
    ) == 16 * GiB
    # One 16-token block over all attention layers: 1 MiB.
    assert pl.block_bytes(seed_cfg, 16) == 1 * MiB
    # DeltaNet matrix state: 48 layers x 48 heads x 128 x 128 x 4 B = 144 MiB.
    assert pl.matrix_state_bytes(seed_cfg) == 48 * 48 * 128 * 128 * 4 == 144 * MiB
    # Conv state: 48 layers x 10,240 channels x 3 x 2 B = 2.8125 MiB.
    assert pl.conv_state_bytes(seed_cfg) == 48 * 10_240 * 3 * 2 == int(2.8125 * MiB)
    # One 32,768-token session: 2 GiB KV + 144 MiB state = 2,192 MiB (the seed's count).
    assert pl.paged_sequence_bytes(seed_cfg, 32_768, 16, include_conv=False) == 2_192 * MiB
    # 10 sessions paged (with or without the conv state), 1 reserving the maximum.
    assert pl.sessions_paged(seed_cfg, pool, 32_768, 16, include_conv=False) == 10
    assert pl.sessions_paged(seed_cfg, pool, 32_768, 16) == 10
    assert pl.sessions_reserved_max(seed_cfg, pool, include_conv=False) == 1
    assert pl.sessions_reserved_max(seed_cfg, pool) == 1
    # Weights in bf16: the seed's "54 GB" (26.9 B parameters x 2 B).
    assert round(pl.weight_bytes(seed_cfg) / 1e9) == 54


def test_seed_report_matches_table(seed_cfg):
    r = pl.capacity_report(seed_cfg, context_len=32_768, pool_bytes=23_859 * MiB)
    assert (r.kv_bytes_per_token, r.block_bytes) == (65_536, MiB)
    assert (r.state_bytes_per_sequence, r.conv_state_bytes_per_sequence) == (144 * MiB, 2_949_120)
    assert r.kv_bytes_at_native_max == 16 * GiB
    assert r.kv_bytes_per_sequence == 2 * GiB
    assert r.session_bytes_paged_without_conv == 2_192 * MiB
    assert r.session_bytes_paged == 2_192 * MiB + 2_949_120
    assert (r.sessions_paged, r.sessions_paged_without_conv, r.sessions_reserved_max) == (10, 10, 1)


def test_seed_is_on_the_edge_of_eleven(seed_cfg):
    # The count flips from 10 to 11 exactly at 11 x 2,192 MiB = 24,112 MiB.
    assert pl.sessions_paged(seed_cfg, 24_112 * MiB - 1, 32_768, include_conv=False) == 10
    assert pl.sessions_paged(seed_cfg, 24_112 * MiB, 32_768, include_conv=False) == 11
    # Two native reservations need 2 x (16 GiB + 144 MiB) = 33,056 MiB.
    assert pl.sessions_reserved_max(seed_cfg, 33_056 * MiB - 1, include_conv=False) == 1
    assert pl.sessions_reserved_max(seed_cfg, 33_056 * MiB, include_conv=False) == 2


# ---- two more configs, by hand ---------------------------------------------------------


def test_config_a_by_hand():
    c = ModelConfig.from_dict(CONFIG_A)
    # KV per token: 2 layers x 2 (K,V) x 2 kv heads x 64 x 2 B = 1,024 B.
    assert pl.kv_bytes_per_token(c) == 1_024
    # Block of 16 tokens: 16 x 1,024 = 16,384 B.
    assert pl.block_bytes(c, 16) == 16_384
    # Matrix state: 6 layers x 4 value heads x 32 (d_k) x 48 (d_v) x 4 B = 147,456 B.
    assert pl.matrix_state_bytes(c) == 147_456
    # Conv channels: 2 x (2 key heads x 32) + 4 value heads x 48 = 128 + 192 = 320;
    # conv state: 6 layers x 320 x (4 - 1) x 2 B = 11,520 B.
    assert pl.conv_state_bytes(c) == 11_520
    # Session of 1,000 tokens: ceil(1000/16) = 63 blocks = 1,032,192 B;
    # + 147,456 + 11,520 = 1,191,168 B (1,179,648 B without conv).
    assert pl.paged_sequence_bytes(c, 1_000, 16) == 1_191_168
    assert pl.paged_sequence_bytes(c, 1_000, 16, include_conv=False) == 1_179_648
    # Reserving the native 4,096 tokens: 4,096 x 1,024 = 4,194,304 + 158,976 = 4,353,280 B.
    assert pl.reserved_sequence_bytes(c) == 4_353_280
    # Pool of 10 MiB = 10,485,760 B: 8 paged (8 x 1,191,168 = 9,529,344; 9 x = 10,720,512),
    # 2 reserved (2 x 4,353,280 = 8,706,560; 3 x = 13,059,840).
    assert pl.sessions_paged(c, 10 * MiB, 1_000, 16) == 8
    assert pl.sessions_paged(c, 10 * MiB, 1_000, 16, include_conv=False) == 8
    assert pl.sessions_reserved_max(c, 10 * MiB) == 2


def test_config_b_by_hand():
    c = ModelConfig.from_dict(CONFIG_B)
    # KV per token in fp8: 3 layers x 2 x 4 kv heads x 128 x 1 B = 3,072 B (6,144 in fp16).
    assert pl.kv_bytes_per_token(c, "float8_e4m3fn") == 3_072
    assert pl.kv_bytes_per_token(c) == 6_144
    # Block of 32 tokens: 32 x 3,072 = 98,304 B.
    assert pl.block_bytes(c, 32, "float8_e4m3fn") == 98_304
    # Matrix state: 3 layers x 8 value heads x 64 (d_k) x 32 (d_v) x 4 B = 196,608 B.
    assert pl.matrix_state_bytes(c) == 196_608
    # Conv channels: 2 x (4 x 64) + 8 x 32 = 512 + 256 = 768; state: 3 x 768 x (3-1) x the
    # cache dtype: 2 B in fp16 (the model dtype), 1 B in an fp8 cache -- the cache holds it
    # in the KV dtype, so the planner sizes it so (it used the model dtype: 9,216 B).
    assert pl.conv_state_bytes(c) == 9_216
    assert pl.conv_state_bytes(c, "float8_e4m3fn") == 4_608
    # Session of 5,000 tokens: ceil(5000/32) = 157 blocks x 98,304 = 15,433,728 B
    # + 196,608 + 4,608 = 15,634,944 B.
    assert pl.paged_sequence_bytes(c, 5_000, 32, "float8_e4m3fn") == 15_634_944
    # Native 8,192 tokens = 256 blocks of 32: 8,192 x 3,072 = 25,165,824 + 201,216
    # = 25,367,040 B.
    assert pl.reserved_sequence_bytes(c, 32, "float8_e4m3fn") == 25_367_040
    # Pool of 100 MiB = 104,857,600 B: 6 paged (7 x 15,634,944 = 109,444,608 > pool),
    # 4 reserved (5 x 25,367,040 = 126,835,200 > pool; 4 x = 101,468,160).
    assert pl.sessions_paged(c, 100 * MiB, 5_000, 32, "float8_e4m3fn") == 6
    assert pl.sessions_reserved_max(c, 100 * MiB, 32, "float8_e4m3fn") == 4


def _hf_param_count(d: dict) -> int:
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kwargs = {k: v for k, v in d.items() if k not in ("architectures", "model_type")}
    hf_cfg = Qwen3_5TextConfig(**kwargs)
    with torch.device("meta"):  # shapes only: the 27B shape costs no memory
        model = Qwen3_5ForCausalLM(hf_cfg)
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


@pytest.mark.parametrize(
    "name, d",
    [
        ("27b", _fixture_dict()),
        ("27b tied, attention bias", {**_fixture_dict(), "tie_word_embeddings": True,
                                      "attention_bias": True}),
        ("A", CONFIG_A),
        ("B", CONFIG_B),
    ],
)
def test_param_count_matches_hf(name, d):
    assert pl.param_count(ModelConfig.from_dict(d)) == _hf_param_count(d)


def test_param_count_of_vl_config_is_the_language_model():
    # The qwen3_5 VL wrapper nests the text fields; hybridserve loads only those.
    vl = {"model_type": "qwen3_5", "text_config": {**CONFIG_A, "model_type": "qwen3_5_text"},
          "vision_config": {"depth": 2}}
    assert pl.param_count(ModelConfig.from_dict(vl)) == _hf_param_count(CONFIG_A)


def test_weight_bytes_use_model_dtype():
    c = ModelConfig.from_dict({**CONFIG_A, "torch_dtype": "float32"})
    assert pl.weight_bytes(c) == 4 * _hf_param_count(CONFIG_A)


# ---- weights from a checkpoint -------------------------------------------------------


def test_checkpoint_weight_bytes_reads_safetensors_headers(tmp_path):
    from safetensors.numpy import save_file

    shard1 = {
        "model.embed_tokens.weight": np.zeros((10, 8), dtype=np.float16),  # 160 B
        "model.norm.weight": np.zeros((8,), dtype=np.float32),  # 32 B
    }
    shard2 = {
        "model.layers.0.mlp.up_proj.weight": np.zeros((3, 8), dtype=np.float16),  # 48 B
        "mtp.fc.weight": np.zeros((8, 8), dtype=np.float32),  # not loaded by the engine
        "model.visual.patch_embed.weight": np.zeros((4, 4), dtype=np.float32),  # nor this
    }
    save_file(shard1, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(shard2, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG_A))
    assert pl.checkpoint_weight_bytes(tmp_path) == 160 + 32 + 48
    assert pl.checkpoint_weight_bytes(tmp_path, text_only=False) == 160 + 32 + 48 + 256 + 64
    c = ModelConfig.from_json(tmp_path)
    assert pl.weight_bytes(c, tmp_path) == 240


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        pl.checkpoint_weight_bytes(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        pl.checkpoint_weight_bytes(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        pl.checkpoint_weight_bytes(tmp_path / "model.safetensors")


# ---- pool from the device --------------------------------------------------------------


def test_pool_from_device():
    # 80 GB x 0.9 = 72,000,000,000; - 50,000,000,000 weights - 2 GiB reserve.
    assert pl.pool_from_device(80 * 10**9, 50 * 10**9, utilization=0.9, reserve=2 * GiB) == (
        72_000_000_000 - 50_000_000_000 - 2_147_483_648
    )
    assert pl.pool_from_device(10_000, 1_000, utilization=1.0, reserve=0) == 9_000
    with pytest.raises(ConfigError, match="no memory left"):
        pl.pool_from_device(40 * 10**9, 54 * 10**9)
    with pytest.raises(ConfigError, match="utilization"):
        pl.pool_from_device(80 * 10**9, 1, utilization=1.5)


# ---- shared prefixes and parallel samples --------------------------------------------


def test_shared_prefix_by_hand(seed_cfg):
    # 4 sessions of 32,768 tokens sharing a 1,000-token prefix, 16-token blocks of 1 MiB:
    # floor(1000/16) = 62 full prefix blocks shared (992 tokens); the 8 remaining prefix
    # tokens sit in a partly-filled block each session fills on its own.
    # Own blocks per session: 2,048 - 62 = 1,986. Total: 62 + 4 x 1,986 = 8,006 blocks.
    s = pl.sharing_plan(seed_cfg, 23_859 * MiB, 32_768, 1_000, 4)
    assert (s.shared_blocks, s.private_blocks, s.total_blocks) == (62, 1_986, 8_006)
    slot = 144 * MiB + 2_949_120
    assert s.total_bytes == 8_006 * MiB + 4 * slot
    assert s.bytes_without_sharing == 4 * (2_048 * MiB + slot)
    # Most sessions in 23,859 MiB, keeping one 146.8125 MiB checkpoint of the prefix's
    # DeltaNet state: (23,859 - 62 - 146.8125) / (1,986 + 146.8125) = 11.09 -> 11,
    # against 10 without sharing.
    assert (s.checkpoint_slots, s.checkpoint_bytes) == (1, slot)
    assert (s.max_count, s.max_count_without_sharing) == (11, 10)
    assert s.max_count_evicting_checkpoint == 11
    # Where the checkpoint decides: a pool of exactly 11 sessions + the shared blocks.
    exact = 62 * MiB + 11 * (1_986 * MiB + slot)
    t = pl.sharing_plan(seed_cfg, exact, 32_768, 1_000, 4)
    assert (t.max_count, t.max_count_evicting_checkpoint) == (10, 11)
    # A prefix shorter than a block shares nothing and keeps no checkpoint.
    u = pl.sharing_plan(seed_cfg, exact, 32_768, 15, 4)
    assert (u.shared_blocks, u.checkpoint_slots, u.checkpoint_bytes) == (0, 0, 0)


def test_parallel_samples_by_hand(seed_cfg):
    # n = 4 samples of 32,768 tokens after a 32,767-token prompt (the default: each
    # sample has written its first token). floor(32767/16) = 2,047 full prompt blocks
    # shared; each sample owns 1 tail block (15 prompt tokens + its own) and 1 slot.
    p = pl.parallel_sampling_plan(seed_cfg, 23_859 * MiB, 32_768, 4)
    q = p.per_request
    assert (q.shared_len, q.shared_blocks, q.private_blocks, q.total_blocks) == (
        32_767, 2_047, 1, 2_051
    )
    # 2,051 MiB + 4 x 146.8125 MiB = 2,638.25 MiB; 23,859 / 2,638.25 = 9.04 -> 9 requests,
    # 36 sequences; without sharing a request is 4 x 2,194.8125 MiB -> 2 requests.
    assert p.bytes_per_request == 2_051 * MiB + 4 * (144 * MiB + 2_949_120)
    assert p.bytes_per_request == int(2_638.25 * MiB)
    assert (p.requests_that_fit, p.sequences_that_fit, p.requests_that_fit_without_sharing) == (
        9, 36, 2
    )
    # A 1,000-token prompt, 500 tokens each: 62 shared + 4 x (ceil(1500/16)=94 - 62 = 32).
    p = pl.parallel_sampling_plan(seed_cfg, 23_859 * MiB, 1_500, 4, prompt_len=1_000)
    assert (p.per_request.private_blocks, p.per_request.total_blocks) == (32, 62 + 4 * 32)


class _CowBlocks:
    """Brute-force refcounted blocks with copy-on-write, one token written at a time."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.refs: dict[int, int] = {}
        self.next_id = 0

    def _alloc(self) -> int:
        self.next_id += 1
        self.refs[self.next_id] = 1
        return self.next_id

    def append(self, table: list[int], length: int) -> int:
        """Write token number ``length`` (0-based) of a sequence; return the new length."""
        if length % self.bs == 0:
            table.append(self._alloc())
        elif self.refs[table[-1]] > 1:  # shared tail: copy before writing
            self.refs[table[-1]] -= 1
            table[-1] = self._alloc()
        return length + 1

    def fork(self, table: list[int]) -> list[int]:
        for b in table:
            self.refs[b] += 1
        return list(table)

    def live(self) -> int:
        return sum(1 for r in self.refs.values() if r > 0)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_parallel_samples_match_cow_simulation(block_size):
    c = ModelConfig.from_dict(CONFIG_A)
    for n in (1, 2, 3, 5):
        for prompt in range(0, 3 * block_size + 2):
            for gen in range(1, 2 * block_size + 2):
                sim = _CowBlocks(block_size)
                parent: list[int] = []
                length = 0
                for _ in range(prompt):
                    length = sim.append(parent, length)
                samples = [parent] + [sim.fork(parent) for _ in range(n - 1)]
                for table in samples:
                    ln = length
                    for _ in range(gen):
                        ln = sim.append(table, ln)
                p = pl.parallel_sampling_plan(
                    c, 10 * MiB, prompt + gen, n, prompt_len=prompt, block_size=block_size
                )
                assert p.per_request.total_blocks == sim.live(), (n, prompt, gen)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_shared_prefix_matches_prefix_cache_simulation(block_size):
    # A prefix cache shares only full blocks: key a block by its token contents.
    c = ModelConfig.from_dict(CONFIG_A)
    for k in (1, 2, 4):
        for prefix in range(0, 3 * block_size + 2):
            for ctx in range(max(prefix, 1), prefix + 2 * block_size + 2):
                cached: set[tuple] = set()
                own = 0
                for s in range(k):
                    tokens = [("p", i) if i < prefix else (s, i) for i in range(ctx)]
                    for start in range(0, ctx, block_size):
                        block = tuple(tokens[start:start + block_size])
                        if len(block) == block_size and all(t[0] == "p" for t in block):
                            cached.add(block)
                        else:
                            own += 1
                sp = pl.sharing_plan(c, 10 * MiB, ctx, prefix, k, block_size)
                assert sp.total_blocks == len(cached) + own, (k, prefix, ctx)
                slot = pl.state_slot_bytes(c)
                assert sp.total_bytes == sp.total_blocks * pl.block_bytes(c, block_size) + k * slot
                # One checkpoint of the state, at the end of the cached prefix blocks.
                assert sp.checkpoint_bytes == (slot if cached else 0)


def test_sharing_rejects_bad_lengths(seed_cfg):
    with pytest.raises(ConfigError, match="between 0 and the context"):
        pl.sharing_plan(seed_cfg, GiB, 100, 200, 2)
    with pytest.raises(ConfigError, match="below the per-sample context"):
        pl.parallel_sampling_plan(seed_cfg, GiB, 100, 2, prompt_len=100)
    with pytest.raises(ConfigError, match="native maximum"):
        pl.sessions_paged(seed_cfg, GiB, 262_145)


# ---- size_pools: the engine's split ----------------------------------------------------


def test_size_pools_from_expected_context_by_hand():
    c = ModelConfig.from_dict(CONFIG_A)
    # Slot = 147,456 + 11,520 = 158,976 B; sessions of 1,000 tokens cost 1,191,168 B ->
    # 8 slots; blocks: (10,485,760 - 8 x 158,976) // 16,384 = 9,213,952 // 16,384 = 562.
    plan = pl.size_pools(c, 10 * MiB, 16, expected_context_len=1_000)
    assert (plan.num_state_slots, plan.num_blocks) == (8, 562)
    assert plan.slot_bytes == 158_976 and plan.block_bytes == 16_384
    assert plan.kv_pool_bytes + plan.state_pool_bytes + plan.unused_bytes == 10 * MiB
    assert 0 <= plan.unused_bytes < plan.block_bytes
    # 63 blocks each at 1,000 tokens: min(8 slots, 562 // 63 = 8); at 4,000: 562 // 250 = 2.
    assert pl.max_concurrency(plan, 1_000) == 8
    assert pl.max_concurrency(plan, 4_000) == 2
    # Capped at 3 sequences: blocks (10,485,760 - 476,928) // 16,384 = 610.
    plan = pl.size_pools(c, 10 * MiB, 16, expected_context_len=1_000, max_num_seqs=3)
    assert (plan.num_state_slots, plan.num_blocks) == (3, 610)
    assert pl.max_concurrency(plan, 16) == 3


def test_size_pools_explicit_slots_by_hand():
    c = ModelConfig.from_dict(CONFIG_A)
    # 20 slots = 3,179,520 B; blocks (10,485,760 - 3,179,520) // 16,384 = 445.
    plan = pl.size_pools(c, 10 * MiB, 16, num_state_slots=20)
    assert (plan.num_state_slots, plan.num_blocks) == (20, 445)
    # Only max_num_seqs: that many slots.
    plan = pl.size_pools(c, 10 * MiB, 16, max_num_seqs=20)
    assert (plan.num_state_slots, plan.num_blocks) == (20, 445)


def test_size_pools_seed(seed_cfg):
    # 23,859 MiB, 32K sessions of 2,194.8125 MiB (conv counted) -> 10 slots of
    # 146.8125 MiB = 1,468.125 MiB; blocks: floor(23,859 - 1,468.125) = 22,390.
    plan = pl.size_pools(seed_cfg, 23_859 * MiB, 16, "bfloat16", expected_context_len=32_768)
    assert (plan.num_state_slots, plan.num_blocks) == (10, 22_390)
    assert pl.max_concurrency(plan, 32_768) == 10
    lines = pl.format_pool_log(plan)
    assert len(lines) == 2
    assert "22,390 blocks" in lines[0] and "1 MiB" in lines[0]
    assert "10 slots" in lines[1] and "144 MiB" in lines[1] and "2.8125 MiB" in lines[1]
    assert pl.format_max_concurrency(plan, 32_768) == "max concurrency at 32,768 tokens: 10"
    # The same pools under the reserve-maximum policy: 262,144 / 16 = 16,384 blocks per
    # sequence; 22,390 // 16,384 = 1 -- the seed's single session.
    assert plan.reserved_blocks_per_sequence == 16_384
    assert pl.max_concurrency_reserved(plan) == 1


def test_reserve_max_rounds_to_whole_blocks():
    # A native maximum of 1,000 tokens is reserved as ceil(1000/16) = 63 blocks of
    # 16,384 B = 1,032,192 B, + one 158,976 B slot = 1,191,168 B (config A otherwise).
    c = ModelConfig.from_dict({**CONFIG_A, "max_position_embeddings": 1_000})
    assert pl.reserved_blocks_per_sequence(c, 16) == 63
    assert pl.reserved_sequence_bytes(c, 16) == 1_191_168
    assert pl.sessions_reserved_max(c, 10 * MiB, 16) == 8
    # size_pools for 100-token sessions: each costs 7 blocks + a slot = 273,664 B ->
    # 38 slots (38 x 273,664 = 10,399,232); blocks (10,485,760 - 38 x 158,976) // 16,384
    # = 4,444,672 // 16,384 = 271. Paged: min(38, 271 // 7 = 38); reserved: 271 // 63 = 4.
    plan = pl.size_pools(c, 10 * MiB, 16, expected_context_len=100)
    assert (plan.num_state_slots, plan.num_blocks) == (38, 271)
    assert pl.max_concurrency(plan, 100) == 38
    assert pl.max_concurrency_reserved(plan) == 4


def test_size_pools_errors():
    c = ModelConfig.from_dict(CONFIG_A)
    with pytest.raises(ConfigError, match="expected context length"):
        pl.size_pools(c, 10 * MiB, 16)
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        pl.size_pools(c, MiB, 16, expected_context_len=4_000)
    with pytest.raises(ConfigError, match="more than the pool"):
        pl.size_pools(c, MiB, 16, num_state_slots=100)
    with pytest.raises(ConfigError, match="no room for a single"):
        pl.size_pools(c, 6 * 158_976 + 100, 16, num_state_slots=6)
    with pytest.raises(ConfigError, match="block_size"):
        pl.size_pools(c, MiB, 0, num_state_slots=1)


# ---- sizes ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, nbytes",
    [
        ("80GB", 80_000_000_000),
        ("80gb", 80_000_000_000),
        ("80GiB", 80 * 2**30),
        ("23859MiB", 23_859 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2 KiB", 2_048),
        ("512B", 512),
        ("1TB", 10**12),
    ],
)
def test_parse_size(text, nbytes):
    assert pl.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["80", "80G", "eighty GB", "", "-5GB", "0MiB", "1.2.3GB"])
def test_parse_size_rejects_with_hint(text):
    with pytest.raises(ConfigError, match="80GiB"):
        pl.parse_size(text)


def test_planner_does_not_import_torch():
    import hybridserve

    env = dict(os.environ, PYTHONPATH=str(Path(hybridserve.__file__).parent.parent))
    code = (
        "import sys, hybridserve.planner, hybridserve.cli; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
