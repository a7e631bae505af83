"""The planner under tensor parallelism (issue 19): what one rank holds, and how many
devices a model needs for K sessions of L tokens.

Oracles, none of them the planner's arithmetic:

* HF transformers' models built on the meta device (shapes, no memory), each parameter
  cut by NAME with the sharding rule written out here (:func:`_rank_numel`);
* the tensor-parallel runtime's real per-rank models, loaded slice by slice from tiny
  checkpoints (:func:`hybridserve.parallel.loader.load_sharded_model`): their parameter
  bytes, KV projection widths, DeltaNet heads and conv channels;
* a brute-force device search: every N from 1 to 64 tried with the oracle's validity
  rule, weights and a page-by-page packing of the rank's state items.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from hybridserve import planner as pl
from hybridserve.cli import main
from hybridserve.config import ModelConfig
from hybridserve.errors import ConfigError

PRESETS = Path(pl.__file__).parent.parent / "presets"
GiB = 1 << 30


def _preset(name: str) -> dict:
    return json.loads((PRESETS / f"{name}.json").read_text())


@functools.lru_cache(maxsize=None)
def _hf_shapes(name: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(parameter name, shape) of HF's model for a preset, built on the meta device."""
    import torch

    d = _preset(name)
    keep = {k: v for k, v in d.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    with torch.device("meta"):
        if d.get("num_experts"):
            from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

            model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**keep))
        else:
            from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

            model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**keep))
    return tuple((n, tuple(p.shape)) for n, p in model.named_parameters())


# ---- the oracle's sharding rule, by parameter name ---------------------------------

_WHOLE = ("norm.weight", "layernorm.weight", "mlp.gate.weight", "shared_expert_gate.weight", "o_proj.bias")


def _rank_numel(name: str, shape: tuple[int, ...], d: dict, n: int) -> int:
    """Elements of parameter ``name`` that one of ``n`` ranks holds: norms, the router,
    the shared-expert gate and o_proj's bias whole; K/V projections a 1/n share of the
    KV heads or one whole head when the ranks outnumber them; every other tensor (q_proj,
    o_proj, DeltaNet projections / conv1d / A_log / dt_bias / out_proj, MLP and expert
    matrices, embedding and LM head) an even 1/n along its split dimension."""
    numel = math.prod(shape)
    if name.endswith(_WHOLE):
        return numel
    if ".k_proj." in name or ".v_proj." in name:
        kv = d["num_key_value_heads"]
        return numel // kv * max(1, kv // n)
    assert numel % n == 0, name
    return numel // n


def _oracle_valid(d: dict, n: int) -> bool:
    kv = d["num_key_value_heads"]
    split = [d["num_attention_heads"], d["linear_num_key_heads"], d["linear_num_value_heads"], d["vocab_size"]]
    if d.get("num_experts"):
        split += [d["moe_intermediate_size"]] + [d.get("shared_expert_intermediate_size") or n]
    else:
        split.append(d["intermediate_size"])
    return all(s % n == 0 for s in split) and (kv % n == 0 or n % kv == 0)


def _oracle_rank_params(name: str, n: int) -> int:
    d = _preset(name)
    return sum(_rank_numel(p, s, d, n) for p, s in _hf_shapes(name))


def _pack(items: list[int], page: int) -> int:
    """Pages that ``items`` (bytes each, in order) fill when none may straddle a page."""
    pages, room = 0, 0
    for size in items:
        assert size <= page
        if size > room:
            pages, room = pages + 1, page
        room -= size
    return pages


