"""How a model's adapter memory divides into units (engine/adapter_memory.py holds the memory):
the elements one unit holds in each layer, and the units of each target's page."""

import math

from kernels.lora_batch import PAGE_RANK
from shared.model_config import ModelConfig

VOCAB_TARGET = "vocabulary side"  # the target after the LoRA targets: model/vocab_layout.py


def unit_elements(model: ModelConfig) -> int:
    """Elements per unit: PAGE_RANK * gcd over targets of (in_features + out_features), so every
    target's page (PAGE_RANK * (in + out) elements, times the experts for an expert target) and
    every expert's block of it is a whole number of units."""
    return PAGE_RANK * math.gcd(*_block_widths(model))


def page_units(model: ModelConfig) -> tuple[int, ...]:
    """Units per page of each target, lora_targets order, then the vocabulary side's run (1)."""
    unit_width = math.gcd(*_block_widths(model))
    shapes = model.linear_shapes().values()
    return (
        *(width // unit_width * s.experts for width, s in zip(_block_widths(model), shapes, strict=True)),
        1,
    )


def memory_targets(model: ModelConfig) -> tuple[str, ...]:
    """The targets of page_units, named."""
    return (*model.lora_targets, VOCAB_TARGET)


def _block_widths(model: ModelConfig) -> list[int]:
    """in_features + gathered * out_features of each target (of one expert), lora_targets order:
    a page's width over PAGE_RANK."""
    return [s.in_features + s.gathered * s.out_features for s in model.linear_shapes().values()]
