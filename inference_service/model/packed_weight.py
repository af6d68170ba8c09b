"""A dense linear weight laid out for the CPU's matmuls, once loaded.

At decode batch sizes a packed matmul is 2 to 3 times torch's own fp32 matmul (MKL's sgemm). fp32
weights, and bf16 ones on CPUs with AVX512-BF16, are packed for kernels/cpu_linear.py, which sums
fp32 outputs SUM_BLOCK inputs at a time as MKL does (its docstring says why that matters) and bf16
ones in fp32 over all inputs, rounded once. Where that kernel could not be built, fp32 weights take
oneDNN's layout in blocks of at most SUM_BLOCK inputs, the output the sum of the blocks' matmuls,
each added to the last in oneDNN's own epilogue: as accurate, and slower; bf16 weights take
oneDNN's layout in one block where the CPU has bf16 instructions (oneDNN sums in fp32 and rounds
once; adding bf16 partial sums would round each).
"""

from dataclasses import dataclass

import torch

from kernels.cpu_linear import SUM_BLOCK, CpuLinear

# The rows oneDNN lays a packed weight out for (a decode batch); other row counts run on it too.
PACK_ROWS = 32


def packed(weight: torch.Tensor, linear: CpuLinear | None) -> "PanelWeight | PackedWeight | None":
    """weight [out, in] laid out for the CPU's matmuls: in `linear`'s panels where it runs (fp32,
    and bf16 on CPUs with AVX512-BF16); else fp32 in oneDNN's blocks, bf16 in oneDNN's layout where
    the CPU has bf16 instructions. None on a GPU, for fp16 and where torch has no oneDNN: then
    F.linear runs."""
    weight = weight.detach()
    if weight.device.type != "cpu":
        return None
    if linear is not None and linear.runs(weight):
        return PanelWeight(linear, linear.pack(weight), weight.shape[0])
    if not torch.backends.mkldnn.is_available():
        return None
    if weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        return PackedWeight.of(weight)
    return None


@dataclass(frozen=True)
class PanelWeight:
    """A W [out, in] in kernels/cpu_linear.py's panels, multiplied by that kernel."""

    kernel: CpuLinear
    panels: torch.Tensor  # [ceil(out / columns), in, columns]
    out: int

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, W, bias) for x [tokens, in]."""
        x = x if x.stride(1) == 1 else x.contiguous()
        return self.kernel(x, self.panels, self.out, bias)  # [tokens, out]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.panels,)

    def nbytes(self) -> int:
        """W's bytes, its last panel's padding rows left out (as a tensor-parallel rank's half of a
        weight holds half of them; at most columns - 1 rows a weight, none at the default model's
        shapes)."""
        return self.out * self.panels.shape[1] * self.panels.element_size()


@dataclass(frozen=True)
class PackedWeight:
    """W [out, in] as column blocks in oneDNN's layout: blocks[i] holds W[:, a:b] for (a, b) = spans[i]."""

    blocks: tuple[torch.Tensor, ...]
    spans: tuple[tuple[int, int], ...]  # the input columns of each block, in order

    @classmethod
    def of(cls, weight: torch.Tensor) -> "PackedWeight":
        """weight [out, in], fp32 or bf16 on a CPU with oneDNN (bf16: with bf16 instructions)."""
        block = SUM_BLOCK if weight.dtype == torch.float32 else weight.shape[1]
        columns = weight.shape[1]
        spans = tuple((a, min(a + block, columns)) for a in range(0, columns, block))
        blocks = tuple(
            torch.ops.mkldnn._reorder_linear_weight(weight[:, a:b].contiguous(), PACK_ROWS) for a, b in spans
        )
        return cls(blocks, spans)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, W, bias) for x [tokens, in]."""
        (a, b), *rest = self.spans
        first = self.blocks[0]
        y = torch.ops.mkldnn._linear_pointwise(x[:, a:b], first, bias, "none", [], "")  # [tokens, out]
        for block, (a, b) in zip(self.blocks[1:], rest, strict=True):
            y = torch.ops.mkldnn._linear_pointwise.binary(x[:, a:b], y, block, None, "add")  # [tokens, out]
        return y

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.blocks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks)
