"""Checkpoint formats, dtypes and error reporting of the loader and the tiny generator."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model import ForwardBatch, HybridCache, load_model
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.tokenizer import apply_chat_template, load_tokenizer


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _prefill_logits(model, config, tokens):
    cache = model.new_cache(12, 16)
    assert isinstance(cache, HybridCache) and cache.dtype == model.dtype
    state = list(range(6, 6 + cache.state_pages))  # after the blocks it uses
    n = len(tokens)
    batch = ForwardBatch.from_lists(
        input_ids=tokens, positions=range(n), slot_mapping=[16 * (5 if i < 16 else 2) + i % 16 for i in range(n)],
        query_start_loc=[0, n], seq_lens=[n], block_tables=[[5, 2]], state_pages=[state],
        has_initial_state=[False], logits_indices=range(n))
    return model(batch, cache)


def _raw(path):
    """All tensors of a checkpoint dir, by checkpoint name (the generator's own files)."""
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_sharded_and_vl_named_checkpoints_load_the_same_weights(tmp_path, preset, tiny_dirs, our_models):
    plain, _ = our_models[preset]
    sharded, _ = load_model(write_tiny_checkpoint(tmp_path / "s", preset=preset, seed=7, shards=3),
                            progress=False)
    vl, vl_config = load_model(write_tiny_checkpoint(tmp_path / "v", preset=preset, seed=7, vl_naming=True,
                                                     shards=2), progress=False)
    assert vl_config.model_type == "qwen3_5"
    assert len([f for f in os.listdir(tmp_path / "s") if f.endswith(".safetensors")]) == 3
    ref = _state(plain)
    for m in (sharded, vl):
        got = _state(m)
        assert got.keys() == ref.keys()
        for k in ref:
            assert torch.equal(got[k], ref[k]), k
    # And the weights are the checkpoint's, not an artefact of our own naming: every HF
    # tensor, including those fused into one projection, sits where the model reads it.
    # (The MTP layer's tensors are the drafter's, loaded only with load_mtp: see
    # tests/spec/test_mtp_model.py.)
    raw = {k: v for k, v in _raw(tiny_dirs[preset]).items() if not k.startswith("mtp.")}
    views = plain.checkpoint_tensors()
    assert {k if k == "lm_head.weight" else "model." + k for k in views} == set(raw)
    for k, v in views.items():
        name = k if k == "lm_head.weight" else "model." + k
        assert torch.equal(raw[name], v), k
    if plain.config.tie_word_embeddings:
        assert "lm_head.weight" not in raw
        assert plain.lm_head.weight.data_ptr() == plain.embed_tokens.weight.data_ptr()


def test_bfloat16_load_casts_weights_and_tracks_float32_logits(tiny_dirs, our_models, hf_models):
    f32, config = our_models["test-a"]
    bf16, _ = load_model(tiny_dirs["test-a"], dtype="bfloat16", progress=False)
    assert bf16.dtype == torch.bfloat16
    for k, v in _state(f32).items():
        assert torch.equal(bf16.state_dict()[k], v.to(torch.bfloat16)), k
    tokens = list(range(40, 60))
    ours = _prefill_logits(bf16, config, tokens)
    assert ours.dtype == torch.float32
    with torch.no_grad():
        ref = hf_models["test-a"](torch.tensor([tokens])).logits[0]
    # bf16 has ~3 significant digits; through a few layers that is a few percent.
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


def test_bfloat16_checkpoint_loads_as_float32(tmp_path, our_models):
    d = write_tiny_checkpoint(tmp_path / "b", preset="test-a", seed=7, dtype="bfloat16")
    m, _ = load_model(d, dtype=torch.float32, progress=False)
    ref = _state(our_models["test-a"][0])
    for k, v in _state(m).items():
        assert v.dtype == torch.float32
        assert torch.equal(v, ref[k].to(torch.bfloat16).float()), k


def test_generator_is_deterministic_per_seed(tmp_path):
    a = _raw(write_tiny_checkpoint(tmp_path / "a", preset="test-b", seed=3))
    b = _raw(write_tiny_checkpoint(tmp_path / "b", preset="test-b", seed=3))
    c = _raw(write_tiny_checkpoint(tmp_path / "c", preset="test-b", seed=4))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def _rewrite(path, edit):
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)


