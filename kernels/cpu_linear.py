"""cpu_linear: the CPU's matmul for fp32 and bf16 linear layers (kernels/cpu_linear.cpp).

An fp32 sum of n products in one pass errs about n times fp32's unit roundoff; MKL's sgemm, which
transformers runs, sums blocks of inputs apart and adds the blocks, so it errs far less at 1,536
inputs, and our logits must stay as close to the float64 forward as its do (tests/fp32_agreement.py).
oneDNN's packed matmul sums in one pass, so packed_weight.PackedWeight calls it once per block of
inputs and pays for it: a decode step of 32 requests spent 28 ms in those calls against 21 ms in
one-pass ones. This kernel sums each block in registers and adds it to the tile's totals, stored
once: as exact as the blocked calls, faster than oneDNN's one-pass matmul at decode batch sizes,
and at 0.85 to 0.93 of the FMA peak (a 2-core AMD EPYC's) for a 512-token prefill's layers.
bf16 weights, on CPUs with AVX512-BF16, take the same tiles with bf16 pair products (vdpbf16ps,
oneDNN's instruction too), summed in fp32 over all inputs and rounded once. int8 weights with a
scale per output (torchao's weight-only int8, kernels/int8_linear.py) multiply fp32 rows in the
same tiles, each weight widened to fp32 as it is read (where torch casts the whole weight at every
call, 4 times its bytes, before its matmul), summed as fp32's are, then scaled. The C++ source is
compiled once per machine (kernels/cpu_library.py); where it cannot be, `CpuLinear.load` says why
and returns None, and the weights take oneDNN's matmuls.
"""

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, taking_pointers

# Inputs an output sums in registers before the sum is added to the output: MKL's sgemm errs about
# as far at 576 and 1,536 inputs (measured on a 2-core AMD EPYC), smaller blocks err less.
SUM_BLOCK = 192


class LinearShape(ctypes.Structure):  # Linear in the source (cpu_panels.h)
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("rows", "out", "inputs", "x_stride", "y_stride", "panels", "block")
    ] + [("scale", ctypes.c_void_p)]


class CpuLinear(CompiledKernel):
    """The compiled kernel of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")

    def __init__(self, library: ctypes.CDLL):
        functions = {torch.float32: library.linear_float32, torch.int8: library.linear_int8}
        if hasattr(library, "linear_bfloat16"):  # built where the CPU has AVX512-BF16
            functions[torch.bfloat16] = library.linear_bfloat16
        # by the weights' dtype: the shape's, x's, the panels', the bias', y's
        self._functions = taking_pointers(functions, 5)
        library.linear_panel_columns.restype = ctypes.c_int64
        self.columns = library.linear_panel_columns()  # the outputs a panel holds

    def runs(self, weight: torch.Tensor) -> bool:
        """Whether this kernel multiplies by `weight` [out, in]: fp32, int8 (fp32 rows, a scale
        per output), or bf16 with an even number of inputs where the CPU has AVX512-BF16."""
        if weight.device.type != "cpu" or weight.dtype not in self._functions:
            return False
        return weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] where runs() -> panels [ceil(out / columns), in, columns]: panel p holds
        weight[p * columns + c, k] at [p, k, c] (bf16: at [p, k // 2, c, k % 2] of a view [p,
        in / 2, columns, 2]), rows past `out` zero."""
        assert self.runs(weight)
        out, inputs = weight.shape
        panels = -(-out // self.columns)
        padded = weight.new_zeros(panels * self.columns, inputs)  # [panels * columns, in]
        padded[:out] = weight
        step = 2 if weight.dtype == torch.bfloat16 else 1  # the inputs a product takes at once
        pairs = padded.view(panels, self.columns, inputs // step, step).transpose(1, 2)
        return pairs.contiguous().view(panels, inputs, self.columns)  # [panels, in, columns]

    def __call__(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        out: int,
        bias: torch.Tensor | None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """F.linear(x, W, bias) for x [tokens, in] (rows contiguous), panels = pack(W) of W [out,
        in] and bias [out] or None, all of W's dtype. fp32 sums each output's products SUM_BLOCK
        inputs at a time and adds each block's sum to the bias and the blocks before it; bf16 sums
        them all in fp32, adds the bias and rounds once. With scale [out] fp32, W is int8 and x
        fp32: y = (x W^T) * scale + bias, the sums fp32's, each output's total scaled once."""
        assert x.stride(1) == 1 and x.is_cpu and panels.dtype in self._functions
        shape = linear_shape(x, panels, out, bias, self.columns, scale)
        y = x.new_empty(x.shape[0], out)  # [tokens, out]
        pointers = (x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr())
        self._functions[panels.dtype](ctypes.byref(shape), *pointers)
        return y


def linear_shape(
    x: torch.Tensor,
    panels: torch.Tensor,
    out: int,
    bias: torch.Tensor | None,
    columns: int,
    scale: torch.Tensor | None = None,
) -> LinearShape:
    """The kernel's shape of y [tokens, out] = x W^T + b, once panels (pack()'s, of panels of
    `columns` outputs), the bias and the int8 weights' scales are checked as the kernel reads
    them: of x's dtype (int8 panels and fp32 scales with fp32 x), laid out one after another."""
    (tokens, inputs), count = x.shape, -(-out // columns)
    assert panels.shape == (count, inputs, columns) and panels.is_contiguous()
    if scale is None:
        assert panels.dtype == x.dtype
    else:
        assert panels.dtype == torch.int8 and x.dtype == scale.dtype == torch.float32
        assert scale.shape == (out,) and scale.is_contiguous()
    assert bias is None or (bias.dtype == x.dtype and bias.shape == (out,) and bias.is_contiguous())
    pointer = None if scale is None else scale.data_ptr()
    return LinearShape(tokens, out, inputs, x.stride(0), out, count, SUM_BLOCK, pointer)