def _oracle_rank_arena(d: dict, n: int, block: int = 16, el: int = 2) -> tuple[int, int]:
    """(page bytes, state pages) of one rank, from its own cache tensors: a page is one
    ``block``-token K/V block of its KV heads over all attention layers; a sequence's
    state is its value heads' [dk, dv] float32 matrices, packed first, then one conv item
    per DeltaNet layer ([its conv channels, kernel - 1] in the cache dtype, ``el`` bytes),
    packed after."""
    layers = d.get("layer_types") or ["full_attention" if (i + 1) % d.get("full_attention_interval", 4) == 0
                                      else "linear_attention" for i in range(d["num_hidden_layers"])]
    attn = sum(t == "full_attention" for t in layers)
    lin = len(layers) - attn
    kv_heads = max(1, d["num_key_value_heads"] // n)
    kv_block = attn * block * 2 * kv_heads * d["head_dim"] * el
    value_heads = d["linear_num_value_heads"] // n
    dk, dv = d["linear_key_head_dim"], d["linear_value_head_dim"]
    conv_channels = (2 * d["linear_num_key_heads"] * dk + d["linear_num_value_heads"] * dv) // n
    rec, conv = dk * dv * 4, conv_channels * (d["linear_conv_kernel_dim"] - 1) * el
    page = -(-max(kv_block, rec, conv) // 64) * 64
    return page, _pack([rec] * (lin * value_heads), page) + _pack([conv] * lin, page)


def _oracle_devices(name: str, sessions: int, context: int, memory: int) -> tuple[int | None, dict]:
    """Smallest N (1..64) whose per-device arena runs ``sessions`` of ``context`` tokens
    on devices of ``memory`` bytes (0.9 utilization, 2 GiB reserve, one sequence's state
    set aside for the CUDA graphs); and what each device holds at that N."""
    d = _preset(name)
    for n in range(1, 65):
        if not _oracle_valid(d, n):
            continue
        weights = _oracle_rank_params(name, n) * 2  # bfloat16
        budget = int(memory * 0.9) - weights - 2 * GiB
        if budget <= 0:
            continue
        page, state = _oracle_rank_arena(d, n)
        pages = budget // page - state
        fit = pages // (state + -(-context // 16))
        if fit >= sessions:
            return n, {"weights": weights, "budget": budget, "page": page, "pages": pages, "sessions": fit}
    return None, {}


# ---- what one rank holds -------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3.5-27b", "qwen3.5-122b-a10b", "qwen3.5-397b-a17b"])
def test_rank_weights_are_hf_parameters_cut_by_name(name):
    c = ModelConfig.from_dict(_preset(name))
    degrees = pl.valid_degrees(c)
    assert degrees == [n for n in range(1, 65) if _oracle_valid(_preset(name), n)]
    for n in degrees:
        assert pl.rank_param_count(c, n) == _oracle_rank_params(name, n), n
        assert pl.weight_bytes_per_device(c, n) == 2 * _oracle_rank_params(name, n), n


def _tiny(tmp_path, preset: str, **overrides):
    from hybridserve.model.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path / preset, preset=preset, seed=1, **overrides)


class _NoCollectives:
    """Loading needs no collective; a rank's model only keeps its group for forward."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size


# Tiny shapes that vary what matters: 1 KV head over 2 and 4 ranks (replicated), 3
# value heads per DeltaNet key head, attention biases (o_proj's whole on every rank),
# tied embeddings (one vocabulary shard serves both), MoE with a shared expert.
TINY = {
    "dense-kv1-bias": ("test-a", dict(num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6,
                                      attention_bias=True)),
    "dense-tied": ("test-a", dict(tie_word_embeddings=True)),
    "moe-kv1": ("moe-a", dict(num_key_value_heads=1, linear_num_key_heads=4, linear_num_value_heads=12)),
}


@pytest.mark.parametrize("preset, overrides", TINY.values(), ids=list(TINY))
def test_rank_memory_is_what_the_runtime_loads(tmp_path, preset, overrides):
    """Each rank's real shard: its parameter bytes are the planner's per-device weights;
    its K/V projections, DeltaNet heads and conv channels give the per-device KV per
    token and state per sequence the planner reports."""
    from hybridserve.parallel.loader import load_sharded_model
    from hybridserve.parallel.shard import ShardPlan

    from hybridserve.config import dtype_bytes

    d = _tiny(tmp_path, preset, **overrides)
    c = ModelConfig.from_json(d)
    el = dtype_bytes(c.torch_dtype)
    assert len(pl.valid_degrees(c)) >= 2
    for n in pl.valid_degrees(c)[:3]:
        share = pl.device_share(c, n, budget_bytes=64 << 20, context_len=64, cuda_graphs=False)
        for r in range(n):
            model = load_sharded_model(d, ShardPlan(c, r, n), _NoCollectives(r, n), dtype="float32")
            params = {id(p): p for p in model.parameters()}  # tied embeddings count once
            assert sum(p.numel() for p in params.values()) == pl.rank_param_count(c, n)
            assert share.weight_bytes_per_device == pl.rank_param_count(c, n) * el
            named = model.checkpoint_tensors()  # by checkpoint name (views into fused weights)
            kv = sum(named[f"layers.{i}.self_attn.k_proj.weight"].shape[0] * 2 for i in c.full_attention_layers)
            assert share.kv_bytes_per_token_per_device == kv * el  # the cache in the model dtype
            state = sum(named[f"layers.{i}.linear_attn.A_log"].numel() * c.linear_key_head_dim
                        * c.linear_value_head_dim * 4
                        + named[f"layers.{i}.linear_attn.conv1d.weight"].shape[0]
                        * (c.linear_conv_kernel_dim - 1) * el
                        for i in c.linear_attention_layers)
            assert share.state_bytes_per_sequence_per_device == state
        # The rank's arena: pages laid out for the rank's own heads.
        page, state_pages = _oracle_rank_arena(json.loads(Path(d, "config.json").read_text()), n, el=el)
        assert (share.arena.page_bytes, share.arena.state_pages) == (page, state_pages)


@pytest.mark.parametrize("preset, overrides", TINY.values(), ids=list(TINY))
def test_rank_mtp_weights_are_what_the_runtime_loads(tmp_path, preset, overrides):
    """Speculative decoding under tensor parallelism: each rank's real MTP shard (the
    sharded loader with load_mtp) holds the planner's per-device MTP parameters, and
    the device's weights grow by exactly those bytes."""
    from hybridserve.config import dtype_bytes
    from hybridserve.parallel.loader import load_sharded_model
    from hybridserve.parallel.shard import ShardPlan

    d = _tiny(tmp_path, preset, **overrides)
    c = ModelConfig.from_json(d)
    el = dtype_bytes(c.torch_dtype)
    for n in pl.valid_degrees(c)[:3]:
        off = pl.device_share(c, n, budget_bytes=64 << 20, context_len=64, cuda_graphs=False)
        on = pl.device_share(c, n, budget_bytes=64 << 20, context_len=64, cuda_graphs=False, speculative_tokens=2)
        for r in range(n):
            model = load_sharded_model(d, ShardPlan(c, r, n), _NoCollectives(r, n), dtype="float32", load_mtp=True)
            held = sum(p.numel() for p in model.mtp.parameters())
            assert held == pl.rank_mtp_param_count(c, n), (n, r)
        assert on.weight_bytes_per_device - off.weight_bytes_per_device == pl.rank_mtp_param_count(c, n) * el
        assert on.mtp_weight_bytes_per_device == pl.rank_mtp_param_count(c, n) * el
    from hybridserve.planner.weights import mtp_param_count

    assert pl.rank_mtp_param_count(c, 1) == mtp_param_count(c)


