"""Load an HF checkpoint (model.safetensors or a sharded index) into a LlamaModel, packing
q/k/v and gate/up into their fused matmuls."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from inference_service.model.base_weight import Nf4Weight
from inference_service.model.model import LlamaModel
from kernels.nf4_linear import BLOCK, dequantize_nested_absmax, nf4_code
from shared.errors import InvalidArgument
from shared.model_config import MODULE_PARENTS

# Tensors some checkpoints carry that the runtime recomputes or does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# What transformers saves beside a bitsandbytes 4-bit weight "X.weight" (itself the packed codes).
NF4_STATE = ".quant_state.bitsandbytes__nf4"
NF4_PARTS = (NF4_STATE, ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    targets = _targets(model)
    loaded: set[str] = set()
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(path, framework="pt") as f:
            names = set(f.keys())
            for name in sorted(names):
                if name.endswith(IGNORED_SUFFIXES + NF4_PARTS) or (
                    name == "lm_head.weight" and model.cfg.tie_word_embeddings
                ):
                    continue  # an NF4 weight's parts load with the weight
                if name not in targets:
                    raise InvalidArgument(
                        f"{path.name}: tensor {name} is not part of a {model.cfg.model_type} model"
                    )
                if name + NF4_STATE in names:
                    _load_nf4(f, name, targets[name])
                else:
                    _copy(targets[name], f.get_tensor(name), name)
                loaded.add(name)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise InvalidArgument(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[0]}")


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise InvalidArgument(
        f"model folder {model_dir} has neither model.safetensors nor model.safetensors.index.json"
    )


@dataclass(frozen=True)
class Rows:
    """Rows offset .. offset + shape[0] of a fused linear layer's base weight, in its format."""

    base: nn.Module
    offset: int
    shape: tuple[int, int]

    def copy_(self, src: torch.Tensor) -> None:
        self.base.load_rows(self.offset, src)


def _targets(model: LlamaModel) -> dict[str, torch.Tensor | Rows]:
    """HF tensor name -> the tensor (or rows of a fused base weight) it loads into."""
    cfg = model.cfg
    targets = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}"
        targets[f"{prefix}.input_layernorm.weight"] = layer.input_layernorm.weight
        targets[f"{prefix}.post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for name, shape in cfg.linear_shapes().items():
            packed = getattr(getattr(layer, MODULE_PARENTS[name]), shape.packed)
            offset, size = packed.slices[shape.slice_index]
            base = f"{prefix}.{MODULE_PARENTS[name]}.{name}"
            targets[f"{base}.weight"] = Rows(packed.base, offset, (size, packed.in_features))
            if packed.bias is not None:
                targets[f"{base}.bias"] = packed.bias[offset : offset + size]
    return targets


def _copy(dst: torch.Tensor | Rows, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise InvalidArgument(
            f"tensor {name} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def _load_nf4(f, name: str, target) -> None:
    """A bitsandbytes NF4 weight as transformers saves it: the packed codes, the quant state (JSON
    in a uint8 tensor), the 16-value map and the absmax, double-quantized or not."""
    if not isinstance(target, Rows) or not isinstance(target.base, Nf4Weight):
        raise InvalidArgument(f"tensor {name} is NF4, but its layer is not held in NF4")
    state = json.loads(bytes(f.get_tensor(name + NF4_STATE).tolist()))
    rows, columns = target.shape
    expected = {"quant_type": "nf4", "blocksize": BLOCK, "shape": [rows, columns]}
    found = {key: state.get(key) for key in expected}
    if found != expected:
        raise InvalidArgument(f"tensor {name}: quant state {found}, the model expects {expected}")
    if not torch.equal(f.get_tensor(name + ".quant_map").float(), nf4_code()):
        raise InvalidArgument(f"tensor {name}.quant_map is not the NF4 code")
    absmax = f.get_tensor(name + ".absmax")
    if "nested_blocksize" in state:
        nested = (f.get_tensor(name + ".nested_absmax"), f.get_tensor(name + ".nested_quant_map"))
        absmax = dequantize_nested_absmax(absmax, *nested, state["nested_offset"], state["nested_blocksize"])
    packed = f.get_tensor(name).flatten()
    if (packed.numel(), absmax.numel()) != (rows * columns // 2, rows * columns // BLOCK):
        raise InvalidArgument(
            f"tensor {name}: {packed.numel()} bytes and {absmax.numel()} absmax for {rows}x{columns}"
        )
    target.base.load_quantized(target.offset, packed, absmax.float())
