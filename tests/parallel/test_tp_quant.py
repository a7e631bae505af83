"""tensor_parallel_size=2 (gloo, two processes) over quantized checkpoints -- GGUF block
files (a k-quant mix and Q8_0), FP8 and AWQ safetensors -- against the one-process
engine on the same file (the oracle: the same kernels on the unsplit weights), and the
refusal of a split a format cannot make.

Bounds (max |TP - one process| / max(|one process|, 1) over every logits row the TP
driver computed):

- FP8 / AWQ (weights kept quantized, float32): ``SAFETENSORS_TOL`` 1e-4, as the float
  TP test: both sides multiply the same widened weights by the same unrounded float32
  activations; only the order of float32 sums differs (each rank sums its half of a
  row-parallel product, the all-reduce adds the halves).
- GGUF: ``GGUF_TOL``. Every split falls on a block boundary, so each rank's kernel sees
  the same blocks with the same 8-bit rounding of the same activation block as the one
  process; but the float32 summation order differs, and a difference in the last bit of
  an activation can move its 8-bit rounding by one step (1/127 of its block's largest
  value) in the next product; through a few layers of a tiny random model that stays
  within 1e-3 of the largest logit here. Greedy tokens: equal outright.
"""

from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.errors import ConfigError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "quant"))
sys.path.insert(0, os.path.dirname(__file__))

SAFETENSORS_TOL = 1e-4
GGUF_TOL = 1e-3
ENGINE = dict(dtype="float32", cpu_threads=1, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)

# GGUF shapes whose every split at TP=2 falls on block boundaries: DeltaNet value heads
# of 32 (one per key head and rank: the ssm_out runs are whole Q8_0 blocks); for the
# k-quants 256-column blocks, so attention heads of 128 and value heads of 256.
GGUF_CASES = {
    "q8_0": dict(preset="test-a", qtype="q8_0", linear_value_head_dim=32),
    "q4_k_m": dict(preset="test-a", qtype="q4_k", types={"ffn_down": "q6_k", "attn_v": "q6_k", "attn_qkv": "q5_k"},
                   hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=128,
                   linear_value_head_dim=256),
    "moe-q8_0": dict(preset="moe-a", qtype="q8_0", linear_value_head_dim=32, moe_intermediate_size=64,
                     shared_expert_intermediate_size=64),
    # The LM head tied to an embedding kept in blocks: both vocabulary-parallel from the
    # same row shard.
    "q4_0-tied": dict(preset="test-a", qtype="q4_0", linear_value_head_dim=32, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    from gguf_files import write_gguf

    root = tmp_path_factory.mktemp("tp-gguf")
    made = {}

    def make(name, **kw):
        if name not in made:
            made[name] = write_gguf(root / f"{name}.gguf", seed=11, **kw)[0]
        return made[name]

    return make


@pytest.fixture(scope="module")
def quant_ckpts(tmp_path_factory):
    from hybridserve.quant.tiny import DENSE, MOE, write_quantized_checkpoint

    root = tmp_path_factory.mktemp("tp-quant")
    # AWQ at group 64: the tiny shapes' row-parallel inputs (128 wide) split into whole
    # groups at TP=2 (group 128 cannot split them: see the refusal test).
    made = {m: write_quantized_checkpoint(root / m, m, seed=5, group_size=64 if m == "awq" else 128,
                                          **DENSE)[0] for m in ("fp8", "awq")}
    # MoE: the routed and shared experts dequantized at load (each rank its slice), the
    # attention / DeltaNet projections kept.
    made["fp8-moe"] = write_quantized_checkpoint(root / "fp8-moe", "fp8", seed=5, **MOE)[0]
    return made


class RowCapture:
    """Every logits row the driver's runner returns, by (request, position)."""

    def __init__(self, engine):
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        inner = engine.runner.execute

        def execute(plan, *rest):
            step = inner(plan, *rest)
            if step is not None:
                seq_lens = plan.seq_lens
                for row, b in enumerate(step.batch_index.tolist()):
                    self.rows[(plan.request_ids[b], int(seq_lens[b]) - 1)] = step.logits[row].detach().clone()
            return step

        engine.runner.execute = execute


def _run(llm: LLM, vocab: int):
    rng = random.Random(3)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 23, 40)]
    cap = RowCapture(llm.engine)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    # Requests are numbered per engine: key the rows by prompt order instead.
    order = {o.request_id: i for i, o in enumerate(outs)}
    rows = {(order[r], p): v for (r, p), v in cap.rows.items()}
    return [list(o.outputs[0].token_ids) for o in outs], rows


