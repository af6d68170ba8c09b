"""Malformed mixture-of-experts checkpoints registered through the real store process, checked
against a tiny Qwen3-MoE base: each is refused with its status code and a message naming the
tensor or parameter, and a good MoE adapter (attention, router and experts) registers after them."""

import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.random_adapter import write_random_adapter
from shared.model_config import ModelConfig
from shared.pb.loramux.store.v1 import adapter_store_pb2 as pb
from shared.pb.loramux.store.v1 import adapter_store_pb2_grpc as pb_grpc
from tests.adapter_store.conftest import AUTH, StoreProcess, local_store_flags

LAYER = "base_model.model.model.layers.1.mlp"
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def _edit(change):
    def edit(folder: Path) -> None:
        tensors = load_file(folder / WEIGHTS)
        change(tensors)
        save_file(tensors, folder / WEIGHTS)

    return edit


def _config(**changes):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / CONFIG).read_text()) | changes
        (folder / CONFIG).write_text(json.dumps(cfg))

    return edit


def _replace(key: str, value):
    return _edit(lambda t: t.__setitem__(f"{LAYER}.{key}", value(t[f"{LAYER}.{key}"])))


def _rename(old: str, new: str):
    return _edit(lambda t: t.__setitem__(f"{LAYER}.{new}", t.pop(f"{LAYER}.{old}")))


def _per_expert(experts: range):
    """The layer's router and gate/up LoRA dropped; every expert in `experts` given its own
    gate_proj LoRA in transformers 4's layout (experts.{e}.gate_proj)."""

    def change(t: dict) -> None:
        for key in [k for k in t if k.startswith(f"{LAYER}.experts.base_layer")]:
            del t[key]
        for e in experts:
            t[f"{LAYER}.experts.{e}.gate_proj.lora_A.weight"] = torch.zeros(4, 64)
            t[f"{LAYER}.experts.{e}.gate_proj.lora_B.weight"] = torch.zeros(32, 4)

    def edit(folder: Path) -> None:
        _edit(change)(folder)
        _config(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])(folder)

    return edit


# name -> (edit of a good rank-4 adapter on attention, router and experts, code, text the message names)
MOE_CORPUS = {
    "wrong-expert-count": (
        _replace("experts.base_layer.lora_A.weight", lambda t: t[: 4 * 7]),
        INVALID,
        "experts.gate_up_proj.lora_A has shape (28, 64), expected [32, 64] (rank 4 times 8 experts)",
    ),
    "b-transposed": (
        _replace("experts.lora_B.weight", lambda t: t.t().contiguous()),
        INVALID,
        "layers.1.mlp.experts.down_proj.lora_B has shape (32, 64), expected [64, 32]",
    ),
    "nested-too-deep": (
        _rename("experts.base_layer.lora_A.weight", "experts.base_layer.base_layer.lora_A.weight"),
        INVALID,
        "experts.base_layer.base_layer.lora_A.weight is nested 2 wrappers deep",
    ),
    "router-not-targeted": (
        _config(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
        INVALID,
        "layers.0.mlp.gate, which target_modules does not name",
    ),
    "unknown-parameter": (
        _config(target_parameters=["mlp.experts.w13"]),
        PRECONDITION,
        "target_parameters names 'mlp.experts.w13'",
    ),
    "expert-out-of-range": (
        _per_expert(range(9)),
        PRECONDITION,
        "layers.1.mlp.experts.8.gate_proj is for expert 8",
    ),
    "expert-missing": (_per_expert(range(7)), INVALID, "no LoRA for expert 7"),
    "router-wrong-shape": (
        _replace("gate.lora_B.weight", lambda t: t[:6]),
        INVALID,
        "layers.1.mlp.gate.weight.lora_B has shape (6, 4), expected [8, 4]",
    ),
}


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory, tiny_moe_model):
    """A store checking adapters against the tiny Qwen3-MoE; the sources: a good adapter and the
    corpus made from it."""
    sources = tmp_path_factory.mktemp("moe-sources")
    good = write_random_adapter(ModelConfig.from_dir(tiny_moe_model), sources / "good", rank=4, seed=1)
    for name, (edit, _, _) in MOE_CORPUS.items():
        edit(Path(shutil.copytree(good, sources / name)))
    flags = local_store_flags(sources, tiny_moe_model)
    process = StoreProcess(tmp_path_factory.mktemp("moe-store"), [*flags, "--max-lora-rank", "16"]).start()
    yield process, sources
    assert process.stop() == 0


@pytest.mark.parametrize("name", sorted(MOE_CORPUS))
def test_a_malformed_moe_checkpoint_is_refused_naming_the_tensor(moe_store, name):
    store, sources = moe_store
    _, code, named = MOE_CORPUS[name]
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        request = pb.RegisterAdapterRequest(adapter_id=name, source_uri=f"file://{sources / name}")
        with pytest.raises(grpc.RpcError) as e:
            stub.RegisterAdapter(request, metadata=AUTH)
        assert e.value.code() == code, e.value.details()
        assert named in e.value.details()


def test_a_good_moe_adapter_registers_after_the_corpus(moe_store):
    store, sources = moe_store
    with grpc.insecure_channel(store.address) as channel:
        stub = pb_grpc.AdapterStoreStub(channel)
        request = pb.RegisterAdapterRequest(adapter_id="good", source_uri=f"file://{sources / 'good'}")
        adapter = stub.RegisterAdapter(request, metadata=AUTH)
        assert adapter.rank == 4 and adapter.size_bytes > 0
