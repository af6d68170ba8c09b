"""A base linear layer with N packed output slices and paged LoRA adapters on top."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.model.base_weight import DenseWeight, Int8Weight, Nf4Weight, base_weight
from inference_service.model.collectives import Collectives
from inference_service.model.packed_weight import PanelWeight
from kernels.cpu_linear import CpuLinear
from kernels.cpu_lora import CpuLora
from kernels.lora_batch import PAGE_RANK, LoraBatch
from kernels.lora_bmm import lora_bmm
from kernels.lora_expand import lora_expand_triton
from kernels.lora_shrink import lora_shrink_triton


@dataclass(frozen=True)
class LoraSplit:
    """How a fully sharded adapter's part on a tensor-parallel rank (shard.py) meets the other
    ranks' in one layer. A column layer's ranks hold rank rows of A: their shrinks are gathered,
    and this rank's B rows (every rank's, for its outputs) read them all. A row layer's ranks hold
    input columns of A: their shrinks are summed, and this rank's B adds the output columns it
    covers, before the layer's own all-reduce sums the ranks' outputs."""

    parallel: Collectives
    kind: str  # "column" | "row"

    @classmethod
    def of(cls, parallel: Collectives, kind: str) -> "LoraSplit | None":
        """The split of a `kind` layer, or None where LoRA follows the base layer's split."""
        return cls(parallel, kind) if parallel.size > 1 and parallel.shard.fully_sharded else None

    @property
    def gathered(self) -> int:
        """Blocks of rank rows this rank's B^T pages hold: one per rank on a column layer."""
        return self.parallel.size if self.kind == "column" else 1

    def shrunk(self, shrunk: torch.Tensor) -> torch.Tensor:
        """The CPU path's shrink [chunks, pages*PAGE_RANK, rows] as this rank's B reads it."""
        if self.kind == "row":
            return self.parallel.all_reduce(shrunk)
        n, (chunks, rank, rows) = self.parallel.size, shrunk.shape
        every = self.parallel.all_gather(shrunk.unsqueeze(0), dim=0)  # [ranks, chunks, rank, rows]
        pages = every.view(n, chunks, rank // PAGE_RANK, PAGE_RANK, rows)
        return pages.permute(1, 2, 0, 3, 4).reshape(chunks, n * rank, rows)  # page after page

    def partials(self, partials: torch.Tensor) -> torch.Tensor:
        """The Triton path's shrink partials [splits, tokens, slices, lanes], summed, as this
        rank's B reads them: [1, tokens, slices, gathered * lanes]."""
        shrunk = partials.sum(dim=0)  # [tokens, slices, lanes]
        if self.kind == "row":
            return self.parallel.all_reduce(shrunk).unsqueeze(0)
        every = self.parallel.all_gather(shrunk.unsqueeze(0), dim=0)  # [ranks, tokens, slices, lanes]
        return every.permute(1, 2, 0, 3).flatten(2).unsqueeze(0).contiguous()

    def outputs(self, y: torch.Tensor, slice_sizes: tuple[int, ...]) -> tuple[torch.Tensor, tuple[int, ...]]:
        """The columns of y this rank's B adds to, and their slice sizes: a row layer's share."""
        if self.kind == "column":
            return y, slice_sizes
        (size,), rank = slice_sizes, self.parallel.shard.rank
        part = size // self.parallel.size
        return y[:, rank * part : (rank + 1) * part], (part,)


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
        split: LoraSplit | None = None,
    ):
        super().__init__()
        self.split = split
        self.dtype = dtype  # the activations'
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
        # the base weight, where the LoRA kernels multiply by it: (panels, int8 scales, NF4 absmax or None)
        self.panels: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def pack(self, linear: CpuLinear | None, lora: CpuLora | None = None) -> None:
        """Once loaded, on a CPU: the base weight laid out for its matmuls (DenseWeight.pack,
        Int8Weight.pack, Nf4Weight.pack). Where that is `linear`'s panels, `lora` runs them, and
        the adapters are not split across ranks, a step's compiled LoRA kernels run the base matmul
        and the adapters in one call."""
        panels = None
        if isinstance(self.base, Int8Weight):
            self.base.pack(linear)
            panels = (self.base.q, self.base.scale) if self.base.linear is not None else None
        if isinstance(self.base, Nf4Weight):
            self.base.pack(linear)
            panels = (self.base.packed, self.base.absmax) if self.base.linear is not None else None
        if isinstance(self.base, DenseWeight):
            self.base.pack(linear)
            packed = self.base.packed
            panels = (packed.panels, None) if isinstance(packed, PanelWeight) else None
        ours = panels is not None and lora is not None and lora.runs_linear(panels[0], self.dtype)
        self.panels = panels if ours and self.split is None else None

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        if lora is None:
            return self.base(x, self.bias)  # [tokens, out]
        step, panels = lora.cpu_lora, self.panels
        if panels is not None and step is not None:
            x = x if x.stride(1) == 1 else x.contiguous()
            (weights, scale), out = panels, sum(self.slice_sizes)
            args = self.pool, self.first_target, self.slice_sizes, self.unit
            return step.linear(x, weights, out, self.bias, *args, scale=scale)  # [tokens, out]
        y = self.base(x, self.bias)  # [tokens, out]
        return add_lora(y, x, lora, self.pool, self.unit, self.first_target, self.slice_sizes, self.split)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    lora: LoraBatch,
    pool: torch.Tensor,
    unit: int,
    first_target: int,
    slice_sizes: tuple[int, ...],
    split: LoraSplit | None = None,
) -> torch.Tensor:
    """y[:, slice s] += B_t A_t x for each row's adapter on target t = first_target + s (y [rows,
    sum(slice_sizes)], x [rows, in]), the rows being a step's tokens or an MoE layer's (token,
    expert) pairs; updated in place where it can be, and returned. `split`: a fully sharded
    adapter's part, which meets the other ranks' (every rank makes the same calls)."""
    out, sizes = split.outputs(y, slice_sizes) if split else (y, slice_sizes)
    gathered = split.gathered if split else 1
    if lora.cpu_lora is not None:  # the compiled CPU kernels on the step's segments
        if split is None:
            return lora.cpu_lora.shrink_expand(y, x, pool, first_target, sizes, unit)
        partials = split.partials(lora.cpu_lora.shrink(x, pool, first_target, len(sizes), unit))
        lora.cpu_lora.expand(out, partials, pool, first_target, sizes, x.shape[1], unit, gathered)
        return y
    if lora.table is not None:  # the Triton kernels' path: tiles without tokens do nothing
        partials = lora_shrink_triton(x, pool, lora.table, first_target, len(sizes), unit)
        if split is not None:
            partials = split.partials(partials)
        lora_expand_triton(out, partials, pool, lora.table, first_target, sizes, x.shape[1], unit, gathered)
        return y
    rows = lora.rows[first_target : first_target + len(sizes)] if lora.rows else ()
    if not any(rows):
        return y
    if any(work.gather is not None for target_rows in rows if target_rows for work in target_rows):
        x = F.pad(x, (0, 0, 0, 1))  # [rows + 1, in]: padding rows read the zero row
    exchange = split.shrunk if split else None
    for (offset, size), target_rows in zip(_slice_offsets(sizes), rows, strict=True):
        for work in target_rows or ():
            lora_bmm(out[:, offset : offset + size], x, pool, unit, work, gathered, exchange)
    return y


def _slice_offsets(sizes: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    offsets, start = [], 0
    for size in sizes:
        offsets.append((start, size))
        start += size
    return tuple(offsets)