def test_each_rank_holds_a_share_of_every_sequence():
    # 27B: 1/N of the DeltaNet state and of the KV while N divides the 4 KV heads.
    c = ModelConfig.from_dict(_preset("qwen3.5-27b"))
    one = pl.device_share(c, 1, budget_bytes=GiB, context_len=1024)
    for n in (2, 4, 8):
        s = pl.device_share(c, n, budget_bytes=GiB, context_len=1024)
        assert s.state_bytes_per_sequence_per_device * n == one.state_bytes_per_sequence_per_device
        kv_share = 1 if n <= 4 else 2  # 8 ranks: each of the 4 KV heads on 2 of them
        assert s.kv_bytes_per_token_per_device * n == one.kv_bytes_per_token_per_device * kv_share
        assert s.kv_head_replicas == kv_share


# Each case fails exactly one dimension (every other one divides).
@pytest.mark.parametrize("name, change, n, dimension", [
    ("qwen3.5-27b", {}, 16, "num_attention_heads"),
    ("qwen3.5-27b", {"intermediate_size": 17_404}, 8, "intermediate_size"),
    ("qwen3.5-27b", {"vocab_size": 248_322}, 4, "vocab_size"),
    ("qwen3.5-122b-a10b", {}, 32, "linear_num_key_heads"),
    ("qwen3.5-122b-a10b", {"moe_intermediate_size": 1_000}, 16, "moe_intermediate_size"),
    ("qwen3.5-122b-a10b", {"shared_expert_intermediate_size": 1_000}, 16, "shared_expert_intermediate_size"),
])
def test_a_size_that_does_not_shard_names_the_dimension(capsys, tmp_path, name, change, n, dimension):
    d = {**_preset(name), **change}
    c = ModelConfig.from_dict(d)
    valid = [k for k in range(1, 65) if _oracle_valid(d, k)]
    assert n not in valid
    with pytest.raises(ConfigError, match=dimension) as e:
        pl.rank_config(c, n)
    assert ", ".join(map(str, valid)) + " devices" in str(e.value)  # the sizes that do shard it
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    assert main(["plan", str(path), "--tensor-parallel-size", str(n)]) == 2
    err = capsys.readouterr().err
    assert dimension in err and ", ".join(map(str, valid)) in err


