"""Load an HF checkpoint (model.safetensors or a sharded index) into a LlamaModel, packing
q/k/v and gate/up into their fused matmuls. Dense weights, and weights transformers saved
pre-quantized: bitsandbytes NF4 and torchao int8 (their parts may sit in different shards)."""

from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn

from inference_service.model.base_weight import Int8Weight
from inference_service.model.checkpoint import Checkpoint, Part, Rows, Target
from inference_service.model.model import LlamaModel
from inference_service.model.quantized_weights import (
    INT8_DATA,
    INT8_PARTS,
    NF4_PARTS,
    NF4_STATE,
    load_int8,
    load_nf4,
)
from inference_service.model.shard import ROW, Shard
from shared.checkpoint_files import checkpoint_files
from shared.errors import InvalidArgument
from shared.model_config import MODULE_PARENTS, ModelConfig, peft_path

# Tensors some checkpoints carry that the runtime recomputes or does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_weights(model: LlamaModel, model_dir: str | Path) -> None:
    """Every tensor of the checkpoint into the model; under tensor parallelism, each into this
    rank's part of it (shard.py), read alone from the files."""
    targets = _targets(model)
    stored = model.cfg.checkpoint_quantization
    loaded: set[str] = set()
    with ExitStack() as stack:
        checkpoint = Checkpoint(checkpoint_files(Path(model_dir)), stack)
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
                load_int8(checkpoint, name.removesuffix(INT8_DATA), target)
            elif name + NF4_STATE in checkpoint:
                load_nf4(checkpoint, name, target)
            elif isinstance(target.dst, Rows) and stored != "none":
                raise InvalidArgument(
                    f"tensor {name} is dense in a checkpoint quantized to {stored}: loramux "
                    "holds every linear layer of a pre-quantized model quantized (no modules_to_not_convert)"
                )
            elif _whole_rows(target):  # int8 scales span a whole row: quantized whole, then cut
                whole = checkpoint.get(name)
                _check_shape(whole[:, target.part.start : target.part.stop], target.dst.shape, name)
                target.dst.base.load_rows(target.dst.offset, whole, (target.part.start, target.part.stop))
            else:
                _copy(target.dst, checkpoint.get(name, target.part), name)
            loaded.add(weight)
    missing = sorted(set(targets) - loaded)
    if missing:
        raise InvalidArgument(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {missing[0]}")


def _targets(model: LlamaModel) -> dict[str, Target]:
    """HF tensor name -> the tensor (or rows of a fused base weight) it loads into."""
    cfg, shard = model.cfg, model.parallel.shard
    start, stop = shard.vocab(cfg.vocab_size)
    vocab = Part(0, start, min(stop, cfg.vocab_size), cfg.vocab_size)
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
            shapes = cfg.linear_shapes()
            q, k = (
                Part(0, *shard.out_part(cfg, t), shapes[t].out_features) if full else None
                for t in ("q_proj", "k_proj")
            )
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
        whole = cfg.linear_shapes()[target].in_features
        weight = Target(rows, Part(1, *shard.in_part(cfg, target), whole) if split else None)
        bias = Target(packed.bias)  # None off rank 0: the ranks' sum takes it once
    else:
        part = (
            Part(0, *shard.out_part(cfg, target), cfg.linear_shapes()[target].out_features) if split else None
        )
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
    inter, hidden, whole = moe.w2.shape[2], cfg.hidden_size, cfg.moe.intermediate_size  # inter: this rank's
    split = shard.size > 1
    rows = Part(0, *shard.even(whole), whole) if split else None
    columns = Part(1, *shard.even(whole), whole) if split else None
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
    _check_shape(src, dst.shape, name)
    with torch.no_grad():
        dst.copy_(src)


def _check_shape(src: torch.Tensor, shape, name: str) -> None:
    if tuple(shape) != tuple(src.shape):
        raise InvalidArgument(f"tensor {name} has shape {tuple(src.shape)}, the model expects {tuple(shape)}")


def _whole_rows(target: Target) -> bool:
    """Whether a dense weight must be read whole to load this rank's columns of it: int8's
    per-row scale is over the whole row."""
    dst, part = target.dst, target.part
    return isinstance(dst, Rows) and isinstance(dst.base, Int8Weight) and part is not None and part.dim == 1
