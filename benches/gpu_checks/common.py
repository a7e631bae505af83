"""What every device check shares: criteria and verdicts, the run context, random-weight
models and engines, and the HF helpers."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# bfloat16 logits of two implementations that round at different points: the largest
# difference allowed, as a fraction of the reference logits' largest magnitude.
BF16_LOGIT_TOL = 0.05
FP32_LOGIT_TOL = 1e-4


PASS, FAIL, NA = "pass", "fail", "not applicable"


def criterion(name: str, passed: bool | None, **detail: Any) -> dict[str, Any]:
    """One asserted pass criterion of a check: ``passed`` None means this device
    cannot decide it (reported "not applicable", never as passed)."""
    return {"name": name, "status": NA if passed is None else PASS if passed else FAIL, **detail}


def verdict(criteria: list[dict[str, Any]]) -> str:
    """A check's status from its criteria (no criteria: a check that asserts nothing
    is a bug in the check, reported as failed)."""
    statuses = [c["status"] for c in criteria]
    if not statuses or FAIL in statuses:
        return FAIL
    return PASS if PASS in statuses else NA


def log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.small = args.small
        self.quick = args.quick
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self._tiny: dict[str, str] = {}

    def tiny(self, preset: str) -> str:
        from hybridserve.model.tiny import write_tiny_checkpoint

        if preset not in self._tiny:
            self._tiny[preset] = write_tiny_checkpoint(self.tmp / preset, preset=preset, seed=5)
        return self._tiny[preset]


# ---------------------------------------------------------------------------- helpers
def random_model_dir(root: Path, name: str, config: dict[str, Any]) -> str:
    """A checkpoint directory with config.json and a byte tokenizer but no weights:
    :func:`random_weights` fills the model on the device instead of reading files."""
    from hybridserve.model.tiny import write_tokenizer

    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "config.json", "w") as f:
        json.dump(config, f)
    write_tokenizer(str(d), config["vocab_size"], config["max_position_embeddings"])
    return str(d)


def random_weights(model_dir: str, dtype: Any = "float32", device: Any = "cpu", progress: bool = True,
                   load_mtp: bool = False):
    """Stand-in for ``load_model``: the model of ``model_dir``'s config with random
    weights drawn on the device (scaled like the tiny checkpoints, so activations stay
    O(1)); no weight files are read. ``load_mtp``: with a random MTP layer too."""
    import torch

    from hybridserve.config import ModelConfig
    from hybridserve.model.cache import resolve_dtype
    from hybridserve.model.qwen3_5 import Qwen3_5ForServing

    config = ModelConfig.from_json(model_dir)
    device = torch.device(device)
    model = Qwen3_5ForServing(config, dtype=resolve_dtype(dtype), device="meta", mtp=load_mtp)
    model.to_empty(device=device)
    model.tie_weights()
    gen = torch.Generator(device=device).manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape, device=device).uniform_(0.05, 2.0, generator=gen).log())
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, device=device, generator=gen))
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.1, generator=gen)
            elif name.endswith("conv1d.weight"):
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
            elif name == "embed_tokens.weight":
                p.normal_(0.0, 1.0, generator=gen)
            elif p.dim() == 2:
                std = 1.0 / math.sqrt(p.shape[1])
                if name.split(".")[-2] in ("o_proj", "out_proj", "down_proj"):
                    std /= math.sqrt(2 * config.num_hidden_layers)
                p.normal_(0.0, std, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.eval()
    return model, config


@contextlib.contextmanager
def random_weight_engine():
    """Engines built inside draw their weights on the device (no checkpoint files)."""
    import hybridserve.engine.builder as le

    real = le.load_model
    le.load_model = random_weights
    try:
        yield
    finally:
        le.load_model = real


def make_engine(model_dir: str, ctx: Ctx, **kw: Any):
    from hybridserve.engine.args import EngineArgs
    from hybridserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=model_dir, device=str(ctx.device), **kw))


def sync(ctx: Ctx) -> None:
    if ctx.cuda:
        import torch

        torch.cuda.synchronize(ctx.device)


def free_memory() -> None:
    """Return the device memory of engines the caller has already dropped (``del``):
    two 27B engines must never be alive at once."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- checks


def _hf_greedy(hf, prompt: list[int], n: int, device) -> list[int]:
    import torch

    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([ids], device=device)).logits[0, -1]
            ids.append(int(logits.float().argmax()))
    return ids[len(prompt):]


def _our_prefill_logits(model, config, prompt: list[int], device):
    import torch

    from hybridserve.model.batch import ForwardBatch

    n, bs = len(prompt), 16
    nb = -(-n // bs)
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model.cache import dtype_name

    state_pages = arena_layout(config, bs, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + state_pages, bs)
    state = list(range(nb, nb + state_pages))  # the arena's pages after the blocks
    batch = ForwardBatch.from_lists(
        input_ids=prompt, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n],
        seq_lens=[n], block_tables=[list(range(nb))], state_pages=[state], has_initial_state=[False],
        logits_indices=range(n), device=device,
    )
    with torch.no_grad():
        return model(batch, cache).float()


def _worst_prefill_error(hf, ours, config, prompts: list[list[int]], device) -> float:
    """The largest logit error of ``ours`` against ``hf`` over the prompts' prefill,
    relative to each prompt's largest HF logit (at least 1)."""
    import torch

    worst = 0.0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p], device=device)).logits[0].float()
        got = _our_prefill_logits(ours, config, p, device)
        worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp(min=1.0)))
    return worst


def _engine_greedy(model_dir: str, ctx: Ctx, dtype: str, prompts: list[list[int]], n_tokens: int
                   ) -> dict[str, list[list[int]]]:
    """Each prompt's first ``n_tokens`` greedy tokens from an engine on ``model_dir``,
    run eager and (on CUDA) with CUDA graphs: ``{"eager"|"graphs": tokens per prompt}``."""
    from hybridserve.sampling import SamplingParams

    tokens: dict[str, list[list[int]]] = {}
    for eager in ([False, True] if ctx.cuda else [True]):
        eng = make_engine(model_dir, ctx, dtype=dtype, max_num_seqs=8, num_gpu_blocks=256, num_state_slots=16,
                          enforce_eager=eager)
        for i, p in enumerate(prompts):
            eng.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True))
        res: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    res[o.request_id] = o.outputs[0].token_ids
        tokens["eager" if eager else "graphs"] = [res[f"p{i}"] for i in range(len(prompts))]
        del eng
        free_memory()
    return tokens
