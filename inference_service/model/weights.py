"""Load an HF checkpoint (model.safetensors or a sharded index) into a LlamaModel, packing
q/k/v and gate/up into their fused matmuls."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from inference_service.model.model import LlamaModel
from shared.errors import InvalidArgument
from shared.model_config import MODULE_PARENTS

# Tensors some checkpoints carry that the runtime recomputes or does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    targets = _targets(model)
    loaded: set[str] = set()
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name.endswith(IGNORED_SUFFIXES) or (
                    name == "lm_head.weight" and model.cfg.tie_word_embeddings
                ):
                    continue
                if name not in targets:
                    raise InvalidArgument(
                        f"{path.name}: tensor {name} is not part of a {model.cfg.model_type} model"
                    )
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
