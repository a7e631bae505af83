"""The MTP layer (issue 34) against an independent reference, and its loading.

Oracle: ``hybridserve.train.mtp.MTP`` (HF's ``Qwen3_5DecoderLayer``; for MoE the same
with HF's ``Qwen3_5MoeDecoderLayer``) holding the checkpoint's ``mtp.*`` weights, fed
HF's post-norm ``last_hidden_state`` and HF's rotary embeddings, whole sequences with
a causal mask. Ours runs through the paged path: the trunk's ``forward(...,
return_hidden=True)`` gives h_t, and ``mtp_forward`` runs the rows in a prefill chunk,
then one row per step (its own KV in the arena), then a chained draft step fed the
MTP's own output.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from hybridserve.errors import ConfigError
from hybridserve.kernels import native
from hybridserve.memory.layout import arena_layout
from hybridserve.model import ForwardBatch, load_model
from hybridserve.model.loader import checkpoint_files, has_mtp_layer
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.planner.arena import size_arena

BLOCK = 4


@pytest.fixture(params=["native", "torch"])
def kernels(request, monkeypatch):
    if request.param == "native":
        if not native.available():
            pytest.skip("the native kernels are not built")
    else:
        monkeypatch.setattr(native, "_DISABLED", True)
    return request.param


def _mtp_tensors(path):
    out = {}
    for f in checkpoint_files(path):
        with safe_open(f, framework="pt") as st:
            for n in st.keys():
                if n.startswith("mtp."):
                    out[n[len("mtp."):]] = st.get_tensor(n).float()
    return out


def _hf(path, moe, vl):
    import transformers

    if moe:
        cls = transformers.Qwen3_5MoeForConditionalGeneration if vl else transformers.Qwen3_5MoeForCausalLM
    else:
        cls = transformers.Qwen3_5ForConditionalGeneration if vl else transformers.Qwen3_5ForCausalLM
    m = cls.from_pretrained(path, dtype=torch.float32).eval()
    if vl:
        lm = m.model.language_model
        return lm, m.lm_head, m.config.text_config
    return m.model, m.lm_head, m.config


def _reference_mtp(path, text_config, moe):
    from hybridserve.train.mtp import MTP, mtp_layer_config

    if moe:
        # train.mtp's MTP with HF's MoE decoder layer in place of the dense one.
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
            Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm)

        mtp = MTP.__new__(MTP)
        torch.nn.Module.__init__(mtp)
        h, eps = text_config.hidden_size, text_config.rms_norm_eps
        mtp.config = mtp_layer_config(text_config)
        mtp.fc = torch.nn.Linear(2 * h, h, bias=False)
        mtp.pre_fc_norm_embedding = Qwen3_5MoeRMSNorm(h, eps=eps)
        mtp.pre_fc_norm_hidden = Qwen3_5MoeRMSNorm(h, eps=eps)
        mtp.layers = torch.nn.ModuleList([Qwen3_5MoeDecoderLayer(mtp.config, 0)])
        mtp.norm = Qwen3_5MoeRMSNorm(h, eps=eps)
    else:
        mtp = MTP(text_config)
    sd = _mtp_tensors(path)
    if moe and "layers.0.mlp.experts.gate_up_proj" not in sd:
        e = text_config.num_experts
        base = "layers.0.mlp.experts."
        sd[base + "gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"{base}{i}.gate_proj.weight"),
                                                           sd.pop(f"{base}{i}.up_proj.weight")]) for i in range(e)])
        sd[base + "down_proj"] = torch.stack([sd.pop(f"{base}{i}.down_proj.weight") for i in range(e)])
    mtp.load_state_dict(sd, strict=True)
    return mtp.float().eval()


def _batch(ids, positions, slots, lens, tables, logits):
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    return ForwardBatch.from_lists(input_ids=ids, positions=positions, slot_mapping=slots, query_start_loc=qsl,
                                   seq_lens=[p[-1] + 1 for p in _split(positions, lens)], block_tables=tables,
                                   state_pages=[[0]] * len(lens), has_initial_state=[True] * len(lens),
                                   logits_indices=logits)


def _split(xs, lens):
    out, at = [], 0
    for n in lens:
        out.append(list(xs[at:at + n]))
        at += n
    return out


CASES = [("test-a", False, False), ("test-b", True, False), ("moe-a", False, True), ("moe-b", True, True)]


@pytest.mark.parametrize("preset,vl,fused", CASES)
def test_mtp_forward_equals_the_reference_through_the_paged_path(preset, vl, fused, kernels, tmp_path):
    torch.manual_seed(0)
    path = write_tiny_checkpoint(tmp_path / preset, preset=preset, seed=11, vl_naming=vl, fused_experts=fused)
    moe = preset.startswith("moe")
    model, config = load_model(path, progress=False, load_mtp=True)
    lm, lm_head, text_config = _hf(path, moe, vl)
    ref = _reference_mtp(path, text_config, moe)

    # Two sequences of different lengths, trunk prefilled whole.
    seqs = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (11, 7)]
    nb = [-(-n // BLOCK) for n in map(len, seqs)]
    sp = arena_layout(config, BLOCK, "float32").state_pages
    cache = model.new_cache(sum(nb) + 2 * sp + 1, BLOCK)
    assert cache.mtp_k_cache is not None
    tables = [list(range(nb[0])), list(range(nb[0], nb[0] + nb[1]))]
    states = [[sum(nb) + i * sp + j for j in range(sp)] for i in range(2)]
    ids = seqs[0] + seqs[1]
    pos = list(range(len(seqs[0]))) + list(range(len(seqs[1])))
    slots = [tables[s][p // BLOCK] * BLOCK + p % BLOCK for s in range(2) for p in range(len(seqs[s]))]
    trunk = ForwardBatch.from_lists(input_ids=ids, positions=pos, slot_mapping=slots,
                                    query_start_loc=[0, len(seqs[0]), len(ids)], seq_lens=[len(s) for s in seqs],
                                    block_tables=tables, state_pages=states, has_initial_state=[False, False],
                                    logits_indices=[len(seqs[0]) - 1, len(ids) - 1])
    logits, hidden = model(trunk, cache, return_hidden=True)
    assert hidden.shape == (len(ids), config.hidden_size)
    hs = _split(hidden, [len(s) for s in seqs])

    with torch.no_grad():
        want_h = [lm(input_ids=torch.tensor([s])).last_hidden_state[0] for s in seqs]
        for h, w in zip(hs, want_h):
            torch.testing.assert_close(torch.stack(h), w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, torch.stack([lm_head(w[-1]) for w in want_h]), rtol=1e-4, atol=1e-4)

    def reference(hid, toks, n):
        """The oracle's normed states for rows 0..n-1: hid [n, H], toks the t+1 ids."""
        with torch.no_grad():
            p = torch.arange(n)[None]
            h = hid[None]
            e = lm.embed_tokens(torch.tensor([toks]))
            return ref(h, e, lm.rotary_emb(h, p), p)[0]

    # MTP row j of a sequence: h_j with token j+1 at position j (vLLM's and training's
    # layout). Step 1: a prefill chunk of the first rows of both sequences; then one row
    # per step; the logits of every row are checked.
    n_rows = [len(s) - 1 for s in seqs]
    first = [5, 3]
    got_out = [[], []]
    got_logits = [[], []]
    done = [0, 0]

    def run(counts):
        b_ids, b_pos, b_slots, b_hid, lens, tabs, rows = [], [], [], [], [], [], []
        for s, c in enumerate(counts):
            if not c:
                continue
            for j in range(done[s], done[s] + c):
                b_ids.append(seqs[s][j + 1])
                b_pos.append(j)
                b_slots.append(tables[s][j // BLOCK] * BLOCK + j % BLOCK)
                b_hid.append(hs[s][j])
            lens.append(c)
            tabs.append(tables[s])
        rows = list(range(len(b_ids)))
        batch = _batch(b_ids, b_pos, b_slots, lens, tabs, rows)
        lg, out = model.mtp_forward(torch.stack(b_hid), batch.input_ids, batch, cache)
        at = 0
        for s, c in enumerate(counts):
            if c:
                got_out[s].extend(out[at:at + c])
                got_logits[s].extend(lg[at:at + c])
                at += c
                done[s] += c
        return lg, out

    run(first)
    while done != n_rows:
        run([1 if done[s] < n_rows[s] else 0 for s in range(2)])
    for s in range(2):
        want = reference(torch.stack(hs[s][:n_rows[s]]), seqs[s][1:], n_rows[s])
        torch.testing.assert_close(torch.stack(got_out[s]), want, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            torch.testing.assert_close(torch.stack(got_logits[s]), lm_head(want), rtol=1e-4, atol=1e-4)

    # A chained draft step: row n_rows (position n_rows) fed the MTP's own last output
    # and the token it drafts; the oracle sees the same inputs appended to the sequence.
    s = 0
    last = got_out[s][-1]
    draft = int(got_logits[s][-1].argmax())
    j = n_rows[s]
    batch = _batch([draft], [j], [tables[s][j // BLOCK] * BLOCK + j % BLOCK], [1], [tables[s]], [0])
    lg, out = model.mtp_forward(last[None], batch.input_ids, batch, cache)
    want = reference(torch.stack(hs[s][:j] + [last]), seqs[s][1:] + [draft], j + 1)
    torch.testing.assert_close(out[0], want[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset,vl,fused", CASES)
def test_loading_the_mtp_layer_plain_and_vl_naming(preset, vl, fused, tmp_path):
    path = write_tiny_checkpoint(tmp_path / "m", preset=preset, seed=2, vl_naming=vl, fused_experts=fused)
    assert has_mtp_layer(path)
    model, config = load_model(path, progress=False, load_mtp=True)
    want = _mtp_tensors(path)
    got = {k[len("mtp."):]: v for k, v in model.checkpoint_tensors().items() if k.startswith("mtp.")}
    fused_views = {k[len("mtp."):]: t for k, (t, _) in model.checkpoint_aliases().items() if k.startswith("mtp.")}
    assert want, "the checkpoint has no mtp.* tensors"
    for name, t in want.items():
        target = got.get(name, fused_views.get(name))
        assert target is not None, f"{name} not loaded"
        torch.testing.assert_close(target.float(), t, rtol=0, atol=0)
    assert (config.num_experts > 0) == any(".experts." in n for n in want)
    # Without load_mtp the MTP tensors stay skipped (and no MTP KV in the arena).
    plain, _ = load_model(path, progress=False)
    assert plain.mtp is None
    assert plain.new_cache(8, BLOCK).mtp_k_cache is None
    with pytest.raises(ConfigError, match="MTP"):
        plain.mtp_forward(torch.zeros(1, config.hidden_size), torch.zeros(1, dtype=torch.long), None,
                          plain.new_cache(8, BLOCK))


@pytest.mark.parametrize("vl", [False, True])
def test_load_mtp_without_an_mtp_layer_is_refused(vl, tmp_path):
    path = write_tiny_checkpoint(tmp_path / "n", preset="test-a", vl_naming=vl, mtp=False)
    assert not has_mtp_layer(path)
    with pytest.raises(ConfigError, match="no MTP layer.*speculative decoding"):
        load_model(path, progress=False, load_mtp=True)
    # The config says one layer, the weights have none.
    import json
    import os

    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    (cfg.get("text_config") or cfg)["mtp_num_hidden_layers"] = 1
    json.dump(cfg, open(cfg_path, "w"))
    if vl:
        # The VL checkpoint's one stray mtp.* tensor is not an MTP layer: its shape is wrong.
        from hybridserve.errors import CheckpointError

        with pytest.raises(CheckpointError):
            load_model(path, progress=False, load_mtp=True)
    else:
        with pytest.raises(ConfigError, match=r"no mtp\.\* tensors"):
            load_model(path, progress=False, load_mtp=True)


@pytest.mark.parametrize("preset", ["test-a", "test-b", "moe-a"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_bytes_with_mtp_grow_by_one_attention_block(preset, dtype, tmp_path):
    from hybridserve.config import ModelConfig, dtype_bytes
    from hybridserve.model.tiny import text_config

    config = ModelConfig.from_dict(text_config(preset))
    block = 16
    one = 2 * block * config.num_key_value_heads * config.head_dim * dtype_bytes(dtype)
    base = arena_layout(config, block, dtype)
    with_mtp = arena_layout(config, block, dtype, extra_attention_layers=1)
    assert with_mtp.kv_block_bytes == base.kv_block_bytes + one
    assert with_mtp.num_attention_layers == config.num_full_attention_layers + 1
    # Pages are the KV block rounded up to 64 bytes (or the largest state item).
    assert with_mtp.page_bytes == max(-(-with_mtp.kv_block_bytes // 64) * 64, base.page_bytes)
    plan = size_arena(config, block_size=block, kv_dtype=dtype, budget_bytes=1 << 24, extra_attention_layers=1)
    assert plan.layout == with_mtp
    assert plan.num_pages == (1 << 24) // with_mtp.page_bytes
    # The model's cache: the MTP layer's K/V views land in the new block of each page.
    path = write_tiny_checkpoint(tmp_path / "c", preset=preset, dtype=dtype)
    model, _ = load_model(path, dtype=dtype, progress=False, load_mtp=True)
    cache = model.new_cache(3, block)
    assert cache.layout == with_mtp
    k = cache.mtp_k_cache
    assert k.shape == (3, block, config.num_key_value_heads, config.head_dim)
    start = k.storage_offset() * k.element_size()
    assert start == base.kv_block_bytes  # right after the trunk's attention layers
    assert k.stride(0) * k.element_size() == with_mtp.page_bytes


@pytest.mark.parametrize("preset", ["test-a", "test-b", "moe-a", "moe-b"])
def test_planner_counts_the_mtp_layers_weights(preset, tmp_path):
    """mtp_param_count against the model's own MTP parameters, and the checkpoint
    header count with mtp=True against the mtp.* tensors' bytes."""
    from hybridserve.planner.weights import checkpoint_weight_bytes, mtp_param_count, weight_bytes

    path = write_tiny_checkpoint(tmp_path / "w", preset=preset, dtype="bfloat16")
    model, config = load_model(path, progress=False, load_mtp=True)
    assert mtp_param_count(config) == sum(p.numel() for p in model.mtp.parameters())
    mtp_bytes = sum(t.numel() * 2 for t in _mtp_tensors(path).values())
    assert checkpoint_weight_bytes(path, mtp=True) - checkpoint_weight_bytes(path) == mtp_bytes
    assert weight_bytes(config, path, mtp=True) == checkpoint_weight_bytes(path, mtp=True)
    assert weight_bytes(config, mtp=True) - weight_bytes(config) == mtp_param_count(config) * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_native_mtp_pass_equals_the_module_path_bit_for_bit(preset, dtype, tmp_path, monkeypatch):
    """The native MTP pass (NativeDecodeStep.run_mtp) against the module path (checked
    against the reference above): a prefill pass of several rows per sequence, then
    chained one-row passes, from the same arena: identical logits, MTP hidden states
    and arena (the MTP layer's KV)."""
    from hybridserve.kernels import native
    from hybridserve.model.native_decode import NativeDecodeStep

    if not native.available():
        pytest.skip("the native kernels are not built")
    torch.manual_seed(1)
    path = write_tiny_checkpoint(tmp_path / preset, preset=preset, seed=5)
    model, config = load_model(path, dtype=dtype, progress=False, load_mtp=True)
    seen = {"native": 0}
    real = NativeDecodeStep.run_mtp

    def run_mtp(self, *a):
        out = real(self, *a)
        seen["native"] += out is not None
        return out

    monkeypatch.setattr(NativeDecodeStep, "run_mtp", run_mtp)
    lens = [13, 6]
    nb = [-(-(n + 4) // BLOCK) for n in lens]
    cache = model.new_cache(sum(nb) + 2, BLOCK)
    tables = [list(range(nb[0])), list(range(nb[0], sum(nb)))]
    # Stale K/V in the MTP layer's blocks past each sequence's length must not count.
    with torch.no_grad():
        cache.arena.copy_(torch.randn(cache.arena.shape).to(cache.arena.dtype))
    start = cache.arena.clone()

    def passes():
        outs, done = [], [0, 0]
        hid = torch.randn(sum(lens), config.hidden_size).to(model.dtype)
        for counts in ([5, 3], [1, 1], [4, 2], [1, 0], [0, 1]):
            b_ids, b_pos, b_slots, n_s, tabs = [], [], [], [], []
            for s, c in enumerate(counts):
                if not c:
                    continue
                for j in range(done[s], done[s] + c):
                    b_ids.append((7 * j + s) % config.vocab_size)
                    b_pos.append(j)
                    b_slots.append(tables[s][j // BLOCK] * BLOCK + j % BLOCK)
                n_s.append(c)
                tabs.append(tables[s])
                done[s] += c
            rows = [i for i in range(len(b_ids)) if i % 2 == 0]
            batch = _batch(b_ids, b_pos, b_slots, n_s, tabs, rows)
            h = hid[:len(b_ids)] if not outs else torch.cat([outs[-1][1], hid])[:len(b_ids)]
            outs.append(model.mtp_forward(h, batch.input_ids, batch, cache))
        return outs, cache.arena.clone()

    torch.manual_seed(2)
    model.native_decode = False
    want, want_arena = passes()
    assert seen["native"] == 0
    model.native_decode = True
    cache.arena.copy_(start)
    torch.manual_seed(2)
    got, got_arena = passes()
    assert seen["native"] == len(got)
    for (wl, wh), (gl, gh) in zip(want, got):
        assert torch.equal(wl, gl) and torch.equal(wh, gh)
    assert torch.equal(want_arena, got_arena)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("vocab", [None, 37])
@pytest.mark.parametrize("rows,steps", [([3, 1], 3), ([1, 1], 2), ([2, 2], 1), ([1, 3], 4)])
@pytest.mark.parametrize("fused", [True, False])
def test_native_draft_passes_equal_the_module_path_pass_by_pass(dtype, vocab, rows, steps, fused, tmp_path):
    """NativeDecodeStep.mtp_draft (the proposer's passes in one call) against the module
    path run pass by pass as the proposer runs it: the MTP prefill of each sequence's
    committed rows (draft 1 from its last row), then chained passes of one row per
    sequence at the next position, fed the previous pass's MTP state and argmax draft
    (over the first ``vocab`` ids). Same drafts at every pass, same arena after (the
    MTP layer's KV), from an arena of stale values."""
    import numpy as np

    from hybridserve.kernels import native

    if not native.available():
        pytest.skip("the native kernels are not built")
    torch.manual_seed(3)
    path = write_tiny_checkpoint(tmp_path / "m", preset="test-a", seed=7)
    model, config = load_model(path, dtype=dtype, progress=False, load_mtp=True)
    lens = [9, 4]  # tokens per sequence after the committed rows
    nb = [-(-(n + steps + 1) // BLOCK) for n in lens]
    width = max(nb) + 1
    cache = model.new_cache(sum(nb) + 2, BLOCK)
    tables = torch.zeros(2, width, dtype=torch.int32)
    tables[0, :nb[0]] = torch.arange(nb[0])
    tables[1, :nb[1]] = torch.arange(nb[0], sum(nb))
    with torch.no_grad():
        cache.arena.copy_(torch.randn(cache.arena.shape).to(cache.arena.dtype))
    start = cache.arena.clone()
    R = sum(rows)
    hid = torch.randn(R, config.hidden_size).to(model.dtype)
    ids = [(5 * r + 3) % config.vocab_size for r in range(R)]
    pos = [q for s, c in enumerate(rows) for q in range(lens[s] - c, lens[s])]
    seq = [s for s, c in enumerate(rows) for _ in range(c)]

    def slot(s, q):
        return int(tables[s, q // BLOCK]) * BLOCK + q % BLOCK

    last = list(np.cumsum(rows) - 1)
    model.native_decode = False
    want = []
    with torch.no_grad():
        batch = _batch(ids, pos, [slot(s, q) for s, q in zip(seq, pos)], rows,
                       [tables[0].tolist(), tables[1].tolist()], last)
        lg, h = model.mtp_forward(hid, batch.input_ids, batch, cache, vocab)
        toks = lg.argmax(dim=-1).tolist()
        want.append(toks)
        h = h[last]
        for j in range(1, steps):
            p = [lens[s] - 1 + j for s in range(2)]
            batch = _batch(toks, p, [slot(s, q) for s, q in enumerate(p)], [1, 1],
                           [tables[0].tolist(), tables[1].tolist()], [0, 1])
            lg, h = model.mtp_forward(h, batch.input_ids, batch, cache, vocab)
            toks = lg.argmax(dim=-1).tolist()
            want.append(toks)
    want_arena = cache.arena.clone()

    model.native_decode = True
    cache.arena.copy_(start)
    fast = model._usable_native_step()
    assert fast is not None
    # fused: every pass in one native call (_core.MtpDraftPlan); else the Python passes.
    fast.fused_mtp = fused
    fast._plan = None
    fast._bind_cache(cache)
    assert (fast._fused_plan(cache) is not None) == fused
    got = fast.mtp_draft(hid, np.asarray(ids), np.asarray(pos), np.asarray([slot(s, q) for s, q in zip(seq, pos)]),
                         tables.numpy()[seq], np.asarray(last), steps, cache, vocab)
    assert got is not None and got.tolist() == want
    if vocab is not None:
        assert (got < vocab).all()
    assert torch.equal(cache.arena, want_arena)


def test_fused_draft_refuses_bad_input_with_a_clear_error(tmp_path):
    """The one-call drafter's misuse (a drafting row past the committed rows, a position
    past the rope table, more rows than its buffers) is a ValueError naming it, and the
    plan still drafts afterwards."""
    import numpy as np

    from hybridserve.kernels import native

    if not native.available():
        pytest.skip("the native kernels are not built")
    path = write_tiny_checkpoint(tmp_path / "m", preset="test-a", seed=7)
    model, config = load_model(path, dtype="bfloat16", progress=False, load_mtp=True)
    cache = model.new_cache(8, BLOCK)
    fast = model._usable_native_step()
    fast._bind_cache(cache)
    plan = fast._fused_plan(cache)
    assert plan is not None
    from hybridserve.model.native_decode import _view

    hid = _view(torch.randn(2, config.hidden_size).to(torch.bfloat16))
    cos, sin = fast._rope_table(64)
    tables = np.zeros((2, 4), dtype=np.int32)
    tables[:, :4] = np.arange(4)
    out = np.zeros((2, 1), dtype=np.int64)

    def call(last=(1,), pos=(3, 4), h=hid, rows=2):
        plan.draft(h[:rows], np.arange(rows, dtype=np.int64), np.asarray(pos[:rows], dtype=np.int64),
                   np.asarray(pos[:rows], dtype=np.int64), tables[:rows], np.asarray(last, dtype=np.int64), 2,
                   config.vocab_size, cos, sin, out)

    with pytest.raises(ValueError, match="last row 2"):
        call(last=(2,))
    with pytest.raises(ValueError, match="past the rope table"):
        call(pos=(3, cos.shape[0]))
    big = _view(torch.randn(fast.max_rows + 1, config.hidden_size).to(torch.bfloat16))
    with pytest.raises(ValueError, match="committed rows"):
        plan.draft(big, np.zeros(fast.max_rows + 1, dtype=np.int64), np.zeros(fast.max_rows + 1, dtype=np.int64),
                   np.zeros(fast.max_rows + 1, dtype=np.int64), np.zeros((fast.max_rows + 1, 4), dtype=np.int32),
                   np.asarray([0], dtype=np.int64), 2, config.vocab_size, cos, sin, out)
    call()
    assert ((out >= 0) & (out < config.vocab_size)).all()