def test_kv_heads_replicate_instead_of_refusing():
    # 122B-A10B has 2 KV heads: 4, 8 and 16 ranks each keep one (on 2, 4, 8 ranks each);
    # 3 KV heads over 2 ranks neither divide nor replicate evenly.
    c = ModelConfig.from_dict(_preset("qwen3.5-122b-a10b"))
    assert [pl.kv_head_replicas(c, n) for n in (1, 2, 4, 8, 16)] == [1, 1, 2, 4, 8]
    assert pl.rank_config(c, 16).num_key_value_heads == 1
    d = dict(_preset("qwen3.5-27b"), num_key_value_heads=3, num_attention_heads=24)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        pl.rank_config(ModelConfig.from_dict(d), 2)


# ---- how many devices ------------------------------------------------------------------


@pytest.mark.parametrize("name, sessions, context, memory", [
    ("qwen3.5-27b", 1, 32_768, 80 * 10**9),
    ("qwen3.5-27b", 64, 32_768, 80 * 10**9),
    ("qwen3.5-27b", 300, 8_192, 141 * 10**9),
    ("qwen3.5-27b", 10_000, 262_144, 80 * 10**9),  # no degree runs it
    ("qwen3.5-122b-a10b", 1, 262_144, 141 * 10**9),
    ("qwen3.5-122b-a10b", 100, 32_768, 80 * 10**9),
    ("qwen3.5-397b-a17b", 1, 32_768, 141 * 10**9),
    ("qwen3.5-397b-a17b", 200, 65_536, 141 * 10**9),
])
def test_devices_needed_matches_a_brute_force_search(name, sessions, context, memory):
    c = ModelConfig.from_dict(_preset(name))
    plan = pl.devices_needed(c, device_memory=memory, context_len=context, min_sessions=sessions)
    want, per_device = _oracle_devices(name, sessions, context, memory)
    assert plan.devices_needed == want
    if want is None:
        return
    got = plan.shares[-1]
    assert got.tensor_parallel == want
    assert (got.weight_bytes_per_device, got.budget_bytes_per_device, got.arena.page_bytes,
            got.arena.num_pages, got.sessions) == (per_device["weights"], per_device["budget"],
                                                   per_device["page"], per_device["pages"],
                                                   per_device["sessions"])
    # Every smaller valid degree was tried and runs fewer.
    assert all(s.sessions < sessions for s in plan.shares[:-1])