def _compare(path: str, tol: float, vocab: int = 256):
    tp = LLM(path, tensor_parallel_size=2, num_pages=48, **ENGINE)
    toks_tp, rows_tp = _run(tp, vocab)
    del tp
    one = LLM(path, num_pages=48, **ENGINE)
    toks_one, rows_one = _run(one, vocab)
    del one
    assert rows_tp and set(rows_tp) == set(rows_one)
    worst = max(float((rows_tp[k] - rows_one[k]).abs().max() / rows_one[k].abs().max().clamp(min=1.0))
                for k in rows_tp)
    assert worst <= tol, worst
    assert toks_tp == toks_one
    return worst


@pytest.mark.parametrize("case", sorted(GGUF_CASES))
def test_tp2_gguf_matches_one_process(case, gguf_files):
    _compare(gguf_files(case, **GGUF_CASES[case]), GGUF_TOL)


@pytest.mark.parametrize("method,form", [("fp8", "keep"), ("awq", "keep"), ("fp8", "dequantize"),
                                         ("fp8-moe", "keep")])
def test_tp2_quantized_safetensors_match_one_process(method, form, quant_ckpts, monkeypatch):
    # "keep": served quantized (the native kernels on the CPU; FP8's row-parallel inputs
    # of 128 split inside a scale block, so through the zero-padded column window);
    # "dequantize" (the CPU default): each rank's slice dequantized at load. The workers
    # inherit the variable.
    monkeypatch.setenv("HYBRIDSERVE_QUANT_CPU", form)
    _compare(quant_ckpts[method], SAFETENSORS_TOL)


# ---- refusals and the shard's content, without spawning ranks


def _load_rank(path, rank, n=2, load_mtp=False):
    from hybridserve.config import ModelConfig
    from hybridserve.parallel import ShardPlan
    from hybridserve.parallel.loader import load_sharded_model

    cfg = ModelConfig.from_json(path)
    return load_sharded_model(path, ShardPlan(cfg, rank, n), SimpleNamespace(rank=rank, world_size=n),
                              dtype="float32", load_mtp=load_mtp)


def test_gguf_split_inside_a_block_is_refused(gguf_files):
    # test-a as it is: DeltaNet value heads of 16, so each rank's ssm_out columns are
    # runs of 16 inside Q8_0's 32-column blocks.
    path = gguf_files("q8_0-heads16", preset="test-a", qtype="q8_0")
    with pytest.raises(ConfigError, match=r"ssm_out\.weight.*Q8_0.*multiple of 32.*\[1\]"):
        _load_rank(path, 0)
    with pytest.raises(ConfigError, match="ssm_out"):
        LLM(path, tensor_parallel_size=2, num_pages=48, **ENGINE)


def test_awq_split_inside_a_group_is_refused(tmp_path):
    from hybridserve.quant.tiny import DENSE, write_quantized_checkpoint

    path, _ = write_quantized_checkpoint(tmp_path, "awq", seed=5, group_size=128, **DENSE)
    with pytest.raises(ConfigError, match=r"awq.*multiple of 128"):
        _load_rank(path, 1)


