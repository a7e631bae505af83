"""Beam search inside the engine, against two oracles:

* ``ignore_eos=True``: HF transformers ``generate(num_beams=W, num_return_sequences=W,
  do_sample=False)`` (float32) must return the same W sequences in the same order;
* EOS allowed: a brute-force beam search written here over HF's logits (each
  candidate's full sequence recomputed by HF, no cache), with HF's selection
  rules (top ``max(2, 1 + #eos) * W`` candidates, finished list scored
  ``cum / len ** length_penalty``, early-stop heuristic).

Each run forces chunked prefill (a 16-token budget for 21-token prompts) and runs
ordinary greedy requests in the same batches (checked against HF greedy too).
"""

from __future__ import annotations

import copy

import pytest
import torch

from hybridserve import LLM, SamplingParams
from hybridserve.beam_search import BeamSearchParams
from hybridserve.errors import InvalidRequest

PROMPT = [5, 9, 33, 2, 71, 18, 4, 40, 12, 3, 7, 91, 15, 60, 22, 8, 31, 44, 6, 13, 27]  # 21 tokens
OTHERS = [[17, 3, 88, 41, 9], [63, 5, 5, 120, 77, 2, 34, 19, 101]]


def _llm(tiny_dirs, preset, width, block_size=16):
    return LLM(tiny_dirs[preset], dtype="float32", device="cpu", block_size=block_size,
               num_pages=64 + 3 * (width + 2), max_num_seqs=width + 2, max_num_batched_tokens=16)


def _hf_greedy(hf, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def _run_beside_others(llm, prompt, params, n_other):
    """One beam request and ordinary greedy requests stepped together to the end."""
    eng = llm.engine
    eng.add_beam_request("beam", prompt, params)
    for i, p in enumerate(OTHERS):
        eng.add_request(f"o{i}", p, SamplingParams(temperature=0, max_tokens=n_other, ignore_eos=True))
    done, shared_seen, mixed = {}, 0, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        st = eng.stats()
        shared_seen = max(shared_seen, st["shared_blocks"])
        mixed += st["last_step_seqs"] > params.beam_width
    return done, shared_seen, mixed


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
@pytest.mark.parametrize("width,block_size", [(2, 16), (4, 16), (8, 16), (2, 32), (8, 32)])
def test_beams_equal_hf_generate(tiny_dirs, hf_models, preset, width, block_size):
    hf = hf_models[preset]
    n = 7
    llm = _llm(tiny_dirs, preset, width, block_size)
    done, shared, mixed = _run_beside_others(llm, PROMPT, BeamSearchParams(beam_width=width, max_tokens=n,
                                                                           ignore_eos=True), 10)
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id = None  # ignore_eos
    gc.num_beams, gc.num_return_sequences, gc.do_sample = width, width, False
    gc.max_new_tokens, gc.length_penalty, gc.early_stopping = n, 1.0, False
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), generation_config=gc, output_scores=True,
                          return_dict_in_generate=True)
    want = ref.sequences[:, len(PROMPT):].tolist()
    got = [c.token_ids for c in done["beam"].outputs]
    assert got == want
    cum = [c.cumulative_logprob for c in done["beam"].outputs]
    assert cum == pytest.approx((ref.sequences_scores * n).tolist(), rel=1e-4, abs=1e-4)
    for i, p in enumerate(OTHERS):
        assert done[f"o{i}"].outputs[0].token_ids == _hf_greedy(hf, p, 10)
    st = llm.engine.stats()
    assert shared > 0 and mixed > 0
    assert st["state_fork_copies"] >= width - 1
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0 and st["available_pages"] == st["num_pages"]


def _brute_beam_search(hf, prompt, width, max_tokens, eos, lp):
    keep = max(2, 1 + len(eos)) * width
    running = [([], torch.tensor(0.0))]
    finished = []  # (score, cum, tokens, reason)
    for gen in range(1, max_tokens + 1):
        cands = []
        for bi, (toks, cum) in enumerate(running):
            with torch.no_grad():
                row = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0, -1].float(), -1)
            for t in range(row.shape[0]):
                cands.append((float(cum + row[t]), bi * row.shape[0] + t, bi, t, cum + row[t]))
        cands.sort(key=lambda c: (-c[0], c[1]))
        cands = cands[:keep]
        hit = [c[3] in eos or gen == max_tokens for c in cands]
        for j in range(width):
            if hit[j]:
                s = cands[j][0]
                toks = running[cands[j][2]][0] + [cands[j][3]]
                finished.append((s / gen ** lp, s, toks, "stop" if cands[j][3] in eos else "length"))
        finished.sort(key=lambda f: -f[0])
        finished = finished[:width]
        alive = [c for c, h in zip(cands, hit) if not h][:width]
        if not alive:
            break
        running = [(running[c[2]][0] + [c[3]], c[4]) for c in alive]
        if len(finished) == width and not float(running[0][1]) / gen ** lp > finished[-1][0]:
            break
    return finished


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_beams_with_eos_equal_a_brute_force_search_over_hf_logits(tiny_dirs, hf_models, preset):
    hf = hf_models[preset]
    # length_penalty 0 ranks by the plain sum, so a beam ending early in EOS can win.
    width, n, lp = 3, 6, 0.0
    # The tiny checkpoints' EOS is noise that never ranks high; make a token the
    # model does like the EOS, so beams finish early and the stop rule is exercised.
    eos = _hf_greedy(hf, PROMPT, 1)[0]
    llm = _llm(tiny_dirs, preset, width)
    llm.engine.eos_token_ids = [eos]
    outs = llm.beam_search([PROMPT], BeamSearchParams(beam_width=width, max_tokens=n, length_penalty=lp))
    want = _brute_beam_search(hf, PROMPT, width, n, {eos}, lp)
    got = outs[0].sequences
    assert [s.output_token_ids for s in got] == [w[2] for w in want]
    assert [s.finish_reason for s in got] == [w[3] for w in want]
    assert any(s.finish_reason == "stop" for s in got), "no beam ended in EOS: the case is not exercised"
    assert [s.cum_logprob for s in got] == pytest.approx([w[1] for w in want], rel=1e-4, abs=1e-4)
    assert all(s.tokens == PROMPT + s.output_token_ids for s in got)
    st = llm.engine.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0
    # A search that ended (early or at max_tokens) is a finished request, not an abort.
    assert st["finished_requests"] == 1 and st["aborted_requests"] == 0


