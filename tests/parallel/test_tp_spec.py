"""Speculative decoding (MTP drafts) under tensor_parallel_size=2 (gloo, two processes).

Rank 0 drafts and accepts; the verify forward, the DeltaNet commit of the accepted rows
and the drafter's passes run sharded on both ranks (the MTP layer is sharded like a
decoder layer). The oracles are the single-process engine's:

* greedy output with drafts under TP equals decoding without drafts on one process,
  token for token (k = 1..3; the trained default model, whose MTP layer was trained
  with it, accepts most drafts; random MTP weights reject most: both ends of the
  commit path);
* everything (greedy, seeded samples with n = 2, logprobs) equals the single-process
  engine speculating with the same k, and so do the counters ``spec_draft_tokens`` and
  ``spec_accepted_tokens`` (the same drafts were proposed and accepted);
* seeded samples also equal decoding without drafts (the acceptance rule draws every
  token with the stream offset a plain step uses).

The workload runs through chunked prefill (a 32-token budget) and prefix-cache hits.
A worker killed mid-speculation is in test_tp_faults.py.
"""

from __future__ import annotations

import random

import pytest

from hybridserve import LLM, SamplingParams
from hybridserve.errors import ConfigError
from hybridserve.model.tiny import write_tiny_checkpoint

ENGINE = dict(dtype="float32", cpu_threads=1, block_size=16, max_num_seqs=4, max_model_len=256,
              max_num_batched_tokens=32, prefix_checkpoint_interval=16, num_pages=120)
TOL = 1e-4


def _spec(k: int, draft_vocab: int | None = None) -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 0}
    if draft_vocab:
        spec["draft_vocab_size"] = draft_vocab
    return spec


def _path(model: str, tp_dirs) -> str:
    if model == "trained":
        from hybridserve import default_model

        return default_model.path()
    return tp_dirs[model]


def _run(path: str, tp: int, k: int | None, draft_vocab: int | None = None) -> dict:
    llm = LLM(path, tensor_parallel_size=tp, speculative_config=_spec(k, draft_vocab) if k else None, **ENGINE)
    rng = random.Random(11)
    toks = lambda n: [rng.randrange(3, 200) for _ in range(n)]  # noqa: E731
    system = toks(35)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    # Cached first: the later prompts hit its prefix checkpoints.
    llm.generate([{"prompt_token_ids": system + toks(2)}], SamplingParams(max_tokens=2, temperature=0))
    prompts = [system + toks(3 + i) for i in range(3)] + [toks(9), system + toks(4)]
    params = [greedy, SamplingParams(max_tokens=32, temperature=0, logprobs=2, ignore_eos=True), greedy,
              SamplingParams(max_tokens=28, temperature=0.9, top_k=20, top_p=0.9, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=24, n=2, temperature=1.0, min_p=0.02, seed=8, ignore_eos=True)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    st = llm.engine.stats()
    model = llm.engine.model
    res = {
        "tokens": [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs],
        "logprobs": [[(t, lp.logprob) for d in outs[1].outputs[0].logprobs for t, lp in d.items()]],
        "stats": st,
        "mtp_fc_in": model.mtp.fc.weight.shape[1] if model.mtp is not None else None,
        "hidden": model.config.hidden_size,
    }
    del llm
    return res


@pytest.fixture(scope="module")
def off(tp_dirs):
    """The single-process engine without drafts, per model (computed once)."""
    cache: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in cache:
            cache[model] = _run(_path(model, tp_dirs), 1, None)
        return cache[model]

    return get


# draft_vocab: a reduced draft vocabulary (the first 1024 of the trained model's 8192
# ids); under TP it is cut from the gathered logits, so the drafts are the same.
@pytest.mark.parametrize("model,k,draft_vocab", [
    ("trained", 1, None), ("trained", 2, None), ("trained", 3, None), ("trained", 2, 1024),
    ("moe", 1, None), ("moe", 3, None), ("dense-kv1", 2, None)])
def test_tp2_speculation_equals_the_single_process(model, k, draft_vocab, tp_dirs, off):
    path = _path(model, tp_dirs)
    tp = _run(path, 2, k, draft_vocab)
    one = _run(path, 1, k, draft_vocab)
    ref = off(model)
    st = tp["stats"]
    # The drafter ran sharded: its fc holds this rank's half of the 2H input columns.
    assert tp["mtp_fc_in"] == tp["hidden"] and one["mtp_fc_in"] == 2 * one["hidden"]
    # Greedy (entries 0-2) identical to no speculation on one process; seeded samples too.
    assert tp["tokens"] == ref["tokens"]
    # Everything, and the counters, as the single process speculating with the same k.
    assert tp["tokens"] == one["tokens"]
    for (t1, a), (t2, b) in zip(tp["logprobs"][0], one["logprobs"][0]):
        assert t1 == t2 and abs(a - b) <= TOL
    for key in ("spec_draft_tokens", "spec_accepted_tokens", "spec_verify_steps"):
        assert st[key] == one["stats"][key], key
    assert st["spec_draft_tokens"] > 0
    if model == "trained":
        # Most drafts accepted, some rejected: both sides of the commit ran.
        assert 0 < st["spec_accepted_tokens"] < st["spec_draft_tokens"], st
    # The workload went through chunked prefill and prefix-cache hits under TP, and
    # gave every page back.
    assert st["checkpoint_hits"] > 0 and st["prefix_skipped_tokens"] > 0, st
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0


def test_tp2_speculation_without_an_mtp_layer_is_refused(tmp_path):
    path = write_tiny_checkpoint(tmp_path / "no-mtp", preset="test-a", seed=2, mtp=False)
    with pytest.raises(ConfigError, match="no MTP layer"):
        LLM(str(path), tensor_parallel_size=2, speculative_config=_spec(2), dtype="float32", cpu_threads=1,
            num_pages=40)
