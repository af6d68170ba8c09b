"""Placement: where and in what form a rank holds its layers' weights: the dtype and device, the
linear layers' base format (base_weight.py), and its part of the model with the group it
exchanges over (collectives.py). Built once per model and handed to every layer."""

from dataclasses import dataclass, field

import torch

from inference_service.model.collectives import Collectives
from inference_service.model.lora_linear import LoRALinear, LoraSplit


@dataclass(frozen=True)
class Placement:
    dtype: torch.dtype
    device: torch.device | str
    quantization: str = "none"
    parallel: Collectives = field(default_factory=Collectives)

    def linear(
        self,
        in_features: int,
        slice_sizes: tuple[int, ...],
        bias: bool,
        memory: tuple[torch.Tensor, int, int],  # (the layer's adapter pool, unit, first target)
        split: str | None = None,
    ) -> LoRALinear:
        """A linear layer held here; `split`: "column" or "row" where tensor parallelism splits it
        (a fully sharded adapter's part then meets the other ranks'), None where it is whole."""
        lora = LoraSplit.of(self.parallel, split) if split else None
        return LoRALinear(
            in_features, slice_sizes, bias, memory, self.dtype, self.device, self.quantization, lora
        )
