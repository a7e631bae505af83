"""``hybridserve plan``: the seed's numbers through the command line, and clear refusals.

Expected values are the seed's table (DESIGN.md) and hand arithmetic, not the
planner's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import hybridserve
from hybridserve.cli import SUBCOMMANDS, main

MiB, GiB = 1024**2, 1024**3
FIXTURE = Path("/work/shared/fixtures/qwen3_5_27b_shape.config.json")

TINY = {
    "model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 48,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
    "max_position_embeddings": 4096, "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def seed_config(tmp_path_factory) -> str:
    if FIXTURE.exists():
        return str(FIXTURE)
    d = {
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4, "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
    }
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(d))
    return str(path)


def _json(capsys, argv) -> dict:
    rc = main(argv + ["--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_json_reproduces_the_seed(capsys, seed_config):
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--context", "32768"])
    assert d["kv_bytes_per_token"] == 65_536
    assert d["block_bytes"] == 1 * MiB
    assert d["state_bytes_per_sequence"] == 144 * MiB
    assert d["conv_state_bytes_per_sequence"] == 2_949_120  # 2.8125 MiB
    assert d["kv_bytes_at_native_max"] == 16 * GiB
    assert d["pool_bytes"] == 23_859 * MiB
    assert d["session_bytes_paged_without_conv"] == 2_192 * MiB
    assert d["sessions_paged"] == 10
    assert d["sessions_reserved_max"] == 1
    assert d["conv_state_counted"] is True


def test_omit_conv_state_is_the_seeds_count(capsys, seed_config):
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--omit-conv-state"])
    assert d["conv_state_counted"] is False
    assert d["session_bytes_paged"] == 2_192 * MiB  # 2 GiB KV + 144 MiB
    assert (d["sessions_paged"], d["sessions_reserved_max"]) == (10, 1)


def test_table_shows_the_seeds_rows(capsys, seed_config):
    assert main(["plan", seed_config, "--pool-mib", "23859"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line for line in out.splitlines() if "  " in line}
    assert "65,536 B (64 KiB)" in out
    assert "16 GiB" in rows["KV per sequence at the native 262,144 tokens"]
    assert rows["one 16-token block (all attention layers)"].endswith("1 MiB")
    assert rows["DeltaNet matrix state per sequence (float32)"].endswith("144 MiB")
    assert "2.8125 MiB" in out and "2,192 MiB" in out and "23,859 MiB" in out
    assert rows["sessions that fit at 32,768 tokens, paged"].split()[-1] == "10"
    assert rows["sessions that fit, reserving the native maximum"].split()[-1] == "1"


def test_other_context_block_size_and_dtype(capsys, seed_config):
    # 8,192 tokens in 32-token fp8 blocks: 32 KiB per token, 1 MiB blocks = 1 MiB pages.
    # A sequence's state in pages: 48 x 48 recurrent heads of 64 KiB, 16 a page = 144;
    # conv in the fp8 cache dtype is 10,240 x 3 x 1 B = 30,720 B a layer, 34 a page ->
    # ceil(48 / 34) = 2; state = 146 pages. A session: 256 blocks + 146 = 402 pages.
    # 23,859 pages - 146 CUDA-graph scratch = 23,713; 23,713 // 402 = 58 (59 x 402 =
    # 23,718 is 5 pages too many: the scratch state is what costs the 59th session).
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--context", "8192",
                       "--block-size", "32", "--kv-dtype", "float8_e4m3fn"])
    assert (d["kv_bytes_per_token"], d["block_bytes"]) == (32_768, MiB)
    assert d["arena"]["layout"]["state_pages"] == 146
    assert d["arena"]["scratch_pages"] == 146
    assert d["sessions_paged"] == 58
    # Reserving 262,144 tokens = 8,192 blocks + 146 = 8,338 pages: 23,713 // 8,338 = 2.
    assert d["sessions_reserved_max"] == 2
    # The seed's byte count (no scratch, no page padding): 256 MiB + 146.8125 MiB - fp8
    # conv 1.40625 MiB = 401.40625 MiB a session; 23,859 / 401.40625 = 59.4 -> 59.
    assert d["seed_sessions_paged"] == 59
    # Without CUDA graphs nothing is set aside: 23,859 // 402 = 59.
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--context", "8192",
                       "--block-size", "32", "--kv-dtype", "float8_e4m3fn", "--enforce-eager"])
    assert (d["arena"]["scratch_pages"], d["sessions_paged"]) == (0, 59)


def test_scenarios_in_json(capsys, seed_config):
    d = _json(capsys, ["plan", seed_config, "--pool-mib", "23859", "--shared-prefix", "1000",
                       "--sessions", "4", "--n", "4"])
    # In the arena's 1 MiB pages, 23,859 - 147 scratch = 23,712 for sequences.
    # 62 shared blocks + 4 x 1,986 own (see test_planner's hand arithmetic); the most
    # sessions keeping the prefix's 147-page checkpoint: (23,712 - 62 - 147) // (1,986 +
    # 147) = 23,503 // 2,133 = 11.
    sp = d["shared_prefix"]
    assert (sp["shared_blocks"], sp["total_blocks"], sp["max_count"]) == (62, 8_006, 11)
    assert sp["checkpoint_bytes"] == 147 * MiB
    # n = 4 after a 32,767-token prompt: 2,047 shared + 4 x 1 own blocks + 4 x 147 state
    # pages = 2,639 pages a request; 23,712 // 2,639 = 8 (9 would need 23,751: the
    # scratch state costs the ninth request the seed's byte count had).
    ps = d["parallel_sampling"]
    assert (ps["blocks_per_request"], ps["bytes_per_request"]) == (2_051, 2_639 * MiB)
    assert (ps["requests_that_fit"], ps["sequences_that_fit"]) == (8, 32)


def test_pool_from_device_memory(capsys, tmp_path):
    # Tiny model, float32 weights: HF's parameter count x 4 B. The pool is
    # 1 GiB x 0.5 - weights - 100 MiB reserve.
    import torch
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    with torch.device("meta"):
        params = sum(p.numel() for p in Qwen3_5ForCausalLM(hf_cfg).parameters())
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "torch_dtype": "float32"}))
    d = _json(capsys, ["plan", str(cfg), "--device-memory", "1GiB",
                       "--gpu-memory-utilization", "0.5", "--reserve", "100MiB",
                       "--context", "1000"])
    assert d["weight_bytes"] == params * 4
    assert d["pool_bytes"] == GiB // 2 - params * 4 - 100 * MiB


def test_checkpoint_directory_counts_safetensors(capsys, tmp_path):
    from safetensors.numpy import save_file

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    save_file({"model.embed_tokens.weight": np.zeros((1000, 256), dtype=np.float16)},
              str(tmp_path / "model.safetensors"))
    d = _json(capsys, ["plan", str(tmp_path), "--device-memory", "1GB", "--reserve", "1MiB",
                       "--context", "1000"])
    assert d["weight_bytes"] == 1000 * 256 * 2
    assert d["pool_bytes"] == 900_000_000 - 512_000 - MiB


@pytest.mark.parametrize(
    "argv, hint",
    [
        (["--device-memory", "80G"], "80GiB"),
        (["--device-memory", "lots"], "80GiB"),
        (["--reserve", "2"], "23859MiB"),
        (["--pool-mib", "-5"], "positive"),
        (["--pool-mib", "1.5GiB"], "whole number"),
        (["--gpu-memory-utilization", "1.5"], "(0, 1]"),
        (["--kv-dtype", "int3"], "bfloat16"),
        (["--context", "300000"], "native maximum"),
        (["--shared-prefix", "100"], "--sessions"),
        (["--prompt-len", "100"], "--n"),
        (["--device-memory", "lots"], "h200"),
        (["--pool-mib", "100"], "at least 295 MiB"),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, seed_config, argv, hint):
    assert main(["plan", seed_config] + argv) == 2
    err = capsys.readouterr().err
    assert "error" in err and hint in err


def test_missing_config_exits_2(capsys, tmp_path):
    assert main(["plan", str(tmp_path / "nope.json")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_no_subcommand_exits_2(capsys):
    assert main([]) == 2
    assert "required: COMMAND" in capsys.readouterr().err


def test_subcommand_registry():
    assert "plan" in SUBCOMMANDS
    assert callable(SUBCOMMANDS["plan"].run) and callable(SUBCOMMANDS["plan"].add_arguments)


def test_python_dash_m(seed_config):
    env = dict(os.environ, PYTHONPATH=str(Path(hybridserve.__file__).parent.parent))
    proc = subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", "plan", seed_config, "--pool-mib", "23859",
         "--json"],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert (d["sessions_paged"], d["sessions_reserved_max"]) == (10, 1)
    bad = subprocess.run(
        [sys.executable, "-m", "hybridserve.cli", "plan", seed_config, "--device-memory", "80"],
        env=env, capture_output=True, text=True,
    )
    assert bad.returncode == 2 and "80GB" in bad.stderr


def test_shipped_preset_is_the_27b_shape_and_plans_the_seed(capsys, seed_config):
    """``plan qwen3.5-27b`` needs no file outside the package and gives the seed's table."""
    from hybridserve.presets import preset_names, preset_path

    assert "qwen3.5-27b" in preset_names()
    shipped = json.loads(Path(preset_path("qwen3.5-27b")).read_text())
    expect = json.loads(Path(seed_config).read_text())
    for key, value in expect.items():
        assert shipped[key] == value, key
    d = _json(capsys, ["plan", "qwen3.5-27b", "--pool-mib", "23859"])
    assert (d["sessions_paged"], d["sessions_reserved_max"]) == (10, 1)
    assert main(["plan", "qwen9-1t"]) == 2
    assert "qwen3.5-27b" in capsys.readouterr().err


