"""Load an HF checkpoint (model.safetensors or a sharded index) into a LlamaModel, packing
q/k/v and gate/up into their fused matmuls. Dense weights, and weights transformers saved
pre-quantized: bitsandbytes NF4 and torchao int8 (their parts may sit in different shards)."""

import json
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from inference_service.model.base_weight import Int8Weight, Nf4Weight
from inference_service.model.model import LlamaModel
from kernels.nf4_linear import BLOCK, dequantize_nested_absmax, nf4_code
from shared.errors import InvalidArgument
from shared.model_config import MODULE_PARENTS, peft_path

# Tensors some checkpoints carry that the runtime recomputes or does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# What transformers saves beside a bitsandbytes 4-bit weight "X.weight" (itself the packed codes).
NF4_STATE = ".quant_state.bitsandbytes__nf4"
NF4_PARTS = (NF4_STATE, ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
# What transformers saves for a torchao Int8Tensor weight "X.weight": "X._weight_qdata" and these.
INT8_DATA = "._weight_qdata"
INT8_PARTS = ("._weight_scale", "._weight_zero_point")


class Checkpoint:
    """Every tensor of a checkpoint's files, by name, read lazily."""

    def __init__(self, files: list[Path], stack: ExitStack):
        self.file_of: dict[str, Path] = {}
        self._handles = {}
        for path in files:
            handle = stack.enter_context(safe_open(path, framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                self.file_of[name] = path
                self._handles[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def get(self, name: str) -> torch.Tensor:
        if name not in self._handles:
            raise InvalidArgument(f"checkpoint lacks tensor {name}")
        return self._handles[name].get_tensor(name)


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    targets = _targets(model)
    stored = model.cfg.checkpoint_quantization
    loaded: set[str] = set()
    with ExitStack() as stack:
        checkpoint = Checkpoint(_checkpoint_files(Path(model_dir)), stack)
        for name in sorted(checkpoint.file_of):
            if name.endswith(IGNORED_SUFFIXES + NF4_PARTS + INT8_PARTS) or (
                name == "lm_head.weight" and model.cfg.tie_word_embeddings
            ):
                continue  # a quantized weight's parts load with the weight
            weight = name.removesuffix(INT8_DATA) + ".weight" if name.endswith(INT8_DATA) else name
            if weight not in targets:
                file = checkpoint.file_of[name].name
                raise InvalidArgument(f"{file}: tensor {name} is not part of a {model.cfg.model_type} model")
            if name.endswith(INT8_DATA):
                _load_int8(checkpoint, name.removesuffix(INT8_DATA), targets[weight])
            elif name + NF4_STATE in checkpoint:
                _load_nf4(checkpoint, name, targets[weight])
            elif isinstance(targets[weight], Rows) and stored != "none":
                raise InvalidArgument(
                    f"tensor {name} is dense in a checkpoint quantized to {stored}: loramux "
                    "holds every linear layer of a pre-quantized model quantized (no modules_to_not_convert)"
                )
            else:
                _copy(targets[weight], checkpoint.get(name), name)
            loaded.add(weight)
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
        if cfg.qk_norm != "none":
            targets[f"{prefix}.self_attn.q_norm.weight"] = layer.self_attn.q_norm.weight
            targets[f"{prefix}.self_attn.k_norm.weight"] = layer.self_attn.k_norm.weight
        if cfg.moe:
            targets |= _expert_targets(cfg, prefix, layer.mlp)
        for name, shape in cfg.linear_shapes().items():
            if MODULE_PARENTS[name].startswith("mlp") and cfg.moe:
                continue  # _expert_targets
            packed = getattr(getattr(layer, MODULE_PARENTS[name]), shape.packed)
            offset, size = packed.slices[shape.slice_index]
            base = f"{prefix}.{peft_path(name)}"
            targets[f"{base}.weight"] = Rows(packed.base, offset, (size, packed.in_features))
            if packed.bias is not None:
                targets[f"{base}.bias"] = packed.bias[offset : offset + size]
    return targets


# Where each checkpoint names a sparse MLP's parts: its folder, and gate, up and down per expert.
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
DEFAULT_EXPERT_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def _expert_targets(cfg, prefix: str, moe: nn.Module) -> dict[str, torch.Tensor | Rows]:
    """A sparse MLP's router and every expert's gate, up and down weights, as saved one expert at
    a time, into the stacked w13 [experts, 2 * inter, hidden] and w2 [experts, hidden, inter]."""
    folder, gate, up, down = EXPERT_NAMES.get(cfg.model_type, DEFAULT_EXPERT_NAMES)
    inter = cfg.moe.intermediate_size
    targets = {
        f"{prefix}.{folder}.gate.weight": Rows(moe.router.base, 0, (cfg.moe.num_experts, cfg.hidden_size))
    }
    for e in range(cfg.moe.num_experts):
        expert = f"{prefix}.{folder}.experts.{e}"
        targets[f"{expert}.{gate}.weight"] = moe.w13[e, :inter]
        targets[f"{expert}.{up}.weight"] = moe.w13[e, inter:]
        targets[f"{expert}.{down}.weight"] = moe.w2[e]
    shared, hidden = cfg.moe.shared_intermediate_size, cfg.hidden_size
    if shared:  # Qwen2-MoE's shared expert
        targets[f"{prefix}.mlp.shared_expert.gate_proj.weight"] = Rows(
            moe.shared_gate_up_proj.base, 0, (shared, hidden)
        )
        targets[f"{prefix}.mlp.shared_expert.up_proj.weight"] = Rows(
            moe.shared_gate_up_proj.base, shared, (shared, hidden)
        )
        targets[f"{prefix}.mlp.shared_expert.down_proj.weight"] = Rows(
            moe.shared_down_proj.base, 0, (hidden, shared)
        )
        targets[f"{prefix}.mlp.shared_expert_gate.weight"] = Rows(moe.shared_expert_gate.base, 0, (1, hidden))
    return targets


def _copy(dst: torch.Tensor | Rows, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise InvalidArgument(
            f"tensor {name} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def _quantized_target(target, name: str, kind: str, layer_type: type) -> Rows:
    if not isinstance(target, Rows) or not isinstance(target.base, layer_type):
        raise InvalidArgument(f"tensor {name} is {kind}, but its layer is not held in {kind}")
    return target


def _load_nf4(checkpoint: Checkpoint, name: str, target) -> None:
    """A bitsandbytes NF4 weight as transformers saves it: the packed codes, the quant state (JSON
    in a uint8 tensor), the 16-value map and the absmax, double-quantized or not."""
    target = _quantized_target(target, name, "NF4", Nf4Weight)
    state = json.loads(bytes(checkpoint.get(name + NF4_STATE).tolist()))
    rows, columns = target.shape
    expected = {"quant_type": "nf4", "blocksize": BLOCK, "shape": [rows, columns]}
    found = {key: state.get(key) for key in expected}
    if found != expected:
        raise InvalidArgument(f"tensor {name}: quant state {found}, the model expects {expected}")
    if not torch.equal(checkpoint.get(name + ".quant_map").float(), nf4_code()):
        raise InvalidArgument(f"tensor {name}.quant_map is not the NF4 code")
    absmax = checkpoint.get(name + ".absmax")
    if "nested_blocksize" in state:
        nested = (checkpoint.get(name + ".nested_absmax"), checkpoint.get(name + ".nested_quant_map"))
        absmax = dequantize_nested_absmax(absmax, *nested, state["nested_offset"], state["nested_blocksize"])
    packed = checkpoint.get(name).flatten()
    if (packed.numel(), absmax.numel()) != (rows * columns // 2, rows * columns // BLOCK):
        raise InvalidArgument(
            f"tensor {name}: {packed.numel()} bytes and {absmax.numel()} absmax for {rows}x{columns}"
        )
    target.base.load_quantized(target.offset, packed, absmax.float())


def _load_int8(checkpoint: Checkpoint, module: str, target) -> None:
    """A torchao Int8Tensor as transformers saves it: int8 codes [out, in], a scale [out, 1] and a
    zero point [out, 1] that symmetric per-row quantization leaves at zero."""
    name = module + INT8_DATA
    target = _quantized_target(target, name, "int8", Int8Weight)
    rows, columns = target.shape
    q, scale = checkpoint.get(name), checkpoint.get(module + "._weight_scale")
    if q.dtype != torch.int8 or tuple(q.shape) != (rows, columns):
        raise InvalidArgument(
            f"tensor {name} is {q.dtype} {tuple(q.shape)}, the model expects torch.int8 {(rows, columns)}"
        )
    if scale.numel() != rows:
        raise InvalidArgument(
            f"tensor {module}._weight_scale has {scale.numel()} scales, not one per row ({rows})"
        )
    zero_point = module + "._weight_zero_point"
    if zero_point in checkpoint and checkpoint.get(zero_point).any():
        raise InvalidArgument(f"tensor {zero_point} is not zero: only symmetric int8 is supported")
    target.base.load_quantized(target.offset, q, scale.flatten().float())
