"""Checkpoint loading: sharded checkpoints load like single files; broken ones are refused."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference_service.engine.config import EngineConfig
from inference_service.engine.model_runner import ModelRunner
from inference_service.model.forward_batch import SequenceInput
from shared.errors import InvalidArgument

PROMPT = [SequenceInput([3, 14, 15, 92, 65], 0, [0, 1])]


def _logits(model_dir):
    return ModelRunner(EngineConfig(model=str(model_dir), kv_cache_tokens=64, max_model_len=64)).forward(
        PROMPT
    )


def test_sharded_checkpoint_loads_the_same_model(tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    torch.testing.assert_close(_logits(tmp_path), _logits(tiny_models["qwen2"]), atol=0, rtol=0)


def _copy_with(tiny_models, tmp_path, edit):
    folder = shutil.copytree(tiny_models["llama"], tmp_path / "model")
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_missing_tensor_is_named(tiny_models, tmp_path):
    folder = _copy_with(tiny_models, tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(InvalidArgument, match=r"lacks 1 tensors, e.g. model.layers.1.mlp.up_proj.weight"):
        _logits(folder)


def test_wrong_shape_is_named(tiny_models, tmp_path):
    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    folder = _copy_with(tiny_models, tmp_path, shrink)
    with pytest.raises(
        InvalidArgument, match=r"k_proj.weight has shape \(16, 64\), the model expects \(32, 64\)"
    ):
        _logits(folder)


def test_foreign_tensor_is_named(tiny_models, tmp_path):
    def add(t):
        t["model.layers.0.mlp.experts.weight"] = torch.zeros(2)

    folder = _copy_with(tiny_models, tmp_path, add)
    with pytest.raises(InvalidArgument, match=r"experts.weight is not part of a llama model"):
        _logits(folder)
