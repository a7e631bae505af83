"""Mixed-step micro-benchmark of the CPU path: does a step cost more than its parts?

For each case, one step that mixes work of different shapes (a long prompt with many
short ones, decodes at very different contexts, a prefill chunk next to decodes) is
timed against the same work split into homogeneous steps, run one after the other.
``ratio = mixed / sum(parts)``; the CPU path's target is <= 1.3 for every case.

Cases run through the kernel entry points (``hybridserve.kernels.ops``) and through
whole model steps of the ``bench`` preset (random weights), so the same script runs
against any version of the package. ``--before REV`` also runs it, side by side in
one invocation, against the package as of git revision ``REV`` (extracted to a
temporary folder with the current build of the Rust extension, or the one
``--before-core PATH`` names when the native kernels' signatures changed in between)
and prints both.

Since issue 17 the DeltaNet state lives in arena pages found through a state page
table; against a package of that kind the cases lay the state out as the arena does
(items in pages of the layout's size, each sequence's pages scattered), against an
older one in contiguous slots, so ``--before`` measures what the paging costs.

    python benches/mixed_step.py --threads 1 --before 596c949
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

BLOCK = 16


def _paged() -> bool:
    """Whether the package under test keeps DeltaNet state in arena pages (issue 17)."""
    import importlib.util

    return importlib.util.find_spec("hybridserve.kernels.state_pages") is not None


def _state_pool(n_seqs, n_items, item_shape, gen, scale=1.0):
    """``(pool, state_pages, item_base)``: a paged pool as the arena lays it out (items in
    pages of 128 KiB, every sequence's pages scattered over a pool twice the size, the
    layer's items from the second page column on), or, for a pre-arena package,
    ``(slots pool [S, n_items, *item], slots, None)``."""
    if not _paged():
        return scale * torch.randn(n_seqs + 1, n_items, *item_shape, generator=gen), torch.arange(n_seqs), None
    item = 1
    for d in item_shape:
        item *= d
    page = 32768  # floats: 128 KiB
    per_page = page // item
    cols = 1 + -(-n_items // per_page)
    num_pages = 2 * n_seqs * cols + 1
    buf = scale * torch.randn(num_pages * page, generator=gen)
    strides = [1]
    for d in reversed(item_shape[1:]):
        strides.insert(0, strides[0] * d)
    pool = buf.as_strided((num_pages, per_page, *item_shape), (page, item, *strides))
    table = torch.randperm(num_pages, generator=gen)[:n_seqs * cols].view(n_seqs, cols).to(torch.int32)
    return pool, table, per_page


def _median_ms(fn, reps: int, min_s: float = 0.0) -> float:
    fn()  # warm-up (allocator, lazy inits)
    times = []
    start = time.perf_counter()
    while len(times) < reps or (time.perf_counter() - start < min_s and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


# ----------------------------------------------------------------------------- ops
def _qsl(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


def delta_case(lens, init, h=8, kd=64, vd=64, seed=0):
    from hybridserve.kernels import ops

    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, h, kd, generator=gen)
    k = torch.randn(t, h, kd, generator=gen)
    v = torch.randn(t, h, vd, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.5
    beta = torch.rand(t, h, generator=gen)
    state, slots, base = _state_pool(len(lens), h, (kd, vd), gen, 0.1)
    qsl = _qsl(lens)
    has = torch.tensor([init] * len(lens))
    kw = {} if base is None else dict(item_base=base)
    return lambda: ops.gated_delta_rule(q, k, v, g, beta, state, qsl, slots, has, kd ** -0.5, True, **kw)


def attention_case(q_lens, seq_lens, hq=8, hkv=2, d=64, seed=0):
    from hybridserve.kernels import ops

    gen = torch.Generator().manual_seed(seed)
    nblocks = [-(-n // BLOCK) for n in seq_lens]
    total = sum(nblocks) + 1
    if _paged():  # K and V of one layer a page apart, as the arena holds them (4 layers)
        blk = BLOCK * hkv * d
        arena = torch.randn(total * 8 * blk, generator=gen)
        shape, strides = (total, BLOCK, hkv, d), (8 * blk, hkv * d, d, 1)
        k_cache, v_cache = arena.as_strided(shape, strides, 2 * blk), arena.as_strided(shape, strides, 3 * blk)
    else:
        k_cache = torch.randn(total, BLOCK, hkv, d, generator=gen)
        v_cache = torch.randn(total, BLOCK, hkv, d, generator=gen)
    perm = torch.randperm(total, generator=gen)
    width = max(nblocks)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    at = 0
    for b, nb in enumerate(nblocks):
        tables[b, :nb] = perm[at:at + nb].to(torch.int32)
        at += nb
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    qsl = _qsl(q_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return lambda: ops.paged_attention(q, k_cache, v_cache, qsl, lens, tables, d ** -0.5)


def conv_case(lens, init, c=1024, w=4, seed=0):
    from hybridserve.kernels import ops

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lens), c, generator=gen)
    weight = torch.randn(c, w, generator=gen)
    state, slots, base = _state_pool(len(lens), 1, (c, w - 1), gen)
    if base is None:
        state = state[:, 0]
    qsl = _qsl(lens)
    has = torch.tensor(init)
    kw = {} if base is None else dict(item_base=base)
    return lambda: ops.causal_conv1d(x, weight, None, state, qsl, slots, has, "silu", **kw)


def op_cases():
    """(name, mixed fn, [part fns]) of the kernel cases."""
    long_short = [1024] + [8] * 31
    dec = [256] * 63 + [8192]
    pre_q, pre_ctx = [512] + [1] * 16, [4096] + [256] * 16
    conv_lens = [1024] + [8] * 31 + [1] * 64
    conv_init = [False] * 32 + [True] * 64
    return [
        ("delta rule: 1x1024 + 31x8 prompts", delta_case(long_short, False),
         [delta_case([1024], False), delta_case([8] * 31, False)]),
        ("delta rule: 1x1024 prompt + 64 decodes", delta_case([1024] + [1] * 64, True),
         [delta_case([1024], True), delta_case([1] * 64, True)]),
        ("paged attn decode: 63 at ctx 256 + 1 at 8192", attention_case([1] * 64, dec),
         [attention_case([1] * 63, [256] * 63), attention_case([1], [8192])]),
        ("paged attn: 512-token chunk at ctx 4096 + 16 decodes at 256", attention_case(pre_q, pre_ctx),
         [attention_case([512], [4096]), attention_case([1] * 16, [256] * 16)]),
        ("conv1d: 1x1024 + 31x8 prompts + 64 decodes", conv_case(conv_lens, conv_init),
         [conv_case([1024], [False]), conv_case([8] * 31, [False] * 31), conv_case([1] * 64, [True] * 64)]),
    ]


# ----------------------------------------------------------------------------- model
class ModelBench:
    """Bench-preset model with a cache whose sequences already hold some context."""

    def __init__(self, preset: str = "bench"):
        from hybridserve.config import ModelConfig
        from hybridserve.model import Qwen3_5ForServing
        from hybridserve.model.tiny import random_state_dict, text_config

        self.config = ModelConfig.from_dict(text_config(preset))
        self.model = Qwen3_5ForServing(self.config)
        self.model.load_state_dict(random_state_dict(self.config, seed=0), strict=False)
        self.model.tie_weights()
        gen = torch.Generator().manual_seed(0)
        self.paged = _paged()
        if self.paged:
            # 4,096 blocks + 160 sequences' state pages in one arena; state pages are
            # handed out from a shuffled list, interleaved with the blocks.
            self.cache = self.model.new_cache(num_pages=4096 + 160 * 8, block_size=BLOCK)
            arena = self.cache.arena.view(torch.float32)
            arena.copy_(torch.randn(arena.shape, generator=gen))
            self.cache.recurrent_pool.mul_(0.05)
            sp = self.cache.state_pages
            self.free_state = (4096 + torch.randperm(160 * 8, generator=gen)).tolist()
            self.take_state = lambda: [self.free_state.pop() for _ in range(sp)]
        else:
            self.cache = self.model.new_cache(num_blocks=4096, block_size=BLOCK, num_state_slots=160)
            for t in self.cache.k_caches + self.cache.v_caches:
                t.copy_(torch.randn(t.shape, generator=gen))
            for t in self.cache.recurrent_states:
                t.copy_(0.05 * torch.randn(t.shape, generator=gen))
        self.next_block = 1
        self.next_slot = 0

    def seqs(self, specs):
        """specs: (q_len, seq_len) each -> per-sequence (q_len, seq_len, blocks, slot)."""
        out = []
        for q_len, seq_len in specs:
            nb = -(-seq_len // BLOCK)
            blocks = list(range(self.next_block, self.next_block + nb))
            self.next_block += nb
            out.append((q_len, seq_len, blocks, self.take_state() if self.paged else self.next_slot))
            self.next_slot += 1
        return out

    def step(self, seqs):
        from hybridserve.model import ForwardBatch

        gen = torch.Generator().manual_seed(1)
        ids, pos, slot_map, qsl, lens, tables, slots, init, last = [], [], [], [0], [], [], [], [], []
        for q_len, seq_len, blocks, slot in seqs:
            for p in range(seq_len - q_len, seq_len):
                pos.append(p)
                slot_map.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
            ids += torch.randint(0, self.config.vocab_size, (q_len,), generator=gen).tolist()
            qsl.append(qsl[-1] + q_len)
            lens.append(seq_len)
            tables.append(blocks)
            slots.append(slot)
            init.append(seq_len > q_len)
            last.append(qsl[-1] - 1)
        batch = ForwardBatch.from_lists(
            input_ids=ids, positions=pos, slot_mapping=slot_map, query_start_loc=qsl, seq_lens=lens,
            block_tables=tables, **{"state_pages" if self.paged else "state_slots": slots},
            has_initial_state=init, logits_indices=last)
        return lambda: self.model(batch, self.cache)


def model_cases():
    mb = ModelBench()
    prompt_long, prompts_short = mb.seqs([(1024, 1024)]), mb.seqs([(8, 8)] * 31)
    dec_short, dec_long = mb.seqs([(1, 256)] * 63), mb.seqs([(1, 4000)])
    chunk = mb.seqs([(512, 2048)])
    return [
        ("model step: 1x1024 + 31x8 prompts", mb.step(prompt_long + prompts_short),
         [mb.step(prompt_long), mb.step(prompts_short)]),
        ("model step: 63 decodes at 256 + 1 at 4000", mb.step(dec_short + dec_long),
         [mb.step(dec_short), mb.step(dec_long)]),
        ("model step: 512 chunk at 2048 + 31x8 prompts + 64 decodes",
         mb.step(chunk + prompts_short + dec_short + dec_long),
         [mb.step(chunk), mb.step(prompts_short), mb.step(dec_short + dec_long)]),
    ]


def measure(reps: int, which: str) -> list[dict]:
    rows = []
    cases = (op_cases() if which in ("all", "ops") else []) + (model_cases() if which in ("all", "model") else [])
    for name, mixed, parts in cases:
        m = _median_ms(mixed, reps, 0.5)
        ps = [_median_ms(p, reps, 0.3) for p in parts]
        rows.append({"case": name, "mixed_ms": round(m, 2), "parts_ms": [round(p, 2) for p in ps],
                     "ratio": round(m / sum(ps), 2)})
    return rows


def _before(rev: str, args) -> list[dict]:
    """Run this script against the package as of ``rev`` in a subprocess."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tmp = tempfile.mkdtemp(prefix="hybridserve-before-")
    try:
        archive = subprocess.run(["git", "-C", root, "archive", rev, "python/hybridserve"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        pkg = os.path.join(tmp, "python", "hybridserve")
        sos = [args.before_core] if args.before_core else glob.glob(
            os.path.join(root, "python", "hybridserve", "_core*.so"))
        for so in sos:
            shutil.copy(so, os.path.join(pkg, os.path.basename(so)))
        env = dict(os.environ, PYTHONPATH=os.path.join(tmp, "python"))
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--threads", str(args.threads),
               "--reps", str(args.reps), "--only", args.only, "--expect-root", os.path.join(tmp, "python")]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", choices=["all", "ops", "model"], default="all")
    ap.add_argument("--before", metavar="REV", help="also measure the package as of this git revision")
    ap.add_argument("--before-core", metavar="PATH",
                    help="the _core extension (.so) to run --before with (default: the current build)")
    ap.add_argument("--json", action="store_true", help="print one JSON list (used by --before)")
    ap.add_argument("--expect-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.expect_root:
        import hybridserve

        assert os.path.abspath(hybridserve.__file__).startswith(args.expect_root), hybridserve.__file__
    before = _before(args.before, args) if args.before else None
    after = measure(args.reps, args.only)
    if args.json:
        print(json.dumps(after))
        return
    print(f"torch intra-op threads: {torch.get_num_threads()}  (medians; ratio = mixed / sum of parts)")
    head = "| case | " + ("before: step / parts / ratio | " if before else "") + "after: step / parts / ratio |"
    print(head)
    print("|---|" + ("---|" if before else "") + "---|")
    for i, row in enumerate(after):
        def fmt(r):
            return f"{r['mixed_ms']} ms / {' + '.join(str(p) for p in r['parts_ms'])} ms / {r['ratio']}x"
        cells = [row["case"]] + ([fmt(before[i])] if before else []) + [fmt(row)]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