def test_gguf_shards_hold_blocks_and_rebuild_the_weights(gguf_files):
    # Each rank's block shards put side by side are the one-process weights: column-
    # parallel by rows, row-parallel by columns, the embedding by vocabulary rows; the
    # k-quant mix's parts stay in their own block types. With the MTP layer: its fc
    # ([H, 2H], nextn.eh_proj) split by input columns like a row-parallel projection.
    from hybridserve.model.loader import load_model
    from hybridserve.quant.ggml import GGMLWeight

    path = gguf_files("q4_k_m-mtp", mtp=True, **GGUF_CASES["q4_k_m"])
    full, cfg = load_model(path, progress=False, load_mtp=True)
    shards = [_load_rank(path, r, load_mtp=True) for r in range(2)]
    assert isinstance(full.mtp.fc.qweight, GGMLWeight)
    mods = [dict(s.named_modules()) for s in shards]
    for name, m in full.named_modules():
        q = getattr(m, "qweight", None)
        if q is None or name.endswith(("in_proj", "qkv_proj")):  # per-head fused rows: test_tp_loader's rule
            continue
        a, b = (mm[name].qweight for mm in mods)
        if name in ("embed_tokens", "lm_head") or name.endswith("gate_up_proj"):
            if name.endswith("gate_up_proj"):
                i = q.shape[0] // 2
                want = torch.cat([a.dequantize()[:i // 2], b.dequantize()[:i // 2],
                                  a.dequantize()[i // 2:], b.dequantize()[i // 2:]])
            else:
                want = torch.cat([a.dequantize(), b.dequantize()])
        else:
            want = torch.cat([a.dequantize(), b.dequantize()], dim=1)
        assert torch.equal(want, q.dequantize()), name
        if isinstance(q, GGMLWeight):
            assert isinstance(a, GGMLWeight) and a.qtype == q.qtype and a.nbytes * 2 == q.nbytes, name


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_quantized_safetensors_ranks_read_only_their_slices(method, quant_ckpts, monkeypatch):
    # Each rank reads its slices through get_slice (never a whole tensor), widened at most
    # to whole scale blocks (FP8: 128 columns) / groups and int32 packs (AWQ); the split
    # quantized tensors are read about half each.
    import hybridserve.parallel.loader as tp_loader
    from test_tp_loader import RecordingOpen

    path = quant_ckpts[method]
    monkeypatch.setenv("HYBRIDSERVE_QUANT_CPU", "keep")
    monkeypatch.setitem(tp_loader.__dict__, "_real_safe_open", tp_loader.safe_open)
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", framework="pt") as f:
        sizes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    total = {n: int(torch.Size(s).numel()) for n, s in sizes.items()}
    reads = [{}, {}]
    for rank in range(2):
        monkeypatch.setattr(tp_loader, "safe_open", RecordingOpen(reads[rank]))
        _load_rank(path, rank)
    lead = "weight" if method == "fp8" else "qweight"
    split = [n for n in total if n.endswith(f".{lead}") and any(
        k in n for k in ("o_proj", "down_proj", "out_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z"))]
    assert split
    for n in split:
        stem = n.rpartition(".")[0]
        for r in range(2):
            got = reads[r][n]
            if method == "fp8":
                # Rows exactly half; columns widened to the scale block's first column.
                out, inp = sizes[n]
                assert total[n] // 2 <= got <= total[n] // 2 + out * 127, (n, got)
            else:
                assert got == total[n] // 2, (n, got)
            companion = f"{stem}.weight_scale_inv" if method == "fp8" else f"{stem}.scales"
            # (Each of a fused cut's ranges reads its own scale rows: in_proj_qkv's three
            # ranges may read one block row of scales three times.)
            assert 0 < reads[r][companion] <= 3 * total[companion], companion


def test_gguf_experts_split_inside_a_block_are_dequantized(gguf_files):
    # A k-quant MoE whose experts' intermediate range (256 -> 128 a rank) cuts through
    # ffn_down_exps' 256-column Q6_K blocks: each expert's down shard is dequantized at
    # load (the brief's allowance for MoE), gate/up stay in Q4_K blocks; every shard is
    # exactly the one-process weights' cut.
    from hybridserve.model.loader import load_model
    from hybridserve.quant.ggml import GGMLWeight
    from hybridserve.quant.weight import FloatWeight

    path = gguf_files("moe-q4_k_m", preset="moe-a", qtype="q4_k", types={"ffn_down": "q6_k"}, hidden_size=256,
                      num_attention_heads=4, head_dim=128, linear_value_head_dim=256, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512)
    full, cfg = load_model(path, progress=False)
    shards = [_load_rank(path, r) for r in range(2)]
    i = cfg.moe_intermediate_size // 2
    for li, layer in enumerate(full.layers):
        ex = layer.mlp.experts
        for r, s in enumerate(shards):
            sx = s.layers[li].mlp.experts
            for e in range(ex.num):
                gu = sx.gate_up[e]
                assert all(isinstance(p, GGMLWeight) and p.qtype == "q4_k" for p in gu.parts)
                assert isinstance(sx.down[e], FloatWeight)
                want = ex.gate_up[e].dequantize()
                assert torch.equal(gu.dequantize(), torch.cat([want[r * i:(r + 1) * i],
                                                               want[2 * i + r * i:2 * i + (r + 1) * i]]))
                assert torch.equal(sx.down[e].dequantize(), ex.down[e].dequantize()[:, r * i:(r + 1) * i])
