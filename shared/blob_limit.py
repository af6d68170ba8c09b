"""The default --max-adapter-bytes of the store (per PEFT source file) and the worker (per blob): the
largest file an adapter the process accepts can take on its base model. A fixed limit either
refuses good adapters of a large model (a rank-16 adapter on every module of Qwen3-30B-A3B is
1.7 GB in bfloat16, its experts nearly all of it) or lets a small model's store take files no
adapter of it can fill."""

from shared.model_config import ModelConfig

FLOOR_BYTES = 1 << 30  # the default without a base model, and the least any default is
WIDEST_ITEMSIZE = 4  # float32: the widest dtype a PEFT checkpoint or a blob may hold
ENTRY_BYTES = 256  # safetensors header per tensor: its name, dtype, shape and offsets
METADATA_BYTES = 1 << 16  # safetensors header beyond the tensors' entries


def largest_adapter_file(model: ModelConfig, rank: int) -> int:
    """Bytes of an adapter of `rank` on every LoRA target of `model`, A and B of every layer and
    expert in float32, with a header entry per expert matrix (PEFT writes one per expert; a blob,
    fewer, stacked per module); and on the embedding and the head, LoRA with the copy of the base
    layer PEFT saves beside it (the largest part a side can have: an own copy or re-trained rows
    take at most the copy's bytes)."""
    shapes = model.linear_shapes().values()
    elements = sum(s.experts * (s.in_features + s.out_features) for s in shapes)  # per rank row, one layer
    entries = 2 * sum(s.experts for s in shapes)  # per layer
    layers = model.num_layers
    vocab, hidden = model.vocab_size, model.hidden_size
    sides = 2 * ((vocab * hidden + rank * (vocab + hidden)) * WIDEST_ITEMSIZE + 3 * ENTRY_BYTES)
    return layers * (rank * elements * WIDEST_ITEMSIZE + entries * ENTRY_BYTES) + sides + METADATA_BYTES


def default_max_adapter_bytes(model: ModelConfig | None, rank: int) -> int:
    """The largest file of an adapter of `rank` on `model`, and never less than 1 GiB (the
    default before it was sized for the model); 1 GiB when no base model is known."""
    return FLOOR_BYTES if model is None else max(FLOOR_BYTES, largest_adapter_file(model, rank))
