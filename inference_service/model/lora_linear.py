"""A base linear layer with N packed output slices and paged LoRA adapters on top."""

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.model.base_weight import base_weight
from kernels.lora_batch import LoraBatch
from kernels.lora_bmm import lora_bmm
from kernels.lora_expand import lora_expand_triton
from kernels.lora_shrink import lora_shrink_triton


class LoRALinear(nn.Module):
    """y = x W^T + b, plus for each token and each slice s the product B_s A_s x of its adapter.
    W is held in the `quantization` format of base_weight.py (dense, int8 or NF4).

    q/k/v (3 slices) and gate/up (2 slices) run as one base matmul; the adapters keep the slices
    apart, as targets first_target, first_target+1, ..., because an adapter may target some of
    them only. Adapter weights live in pages of the layer's adapter memory `pool` [units*unit]
    (kernels/lora_batch.py gives the layout), shared by every LoRALinear of the layer; scaling
    is merged into B when an adapter is loaded.
    """

    def __init__(
        self,
        in_features: int,
        slice_sizes: tuple[int, ...],
        bias: bool,
        memory: tuple[torch.Tensor, int, int],  # (the layer's pool, unit, first_target)
        dtype: torch.dtype,
        device: torch.device | str,
        quantization: str = "none",
    ):
        super().__init__()
        out_features = sum(slice_sizes)
        self.in_features = in_features
        self.base = base_weight(quantization, in_features, slice_sizes, dtype, device)
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.slice_sizes = slice_sizes
        self.slices = _slice_offsets(slice_sizes)  # (offset, size) of each slice in `out`
        self.pool, self.unit, self.first_target = memory  # the pool is the model's: not a buffer here

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        y = self.base(x, self.bias)  # [tokens, out]
        if lora is None:
            return y
        return add_lora(y, x, lora, self.pool, self.unit, self.first_target, self.slice_sizes)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora: LoraBatch,
    pool: torch.Tensor,
    unit: int,
    first_target: int,
    slice_sizes: tuple[int, ...],
) -> torch.Tensor:
    """y[:, slice s] += B_t A_t x for each row's adapter on target t = first_target + s (y [rows,
    sum(slice_sizes)], x [rows, in]), the rows being a step's tokens or an MoE layer's (token,
    expert) pairs; updated in place where it can be, and returned."""
    if lora.table is not None:  # the Triton kernels' path: tiles without tokens do nothing
        partials = lora_shrink_triton(x, pool, lora.table, first_target, len(slice_sizes), unit)
        return lora_expand_triton(y, partials, pool, lora.table, first_target, slice_sizes, x.shape[1], unit)
    rows = lora.rows[first_target : first_target + len(slice_sizes)] if lora.rows else ()
    if not any(rows):
        return y
    if any(work.gather is not None for target_rows in rows if target_rows for work in target_rows):
        x = F.pad(x, (0, 0, 0, 1))  # [rows + 1, in]: padding rows read the zero row
    for (offset, size), target_rows in zip(_slice_offsets(slice_sizes), rows, strict=True):
        for work in target_rows or ():
            lora_bmm(y[:, offset : offset + size], x, pool, unit, work)
    return y


def _slice_offsets(sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    offsets, start = [], 0
    for size in sizes:
        offsets.append((start, size))
        start += size
    return tuple(offsets)