def test_a_model_too_big_for_one_device_gets_a_device_count(capsys, seed_config):
    # 27B in bf16 is 26,895,998,464 x 2 = 53,791,996,928 B; 40 GB x 0.9 = 36 GB cannot
    # hold it. On 2 devices each holds half the sharded parameters plus every replicated
    # one (norms: 64 x 2 x 5,120 + 5,120 = 660,480; q/k norms 16 x 2 x 256 = 8,192;
    # DeltaNet gated norms 48 x 128 = 6,144; 674,816 in all):
    # (26,895,998,464 - 674,816) / 2 + 674,816 = 13,448,336,640 params = 26,896,673,280 B;
    # budget 36,000,000,000 - 26,896,673,280 - 2 GiB = 6,955,843,072 B. The shard (12
    # heads, 2 KV heads, 8/24 DeltaNet heads) has 512 KiB pages: 13,267 of them, 147 of
    # which are scratch state (144 recurrent pages of 8 heads + 3 conv pages of 17
    # layers of 30,720 B); 13,120 // (2,048 + 147) = 5 sessions of 32,768 tokens.
    d = _json(capsys, ["plan", seed_config, "--device-memory", "40GB"])
    assert d["pool_bytes"] < 0 and d["arena"] is None and d["sessions_paged"] == 0
    dev = d["devices"]
    assert dev["devices_needed"] == 2
    one, two = dev["shares"]
    assert (one["tensor_parallel"], one["sessions"]) == (1, 0)
    assert two["weight_bytes_per_device"] == 26_896_673_280
    assert two["budget_bytes_per_device"] == 6_955_843_072
    assert (two["page_bytes"], two["pages_per_device"], two["sessions"]) == (512 * 1024, 13_120, 5)
    assert main(["plan", seed_config, "--device-memory", "40GB"]) == 0
    out = capsys.readouterr().out
    assert "2 devices of 40 GB" in out


