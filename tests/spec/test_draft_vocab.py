"""The reduced draft vocabulary (issue 34): drafts from the LM head's first rows only.

* ``speculative_config``'s ``draft_vocab_size`` is checked at start-up (a positive
  integer or null);
* ``mtp_forward(..., vocab=n)`` gives the first ``n`` columns of the full-vocabulary
  logits and the same MTP state, on the native and the module path;
* with a small draft vocabulary every draft is a token id below it, and greedy output
  equals decoding without speculation (the oracle: the cut changes acceptance only).
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.errors import ConfigError
from hybridserve.model import ForwardBatch, load_model
from hybridserve.model.tiny import write_tiny_checkpoint
from hybridserve.spec.config import SpeculativeConfig
from hybridserve.spec.proposer import DRAFT_VOCAB_CUT, DRAFT_VOCAB_MIN, MTPProposer, default_draft_vocab_size


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(write_tiny_checkpoint(tmp_path_factory.mktemp("dv") / "a", preset="test-a", seed=5))


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "100"])
def test_a_bad_draft_vocab_size_is_refused(bad):
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_size": bad})


def test_draft_vocab_size_parses_and_round_trips():
    c = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2, "draft_vocab_size": 4096}')
    assert c.draft_vocab_size == 4096
    assert SpeculativeConfig.parse(c.to_dict()) == c
    assert SpeculativeConfig.parse({"num_speculative_tokens": 1}).draft_vocab_size is None
    assert SpeculativeConfig.parse({"num_speculative_tokens": 1, "draft_vocab_size": None}).draft_vocab_size is None


def test_the_default_keeps_an_eighth_of_the_ids_within_bounds():
    assert default_draft_vocab_size(272) == 272  # below the floor: the whole vocabulary
    assert default_draft_vocab_size(DRAFT_VOCAB_MIN + 5) == DRAFT_VOCAB_MIN
    assert default_draft_vocab_size(8192) == 1024  # the default model
    assert default_draft_vocab_size(248_320) == 248_320 // 8 < DRAFT_VOCAB_CUT
    assert default_draft_vocab_size(1_000_000) == DRAFT_VOCAB_CUT


@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_logits_over_a_draft_vocab_are_the_full_logits_first_columns(ckpt, dtype, native_on):
    model, config = load_model(ckpt, dtype=dtype, progress=False, load_mtp=True)
    model.native_decode = native_on
    cache = model.new_cache(8, 4)
    torch.manual_seed(0)
    hidden = torch.randn(3, config.hidden_size).to(model.dtype)
    n = 37
    outs = []
    for vocab in (None, n):
        b = ForwardBatch.from_lists(input_ids=[5, 9, 11], positions=[0, 1, 2], slot_mapping=[0, 1, 2],
                                    query_start_loc=[0, 3], seq_lens=[3], block_tables=[[0]], state_pages=[[1]],
                                    has_initial_state=[True], logits_indices=[1, 2])
        outs.append(model.mtp_forward(hidden, b.input_ids, b, cache, vocab))
    (full, h_full), (cut, h_cut) = outs
    assert cut.shape == (2, n) and full.shape == (2, config.vocab_size)
    torch.testing.assert_close(cut, full[:, :n], rtol=0, atol=0)
    assert torch.equal(h_cut, h_full)
    with pytest.raises(ValueError, match="vocab"):
        model.mtp_forward(hidden, b.input_ids, b, cache, 0)


def test_a_small_draft_vocab_drafts_below_it_and_keeps_greedy_output(ckpt, monkeypatch):
    from hybridserve import default_model

    path = default_model.path()
    rnd = random.Random(3)
    prompts = [[rnd.randrange(3, 400) for _ in range(rnd.randint(4, 20))] for _ in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    args = dict(dtype="float32", num_pages=200, max_num_seqs=4, block_size=16, max_model_len=256)
    off = LLM(path, **args).generate([{"prompt_token_ids": p} for p in prompts], params)
    n = 300
    seen = []
    real = MTPProposer.propose

    def propose(self, *a, **kw):
        self.draft_vocab = n
        drafts = real(self, *a, **kw)
        seen.extend(t for d in drafts for t in d)
        return drafts

    monkeypatch.setattr(MTPProposer, "propose", propose)
    llm = LLM(path, speculative_config={"method": "mtp", "num_speculative_tokens": 3, "disable_by_batch_size": 0},
              **args)
    on = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    assert seen and all(0 <= t < n for t in seen)
    # Outputs do leave the draft vocabulary, so some drafts must have been rejected there.
    assert any(t >= n for o in off for t in o.outputs[0].token_ids)