def test_plan_sessions_answers_the_device_count(capsys):
    # 27B, 64 sessions of 32K on 80 GB devices: 1 device holds 6, 2 hold 37, 4 hold 97.
    # By hand for 4: 26,895,998,464 params, 674,816 of them replicated (norms, q/k and
    # gated norms; test_cli_plan), the rest split 4 ways: 6,723,830,912 + 674,816 =
    # 6,724,505,728 params = 13,449,011,456 B; budget 72,000,000,000 - that - 2 GiB =
    # 56,403,504,896 B. The shard: 6 heads, 1 KV head, 4/12 DeltaNet heads: pages of 16
    # layers x 16 x 256 x 2 x 2 B = 256 KiB, 215,162 of them; state: 48 layers x 12
    # heads of 64 KiB at 4 a page = 144 pages + 48 conv items of 2,560 x 3 x 2 B =
    # 15,360 B at 17 a page = 3 pages: 147 (also the scratch) -> 215,015 pages; 32K =
    # 2,048 + 147 = 2,195 pages a session: 215,015 // 2,195 = 97.
    argv = ["plan", "qwen3.5-27b", "--sessions", "64", "--context", "32768"]
    d = json.loads(_run(capsys, argv + ["--json"]))
    dev = d["devices"]
    assert (dev["devices_needed"], dev["min_sessions"]) == (4, 64)
    four = dev["shares"][-1]
    assert four["weight_bytes_per_device"] == 13_449_011_456
    assert four["budget_bytes_per_device"] == 56_403_504_896
    assert (four["page_bytes"], four["state_pages"], four["pages_per_device"]) == (256 * 1024, 147, 215_015)
    assert (four["pages_per_session"], four["sessions"]) == (2_195, 97)
    assert [s["sessions"] for s in dev["shares"]] == [6, 37, 97]
    out = _run(capsys, argv)
    assert "devices needed for 64 sessions of 32,768 tokens" in out and "4 devices of 80 GB" in out
    assert "the arena on each of 4 devices" in out
    # --min-sessions is the old name; the two must agree.
    assert main(argv + ["--min-sessions", "65"]) == 2
    assert "disagree" in capsys.readouterr().err
    assert main(["plan", "qwen3.5-27b", "--pool-mib", "20000", "--sessions", "3"]) == 2
    assert "--device-memory" in capsys.readouterr().err