def test_moe_preset_on_one_h200(capsys):
    # Qwen3.5-35B-A3B, bf16, on one H200 (141 GB): 34,660,610,688 parameters x 2 B =
    # 69,321,221,376 B; budget 126,900,000,000 - that - 2 GiB = 55,431,294,976 B.
    # Pages: 10 attention layers x 16 tokens x 2 KV heads x 256 x 2 (K, V) x 2 B =
    # 327,680 B; 55,431,294,976 // 327,680 = 169,162. State: 30 x 32 recurrent heads of
    # 64 KiB, 5 a page = 192 pages; conv 8,192 channels x 3 x 2 B = 49,152 B a layer,
    # 6 a page = 5 pages; 197 in all, set aside once for the CUDA graphs: 168,965 left.
    # At 32,768 tokens a session is 2,048 + 197 = 2,245 pages: 75 sessions; reserving
    # 262,144 tokens it is 16,384 + 197 = 16,581 pages: 10.
    d = _json(capsys, ["plan", "qwen3.5-35b-a3b", "--device-memory", "h200"])
    assert d["model_type"] == "qwen3_5_moe_text"
    assert (d["num_experts"], d["num_experts_per_tok"]) == (256, 8)
    assert d["weight_bytes"] == 69_321_221_376
    assert d["pool_bytes"] == 55_431_294_976
    assert (d["arena"]["page_bytes"], d["arena"]["total_pages"], d["arena"]["num_pages"]) == (
        327_680, 169_162, 168_965)
    assert (d["sessions_paged"], d["sessions_reserved_max"]) == (75, 10)
    assert d["devices"]["devices_needed"] == 1
    assert main(["plan", "qwen3.5-35b-a3b", "--device-memory", "h200", "--context", "8192"]) == 0
    out = capsys.readouterr().out
    # 8,192 tokens: 512 + 197 = 709 pages; 168,965 // 709 = 238.
    assert "sessions that fit at 8,192 tokens: 238 paged" in out


