"""Causal attention of a flattened varlen batch over a paged KV cache: the reference.

Two implementations of one contract. :func:`paged_attention_ref` is gather-based and
one sequence at a time: it collects the K/V rows a sequence's block table names into a
dense tensor and runs ordinary masked attention; slow but obviously right (the oracle
of the CPU path and of the Triton kernel). :func:`paged_attention_cpu` is the CPU path:
sequences of similar shape (query count and context, each within a factor 1.25) share
one ``F.scaled_dot_product_attention`` call over their own gathered blocks, GQA read
without repeating K/V, so a step costs about what its parts cost and memory stays
O(queries x key tile), not O(queries x context x heads).
"""

from __future__ import annotations

import torch


def _as_list(t: torch.Tensor | list[int]) -> list[int]:
    return t if isinstance(t, list) else t.tolist()


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention output ``[T, Hq, D]`` in ``q``'s dtype (softmax and sums in float32).

    * ``q`` ``[T, Hq, D]``: sequence ``b``'s queries are rows
      ``query_start_loc[b]:query_start_loc[b+1]``; they are the LAST ``q_len`` tokens of
      its ``seq_lens[b]`` tokens, whose K/V are all in the cache already (write first).
    * ``k_cache``/``v_cache`` ``[num_blocks, block_size, Hkv, D]``; ``Hq`` is a multiple
      of ``Hkv`` and query head ``h`` reads KV head ``h // (Hq // Hkv)`` (HF ``repeat_kv``).
    * ``block_tables`` ``[B, max_blocks]``: logical block ``i`` of sequence ``b`` is
      physical block ``block_tables[b, i]``; entries past ``ceil(seq_lens[b]/block_size)``
      are ignored.
    * Causal: the query at absolute position ``p`` sees keys ``0..p``.

    Cost O(sum_b q_len_b * seq_len_b * Hq * D).
    """
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    group = hq // hkv
    qsl = _as_list(query_start_loc)
    lens = _as_list(seq_lens)
    out = torch.empty_like(q)
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0:
            continue
        if q_len > seq_len:
            raise ValueError(f"sequence {b} has {q_len} queries but only {seq_len} tokens in total")
        n_blocks = -(-seq_len // block_size)
        if n_blocks > block_tables.shape[1]:
            raise ValueError(
                f"sequence {b} has {seq_len} tokens ({n_blocks} blocks of {block_size}) but its "
                f"block table has only {block_tables.shape[1]} entries"
            )
        blocks = block_tables[b, :n_blocks].to(device=k_cache.device, dtype=torch.long)
        k = k_cache[blocks].reshape(-1, hkv, d)[:seq_len].float()
        v = v_cache[blocks].reshape(-1, hkv, d)[:seq_len].float()
        if group > 1:
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        qb = q[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] > q_pos[:, None]
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# ----------------------------------------------------------------------------- CPU path
_BUCKET = 1.25  # members of a group differ by at most this factor in queries and in context


class AttentionPlan:
    """Groups of one step's sequences for :func:`paged_attention_cpu`; built once per step
    and shared by every attention layer (it depends on lengths and block tables only).

    Sequences are bucketed by (query count, context) on a geometric grid of ratio 1.25,
    so padding inside a group is at most 25% of its work and a decode at 8k context
    never makes 63 decodes at 256 read 8k keys. Each group holds its query rows (padded
    rows read row 0 and are dropped), its block tables (entries past a member's own
    blocks point at block 0 and are masked) and its mask, or ``None`` / causal when the
    shape needs none.

    With ``split_decodes`` the single-query sequences are left out of the groups and
    listed in ``decode`` (rows, seq_lens, block tables) for the native decode kernel.
    """

    def __init__(self, query_start_loc, seq_lens, block_tables: torch.Tensor, block_size: int,
                 device: torch.device | str = "cpu", split_decodes: bool = False):
        import numpy as np

        qsl = np.asarray(_as_list(query_start_loc), dtype=np.int64)
        lens = np.asarray(_as_list(seq_lens), dtype=np.int64)
        q_lens = qsl[1:] - qsl[:-1]
        if (q_lens > lens).any():
            b = int(np.nonzero(q_lens > lens)[0][0])
            raise ValueError(f"sequence {b} has {int(q_lens[b])} queries but only {int(lens[b])} tokens in total")
        n_blocks = -(-lens // block_size)
        width = block_tables.shape[1]
        if (n_blocks > width).any():
            b = int(np.nonzero(n_blocks > width)[0][0])
            raise ValueError(
                f"sequence {b} has {int(lens[b])} tokens ({int(n_blocks[b])} blocks of {block_size}) but "
                f"its block table has only {width} entries"
            )

        def tt(a, dtype=torch.long):
            return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

        act = np.nonzero(q_lens > 0)[0]
        self.decode = None
        if split_decodes:
            dec = act[q_lens[act] == 1]
            act = act[q_lens[act] != 1]
            if len(dec):
                nb = -(-int(lens[dec].max()) // block_size)
                self.decode = (qsl[dec].astype(np.int64), lens[dec].astype(np.int64),
                               block_tables.index_select(0, tt(dec).to(block_tables.device))[:, :nb]
                               .to(device="cpu", dtype=torch.int32).contiguous())
        log_r = np.log(_BUCKET)
        key = (np.floor(np.log(q_lens[act]) / log_r).astype(np.int64) * 4096
               + np.floor(np.log(np.maximum(lens[act], 1)) / log_r).astype(np.int64))
        self.groups = []
        tables_dev = block_tables.to(device=device)
        for k in np.unique(key):
            mem = act[key == k]
            n, qmax, lmax = len(mem), int(q_lens[mem].max()), int(lens[mem].max())
            nb = -(-lmax // block_size)
            i = np.arange(qmax)[None, :]
            valid = i < q_lens[mem][:, None]
            rows = np.where(valid, qsl[mem][:, None] + i, 0)
            flat_valid = np.nonzero(valid.ravel())[0]
            tables = tables_dev.index_select(0, tt(mem))[:, :nb].long()
            if (n_blocks[mem] < nb).any():
                tables = tables.masked_fill(
                    torch.arange(nb, device=device)[None, :] >= tt(n_blocks[mem])[:, None], 0)
            offset = lens[mem] - q_lens[mem]  # absolute position of each member's first query
            causal, mask = False, None
            if (offset == 0).all() and (q_lens[mem] == qmax).all() and qmax == lmax and qmax > 1:
                causal = True  # whole prompts of one length: plain causal attention
            elif not ((q_lens[mem] == 1).all() and (lens[mem] == lmax).all()):
                # key j is visible to query i of member b iff j <= offset_b + i
                m = np.arange(lmax)[None, None, :] <= (offset[:, None] + np.arange(qmax)[None, :])[:, :, None]
                mask = tt(m[:, None], torch.bool)
            # Key slots past a member's own length: the tail of its last block and the
            # block-0 entries past its blocks hold whatever those pages held before
            # (another sequence's K/V, or DeltaNet state bytes read as this dtype, which
            # in bfloat16 can be NaN or inf). The mask gives them weight 0, but 0 * NaN
            # is NaN, so paged_attention_cpu zeroes them.
            short = lens[mem] < lmax
            pad = tt(np.arange(lmax)[None, :] >= lens[mem][:, None], torch.bool) if short.any() else None
            self.groups.append({
                "n": n, "q": qmax, "len": lmax, "rows": tt(rows.ravel()), "pad": pad,
                "out_pos": None if valid.all() else tt(flat_valid),
                "out_rows": tt((rows.ravel())[flat_valid]) if not valid.all() else tt(rows.ravel()),
                "tables": tables, "causal": causal, "mask": mask,
            })


def paged_attention_cpu(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale,
                        plan: AttentionPlan | None = None) -> torch.Tensor:
    """The CPU path; same contract as :func:`paged_attention_ref`. Pass an
    :class:`AttentionPlan` to share the grouping across layers."""
    t, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of KV heads {hkv}")
    if plan is None:
        plan = AttentionPlan(query_start_loc, seq_lens, block_tables, block_size, q.device)
    out = torch.empty_like(q)
    if plan.decode is not None:
        from hybridserve.kernels import native

        native.paged_attention_decode(q, k_cache, v_cache, *plan.decode, scale, out)
    # A bfloat16 model's groups run SDPA in bfloat16 on the gathered bfloat16 blocks (its
    # CPU flash kernel sums and softmaxes in float32; HF's bfloat16 run calls the same
    # kernel): no float32 copies of the queries and blocks. Speed is level with SDPA on
    # float32 copies (0.91-0.96x at 1 thread, benches/bf16_kernels.py --only attention).
    cd = q.dtype if q.dtype == torch.bfloat16 and k_cache.dtype == q.dtype else torch.float32
    qf = q.to(cd)
    for grp in plan.groups:
        n, ql, length, tables = grp["n"], grp["q"], grp["len"], grp["tables"]
        nb = tables.shape[1]
        qg = qf.index_select(0, grp["rows"]).view(n, ql, hq, d).transpose(1, 2)
        flat = tables.reshape(-1)
        kg = k_cache.index_select(0, flat).view(n, nb * block_size, hkv, d)[:, :length]
        vg = v_cache.index_select(0, flat).view(n, nb * block_size, hkv, d)[:, :length]
        if grp["pad"] is not None:  # see AttentionPlan: stale slots must not reach the sums
            kg.masked_fill_(grp["pad"][:, :, None, None], 0)
            vg.masked_fill_(grp["pad"][:, :, None, None], 0)
        kg, vg = kg.transpose(1, 2), vg.transpose(1, 2)
        og = torch.nn.functional.scaled_dot_product_attention(
            qg, kg.to(cd), vg.to(cd), attn_mask=grp["mask"], is_causal=grp["causal"], scale=scale,
            enable_gqa=hq != hkv)
        og = og.transpose(1, 2).reshape(n * ql, hq, d)
        if grp["out_pos"] is not None:
            og = og.index_select(0, grp["out_pos"])
        out.index_copy_(0, grp["out_rows"], og.to(out.dtype))
    return out
