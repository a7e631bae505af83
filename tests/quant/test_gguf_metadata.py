"""What a GGUF file says besides its weights: the config (against the HF config the
file was written from), the tokenizer and chat template (against HF's tokenizer of the
same vocabulary), split files, and the files refused (a type not served, another
architecture)."""

import os

import gguf
import numpy as np
import pytest
import torch

from gguf_helpers import hf_oracle, prompt_logits
from gguf_files import write_gguf
from hybridserve.config import ModelConfig
from hybridserve.errors import CheckpointError, ConfigError
from hybridserve.model import load_model
from hybridserve.quant.gguf.load import gguf_config
from hybridserve.quant.gguf.reader import GGUFFile
from hybridserve.tokenizer import load_tokenizer

DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "..", "..", "python", "hybridserve", "default_model")


def _comparable(c: ModelConfig) -> dict:
    d = c.to_dict()
    d.pop("torch_dtype")  # a GGUF stores no serving dtype
    return d


@pytest.mark.parametrize("preset,mtp", [("test-a", False), ("test-b", True), ("moe-a", True), ("moe-b", False)])
def test_config_from_metadata_equals_hf(preset, mtp, tmp_path):
    path, text, _ = write_gguf(tmp_path / "m.gguf", preset=preset, qtype="q8_0", mtp=mtp)
    ours = gguf_config(path)
    assert _comparable(ours) == _comparable(ModelConfig.from_dict(text))
    assert int(ours.raw["mtp_num_hidden_layers"]) == (1 if mtp else 0)
    assert ours.rotary_dim == ModelConfig.from_dict(text).rotary_dim


def test_tokenizer_and_chat_template_equal_hf(tmp_path):
    """The default model's BPE tokenizer (merges, Qwen3.5 pre-tokenizer, special and
    marker tokens, Qwen3.5's chat template) stored as the converter stores it."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(DEFAULT_MODEL, local_files_only=True)
    path, _, _ = write_gguf(tmp_path / "m.gguf", preset="test-a", qtype="q8_0", vocab_size=8192,
                            tokenizer_dir=DEFAULT_MODEL)
    ours = load_tokenizer(path)
    texts = ["Hello, world! It's 2026 and we're testing   spaces\n\nnewlines\ttabs.",
             "Ünïcödé 日本語 テスト — émojis 🎉 and numbers 1234567",
             "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n<tool_call>x</tool_call>",
             "don't won't I'LL we'D", "  leading and trailing  "]
    for t in texts:
        assert ours.encode(t) == hf.encode(t), t
        ids = hf.encode(t)
        assert ours.decode(ids) == hf.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (hf.eos_token_id, hf.pad_token_id,
                                                                         hf.bos_token_id)
    assert ours.chat_template == hf.chat_template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    for kw in ({}, {"enable_thinking": False}):
        assert (ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
                == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw))
        a = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
        b = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
        a = a["input_ids"] if isinstance(a, dict) or hasattr(a, "input_ids") else a
        b = b["input_ids"] if isinstance(b, dict) or hasattr(b, "input_ids") else b
        assert list(a) == list(b)


def test_split_gguf_loads_as_one(tmp_path, gguf_case):
    path, text, oracle_dir = gguf_case("dense-q8_0", preset="test-a", qtype="q8_0")
    split, _, _ = write_gguf(tmp_path / "m.gguf", preset="test-a", qtype="q8_0", split_max_tensors=9)
    assert split.endswith("-00001-of-00007.gguf"), split
    assert len(GGUFFile(split).parts) == 7
    prompt = [5, 77, 200, 3, 9, 250, 17, 1, 64]
    a, ca = load_model(path, progress=False)
    b, cb = load_model(split, progress=False)
    assert _comparable(ca) == _comparable(cb)
    torch.testing.assert_close(prompt_logits(b, cb, prompt), prompt_logits(a, ca, prompt), rtol=0, atol=0)
    # Any part names the whole file; a missing part is named.
    last = split.replace("-00001-of-", "-00007-of-")
    assert len(GGUFFile(last).parts) == 7
    os.remove(split.replace("-00001-of-", "-00004-of-"))
    with pytest.raises(CheckpointError, match="00004-of-00007"):
        load_model(split, progress=False)


def test_unserved_type_refused_naming_tensor_and_type(tmp_path):
    path, _, _ = write_gguf(tmp_path / "m.gguf", preset="test-a", qtype="q8_0")
    # Rewrite the file with one projection in Q2_K (a type gguf knows, hybridserve does not serve).
    r = gguf.GGUFReader(path)
    bad = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(bad), "qwen35")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = f.contents()
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(name, v, vt, sub_type=f.types[-1])
        else:
            w.add_key_value(name, v, vt)
    target = "blk.1.attn_gate.weight"
    for t in r.tensors:
        if t.name == target:
            rows, cols = int(t.shape[1]), int(t.shape[0])
            size, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K]
            cols = 256  # Q2_K rows hold 256-blocks: a made-up shape, refused before it is read
            w.add_tensor(t.name, np.zeros((rows, cols // size * nbytes), np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q2_K)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError) as e:
        load_model(str(bad), progress=False)
    assert target in str(e.value) and "Q2_K" in str(e.value)


def test_other_architecture_refused(tmp_path):
    path, _, _ = write_gguf(tmp_path / "m.gguf", preset="test-a", qtype="q8_0", arch="llama")
    with pytest.raises(ConfigError, match="'llama'.*qwen35"):
        load_model(path, progress=False)
    with pytest.raises(ConfigError, match="qwen35"):
        gguf_config(path)


def test_missing_file_and_gpu_refused(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "nope.gguf"), progress=False)
    path, _, _ = write_gguf(tmp_path / "m.gguf", preset="test-a", qtype="q8_0")
    with pytest.raises(ConfigError, match="CPU"):
        load_model(path, device="meta", progress=False)


def test_planner_counts_the_stored_block_bytes(tmp_path):
    from hybridserve.planner.weights import weight_bytes

    path, text, _ = write_gguf(tmp_path / "m.gguf", preset="moe-a", qtype="q4_0", mtp=True,
                            moe_intermediate_size=64, shared_expert_intermediate_size=64)
    f = GGUFFile(path)
    config = ModelConfig.from_dict(text)
    stored = {n: int(np.asarray(t.raw).nbytes) for n, t in f.tensors.items()}
    trunk = sum(b for n, b in stored.items() if not n.startswith(f"blk.{config.num_hidden_layers}."))
    assert weight_bytes(config, path) == trunk
    assert weight_bytes(config, path, mtp=True) == sum(stored.values()) > trunk
    # Below the float32 parameter bytes the same model would take.
    assert trunk < weight_bytes(dataclasses_replace(config, torch_dtype="float32")) / 3


def dataclasses_replace(c, **kw):
    import dataclasses

    return dataclasses.replace(c, **kw)
