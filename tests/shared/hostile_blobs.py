"""Adapter blobs with one defect each, made from a good blob of the tiny llama: what a malicious
or broken adapter store could send. Each maps to the words its refusal must contain."""

import json
import math
import struct
from collections.abc import Callable

import torch
from safetensors.torch import save

from shared import adapter_blob
from shared.peft_checkpoint import AdapterWeights

Tensors = dict[str, torch.Tensor]


def parts(weights: AdapterWeights) -> tuple[Tensors, dict]:
    """The tensors and metadata adapter_blob.encode would write, to edit before `build`."""
    tensors = {}
    for (layer, module), m in weights.modules.items():
        tensors[f"layers.{layer}.{module}.lora_a"] = m.a.clone()
        tensors[f"layers.{layer}.{module}.lora_b_t"] = m.b_t.clone()
    metadata = {
        "format": adapter_blob.FORMAT,
        "rank": weights.rank,
        "alpha": weights.alpha,
        "target_modules": list(weights.target_modules),
    }
    return tensors, metadata


def build(tensors: Tensors, metadata: dict) -> bytes:
    return save(tensors, metadata={adapter_blob.METADATA_KEY: json.dumps(metadata, sort_keys=True)})


def _edited(edit: Callable[[Tensors, dict], None]) -> Callable[[AdapterWeights], bytes]:
    def make(weights: AdapterWeights) -> bytes:
        tensors, metadata = parts(weights)
        edit(tensors, metadata)
        return build(tensors, metadata)

    return make


def _rename_layer(tensors: Tensors, layer: int) -> None:
    for half in ("lora_a", "lora_b_t"):
        tensors[f"layers.{layer}.q_proj.{half}"] = tensors.pop(f"layers.0.q_proj.{half}")


def _set(name: str, value: float) -> Callable[[Tensors, dict], None]:
    def edit(tensors: Tensors, metadata: dict) -> None:
        tensors[name][0, 0] = value

    return edit


def _huge_header(weights: AdapterWeights) -> bytes:
    return struct.pack("<Q", 1 << 60) + adapter_blob.encode(weights)[8:]


# name -> (blob from the good qv4 weights (rank 4, q_proj and v_proj), words its refusal names)
HOSTILE_BLOBS: dict[str, tuple[Callable[[AdapterWeights], bytes], tuple[str, ...]]] = {
    "rank-declared-low": (
        _edited(lambda t, m: m.update(rank=2)),
        ("has rank 4", "declares rank 2"),
    ),
    "rank-disagree": (
        _edited(lambda t, m: t.update({"layers.1.v_proj.lora_b_t": t["layers.1.v_proj.lora_b_t"][:3]})),
        ("layers.1.v_proj", "lora_a [4, 64]", "lora_b_t [3, 32]", "share a rank"),
    ),
    "layer-negative": (_edited(lambda t, m: _rename_layer(t, -1)), ("layers.-1.q_proj", "layer -1")),
    "layer-out-of-range": (
        _edited(lambda t, m: _rename_layer(t, 7)),
        ("layers.7.q_proj", "layer 7", "0 to 1"),
    ),
    "shape-mismatch": (
        _edited(lambda t, m: t.update({"layers.0.q_proj.lora_a": torch.ones(4, 32)})),
        ("layers.0.q_proj", "[4, 32]", "expects [r, 64]"),
    ),
    "nan": (_edited(_set("layers.0.q_proj.lora_a", math.nan)), ("layers.0.q_proj.lora_a", "NaN or Inf")),
    "inf": (_edited(_set("layers.1.v_proj.lora_b_t", math.inf)), ("layers.1.v_proj.lora_b_t", "NaN or Inf")),
    "huge-header": (_huge_header, ("safetensors header claims", str(1 << 60))),
    "unknown-tensor": (
        _edited(lambda t, m: t.update(evil=torch.zeros(2, 2))),
        ("tensor 'evil'", "not a LoRA tensor"),
    ),
    "bad-metadata": (
        _edited(lambda t, m: m.update(rank="two")),
        ("metadata rank", "'two'", "positive integer"),
    ),
}
