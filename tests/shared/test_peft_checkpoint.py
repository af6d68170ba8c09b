"""Checkpoints the runtime cannot serve exactly are refused with the right error class and a
message naming the cause; good ones load with scaling merged into B."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.errors import FailedPrecondition, InvalidArgument
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter

PREFIX = "base_model.model.model.layers.0"


@pytest.fixture
def model_config(tiny_models) -> ModelConfig:
    return ModelConfig.from_dir(tiny_models["llama"])


@pytest.fixture
def adapter(tiny_adapters, tmp_path) -> Path:
    """A writable copy of a good rank-4 q/v adapter."""
    return Path(shutil.copytree(tiny_adapters["llama"]["qv4"], tmp_path / "qv4"))


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, path / "adapter_model.safetensors")


def _load(path: Path, model_config, max_rank=16):
    return load_peft_adapter("legal", path, model_config, max_rank, torch.float32)


def test_good_adapter_merges_scaling_into_b(adapter, model_config):
    raw = load_file(adapter / "adapter_model.safetensors")
    weights = _load(adapter, model_config)
    assert weights.rank == 4 and weights.target_modules == ("q_proj", "v_proj")
    assert set(weights.modules) == {(layer, m) for layer in (0, 1) for m in ("q_proj", "v_proj")}
    torch.testing.assert_close(
        weights.modules[(0, "q_proj")].b_t.t(), raw[f"{PREFIX}.self_attn.q_proj.lora_B.weight"] * 2.0
    )


def test_pickle_checkpoint_is_refused_and_never_unpickled(adapter, model_config, tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (adapter / "adapter_model.safetensors").unlink()
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(InvalidArgument, match=r"adapter_model.bin is a pickle checkpoint"):
        _load(adapter, model_config)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        (dict(use_dora=True), InvalidArgument, r"DoRA"),
        (
            dict(modules_to_save=["lm_head"]),
            InvalidArgument,
            r"modules_to_save names lm_head, but the weights lack lm_head.weight",
        ),
        (
            dict(modules_to_save=["model.norm"]),
            InvalidArgument,
            r"modules_to_save names 'model.norm'.*embed_tokens and lm_head only",
        ),
        (dict(bias="all"), InvalidArgument, r"bias='all'"),
        (dict(bias="lora_only"), InvalidArgument, r"bias='lora_only'"),
        (dict(peft_type="IA3"), InvalidArgument, r"peft_type 'IA3'"),
        (dict(r=0), InvalidArgument, r"r must be a positive integer"),
        (dict(target_modules=["q_proj", "c_attn"]), FailedPrecondition, r"'c_attn' is not in the base model"),
        (
            dict(target_modules=["q_proj", "v_proj", "lm_head"]),
            InvalidArgument,
            r"target_modules\) names lm_head, but the weights lack lm_head.lora_A.weight",
        ),
        (dict(target_modules=r".*\.nothing_here"), FailedPrecondition, r"matches no module"),
        (
            dict(target_modules=["q_proj"]),
            InvalidArgument,
            r"layers.0.v_proj, which target_modules does not name",
        ),
        (dict(r=8), InvalidArgument, r"layers.0.q_proj.lora_A has rank 4, adapter_config.json says r=8"),
    ],
)
def test_unsupported_config_is_refused(adapter, model_config, changes, error, message):
    _edit_config(adapter, **changes)
    with pytest.raises(error, match=message):
        _load(adapter, model_config)


def test_missing_config_is_refused(adapter, model_config):
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(InvalidArgument, match=r"has no adapter_config.json"):
        _load(adapter, model_config)


def test_config_that_is_not_json_is_refused(adapter, model_config):
    (adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidArgument, match=r"adapter_config.json is not valid JSON"):
        _load(adapter, model_config)


def test_rank_above_max_is_refused(adapter, model_config):
    with pytest.raises(
        InvalidArgument, match=r"layers.0.q_proj has rank 4, above this server's max_lora_rank 2"
    ):
        _load(adapter, model_config, max_rank=2)


def test_shape_mismatch_names_module_and_both_shapes(adapter, model_config):
    def widen(t):
        t[f"{PREFIX}.self_attn.v_proj.lora_B.weight"] = torch.randn(40, 4)

    _edit_tensors(adapter, widen)
    with pytest.raises(
        InvalidArgument, match=r"layers.0.v_proj.lora_B has shape \(40, 4\).*expected \[32, 4\]"
    ):
        _load(adapter, model_config)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_values_are_refused(adapter, model_config, bad):
    def poison(t):
        t[f"{PREFIX}.self_attn.q_proj.lora_A.weight"][1, 2] = bad

    _edit_tensors(adapter, poison)
    with pytest.raises(InvalidArgument, match=r"layers.0.q_proj.lora_A contains NaN or Inf"):
        _load(adapter, model_config)


def test_weights_that_overflow_the_serving_dtype_once_scaled_are_refused(adapter, model_config):
    def large(t):  # finite in the checkpoint's float32, past float16's 65504 once doubled
        t[f"{PREFIX}.self_attn.v_proj.lora_B.weight"][0, 0] = 40000.0

    _edit_tensors(adapter, large)
    assert _load(adapter, model_config).modules[(0, "v_proj")].b_t[0, 0] == 80000.0  # float32 serves it
    with pytest.raises(InvalidArgument, match=r"layers.0.v_proj.lora_B overflows float16 once scaled"):
        load_peft_adapter("legal", adapter, model_config, 16, torch.float16)


def test_unpaired_and_foreign_tensors_are_refused(adapter, model_config):
    _edit_tensors(adapter, lambda t: t.pop(f"{PREFIX}.self_attn.q_proj.lora_B.weight"))
    with pytest.raises(InvalidArgument, match=r"layers.0.q_proj has no lora_B weight"):
        _load(adapter, model_config)

    def add_dora(t):
        t[f"{PREFIX}.self_attn.v_proj.lora_magnitude_vector"] = torch.ones(32)

    _edit_tensors(adapter, add_dora)
    with pytest.raises(InvalidArgument, match=r"lora_magnitude_vector is not a LoRA A/B matrix"):
        _load(adapter, model_config)


def test_layer_past_the_model_is_refused(adapter, model_config):
    def add_layer(t):
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.randn(4, 64)
        t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.randn(64, 4)

    _edit_tensors(adapter, add_layer)
    with pytest.raises(FailedPrecondition, match=r"layer 7, the base model has 2"):
        _load(adapter, model_config)


def test_unsupported_dtype_is_refused(adapter, model_config):
    def to_int(t):
        key = f"{PREFIX}.self_attn.q_proj.lora_A.weight"
        t[key] = t[key].to(torch.int8)

    _edit_tensors(adapter, to_int)
    with pytest.raises(InvalidArgument, match=r"lora_A has dtype torch.int8"):
        _load(adapter, model_config)


def test_truncated_safetensors_is_refused(adapter, model_config):
    path = adapter / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(InvalidArgument, match=r"not a readable safetensors file"):
        _load(adapter, model_config)
