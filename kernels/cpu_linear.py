"""cpu_linear: the CPU's matmul for fp32, bf16, int8 and NF4 linear layers (kernels/cpu_linear.cpp).

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
call, 4 times its bytes, before its matmul), summed as fp32's are, then scaled; and bf16 rows, on
CPUs with AVX512-BF16, each pair widened to bf16 and summed as bf16's are, the total then rounded
before and after its scale as int8_linear's ops round it. NF4 weights
(kernels/nf4_linear.py) multiply fp32 rows in them too, each code looked up and scaled by its
block's absmax as it is read (where torch's path dequantizes the whole weight at every call, 8
times its bytes), bit for bit the fp32 tiles on dequantize_nf4's weights; and bf16 rows, on CPUs
with AVX512-BF16, each weight then rounded to bf16 as dequantize_nf4 rounds it, bit for bit the
bf16 tiles on those weights. The C++ source is compiled once per machine
(kernels/cpu_library.py); where it cannot be, `CpuLinear.load` says why and returns None, and the
weights take oneDNN's matmuls.
"""

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, present_functions, taking_pointers
from kernels.nf4_linear import BLOCK as NF4_BLOCK

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
        names = {
            (torch.float32, torch.float32): "linear_float32",
            (torch.int8, torch.float32): "linear_int8",
            (torch.uint8, torch.float32): "linear_nf4",  # NF4 codes
            (torch.bfloat16, torch.bfloat16): "linear_bfloat16",  # built where the CPU has AVX512-BF16
            (torch.int8, torch.bfloat16): "linear_int8_bfloat16",  # and there
            (torch.uint8, torch.bfloat16): "linear_nf4_bfloat16",  # and there
        }
        # by the weights' and x's dtypes: the shape's, x's, the panels', the bias', y's
        self._functions = taking_pointers(present_functions(library, names), 5)
        library.linear_panel_columns.restype = ctypes.c_int64
        self.columns = library.linear_panel_columns()  # the outputs a panel holds
        library.linear_block_rows.restype = ctypes.c_int64
        self.block_rows = library.linear_block_rows()  # the rows of x the panels stream past at a time

    def runs(self, weight: torch.Tensor, activations: torch.dtype | None = None) -> bool:
        """Whether this kernel multiplies rows of `activations` (default: the weight's dtype; fp32
        for int8) by `weight` [out, in]: fp32; int8 with a scale per output; bf16, and int8 under
        bf16 rows, where the CPU has AVX512-BF16 and the inputs come in pairs."""
        if activations is None:
            activations = torch.float32 if weight.dtype == torch.int8 else weight.dtype
        if weight.device.type != "cpu" or (weight.dtype, activations) not in self._functions:
            return False
        return activations != torch.bfloat16 or weight.shape[1] % 2 == 0

    def runs_nf4(self, codes: torch.Tensor, in_features: int, dtype: torch.dtype) -> bool:
        """Whether this kernel multiplies rows of `dtype` by NF4 weights of these codes (nf4_linear's
        packed, on the CPU) and in_features inputs: fp32 rows, or bf16 ones where the CPU has
        AVX512-BF16, each block of 64 within one output's inputs."""
        known = (torch.uint8, dtype) in self._functions
        return known and codes.device.type == "cpu" and in_features % NF4_BLOCK == 0

    def pack_nf4(
        self, codes: torch.Tensor, absmax: torch.Tensor, out: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """NF4 weights [out, in] (nf4_linear's packed [out * in / 2] uint8, absmax [out * in / 64]
        fp32, where runs_nf4) -> panels [ceil(out / columns), in / 2, columns] uint8, byte c of
        panel p's row j holding output p * columns + c's codes of inputs 2j (low nibble) and 2j + 1
        (high), and their absmax [ceil(out / columns), in / 64, columns]; outputs past `out`: code
        0, absmax 0."""
        inputs = codes.numel() * 2 // out
        assert (
            codes.device.type == "cpu"
            and inputs % NF4_BLOCK == 0
            and absmax.numel() * NF4_BLOCK == out * inputs
        )
        panels = -(-out // self.columns)
        padded = codes.new_zeros(panels * self.columns, inputs)  # [panels * columns, in] one code each
        padded[:out, 0::2], padded[:out, 1::2] = codes.view(out, -1) >> 4, codes.view(out, -1) & 15
        pairs = padded.view(panels, self.columns, inputs // 2, 2).permute(0, 2, 3, 1)  # [p, in/2, 2, columns]
        packed = (pairs[:, :, 0] | pairs[:, :, 1] << 4).contiguous()  # [p, in / 2, columns]
        scales = absmax.new_zeros(panels * self.columns, inputs // NF4_BLOCK)  # [panels * columns, in / 64]
        scales[:out] = absmax.view(out, -1)
        blocks = scales.view(panels, self.columns, -1).transpose(1, 2).contiguous()  # [p, in / 64, columns]
        return packed, blocks

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
        them all in fp32, adds the bias and rounds once. With scale [out] fp32, W is int8: y = (x
        W^T) * scale + bias, the sums x's dtype's; fp32 x scales each total once, bf16 x rounds
        each total, then its product by the scale rounded to bf16, then the bias' sum. With
        uint8 panels and their absmax as scale (pack_nf4's), W is NF4 and x fp32 or bf16: y = x
        W^T + bias summed as x's dtype sums it on W's dequantized values (rounded to bf16 for bf16
        x, as dequantize_nf4 rounds them)."""
        assert x.stride(1) == 1 and x.is_cpu and (panels.dtype, x.dtype) in self._functions
        shape = linear_shape(x, panels, out, bias, self.columns, scale)
        y = x.new_empty(x.shape[0], out)  # [tokens, out]
        pointers = (x.data_ptr(), panels.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr())
        self._functions[panels.dtype, x.dtype](ctypes.byref(shape), *pointers)
        return y


def linear_shape(
    x: torch.Tensor,
    panels: torch.Tensor,
    out: int,
    bias: torch.Tensor | None,
    columns: int,
    scale: torch.Tensor | None = None,
) -> LinearShape:
    """The kernel's shape of y [tokens, out] = x W^T + b, once panels (pack()'s or pack_nf4's,
    of panels of `columns` outputs), the bias and the int8 weights' scales or NF4's absmax are
    checked as the kernel reads them: of x's dtype (int8 or NF4 panels with fp32 scales or
    absmax), laid out one after another. Which pairs of weight and x dtypes a kernel takes, the
    callers check (CpuLinear.__call__, CpuLora.runs_linear)."""
    (tokens, inputs), count = x.shape, -(-out // columns)
    nf4 = panels.dtype == torch.uint8
    assert panels.shape == (count, inputs // 2 if nf4 else inputs, columns) and panels.is_contiguous()
    if scale is None:
        assert panels.dtype == x.dtype
    else:
        assert scale.dtype == torch.float32
        assert panels.dtype in (torch.int8, torch.uint8)
        assert scale.is_contiguous()
        assert scale.shape == ((count, inputs // NF4_BLOCK, columns) if nf4 else (out,))
    assert bias is None or (bias.dtype == x.dtype and bias.shape == (out,) and bias.is_contiguous())
    pointer = None if scale is None else scale.data_ptr()
    return LinearShape(tokens, out, inputs, x.stride(0), out, count, SUM_BLOCK, pointer)
