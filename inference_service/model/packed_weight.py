"""A dense linear weight in oneDNN's blocked layout, for the CPU's matmuls.

At decode batch sizes oneDNN's packed matmul is 2 to 3 times torch's own fp32 matmul (MKL's sgemm)
on one core. But its fp32 kernels sum each output over all of a layer's inputs in one pass, where
MKL sums blocks of them apart and then adds the blocks: at 1,536 inputs (SmolLM2's down_proj)
oneDNN's sums err about twice as far from the exact ones, and through 30 layers the default model's
logits strayed further from the float64 reference than fp32 allows (tests/fp32_agreement.py). So an
fp32 weight is packed in blocks of at most SUM_BLOCK inputs, and the output is the sum of the blocks'
matmuls, each added to the last in oneDNN's own epilogue: a blocked sum, as accurate as MKL's and
still 1.5 to 2 times as fast. In bf16 oneDNN sums in fp32 and rounds once, so that weight is one block
(adding bf16 partial sums would round each).
"""

from dataclasses import dataclass

import torch

# The rows oneDNN lays a packed weight out for (a decode batch); other row counts run on it too.
PACK_ROWS = 32
# Inputs an fp32 output sums in one oneDNN call. On a 2-core AMD EPYC (AVX-512) MKL's sgemm errs
# exactly as far as this blocking does for 576 and 1,536 inputs; smaller blocks err less and cost
# more calls.
SUM_BLOCK = 192


def packs(weight: torch.Tensor) -> bool:
    """Whether a matmul with this weight runs on oneDNN, packed: on a CPU, in fp32, or in bf16
    where the CPU has bf16 instructions."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (
        weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


@dataclass(frozen=True)
class PackedWeight:
    """W [out, in] as column blocks in oneDNN's layout: blocks[i] holds W[:, a:b] for (a, b) = spans[i]."""

    blocks: tuple[torch.Tensor, ...]
    spans: tuple[tuple[int, int], ...]  # the input columns of each block, in order

    @classmethod
    def of(cls, weight: torch.Tensor) -> "PackedWeight":
        """weight [out, in], fp32 or bf16 on a CPU where packs()."""
        weight = weight.detach()
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

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.blocks)
