"""A base linear layer with N packed output slices and slot-stacked LoRA adapters on top."""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.lora_batch import LoraBatch
from kernels.lora_expand import expand_padded, lora_expand, lora_expand_triton
from kernels.lora_shrink import lora_shrink, lora_shrink_triton, shrink_padded


class LoRALinear(nn.Module):
    """y = x W^T + b, plus for each token B[slot] (A[slot] x) of its adapter slot, per slice.

    q/k/v (3 slices) and gate/up (2 slices) run as one base matmul; the LoRA buffers keep the
    slices apart because an adapter may target some of them only. Layout:
    A:   [max_loras, max_rank, slices, in]   one shrink matmul per slot covers every slice, and
                                             a slot's first r ranks of every slice are one
                                             contiguous block, so an adapter of rank r reads
                                             only that, whatever max_rank is;
    B_s: [max_loras, max_rank, out_s]        one per slice, so uneven slices (q vs k/v under
                                             GQA) need no padding; transposed, so a decode
                                             step streams each slot's B row by row.
    Scaling is merged into B when an adapter is loaded.
    """

    def __init__(
        self,
        in_features: int,
        slice_sizes: tuple[int, ...],
        bias: bool,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        out_features = sum(slice_sizes)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )
        self.slices = _slice_offsets(slice_sizes)  # (offset, size) of each slice in `out`
        slots = (max_loras, max_rank, len(slice_sizes))
        self.register_buffer("lora_a", torch.zeros(*slots, in_features, dtype=dtype, device=device))
        for s, size in enumerate(slice_sizes):
            b = torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device)
            self.register_buffer(f"lora_b{s}", b)
        self.lora_b = tuple(getattr(self, f"lora_b{s}") for s in range(len(slice_sizes)))

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)  # [tokens, out]
        if lora is None:
            return y
        if lora.table is not None:  # the Triton kernels' path: tiles without tokens do nothing
            partials = lora_shrink_triton(x, self.lora_a, lora)  # [splits, tokens, slices, rank] fp32
            return lora_expand_triton(y, partials, self.lora_b, lora)
        if not lora.segments:
            return y
        if lora.padded is not None:  # decode steps on the CPU: stay in the padded layout in between
            padded = shrink_padded(x, self.lora_a, lora.padded)  # [slots, rank*slices, rows]
            return expand_padded(y, padded, self.lora_b, lora.padded)
        buf = lora_shrink(x, self.lora_a, lora)  # [tokens, slices, rank]
        return lora_expand(y, buf, self.lora_b, lora)

    def slice_views(self, slot: int, slice_index: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where one adapter's A [rank, in] and scaled B^T [rank, slice_out] for one slice go;
        ranks from `rank` to max_rank stay zero."""
        return self.lora_a[slot, :rank, slice_index], self.lora_b[slice_index][slot, :rank]

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """Every buffer region of one slot, A and each slice's B."""
        return [self.lora_a[slot], *(b[slot] for b in self.lora_b)]


def _slice_offsets(sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    offsets, start = [], 0
    for size in sizes:
        offsets.append((start, size))
        start += size
    return tuple(offsets)
