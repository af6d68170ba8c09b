"""Random PEFT-format LoRA checkpoints for a base model, written without PEFT itself: on an MoE
model the router and experts as PEFT's target_parameters saves them (shared/peft_experts.py), and
optionally LoRA on embed_tokens and lm_head as PEFT saves it (shared/peft_vocab.py)."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.model_config import EXPERT_TARGETS, ModelConfig, peft_path

PREFIX = "base_model.model.model.layers"
EMBED, HEAD = "base_model.model.model.embed_tokens", "base_model.model.lm_head"
# The vocabulary side's halves are drawn larger than the layers' (0.01): a term of this size moves
# the greedy tokens, so a benchmark can tell that the parts were applied.
VOCAB_SCALE = 0.1


def write_random_adapter(
    model: ModelConfig,
    folder: Path,
    rank: int,
    seed: int,
    targets: tuple[str, ...] | None = None,
    vocab: bool = False,
) -> Path:
    """adapter_config.json + adapter_model.safetensors with non-zero A and B on `targets` (LoRA
    targets; every one of the model's by default); `vocab`: on embed_tokens and lm_head too
    (without PEFT's base_layer copies), drawn after the layers', so the layers' weights of a seed
    are the same either way."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    targets = targets or model.lora_targets
    modules = [t for t in targets if not (model.moe and t in ("router", *EXPERT_TARGETS))]  # nn.Linear ones
    parameters = _moe_parameters(targets) if model.moe else []
    shapes = model.linear_shapes()
    tensors = {}

    def pair(key: str, in_features: int, out_features: int, stacked: int = 1) -> None:
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank * stacked, in_features, generator=gen) * 0.01
        tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank * stacked, generator=gen) * 0.01

    for layer in range(model.num_layers):
        for name in modules:
            pair(
                f"{PREFIX}.{layer}.{peft_path(name)}",
                shapes[name].in_features,
                shapes[name].out_features,
            )
        if "gate.weight" in parameters:
            pair(f"{PREFIX}.{layer}.mlp.gate", model.hidden_size, model.moe.num_experts)
        experts = [p for p in parameters if p.startswith("experts.")]
        for depth, param in enumerate(reversed(experts)):  # the last one wraps the others
            key = f"{PREFIX}.{layer}.mlp.experts" + ".base_layer" * depth
            hidden, inter, count = model.hidden_size, model.moe.intermediate_size, model.moe.num_experts
            in_out = (hidden, 2 * inter) if param == "experts.gate_up_proj" else (inter, hidden)
            pair(key, *in_out, stacked=count)
    if vocab:
        tensors |= _vocab_lora(model, rank, gen)
    save_file(tensors, folder / "adapter_model.safetensors")
    vocab_modules = ["embed_tokens", "lm_head"] if vocab else []
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [peft_path(name) for name in modules] + vocab_modules,
        "target_parameters": parameters,
        "bias": "none",
        "use_rslora": False,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder


def _moe_parameters(targets: tuple[str, ...]) -> list[str]:
    """The PEFT parameter names for an MoE layer's router and expert targets; gate and up are one
    parameter, so either brings both."""
    parameters = ["gate.weight"] if "router" in targets else []
    if {"gate_proj", "up_proj"} & set(targets):
        parameters.append("experts.gate_up_proj")
    if "down_proj" in targets:
        parameters.append("experts.down_proj")
    return parameters


def _vocab_lora(model: ModelConfig, rank: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """LoRA on embed_tokens and lm_head under PEFT's keys: the embedding's A holds a column per
    token, the head's B a row per token."""
    vocab, hidden = model.vocab_size, model.hidden_size
    shapes = {
        f"{EMBED}.lora_embedding_A": (rank, vocab),
        f"{EMBED}.lora_embedding_B": (hidden, rank),
        f"{HEAD}.lora_A.weight": (rank, hidden),
        f"{HEAD}.lora_B.weight": (vocab, rank),
    }
    return {key: torch.randn(*shape, generator=gen) * VOCAB_SCALE for key, shape in shapes.items()}
