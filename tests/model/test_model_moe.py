"""The Qwen3.5 mixture-of-experts models against HF ``Qwen3_5MoeForCausalLM`` /
``Qwen3_5MoeForConditionalGeneration``, plus loading of their expert tensors.

The dense fidelity tests of ``test_model_fidelity.py`` (batched decode, chunked prefill
at awkward sizes mixed with decodes, an n=2 fork, preemption by recompute, HF's own
cached generate) run again here on tiny MoE checkpoints, with the native CPU kernels
and without: the module's fixtures give the presets' keys MoE checkpoints.

* ``test-a`` -> ``moe-a``: top-3 of 7 experts, GQA 1:1, a shared expert with an
  ordinary gate, causal-LM naming (``qwen3_5_moe_text``), 3 shards.
* ``test-b`` -> ``moe-b``: top-1 of 5 experts, GQA 3:1, tied embeddings, a shared
  expert gate that saturates (``sigmoid`` at 0 or 1), VL naming (``qwen3_5_moe``,
  ``model.language_model.*``, oracle ``Qwen3_5MoeForConditionalGeneration``), 2 shards
  holding HF's fused 3-D expert tensors.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.kernels import native
from hybridserve.kernels.moe import fused_moe_ref, moe_block_ref, route_ref
from hybridserve.model import load_model
from hybridserve.model.tiny import write_tiny_checkpoint


def _dense_suite():
    """``test_model_fidelity.py`` loaded by path (the tests folder is not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "test_model_fidelity.py")
    spec = importlib.util.spec_from_file_location("_dense_model_fidelity", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# The dense suite's tests, collected again here against this module's fixtures.
_dense = _dense_suite()
cpu_path = _dense.cpu_path
test_batch_of_four_decoded_together = _dense.test_batch_of_four_decoded_together
test_chunked_prefill_at_awkward_sizes_mixed_with_decodes = _dense.test_chunked_prefill_at_awkward_sizes_mixed_with_decodes
test_hf_cached_generation_matches_our_greedy_decode = _dense.test_hf_cached_generation_matches_our_greedy_decode
test_n2_fork_after_prefill_shares_prompt_blocks = _dense.test_n2_fork_after_prefill_shares_prompt_blocks
test_preempted_sequence_recomputes_to_the_same_logits = _dense.test_preempted_sequence_recomputes_to_the_same_logits

SATURATING = 400.0  # shared-gate logits of O(100): sigmoid is 0 or 1 in float32

MOE_CHECKPOINTS = {
    "test-a": dict(preset="moe-a", seed=5, shards=3),
    "test-b": dict(preset="moe-b", seed=6, shards=2, vl_naming=True, fused_experts=True,
                   shared_gate_scale=SATURATING),
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-moe")
    return {k: write_tiny_checkpoint(root / k, **kw) for k, kw in MOE_CHECKPOINTS.items()}


def hf_oracle(path):
    import transformers

    with open(os.path.join(path, "config.json")) as f:
        vl = json.load(f)["model_type"] == "qwen3_5_moe"
    cls = transformers.Qwen3_5MoeForConditionalGeneration if vl else transformers.Qwen3_5MoeForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_models(tiny_dirs):
    return {k: hf_oracle(d) for k, d in tiny_dirs.items()}


@pytest.fixture(scope="module")
def our_models(tiny_dirs):
    return {k: load_model(d, dtype="float32", progress=False) for k, d in tiny_dirs.items()}


def test_checkpoints_are_what_they_claim(tiny_dirs, our_models, hf_models):
    """The variations above are real: model types, shards, tensor layouts, gates."""
    a, b = tiny_dirs["test-a"], tiny_dirs["test-b"]
    ca, cb = our_models["test-a"][1], our_models["test-b"][1]
    assert (ca.model_type, cb.model_type) == ("qwen3_5_moe_text", "qwen3_5_moe")
    assert (ca.num_experts, ca.num_experts_per_tok, cb.num_experts, cb.num_experts_per_tok) == (7, 3, 5, 1)
    assert ca.num_attention_heads == ca.num_key_value_heads
    assert cb.num_attention_heads == 3 * cb.num_key_value_heads
    assert sum(f.endswith(".safetensors") for f in os.listdir(a)) == 3
    names_b = json.load(open(os.path.join(b, "model.safetensors.index.json")))["weight_map"]
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names_b
    names_a = json.load(open(os.path.join(a, "model.safetensors.index.json")))["weight_map"]
    assert "model.layers.0.mlp.experts.6.down_proj.weight" in names_a
    hf = hf_models["test-b"]
    x = hf.get_input_embeddings().weight
    gate = torch.sigmoid(hf.model.language_model.layers[0].mlp.shared_expert_gate(x)).flatten()
    assert ((gate < 1e-6) | (gate > 1 - 1e-6)).float().mean() > 0.8 and 0.1 < gate.mean() < 0.9


def test_experts_hold_the_checkpoints_tensors_in_the_kernel_layout(tiny_dirs, our_models):
    model, config = our_models["test-a"]
    raw = {}
    for f in sorted(os.listdir(tiny_dirs["test-a"])):
        if f.endswith(".safetensors"):
            raw.update(load_file(os.path.join(tiny_dirs["test-a"], f)))
    i = config.moe_intermediate_size
    for layer in (0, 3):
        ex = model.layers[layer].mlp.experts
        assert ex.w13.is_contiguous() and ex.w2.is_contiguous()  # [E, H, 2I] and [E, I, H] in memory
        for e in (0, 4, 6):
            p = f"model.layers.{layer}.mlp.experts.{e}."
            assert torch.equal(ex.w13[e][:, :i], raw[p + "gate_proj.weight"].t())
            assert torch.equal(ex.w13[e][:, i:], raw[p + "up_proj.weight"].t())
            assert torch.equal(ex.w2[e], raw[p + "down_proj.weight"].t())


@pytest.mark.parametrize("form", ["per-expert", "fused"])
def test_missing_expert_tensor_is_named(tmp_path, form):
    d = write_tiny_checkpoint(tmp_path / "m", preset="moe-a", fused_experts=form == "fused")
    name = ("model.layers.2.mlp.experts.5.up_proj.weight" if form == "per-expert"
            else "model.layers.2.mlp.experts.gate_up_proj")
    _rewrite(d, lambda t: t.pop(name))
    want = r"layers\.2\.mlp\.experts\.5\.up_proj\.weight" if form == "per-expert" else r"'layers\.2\.mlp\.experts\.gate_up_proj \(or its 14 per-expert"
    with pytest.raises(CheckpointError, match=want):
        load_model(d, progress=False)


@pytest.mark.parametrize("name, shape", [
    ("model.layers.1.mlp.experts.3.gate_proj.weight", (41, 64)),
    ("model.layers.1.mlp.gate.weight", (8, 64)),
])
def test_misshaped_expert_tensor_is_named(tmp_path, name, shape):
    d = write_tiny_checkpoint(tmp_path / "m", preset="moe-a")
    _rewrite(d, lambda t: t.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*" + str(list(shape)).replace("[", r"\[")):
        load_model(d, progress=False)


def test_misshaped_fused_expert_tensor_is_named(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", preset="moe-a", fused_experts=True)
    name = "model.layers.0.mlp.experts.down_proj"
    _rewrite(d, lambda t: t.__setitem__(name, torch.zeros(7, 64, 41)))
    with pytest.raises(CheckpointError, match=r"experts\.down_proj.*\[7, 64, 41\].*\[7, 64, 40\]"):
        load_model(d, progress=False)


def test_unsupported_moe_configs_are_config_errors(tmp_path):
    from hybridserve.config import ModelConfig
    from hybridserve.model.tiny import text_config

    for bad, match in (({"num_experts_per_tok": 8}, "num_experts_per_tok"),
                       ({"norm_topk_prob": False}, "norm_topk_prob"),
                       ({"mlp_only_layers": [1]}, "mlp_only_layers")):
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_dict(text_config("moe-a", **bad))
    cfg = text_config("moe-a")
    del cfg["moe_intermediate_size"]
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        ModelConfig.from_dict(cfg)


def _rewrite(path, edit):
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)


# ---- routing and the block against HF's modules --------------------------------------

def test_routing_follows_hf_order_of_operations_at_near_ties(hf_models):
    """Logits whose softmax probabilities tie or nearly tie in float32: the choice and the
    renormalised weights are HF's router's, bit for bit (same ops on the same values)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    import copy

    # A copy: its weight is overwritten below, and the HF model is shared by other tests.
    hf_router = copy.deepcopy(hf_models["test-a"].model.layers[0].mlp.gate)
    assert isinstance(hf_router, Qwen3_5MoeTopKRouter)
    e = hf_router.num_experts
    base = torch.randn(64, e, generator=torch.Generator().manual_seed(0))
    base[:, 1] = base[:, 2]                      # exact ties
    base[:32, 4] = base[:32, 2] + 1e-7           # ties after float32 softmax rounding
    x = torch.randn(64, hf_router.hidden_dim, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        # Logits through HF's own module: solve for the router input that yields them.
        hf_router.weight.copy_(torch.linalg.lstsq(x, base).solution.t())
        logits, hf_w, hf_ids = hf_router(x)
    w, ids = route_ref(logits, hf_router.top_k)
    assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)
    if native.available():
        # The native kernel routes on its own logits (same GEMM up to rounding): its
        # choices must agree wherever HF's top-k is not a float32 tie.
        from hybridserve.model.moe import Experts  # noqa: F401
        h = x.shape[1]
        w13 = torch.zeros(e, h, 2); w2 = torch.zeros(e, 1, h)  # noqa: E702
        _, nat_ids, _ = native.moe_block(x, hf_router.weight.detach().t().contiguous().t(), w13, w2,
                                         hf_router.top_k)
        probs = torch.softmax(logits, -1)
        kth = probs.topk(hf_router.top_k + 1).values
        clear = (kth[:, -2] - kth[:, -1]) > 1e-6
        assert torch.equal(nat_ids[clear].sort(-1).values, hf_ids[clear].sort(-1).values)


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_moe_block_equals_hf_sparse_moe_block(preset, rows, our_models, hf_models, cpu_path):
    """Our block (native or PyTorch) against HF's ``Qwen3_5MoeSparseMoeBlock`` on the
    same input, every layer."""
    model, _ = our_models[preset]
    hf = hf_models[preset]
    hf_layers = hf.model.language_model.layers if hasattr(hf.model, "language_model") else hf.model.layers
    x = torch.randn(rows, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    for ours, theirs in zip(model.layers, hf_layers):
        with torch.no_grad():
            want = theirs.mlp(x[None])[0]
            got = ours.mlp(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_references_agree_with_each_other():
    """``moe_block_ref`` = route + ``fused_moe_ref`` + gated shared expert, written out."""
    g = torch.Generator().manual_seed(3)
    t, h, e, k, i = 19, 16, 5, 2, 12
    x = torch.randn(t, h, generator=g)
    rw, w13, w2 = torch.randn(e, h, generator=g), torch.randn(e, h, 2 * i, generator=g), torch.randn(e, i, h, generator=g)
    out, ids = moe_block_ref(x, rw, w13, w2, k)
    w, ids2 = route_ref(x @ rw.t(), k)
    want = torch.zeros(t, h)
    for tok in range(t):
        for j in range(k):
            hh = x[tok] @ w13[ids[tok, j]]
            want[tok] += w[tok, j] * ((torch.nn.functional.silu(hh[:i]) * hh[i:]) @ w2[ids[tok, j]])
    assert torch.equal(ids, ids2)
    tol = dict(rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(out, want, **tol)
    torch.testing.assert_close(fused_moe_ref(x, w13, w2, w, ids), want, **tol)


@pytest.mark.skipif(not native.available(), reason="the extension was built without the kernels")
# 27 tokens over 9 experts, top-3: routed groups of 4-16 rows (the blocked few-row walk
# and the strip kernel) and the shared expert in 16-row blocks (16, 11).
@pytest.mark.parametrize("t, e, k, i, si", [(1, 7, 3, 40, 48), (17, 64, 4, 24, 0), (300, 5, 1, 33, 16),
                                            (130, 13, 13, 16, 20), (27, 9, 3, 24, 36)])
def test_native_block_equals_the_reference(t, e, k, i, si):
    g = torch.Generator().manual_seed(t)
    h = 40
    cm = lambda w: w.t().contiguous().t()  # noqa: E731  the CPU layout of a projection
    x = torch.randn(t, h, generator=g)
    rw = torch.randn(e, h, generator=g) / 4
    w13, w2 = torch.randn(e, h, 2 * i, generator=g) / 6, torch.randn(e, i, h, generator=g) / 5
    shared = None
    if si:
        shared = (torch.randn(2 * si, h, generator=g) / 6, torch.randn(h, si, generator=g) / 5,
                  torch.randn(1, h, generator=g) / 6)
    want, want_ids = moe_block_ref(x, rw, w13, w2, k, None if shared is None else
                                   (shared[0].t(), shared[1].t(), shared[2].reshape(-1)))
    got, ids, busiest = native.moe_block(x, cm(rw), w13, w2, k,
                                         None if shared is None else tuple(cm(s) for s in shared))
    assert torch.equal(ids.sort(-1).values, want_ids.sort(-1).values)
    assert busiest == int(torch.bincount(want_ids.reshape(-1), minlength=e).max())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_expert_load_is_busiest_over_mean(our_models, cpu_path):
    """``expert_load`` after a step: the busiest expert's rows over the mean, the worst
    MoE layer, from the routing the step actually used."""
    from hybridserve.model import ForwardBatch, HybridCache

    model, config = our_models["test-a"]
    tokens = [random.Random(0).randrange(259) for _ in range(23)]
    n = len(tokens)
    cache = model.new_cache(8, 16)
    assert isinstance(cache, HybridCache)
    state = list(range(5, 5 + cache.state_pages))  # after the blocks it uses
    batch = ForwardBatch.from_lists(
        input_ids=tokens, positions=range(n), slot_mapping=[16 * 3 + i for i in range(n)],
        query_start_loc=[0, n], seq_lens=[n], block_tables=[[3, 4]], state_pages=[state],
        has_initial_state=[False], logits_indices=[n - 1])
    seen = []
    for layer in model.layers:
        mlp = layer.mlp
        orig = mlp.forward

        def rec(x, orig=orig, mlp=mlp):
            w, ids = route_ref(torch.nn.functional.linear(x, mlp.gate.weight), mlp.top_k)
            seen.append(int(torch.bincount(ids.reshape(-1), minlength=mlp.num_experts).max()))
            return orig(x)
        mlp.forward = rec
    try:
        model(batch, cache)
    finally:
        for layer in model.layers:
            del layer.mlp.forward
    mean = n * config.num_experts_per_tok / config.num_experts
    assert model.expert_load() == pytest.approx(max(seen) / mean)


def test_load_state_dict_takes_per_expert_and_fused_names(our_models, hf_models):
    """``load_state_dict`` accepts the published per-expert names (stacked by a
    pre-hook) and HF's in-memory fused tensors alike."""
    from hybridserve.model import Qwen3_5ForServing
    from hybridserve.model.tiny import random_state_dict

    model, config = our_models["test-a"]
    per_expert = random_state_dict(config, seed=5)  # moe-a's checkpoint: seed 5, local names
    fresh = Qwen3_5ForServing(config)
    fresh.load_state_dict(per_expert, strict=False)
    for k, v in model.state_dict().items():
        if ".mlp." in k:
            assert torch.equal(fresh.state_dict()[k], v), k
    hf_sd = {k.removeprefix("model."): v for k, v in hf_models["test-a"].state_dict().items()
             if ".mlp.experts." in k}
    fresh2 = Qwen3_5ForServing(config)
    fresh2.load_state_dict(hf_sd, strict=False)
    assert torch.equal(fresh2.layers[1].mlp.experts.w2, model.layers[1].mlp.experts.w2)
    assert fresh2.layers[1].mlp.experts.w13.is_contiguous()


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux only: reads /proc/self/smaps")
def test_expert_weights_live_in_memory_advised_for_huge_pages():
    """The expert tensors of a layer large enough to hold a 2 MiB page are moved into a
    mapping advised ``MADV_HUGEPAGE`` (VmFlags ``hg``), at construction and again after
    ``to_empty`` (the loader's path) and a dtype change, with values and layout kept."""
    import mmap

    from hybridserve.model.moe import Experts

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("this Python's mmap has no MADV_HUGEPAGE")

    def advised(t: torch.Tensor) -> bool:
        addr = t.data_ptr()
        flags = None
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(v, 16) for v in head.split("-"))
                    inside = lo <= addr < hi
                elif head == "VmFlags:" and inside:
                    flags = line.split()[1:]
                    break
        return flags is not None and "hg" in flags

    e = Experts(16, 256, 192)  # 6.3 MB of gate/up, 3.1 MB of down: only the first qualifies
    assert advised(e.gate_up_proj) and not advised(e.down_proj)
    meta = Experts(16, 256, 192).to("meta")
    meta.to_empty(device="cpu")
    assert advised(meta.gate_up_proj) and meta.w13.is_contiguous() and meta.w2.is_contiguous()
    with torch.no_grad():
        meta.gate_up_proj.normal_()
    want = meta.gate_up_proj.detach().clone()
    meta.double()
    assert advised(meta.gate_up_proj) and meta.w13.is_contiguous()
    assert torch.equal(meta.gate_up_proj.float(), want)