def test_missing_tensor_is_named(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", preset="test-a")
    _rewrite(d, lambda t: t.pop("model.layers.1.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"layers\.1\.linear_attn\.A_log"):
        load_model(d, progress=False)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", preset="test-a")

    def edit(t):
        t["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(3, 64)

    _rewrite(d, edit)
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_proj\.weight.*\[3, 64\].*\[64, 64\]"):
        load_model(d, progress=False)


def test_missing_lm_head_when_untied_is_an_error(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", preset="test-a")
    _rewrite(d, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(d, progress=False)


def test_unsupported_model_type_and_empty_dirs(tmp_path):
    d = write_tiny_checkpoint(tmp_path / "m", preset="test-a")
    cfg_path = os.path.join(d, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["model_type"] = "llama"
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="llama"):
        load_model(d, progress=False)
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ConfigError, match="config.json"):
        load_model(tmp_path / "empty", progress=False)
    cfg["model_type"] = "qwen3_5_text"
    json.dump(cfg, open(cfg_path, "w"))
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(d, progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope", progress=False)
    with pytest.raises(ConfigError, match="dtype"):
        load_model(d, dtype="int8", progress=False)
    # FP8 and AWQ are served (tests/quant); other methods are refused by name.
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="quantized with quant_method 'bitsandbytes'"):
        load_model(d, progress=False)


def test_tokenizer_round_trip_and_chat_template(tiny_dirs):
    import transformers

    d = tiny_dirs["test-a"]
    tok = load_tokenizer(d)
    assert isinstance(tok, transformers.PreTrainedTokenizerBase)
    text = "héllo wörld ✓"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # byte-level: one id per UTF-8 byte
    assert tok.decode(ids) == text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id in (258,)
    msgs = [{"role": "user", "content": "hi"}]
    ids = apply_chat_template(tok, msgs)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # The special tokens are single ids, and the config's eos is the template's end marker.
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    cfg = json.load(open(os.path.join(d, "config.json")))
    assert cfg["eos_token_id"] == tok.eos_token_id
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_tokenizer(os.path.join(d, "no-such-dir"))


def test_tied_lm_head_runs_the_native_few_row_kernel_and_matches_f_linear(tmp_path, monkeypatch):
    # The tied LM head is the embedding table too, kept [vocab, hidden] as stored: the
    # native row-major kernel reads it in place (no transposed copy), and the embedding
    # lookup gathers its rows. Oracle: F.linear on a copy of the checkpoint's table, and
    # the embedding lookup on that copy.
    from hybridserve.kernels import native
    from hybridserve.model import qwen3_5

    if not native.available():
        pytest.fail("the native extension is part of the build; it must be importable here")
    path = write_tiny_checkpoint(tmp_path / "tied", preset="test-a", seed=0, tie_word_embeddings=True)
    model, _ = load_model(path, progress=False)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.is_contiguous()
    table = model.embed_tokens.weight.detach().clone()
    calls = []
    real = native.linear_rows
    monkeypatch.setattr(qwen3_5.native, "linear_rows", lambda x, w: calls.append(w) or real(x, w))
    x = torch.randn(3, table.shape[1])
    torch.testing.assert_close(model.lm_head(x), torch.nn.functional.linear(x, table), rtol=1e-5, atol=1e-5)
    assert calls and calls[0] is model.lm_head.weight
    ids = torch.tensor([0, 5, table.shape[0] - 1])
    assert torch.equal(model.embed_tokens(ids), table[ids])
