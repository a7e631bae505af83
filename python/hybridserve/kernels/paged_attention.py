"""Causal attention of a flattened varlen batch over a paged KV cache: the reference.

Gather-based: for each sequence it collects the K/V rows its block table names into
a dense tensor and runs ordinary masked attention. Slow but obviously right, which is
what the CPU path and the Triton kernel's oracle need.
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
    decodes = [b for b in range(len(lens)) if qsl[b + 1] - qsl[b] == 1]
    if len(decodes) > 1:
        _decode_batch(q, k_cache, v_cache, qsl, lens, block_tables, scale, decodes, out)
    done = set(decodes) if len(decodes) > 1 else set()
    for b, seq_len in enumerate(lens):
        start, end = qsl[b], qsl[b + 1]
        q_len = end - start
        if q_len == 0 or b in done:
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


def _decode_batch(q, k_cache, v_cache, qsl, lens, block_tables, scale, decodes, out):
    """All one-query sequences at once: gather their blocks, mask past each length."""
    _, block_size, hkv, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    seq_lens = [lens[b] for b in decodes]
    n_blocks = -(-max(seq_lens) // block_size)
    if n_blocks > block_tables.shape[1]:
        raise ValueError(
            f"a decode sequence has {max(seq_lens)} tokens ({n_blocks} blocks of {block_size}) but "
            f"the block tables have only {block_tables.shape[1]} entries"
        )
    dev = k_cache.device
    sel = torch.tensor(decodes, device=block_tables.device)
    tables = block_tables.index_select(0, sel)[:, :n_blocks].to(device=dev, dtype=torch.long)
    # Entries past a sequence's own blocks are padding of any value: point them at block 0
    # (always valid; what they gather is masked out below).
    own = torch.tensor([-(-n // block_size) for n in seq_lens], device=dev)
    tables = tables.masked_fill(torch.arange(n_blocks, device=dev)[None, :] >= own[:, None], 0)
    n = len(decodes)
    k = k_cache[tables].reshape(n, n_blocks * block_size, hkv, d).float()
    v = v_cache[tables].reshape(n, n_blocks * block_size, hkv, d).float()
    rows = torch.tensor([qsl[b] for b in decodes], device=q.device)
    qb = q.index_select(0, rows).float().reshape(n, hkv, group, d)
    scores = torch.einsum("nhgd,nkhd->nhgk", qb, k) * scale
    length = torch.tensor(seq_lens, device=dev)
    # The query is the last token, so causality reduces to "key index < seq_len".
    invalid = torch.arange(n_blocks * block_size, device=dev)[None, :] >= length[:, None]
    scores = scores.masked_fill(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.einsum("nhgk,nkhd->nhgd", probs, v).reshape(n, hq, d)
    out[rows] = o.to(out.dtype)