def test_abort_mid_search_returns_every_block_and_slot(tiny_dirs):
    llm = _llm(tiny_dirs, "test-a", 4)
    eng = llm.engine
    eng.add_beam_request("b", PROMPT, BeamSearchParams(beam_width=4, max_tokens=12, ignore_eos=True))
    for _ in range(5):
        eng.step()
    assert eng.stats()["running_state_pages"] == 4 * eng.stats()["pages_per_state"]
    eng.abort_request("b")
    eng.step()
    st = eng.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0 and st["available_pages"] == st["num_pages"]
    assert not eng.has_unfinished_requests()


def test_bad_beam_parameters_name_the_field(tiny_dirs):
    with pytest.raises(InvalidRequest, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(InvalidRequest, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    llm = _llm(tiny_dirs, "test-a", 2)
    with pytest.raises(InvalidRequest, match="beam_width"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=5, max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    assert llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=2))[0].sequences


class _HashedLM:
    """A stand-in model for the selection logic alone: logits a fixed function of the
    sequence (seeded by its hash), in HF's output shape."""

    vocab = 12

    def __call__(self, ids):
        seq = tuple(ids[0].tolist())
        g = torch.Generator().manual_seed(hash(seq) % (2**31))

        class Out:
            logits = (torch.randn(len(seq), self.vocab, generator=g) * 2)[None]
        return Out()


def test_selection_equals_brute_force_over_many_small_searches():
    # BeamSearch alone (no engine): widths 1-4, lengths 1-6, length penalties of
    # both signs' effects, EOS everywhere in the vocabulary.
    from hybridserve.beam_search import BeamSearch

    lm = _HashedLM()
    for trial in range(120):
        w, n, lp = 1 + trial % 4, 1 + trial % 6, [1.0, 0.5, 2.0, 0.0][trial % 4]
        eos = {trial % lm.vocab}
        prompt = [trial, 3]

        def lps(s):
            return torch.log_softmax(lm(torch.tensor([prompt + s])).logits[0, -1].float(), -1)

        bs = BeamSearch(w, n, list(eos), lp, ignore_eos=False)
        beams = [[t] for t in bs.first_step(lps([]))]
        while not bs.done:
            parents, toks = bs.step(torch.stack([lps(b) for b in beams]))
            beams = [beams[p] + [t] for p, t in zip(parents, toks)]
        got = bs.results()
        want = _brute_beam_search(lm, prompt, w, n, eos, lp)
        assert [g[2] for g in got] == [x[2] for x in want], trial
        assert [g[3] for g in got] == [x[3] for x in want], trial


def test_beam_request_preempted_as_a_unit_still_equals_hf(tiny_dirs, hf_models):
    # Four beams fill max_num_seqs; an urgent request preempts the beam request
    # (all four beams), which is recomputed (prompt once, then each beam's own
    # tokens, then one joint decode) and must still give HF's beams.
    hf = hf_models["test-b"]
    llm = LLM(tiny_dirs["test-b"], dtype="float32", device="cpu", block_size=16, num_pages=64 + 3 * 4, max_num_seqs=4, max_num_batched_tokens=16)
    eng = llm.engine
    eng.add_beam_request("beam", PROMPT, BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True), priority=10)
    done = {}
    for _ in range(5):
        for o in eng.step():
            done[o.request_id] = o
    eng.add_request("urgent", [7, 8, 9], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), priority=-10)
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    st = eng.stats()
    assert st["preemptions_priority"] == 1, st
    gc = copy.deepcopy(hf.generation_config)
    gc.eos_token_id = None
    gc.num_beams, gc.num_return_sequences, gc.do_sample, gc.max_new_tokens = 4, 4, False, 8
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), generation_config=gc)
    assert [c.token_ids for c in done["beam"].outputs] == ref[:, len(PROMPT):].tolist()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0


@pytest.mark.parametrize("preset", ["test-a", "test-b"])
def test_search_that_stops_early_is_finished_not_aborted(tiny_dirs, hf_models, preset):
    # Make the model's 2W favourite next tokens EOS: every first-step candidate
    # finishes, no running beam is left, and the search ends far before max_tokens.
    width, n = 3, 24
    with torch.no_grad():
        logits = hf_models[preset](torch.tensor([PROMPT])).logits[0, -1]
    eos = [int(t) for t in logits.topk(2 * width).indices]
    llm = _llm(tiny_dirs, preset, width)
    llm.engine.eos_token_ids = eos
    outs = llm.beam_search([PROMPT], BeamSearchParams(beam_width=width, max_tokens=n))
    got = outs[0].sequences
    assert [len(s.output_token_ids) for s in got] == [1] * width
    assert all(s.finish_reason == "stop" and s.output_token_ids[0] in eos for s in got)
    st = llm.engine.stats()
    assert st["used_blocks"] == 0 and st["running_state_pages"] == 0
    assert (st["finished_requests"], st["aborted_requests"]) == (1, 0), st