def _run(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name, n", [("qwen3.5-27b", 2), ("qwen3.5-122b-a10b", 4), ("qwen3.5-397b-a17b", 8)])
def test_plan_tensor_parallel_size_shows_each_device(capsys, name, n):
    argv = ["plan", name, "--device-memory", "h200", "--tensor-parallel-size", str(n)]
    tp = json.loads(_run(capsys, argv + ["--json"]))["tensor_parallel"]
    d = _preset(name)
    weights = _oracle_rank_params(name, n) * 2
    budget = int(141 * 10**9 * 0.9) - weights - 2 * GiB
    page, state = _oracle_rank_arena(d, n)
    pages = budget // page - state
    assert (tp["tensor_parallel"], tp["weight_bytes_per_device"], tp["budget_bytes_per_device"]) == (n, weights, budget)
    assert (tp["page_bytes"], tp["state_pages"], tp["pages_per_device"]) == (page, state, pages)
    assert tp["sessions"] == pages // (state + 32_768 // 16)
    out = _run(capsys, argv)
    assert f"tensor parallel over {n} devices" in out and f"the arena on each of {n} devices" in out
    assert f"{tp['sessions']:,} ({state + 2048:,} pages of" in out


def test_pool_mib_with_tensor_parallel_is_each_devices_budget(capsys):
    # 27B over 2 devices with 1,000 MiB each: pages of 512 KiB (2 KV heads a rank):
    # 2,000 of them, 147 state pages (8 heads of 64 KiB a page x 144 + 3 conv) aside for
    # the graphs: 1,853; 4K tokens = 256 + 147 = 403 pages -> 4 sessions.
    tp = json.loads(_run(capsys, ["plan", "qwen3.5-27b", "--pool-mib", "1000", "--context", "4096",
                                  "-tp", "2", "--json"]))["tensor_parallel"]
    assert (tp["page_bytes"], tp["pages_per_device"], tp["state_pages"], tp["sessions"]) == (
        512 * 1024, 1_853, 147, 4)
    assert tp["budget_source"] == "given explicitly, for each device"


def test_no_size_is_enough_says_what_the_largest_runs(capsys):
    # 397B-A17B on 80 GB devices: 16 is the largest size that shards it (32 does not
    # divide its 16 DeltaNet key heads) and holds fewer than 64 sessions of 32K.
    d = _preset("qwen3.5-397b-a17b")
    assert [n for n in range(1, 65) if _oracle_valid(d, n)][-1] == 16
    weights = _oracle_rank_params("qwen3.5-397b-a17b", 16) * 2
    page, state = _oracle_rank_arena(d, 16)
    fit = ((int(80e9 * 0.9) - weights - 2 * GiB) // page - state) // (state + 2_048)
    assert fit < 64
    argv = ["plan", "qwen3.5-397b-a17b", "--sessions", "64"]
    assert json.loads(_run(capsys, argv + ["--json"]))["devices"]["devices_needed"] is None
    out = _run(capsys, argv)
    assert f"none does: the largest that shards this model, 16 devices of 80 GB, runs {fit:,}" in out


def test_a_tensor_parallel_engine_sizes_its_arena_as_planned(tmp_path):
    """The engine on 2 ranks (gloo, CPU) cuts its byte budget into the pages the planner
    predicts for one device of 2: the rank's page size, state pages and page count, and
    the arena tensor it allocates is exactly that many pages (the planner's arena sizing
    is itself checked against a brute-force allocator in test_planner_arena)."""
    from hybridserve import LLM

    d = _tiny(tmp_path, "test-a", num_key_value_heads=1, linear_num_key_heads=2, linear_num_value_heads=6)
    c = ModelConfig.from_json(d)
    budget = 3_000_000
    want = pl.device_share(c, 2, budget_bytes=budget, context_len=64, cuda_graphs=False).arena
    one = pl.device_share(c, 1, budget_bytes=budget, context_len=64, cuda_graphs=False).arena
    # The one KV head is replicated (same page), the DeltaNet state halves: fewer state pages.
    assert want.page_bytes == one.page_bytes and want.state_pages < one.state_pages
    llm = LLM(d, tensor_parallel_size=2, dtype="float32", cpu_threads=1, kv_cache_memory_bytes=budget)
    try:
        got = llm.engine.arena_plan
        assert (got.page_bytes, got.state_pages, got.num_pages, got.total_pages) == (
            want.page_bytes, want.state_pages, want.num_pages, want.total_pages)
        assert llm.engine.cache.arena.numel() == want.total_pages * want.page_bytes
    finally:
        llm.engine.parallel.close()


def test_a_speculating_tensor_parallel_engine_sizes_its_arena_as_planned(tmp_path):
    """With speculation each rank's pages also hold its share of the MTP layer's KV:
    the engine's per-rank arena is the planner's for one device of 2 with k drafts."""
    from hybridserve import LLM

    d = _tiny(tmp_path, "test-a")
    c = ModelConfig.from_json(d)
    budget = 3_000_000
    want = pl.device_share(c, 2, budget_bytes=budget, context_len=64, cuda_graphs=False,
                           speculative_tokens=2).arena
    plain = pl.device_share(c, 2, budget_bytes=budget, context_len=64, cuda_graphs=False).arena
    assert want.page_bytes > plain.page_bytes
    llm = LLM(d, tensor_parallel_size=2, dtype="float32", cpu_threads=1, kv_cache_memory_bytes=budget,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    try:
        got = llm.engine.arena_plan
        assert (got.page_bytes, got.state_pages, got.num_pages, got.total_pages) == (
            want.page_bytes, want.state_pages, want.num_pages, want.total_pages)
        assert llm.engine.cache.arena.numel() == want.total_pages * want.page_bytes
    finally:
        llm.engine.parallel.close()
