"""``LLM("model.gguf")``: the engine serves a GGUF file (weights from its blocks, the
tokenizer and chat template from its metadata), text prompts tokenized as HF's tokenizer
does. On the reference products greedy outputs equal HF's on the dequantized weights
outright; on the native block kernels (activations rounded to 8 bits, see gguf_helpers)
they equal the model's own greedy decode, which test_gguf_model checks against HF
rounded alike."""

import pytest
import torch

from gguf_helpers import greedy, hf_oracle
from hybridserve import LLM, SamplingParams
from hybridserve.errors import ConfigError
from hybridserve.model import load_model

CASES = {
    "dense-q8_0": dict(preset="test-a", qtype="q8_0"),
    "moe-q8_0": dict(preset="moe-a", qtype="q8_0"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_llm_generate_greedy_equals_hf(case, gguf_case, kernel_path, monkeypatch):
    from transformers import AutoTokenizer

    from hybridserve.quant import tiles

    # On the native path every product runs on the block kernels, whose rows do not
    # depend on the rows sharing the call: the engine's batched prefill (all prompts in
    # one step) then equals the one-prompt decode however long the prompts are. With a
    # row limit between the two lengths, one would take float tiles and the other rounded
    # activations, equal only by luck on this tiny model.
    monkeypatch.setitem(tiles.NATIVE_MAX_ROWS, CASES[case]["qtype"], 1 << 20)

    path, _, oracle_dir = gguf_case(case, **CASES[case])
    llm = LLM(path, dtype="float32", device="cpu", num_pages=256, max_num_seqs=4, max_model_len=512)
    hf = hf_oracle(oracle_dir)
    model, config = load_model(path, dtype="float32", progress=False)
    hf_tok = AutoTokenizer.from_pretrained(oracle_dir)
    prompts = ["The GGUF file says", "hello", "a longer prompt, with punctuation; and more words"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ids = hf_tok.encode(prompt)
        assert list(out.prompt_token_ids) == ids
        if kernel_path == "reference":
            want = hf.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        else:
            want = greedy(model, config, ids, 16)
        assert list(out.outputs[0].token_ids) == want
    # The chat template from the file's metadata.
    msgs = [{"role": "user", "content": "hi"}]
    assert llm.get_tokenizer().apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == \
        hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def test_tensor_parallel_gguf_split_inside_a_block_refused(gguf_case):
    # test-a's DeltaNet value heads (16) put each rank's ssm_out columns inside Q8_0's
    # 32-column blocks (TP over GGUF files: tests/parallel/test_tp_quant.py).
    path, _, _ = gguf_case("dense-q8_0", **CASES["dense-q8_0"])
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 cannot split 'blk\.0\.ssm_out\.weight' \(Q8_0"):
        LLM(path, dtype="float32", device="cpu", tensor_parallel_size=2)


def test_memory_held_counts_the_blocks(gguf_case):
    from hybridserve.server.serve import memory_held

    path, _, _ = gguf_case("moe-q8_0", **CASES["moe-q8_0"])
    llm = LLM(path, dtype="float32", device="cpu", num_pages=64, max_num_seqs=2, max_model_len=256)
    model = llm.engine.model
    params = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    blocks = sum(m.qweight.nbytes for m in model.modules() if getattr(m, "qweight", None) is not None)
    experts = sum(m.nbytes for m in model.modules() if getattr(m, "quantized", False))
    assert blocks > 0 and experts > 0
    assert memory_held(llm.engine)["weights"] == params + blocks + experts
