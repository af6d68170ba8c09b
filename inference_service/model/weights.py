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
from inference_service.model.shard import ROW, Shard
from kernels.nf4_linear import BLOCK, dequantize_nested_absmax, nf4_code
from shared.errors import InvalidArgument
from shared.model_config import MODULE_PARENTS, ModelConfig, peft_path

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

    def get(self, name: str, part: "Part | None" = None) -> torch.Tensor:
        """The tensor, or only the part of it this rank loads (read alone from the file)."""
        if name not in self._handles:
            raise InvalidArgument(f"checkpoint lacks tensor {name}")
        if part is None:
            return self._handles[name].get_tensor(name)
        whole = self._handles[name].get_slice(name)
        return whole[(slice(None),) * part.dim + (slice(part.start, part.stop),)]


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    """Every tensor of the checkpoint into the model; under tensor parallelism, each into this
    rank's part of it (shard.py), read alone from the files."""
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
            target = targets[weight]
            if target.dst is None:
                pass  # nothing of it on this rank: a row-parallel layer's bias, added by rank 0 alone
            elif name.endswith(INT8_DATA):
                _load_int8(checkpoint, name.removesuffix(INT8_DATA), target.dst)
            elif name + NF4_STATE in checkpoint:
                _load_nf4(checkpoint, name, target.dst)
            elif isinstance(target.dst, Rows) and stored != "none":
                raise InvalidArgument(
                    f"tensor {name} is dense in a checkpoint quantized to {stored}: loramux "
                    "holds every linear layer of a pre-quantized model quantized (no modules_to_not_convert)"
                )
            else:
                _copy(target.dst, checkpoint.get(name, target.part), name)
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


@dataclass(frozen=True)
class Part:
    """The part of a checkpoint tensor one rank loads: indices [start, stop) along `dim`."""

    dim: int
    start: int
    stop: int


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor loads: all of it (part None) or its `part`; dst None: nothing of
    it on this rank."""

    dst: torch.Tensor | Rows | None
    part: Part | None = None


def _targets(model: LlamaModel) -> dict[str, Target]:
    """HF tensor name -> the tensor (or rows of a fused base weight) it loads into."""
    cfg, shard = model.cfg, model.parallel.shard
    start, stop = shard.vocab(cfg.vocab_size)
    vocab = Part(0, start, min(stop, cfg.vocab_size))
    rows = vocab.stop - vocab.start  # the last rank's padding rows stay zero
    targets = {
        "model.embed_tokens.weight": Target(model.embed_tokens.weight[:rows], vocab),
        "model.norm.weight": Target(model.norm.weight),
    }
    if not cfg.tie_word_embeddings:
        targets["lm_head.weight"] = Target(model.lm_head[:rows], vocab)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}"
        targets[f"{prefix}.input_layernorm.weight"] = Target(layer.input_layernorm.weight)
        targets[f"{prefix}.post_attention_layernorm.weight"] = Target(layer.post_attention_layernorm.weight)
        if cfg.qk_norm != "none":
            attn, full = layer.self_attn, cfg.qk_norm == "full"  # a full norm is split as q and k are
            q, k = (Part(0, *shard.out_part(cfg, t)) if full else None for t in ("q_proj", "k_proj"))
            targets[f"{prefix}.self_attn.q_norm.weight"] = Target(attn.q_norm.weight, q)
            targets[f"{prefix}.self_attn.k_norm.weight"] = Target(attn.k_norm.weight, k)
        if cfg.moe:
            targets |= _expert_targets(cfg, shard, prefix, layer.mlp)
        for name, shape in cfg.linear_shapes().items():
            if MODULE_PARENTS[name].startswith("mlp") and cfg.moe:
                continue  # _expert_targets
            packed = getattr(getattr(layer, MODULE_PARENTS[name]), shape.packed)
            targets |= _linear_targets(cfg, shard, name, packed, f"{prefix}.{peft_path(name)}")
    return targets


def _linear_targets(
    cfg: ModelConfig, shard: Shard, target: str, packed: nn.Module, base: str
) -> dict[str, Target]:
    """One linear layer's weight (and bias) into its rows of its packed module (a LoRALinear):
    this rank's rows of a column-parallel layer, its columns of a row-parallel one."""
    offset, size = packed.slices[cfg.linear_shapes()[target].slice_index]
    rows = Rows(packed.base, offset, (size, packed.in_features))
    split = shard.size > 1
    if target in ROW:
        weight = Target(rows, Part(1, *shard.in_part(cfg, target)) if split else None)
        bias = Target(packed.bias)  # None off rank 0: the ranks' sum takes it once
    else:
        part = Part(0, *shard.out_part(cfg, target)) if split else None
        weight = Target(rows, part)
        bias = Target(None if packed.bias is None else packed.bias[offset : offset + size], part)
    return {f"{base}.weight": weight} | ({f"{base}.bias": bias} if _has_bias(cfg, target) else {})


def _has_bias(cfg: ModelConfig, target: str) -> bool:
    if target in ("q_proj", "k_proj", "v_proj"):
        return cfg.qkv_bias
    return (
        cfg.o_bias if target == "o_proj" else cfg.mlp_bias and target in ("gate_proj", "up_proj", "down_proj")
    )


# Where each checkpoint names a sparse MLP's parts: its folder, and gate, up and down per expert.
EXPERT_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}
DEFAULT_EXPERT_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def _expert_targets(cfg: ModelConfig, shard: Shard, prefix: str, moe: nn.Module) -> dict[str, Target]:
    """A sparse MLP's router and every expert's gate, up and down weights, as saved one expert at
    a time, into the stacked w13 [experts, 2 * inter, hidden] and w2 [experts, hidden, inter]:
    this rank's part of each expert's intermediate dimension (and of the shared expert's)."""
    folder, gate, up, down = EXPERT_NAMES.get(cfg.model_type, DEFAULT_EXPERT_NAMES)
    inter, hidden = moe.w2.shape[2], cfg.hidden_size  # this rank's part of each expert's
    split = shard.size > 1
    rows = Part(0, *shard.even(cfg.moe.intermediate_size)) if split else None
    columns = Part(1, *shard.even(cfg.moe.intermediate_size)) if split else None
    targets = {
        f"{prefix}.{folder}.gate.weight": Target(Rows(moe.router.base, 0, (cfg.moe.num_experts, hidden)))
    }
    for e in range(cfg.moe.num_experts):
        expert = f"{prefix}.{folder}.experts.{e}"
        targets[f"{expert}.{gate}.weight"] = Target(moe.w13[e, :inter], rows)
        targets[f"{expert}.{up}.weight"] = Target(moe.w13[e, inter:], rows)
        targets[f"{expert}.{down}.weight"] = Target(moe.w2[e], columns)
    if cfg.moe.shared_intermediate_size:  # Qwen2-MoE's shared expert
        shared = f"{prefix}.mlp.shared_expert"
        gate_up, down_proj = moe.shared_gate_up_proj, moe.shared_down_proj
        targets |= _linear_targets(cfg, shard, "shared_gate_proj", gate_up, f"{shared}.gate_proj")
        targets |= _linear_targets(cfg, shard, "shared_up_proj", gate_up, f"{shared}.up_proj")
        targets |= _linear_targets(cfg, shard, "shared_down_proj", down_proj, f"{shared}.down_proj")
        targets[f"{prefix}.mlp.shared_expert_gate.weight"] = Target(
            Rows(moe.shared_expert_gate.base, 0, (1, hidden))
        )
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
