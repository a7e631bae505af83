"""Each rank reads only its slices of the checkpoint (safetensors get_slice, never a
whole split tensor), and the two ranks' shards put back together are the
single-process loader's weights (the oracle)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import hybridserve.parallel.loader as tp_loader
from hybridserve.config import ModelConfig
from hybridserve.model.loader import load_model
from hybridserve.parallel import ShardPlan


class RecordingOpen:
    """safe_open that records the elements each read returns and refuses get_tensor."""

    def __init__(self, reads: dict[str, int]):
        self.reads = reads

    def __call__(self, path, framework, device):
        real = tp_loader.__dict__["_real_safe_open"](path, framework=framework, device=device)
        reads = self.reads

        class Handle:
            def __enter__(self):
                self.f = real.__enter__()
                return self

            def __exit__(self, *a):
                return real.__exit__(*a)

            def keys(self):
                return self.f.keys()

            def get_tensor(self, name):
                raise AssertionError(f"{name} read whole")

            def get_slice(self, name):
                sl = self.f.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return sl.get_shape()

                    def __getitem__(self, index):
                        t = sl[index]
                        reads[name] = reads.get(name, 0) + t.numel()
                        return t

                return Slice()

        return Handle()


@pytest.mark.parametrize("mtp", [False, True], ids=["trunk", "with-mtp"])
@pytest.mark.parametrize("config", ["dense-kv1", "moe"])
def test_each_rank_reads_only_its_slices_and_the_shards_rebuild_the_model(config, mtp, tp_dirs, monkeypatch):
    # With mtp: the MTP layer (speculative decoding's drafter) is sharded like a decoder
    # layer, and its fc row-parallel (each rank half of the 2H input columns).
    path = tp_dirs[config]
    full, cfg = load_model(path, dtype="float32", load_mtp=mtp)
    full_params = dict(full.named_parameters())
    assert any(n.startswith("mtp.") for n in full_params) == mtp
    monkeypatch.setitem(tp_loader.__dict__, "_real_safe_open", tp_loader.safe_open)
    shards = []
    for rank in range(2):
        reads: dict[str, int] = {}
        monkeypatch.setattr(tp_loader, "safe_open", RecordingOpen(reads))
        shard = ShardPlan(cfg, rank, 2)
        group = SimpleNamespace(rank=rank, world_size=2)  # no collective runs while loading
        model = tp_loader.load_sharded_model(path, shard, group, dtype="float32", load_mtp=mtp)
        shards.append(dict(model.named_parameters()))
        assert set(shards[-1]) == set(full_params)
        shapes = tp_loader.full_shapes(cfg, mtp=mtp)
        c_kv = cfg.num_key_value_heads
        from hybridserve.model.loader import local_name

        assert any(name.startswith("mtp.") for name in reads) == mtp
        for name, n in reads.items():
            local = local_name(name, mtp=mtp)
            total = 1
            for d in shapes[local]:
                total *= d
            replicated = shard.cut(local, shapes[local]) is None or (
                c_kv == 1 and local.endswith(("k_proj.weight", "v_proj.weight")))
            # Split tensors: exactly half read; replicated ones (norms, router,
            # shared-expert gate, the 1 KV head) whole, and only those.
            assert n == (total if replicated else total // 2), name
        assert any(n for n in reads.values())
    # The shards side by side are the full weights (the split rules written out here,
    # independently of ShardPlan.cut, for the tensors that show each rule).
    c = cfg
    for name, p in full_params.items():
        a, b = shards[0][name], shards[1][name]
        if name in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(torch.cat([a, b]), p), name
        elif name == "mtp.fc.weight":  # [H, 2H]: rank 0 the first H input columns
            assert a.shape[1] == c.hidden_size and torch.equal(torch.cat([a, b], dim=1), p), name
        elif name.endswith("self_attn.o_proj.weight") or name.endswith("linear_attn.out_proj.weight") \
                or name.endswith("mlp.down_proj.weight") or name.endswith("shared_expert.down_proj.weight"):
            assert torch.equal(torch.cat([a, b], dim=1), p), name
        elif name.endswith("linear_attn.A_log") or name.endswith("linear_attn.dt_bias"):
            assert torch.equal(torch.cat([a, b]), p), name
        elif name.endswith("experts.down_proj"):  # [E, H, I]
            assert torch.equal(torch.cat([a, b], dim=2), p), name
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows then up rows on each rank
            i = c.moe_intermediate_size // 2
            gate = torch.cat([a[:, :i], b[:, :i]], dim=1)
            up = torch.cat([a[:, i:], b[:, i:]], dim=1)
            assert torch.equal(torch.cat([gate, up], dim=1), p), name
        elif name.endswith("self_attn.qkv_proj.weight"):
            d = c.head_dim
            hq = c.num_attention_heads * 2 * d
            kv = c.num_key_value_heads * d
            q = torch.cat([a[:hq // 2], b[:hq // 2]])
            assert torch.equal(q, p[:hq]), name
            if c.num_key_value_heads == 1:  # replicated on both ranks
                assert torch.equal(a[hq // 2:], p[hq:]) and torch.equal(b[hq // 2:], p[hq:]), name
        elif "norm" in name or name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
            assert torch.equal(a, p) and torch.equal(b, p), name
