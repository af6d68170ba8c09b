"""Random PEFT-format LoRA checkpoints for a base model, written without PEFT itself."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.model_config import MODULE_PARENTS, ModelConfig


def write_random_adapter(
    model: ModelConfig, folder: Path, rank: int, seed: int, targets: tuple[str, ...] = tuple(MODULE_PARENTS)
) -> Path:
    """adapter_config.json + adapter_model.safetensors with non-zero A and B on `targets`."""
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = model.linear_shapes()
    tensors = {}
    for layer in range(model.num_layers):
        for name in targets:
            key = f"base_model.model.model.layers.{layer}.{MODULE_PARENTS[name]}.{name}"
            tensors[f"{key}.lora_A.weight"] = (
                torch.randn(rank, shapes[name].in_features, generator=gen) * 0.01
            )
            tensors[f"{key}.lora_B.weight"] = (
                torch.randn(shapes[name].out_features, rank, generator=gen) * 0.01
            )
    save_file(tensors, folder / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(targets),
        "bias": "none",
        "use_rslora": False,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder
