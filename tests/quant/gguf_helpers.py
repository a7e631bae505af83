"""Helpers of the GGUF tests: the HF oracle (and its rounding as the block kernels
round), our logits for a prompt and for teacher-forced decode steps, greedy checks.
(A module of its own name: every test folder has a ``conftest``.)"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


# Shapes whose every projection input holds whole 256-wide k-quant blocks (hidden,
# attention heads x head dim, DeltaNet value dim, the MLPs' intermediates), so a Q4_K /
# Q5_K / Q6_K file really has those types (else the writer falls back to Q8_0, as
# llama-quantize does).
KQUANT_DENSE = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, head_dim=64,
                    linear_value_head_dim=64)
KQUANT_MOE = dict(hidden_size=256, num_attention_heads=4, head_dim=64, linear_value_head_dim=64,
                  moe_intermediate_size=256, shared_expert_intermediate_size=256)


def hf_oracle(oracle_dir: str):
    import transformers

    from hybridserve.config import ModelConfig

    cls = (transformers.Qwen3_5MoeForCausalLM if ModelConfig.from_json(oracle_dir).is_moe
           else transformers.Qwen3_5ForCausalLM)
    return cls.from_pretrained(oracle_dir, dtype=torch.float32).eval()


def prompt_logits(model, config, prompt, block_size=16):
    """Our logits ``[n, vocab]`` for one whole prompt in one forward."""
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model import ForwardBatch
    from hybridserve.model.cache import dtype_name

    n = len(prompt)
    nb = -(-n // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    batch = ForwardBatch.from_lists(
        input_ids=prompt, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=[list(range(nb))], state_pages=[list(range(nb, nb + pages))],
        has_initial_state=[False], logits_indices=range(n), device="cpu")
    with torch.no_grad():
        return model(batch, cache).float()


def greedy(model, config, prompt, steps, block_size=16, logits=None):
    """Our greedy continuation of ``prompt``: one prefill, then one decode per token
    (each step's logits row appended to ``logits`` when a list is given)."""
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model import ForwardBatch
    from hybridserve.model.cache import dtype_name

    total = len(prompt) + steps
    nb = -(-total // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    tables, state = [list(range(nb))], [list(range(nb, nb + pages))]
    tokens = list(prompt)
    n = len(prompt)
    batch = ForwardBatch.from_lists(
        input_ids=tokens, positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=tables, state_pages=state, has_initial_state=[False], logits_indices=[n - 1], device="cpu")
    out = []
    with torch.no_grad():
        for _ in range(steps):
            row = model(batch, cache)[0]
            if logits is not None:
                logits.append(row.clone())
            tok = int(row.argmax())
            out.append(tok)
            p = len(tokens)
            tokens.append(tok)
            batch = ForwardBatch.from_lists(
                input_ids=[tok], positions=[p], slot_mapping=[p], query_start_loc=[0, 1], seq_lens=[p + 1],
                block_tables=tables, state_pages=state, has_initial_state=[True], logits_indices=[0],
                device="cpu")
    return out


# ---- the kernels' activation rounding, applied to the HF oracle ----------------------
#
# The block GEMM (hybridserve.kernels.quant.matmul, as llama.cpp's vec_dot) rounds each
# activation row to 8 bits before the integer dot products: Q8_0 blocks of 32 against
# Q8_0 / Q4_0 weights, Q8_K blocks of 256 against the k-quants (q8_act_ref, the plain
# PyTorch reference of that rounding). It does so for products of at most
# native_max_rows(qtype) rows (hybridserve.quant.tiles) (decode, the routed rows of an
# expert, short prompts), and for longer inputs too on a CPU in PREFILL_INT8_ISAS (the
# many-row int8 GEMM); elsewhere longer inputs run dequantized tiles on unrounded
# activations. A tiny random
# model amplifies that rounding a lot (measured: max |logit error| 0.01-0.3 of the
# logits' standard deviation), enough to flip near-tied greedy choices; so the oracle
# applies the same rounding at the same products (HF's own modules, a pre-hook on each
# linear layer and the experts' loop), and is then compared to tight bounds.

K_QUANTS = ("q4_k", "q5_k", "q6_k")


def _round_rows(x: torch.Tensor, qtype: str | None, perm=None) -> torch.Tensor:
    """``x [..., K]`` as the block kernel of weight type ``qtype`` sees it (None: a float
    weight, unrounded); ``perm``: the weight's input features were stored permuted, so the
    blocks run over ``x[..., perm]``."""
    from hybridserve.kernels import quant as qk
    from hybridserve.quant.ggml import PREFILL_INT8_ISAS
    from hybridserve.quant.tiles import native_max_rows

    if qtype is None or not qk.available():
        return x
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0 or (flat.shape[0] > native_max_rows(qtype) and qk.isa() not in PREFILL_INT8_ISAS):
        return x
    if perm is not None:
        flat = flat[:, perm]
    r = qk.q8_act_ref(flat.float(), k_quant=qtype in K_QUANTS).to(x.dtype)
    if perm is not None:
        r = r[:, torch.argsort(perm)]
    return r.reshape(x.shape)


def round_like_kernels(hf, gguf_path: str):
    """Hook ``hf`` (a HF Qwen3.5 model on a GGUF's dequantized weights) so each product
    sees its input rounded as our block kernel rounds it (see above). Returns ``hf``."""
    import types

    from hybridserve.quant.gguf import names
    from hybridserve.quant.gguf.load import gguf_config
    from hybridserve.quant.gguf.reader import GGUFFile

    f = GGUFFile(gguf_path)
    config = gguf_config(gguf_path)

    def qtype_of(local: str) -> str | None:
        gname, _ = names.gguf_name(local, config.num_hidden_layers)
        t = f.tensors[gname]
        return t.type_name.lower() if t.quantized else None

    for name, mod in hf.named_modules():
        local = name.removeprefix("model.")
        if isinstance(mod, torch.nn.Linear):
            tied = name == "lm_head" and config.tie_word_embeddings
            q = qtype_of("embed_tokens.weight" if tied else f"{local}.weight")
            if q is None:
                continue
            perm = names.column_perm(f"{local}.weight", config)
            mod.register_forward_pre_hook(lambda m, args, q=q, perm=perm: (_round_rows(args[0], q, perm),))
        elif type(mod).__name__.endswith("Experts") and hasattr(mod, "gate_up_proj"):
            qg = qtype_of(f"{local}.0.gate_proj.weight")
            qd = qtype_of(f"{local}.0.down_proj.weight")

            def forward(self, hidden_states, top_k_index, top_k_weights, qg=qg, qd=qd):
                # HF's eager experts loop, with the kernels' input rounding.
                out = torch.zeros_like(hidden_states)
                for e in range(self.num_experts):
                    token_idx, top_k_pos = torch.where(top_k_index == e)
                    if token_idx.numel() == 0:
                        continue
                    x = _round_rows(hidden_states[token_idx], qg)
                    gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                    h = _round_rows(self.act_fn(gate) * up, qd)
                    h = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[token_idx, top_k_pos, None]
                    out.index_add_(0, token_idx, h.to(out.dtype))
                return out

            mod.forward = types.MethodType(forward, mod)
    return hf


# Logit bounds, as a fraction of the largest |logit| of the oracle's row block.
# Reference path: float32 summation order (the safetensors fidelity tests' bound).
# Native path, against the oracle rounded as the kernels round: what differs is where a
# float difference upstream (the native SiLU, norms and attention against torch's, in
# the last bits) moves an activation across an 8-bit rounding boundary: one step of
# amax/127 in one element of one block, a product change of at most that times |w|,
# which the tiny random models amplify through their layers (measured at most 1.4 % of
# max |logit| over the test configs); 3 % leaves room for the other kernels' ISA paths.
LOGIT_BOUND = {"reference": 1e-4, "native": 3e-2}


def forced_decode_logits(model, config, prompt, forced, block_size=16):
    """Our logits rows: the prompt's last, then one decode step per token of ``forced``
    (teacher forcing: each step is fed ``forced[i]``, not our own choice)."""
    from hybridserve.memory.layout import arena_layout
    from hybridserve.model import ForwardBatch
    from hybridserve.model.cache import dtype_name

    total = len(prompt) + len(forced)
    nb = -(-total // block_size)
    pages = arena_layout(config, block_size, dtype_name(model.dtype)).state_pages
    cache = model.new_cache(nb + pages, block_size)
    tables, state = [list(range(nb))], [list(range(nb, nb + pages))]
    n = len(prompt)
    batch = ForwardBatch.from_lists(
        input_ids=list(prompt), positions=range(n), slot_mapping=range(n), query_start_loc=[0, n], seq_lens=[n],
        block_tables=tables, state_pages=state, has_initial_state=[False], logits_indices=[n - 1], device="cpu")
    rows = []
    with torch.no_grad():
        rows.append(model(batch, cache)[0].clone())
        for i, tok in enumerate(forced[:-1]):
            p = n + i
            batch = ForwardBatch.from_lists(
                input_ids=[tok], positions=[p], slot_mapping=[p], query_start_loc=[0, 1], seq_lens=[p + 1],
                block_tables=tables, state_pages=state, has_initial_state=[True], logits_indices=[0],
                device="cpu")
            rows.append(model(batch, cache)[0].clone())
    return torch.stack(rows)


def hf_greedy(hf, prompt, steps):
    """HF's greedy tokens and each step's logits row (cached generation)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                      eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack([s[0].float() for s in out.logits])


def check_greedy(ours_rows, hf_tokens, hf_rows, bound):
    """Step by step (teacher-forced on HF's tokens): our logits within ``bound`` of HF's
    largest |logit|, and our argmax HF's token, unless HF's own top-2 margin at that step
    is within twice our measured deviation there (then the two are a tie within the
    kernels' rounding and either choice is right). Returns the number of such ties
    (tests assert it is small, so the check is not vacuous)."""
    ties = 0
    for i, (ours, ref, tok) in enumerate(zip(ours_rows, hf_rows, hf_tokens)):
        torch.testing.assert_close(ours, ref, rtol=0, atol=bound * float(ref.abs().max()),
                                   msg=lambda m: f"step {i}: {m}")
        if int(ours.argmax()) == tok:
            continue
        top2 = torch.topk(ref, 2).values
        err = float((ours - ref).abs().max())
        assert float(top2[0] - top2[1]) <= 2 * err, f"greedy token differs at step {i} (HF's margin " \
            f"{float(top2[0] - top2[1]):.4g}, our deviation {err:.4g})"
        ties += 1
    return ties
