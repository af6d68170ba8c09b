"""The optimized adapter wire format: one safetensors blob, identified by its sha256.

Tensors are named `layers.{i}.{module}.lora_a` ([rank, in]) and `.lora_b_t` ([rank, out]: B
transposed, scaling merged), in the serving dtype: the kernels' layout. safetensors writes
metadata keys in hash order, so rank, alpha and the format version sit in one key as sorted
JSON: the same content always encodes to the same bytes, hence the same digest.
"""

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import BinaryIO

from safetensors.torch import load, save

from shared.errors import InvalidArgument
from shared.peft_checkpoint import AdapterWeights, ModuleLora

FORMAT = "loramux-adapter/2"
METADATA_KEY = "loramux"
SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32", "bfloat16" or "float16"


@dataclass(frozen=True)
class BlobInfo:
    """What a blob holds, read from its header alone."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    tensors: tuple[TensorInfo, ...]


def encode(weights: AdapterWeights) -> bytes:
    tensors = {}
    for (layer, module), m in weights.modules.items():
        tensors[f"layers.{layer}.{module}.lora_a"] = m.a
        tensors[f"layers.{layer}.{module}.lora_b_t"] = m.b_t
    metadata = {
        "format": FORMAT,
        "rank": weights.rank,
        "alpha": weights.alpha,
        "target_modules": list(weights.target_modules),
    }
    return save(tensors, metadata={METADATA_KEY: json.dumps(metadata, sort_keys=True)})


def digest(blob: bytes) -> str:
    return "sha256:" + hashlib.sha256(blob).hexdigest()


def decode(blob: bytes) -> AdapterWeights:
    metadata = _metadata(blob)
    if metadata.get("format") != FORMAT:
        raise InvalidArgument(f"adapter blob format {metadata.get('format')!r}, expected {FORMAT!r}")
    tensors = load(blob)
    modules = {}
    for name in tensors:
        _, layer, module, half = name.split(".")
        if half == "lora_a":
            modules[(int(layer), module)] = ModuleLora(
                tensors[name], tensors[f"layers.{layer}.{module}.lora_b_t"]
            )
    return AdapterWeights(
        int(metadata["rank"]),
        float(metadata["alpha"]),
        tuple(metadata["target_modules"]),
        dict(sorted(modules.items())),
    )


def read_info(f: BinaryIO) -> BlobInfo:
    """The header of the blob open in `f` (read from its start)."""
    (size,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(size))
    metadata = json.loads((header.pop("__metadata__", None) or {}).get(METADATA_KEY, "{}"))
    tensors = tuple(
        TensorInfo(name, tuple(t["shape"]), SAFETENSORS_DTYPES[t["dtype"]])
        for name, t in sorted(header.items())
    )
    return BlobInfo(
        int(metadata["rank"]),
        float(metadata["alpha"]),
        tuple(metadata["target_modules"]),
        tensors[0].dtype,
        tensors,
    )


def _metadata(blob: bytes) -> dict:
    (size,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + size]).get("__metadata__") or {}
    return json.loads(header.get(METADATA_KEY, "{}"))