def test_flagship_needs_eight_h200s(capsys):
    # Qwen3.5-397B-A17B: 396,346,350,336 parameters, of which replicated on every device
    # the norms (60 x 2 x 4,096 + 4,096 = 495,616; q/k norms 15 x 512 = 7,680; gated
    # norms 45 x 128 = 5,760), the routers (60 x 512 x 4,096 = 125,829,120) and the shared
    # experts' gates (60 x 4,096 = 245,760): 126,583,936. On 4 devices each holds
    # (396,346,350,336 - 126,583,936) / 4 + 126,583,936 = 99,181,525,536 params =
    # 198.4 GB > 126.9 GB usable. On 8 the 2 KV heads replicate: each device holds one
    # KV head's k/v_proj (15 layers x 2 x 4,096 x 256 = 31,457,280) instead of an eighth
    # of both (15 x 2 x 4,096 x 512 / 8 = 7,864,320), so
    # (396,346,350,336 - 126,583,936) / 8 + 126,583,936 + 31,457,280 - 7,864,320 =
    # 49,677,647,696 params = 99,355,295,392 B, budget
    # 126,900,000,000 - that - 2 GiB = 25,397,220,960 B.
    d = _json(capsys, ["plan", "qwen3.5-397b-a17b", "--device-memory", "h200"])
    dev = d["devices"]
    assert dev["devices_needed"] == 8
    assert [s["tensor_parallel"] for s in dev["shares"]] == [1, 2, 4, 8]
    assert [s["sessions"] for s in dev["shares"]] == [0, 0, 0, 47]
    eight = dev["shares"][-1]
    assert eight["weight_bytes_per_device"] == 99_355_295_392
    assert eight["budget_bytes_per_device"] == 25_397_220_960
    # The 8-way shard: 4 heads, 1 KV head (each of the 2 on 4 devices), 2/8 DeltaNet
    # heads. Pages: 15 layers x 16 x 1 x 256 x 2 x 2 B = 245,760 B; 103,341 of them.
    # State: 45 x 8 heads of 64 KiB, 3 a page (48 KiB of each page padding) = 120 pages;
    # conv 1,536 x 3 x 2 B = 9,216 B a layer, 26 a page = 2 pages; 122 pages, 122 of
    # scratch: 103,219 left; 32,768 tokens = 2,048 + 122 = 2,170 pages -> 47 sessions.
    assert eight["kv_head_replicas"] == 4
    assert (eight["page_bytes"], eight["pages_per_device"]) == (245_760, 103_219)


def test_devices_for_more_sessions(capsys):
    # One H200 runs 75 sessions of 32K of Qwen3.5-35B-A3B (test_moe_preset_on_one_h200);
    # 76 need 2 devices. Each holds (34,660,610,688 - 21,228,288 replicated) / 2 +
    # 21,228,288 = 17,340,919,488 params (replicated: norms 40 x 2 x 2,048 + 2,048 =
    # 165,888, q/k norms 10 x 512 = 5,120, gated norms 30 x 128 = 3,840, routers 40 x 256
    # x 2,048 = 20,971,520, shared gates 40 x 2,048 = 81,920) = 34,681,838,976 B; budget
    # 126,900,000,000 - that - 2 GiB = 90,070,677,376 B. The 2-way shard (8 heads, 1 KV
    # head, 8/16 DeltaNet heads): pages of 10 x 16 x 256 x 2 x 2 B = 163,840 B, 549,747 of
    # them; state 30 x 16 heads of 64 KiB, 2 a page = 240 + conv 4,096 x 3 x 2 B = 24,576 B
    # a layer, 6 a page = 5: 245 pages, also the scratch: 549,502 left; 32K = 2,048 + 245
    # = 2,293 pages -> 239 sessions.
    d = _json(capsys, ["plan", "qwen3.5-35b-a3b", "--device-memory", "h200", "--min-sessions", "76"])
    dev = d["devices"]
    assert (dev["devices_needed"], dev["min_sessions"]) == (2, 76)
    two = dev["shares"][-1]
    assert two["weight_bytes_per_device"] == 34_681_838_976
    assert two["budget_bytes_per_device"] == 90_070_677_376
    assert (two["page_bytes"], two["pages_per_device"], two["sessions"]) == (163_840, 549_502, 239)
    assert main(["plan", "qwen3.5-35b-a3b", "--device-memory", "h200", "--min-sessions", "0"]) == 2


def test_flagship_table_shows_each_devices_arena(capsys):
    # The 8-way shard's arena (see test_flagship_needs_eight_h200s for the arithmetic):
    # 2,170 pages a 32K session; 122 state pages hold 45 x 8 x 64 KiB + 45 x 9,216 B =
    # 24,007,680 B in 122 x 245,760 = 29,982,720 B: 5,975,040 B (5.6982 MiB) padding.
    assert main(["plan", "qwen3.5-397b-a17b", "--device-memory", "h200"]) == 0
    out = capsys.readouterr().out
    assert "the arena on each of 8 devices" in out
    assert "47 paged (2,170 pages each)" in out
    assert "122 pages (120 recurrent" in out and "padding 5.6982 MiB" in out
