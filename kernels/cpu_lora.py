"""cpu_lora: LoRA shrink and expand on the CPU over one step's segment table, reading each adapter's
pages in place in adapter memory (kernels/cpu_lora.cpp).

The torch path (lora_bmm) gathers each chunk's A and B rows into new tensors with index_select
before its two batched matmuls: every adapter byte is read, written and read again, in seven
targets' worth of small torch calls per layer. At decode, where each adapter has a few tokens,
that was a third of a mixed-adapter step. These kernels read each page once per tile of tokens.
`CpuLoraStep.linear` runs a layer's base matmul (kernels/cpu_linear.py's panels) and its adapters
in one call, where the layer's weight is in those panels.
The C++ source is compiled once per machine (kernels/cpu_library.py); where it cannot be,
`CpuLora.load` says why and returns None, and LoRA takes the torch path.
"""

import ctypes
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from kernels.cpu_library import (
    DTYPE_NAMES,
    CompiledKernel,
    dtype_functions,
    present_functions,
    taking_pointers,
)
from kernels.cpu_linear import linear_shape
from kernels.lora_batch import SegmentTable
from kernels.lora_expand import MAX_SLICES

_SIZES = (
    "segments", "max_pages", "first_target", "slices", "in_features", "unit", "x_stride", "y_stride",
    "lanes", "gathered",
)  # fmt: skip
_TABLE = ("tokens", "starts", "lengths", "ranks", "pages")


class _Lora(ctypes.Structure):  # Lora in the source
    _fields_ = [
        *((name, ctypes.c_int64) for name in _SIZES),
        ("offsets", ctypes.c_int64 * MAX_SLICES),
        ("sizes", ctypes.c_int64 * MAX_SLICES),
        *((name, ctypes.c_void_p) for name in _TABLE),
    ]


class CpuLora(CompiledKernel):
    """The compiled kernels of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")

    def __init__(self, library: ctypes.CDLL):
        self.functions = {  # by (name, dtype)
            (name, dtype): function
            for name in ("shrink", "expand", "shrink_expand")
            for dtype, function in dtype_functions(library, f"lora_{name}", 4).items()
        }
        # by the weights' and x's dtypes (bf16 where the CPU has AVX512-BF16; NF4, and int8 under
        # bf16, missing from an earlier commit's build, as bench.cpu_lora --against makes one): the
        # shapes' pointers, then x's, the panels', the bias', the pool's and y's; int8 and NF4
        # weights then their scales' (absmax's)
        dense = {(d, d): f"lora_linear_{DTYPE_NAMES[d]}" for d in (torch.float32, torch.bfloat16)}
        scaled = {
            (torch.int8, torch.float32): "lora_linear_int8",
            (torch.int8, torch.bfloat16): "lora_linear_int8_bfloat16",
            (torch.uint8, torch.float32): "lora_linear_nf4",
            (torch.uint8, torch.bfloat16): "lora_linear_nf4_bfloat16",
        }
        linear = taking_pointers(present_functions(library, dense), 7)
        linear |= taking_pointers(present_functions(library, scaled), 8)
        self.functions.update({("linear", *key): function for key, function in linear.items()})
        library.lora_panel_columns.restype = ctypes.c_int64
        self.columns = library.lora_panel_columns()  # the outputs a panel of W holds (CpuLinear's)

    def runs_linear(self, panels: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether CpuLoraStep.linear multiplies rows of `dtype` by these panels (CpuLinear.pack's
        or pack_nf4's)."""
        return ("linear", panels.dtype, dtype) in self.functions and panels.shape[2] == self.columns

    def step(self, table: SegmentTable) -> "CpuLoraStep":
        """The kernels on one step's segments (`table`: int32, on the CPU)."""
        assert table.ranks.dtype == table.pages.dtype == torch.int32 and table.pages.is_contiguous()
        return CpuLoraStep(self, table)


class CpuLoraStep:
    """The kernels on one step's segment table, in parallel over (segment, tokens of it, slice).
    Each call shape (a layer's qkv, o, gate/up, down) is checked, and its arguments built, once a
    step: the other layers' calls look it up by what was checked (strides, dtypes) and pass only
    pointers. Checked and built at every call, a decode step's 120 calls took 6 to 7 µs each of
    Python, as long as a batch-1 call's kernel."""

    def __init__(self, kernel: CpuLora, table: SegmentTable):
        self._kernel, self.table = kernel, table
        self._calls: dict[tuple, Callable[..., None]] = {}

    def shrink(
        self, x: torch.Tensor, pool: torch.Tensor, first_target: int, slices: int, unit: int
    ) -> torch.Tensor:
        """lora_shrink_triton's semantics, in one split: fp32 partials [1, tokens, slices,
        table.max_rank]. x: [tokens, in] rows contiguous; pool: one layer's [units*unit]. Rows of
        base-model tokens are not written."""
        tokens, in_features = x.shape
        partials = torch.empty(1, tokens, slices, self.table.max_rank)  # [1, tokens, slices, max_rank]
        key = (
            "shrink", first_target, (0,) * slices, in_features, unit, x.stride(), (0, 1), 1, x.dtype,
            pool.dtype,
        )  # fmt: skip
        run = self._calls.get(key) or self._prepare(key, x, pool)
        run(x.data_ptr(), pool.data_ptr(), partials.data_ptr())
        return partials

    def expand(
        self,
        y: torch.Tensor,
        partials: torch.Tensor,
        pool: torch.Tensor,
        first_target: int,
        slice_sizes: tuple[int, ...],
        in_features: int,
        unit: int,
        gathered: int = 1,
    ) -> torch.Tensor:
        """lora_expand_triton's semantics for partials of one split, but for one rounding more,
        PEFT's: the sum of B times a token's shrinks is rounded to y's dtype before it is added
        (lora_B's output is, in PEFT), then the sum is. y [tokens, sum(slice_sizes)] is updated in
        place and returned; each (token, column) has one owner."""
        splits, _, slices, lanes = partials.shape
        assert splits == 1 and slices == len(slice_sizes) and lanes == gathered * self.table.max_rank
        assert partials.is_contiguous() and partials.dtype == torch.float32
        key = (
            "expand", first_target, slice_sizes, in_features, unit, (0, 1), y.stride(), gathered, y.dtype,
            pool.dtype,
        )  # fmt: skip
        run = self._calls.get(key) or self._prepare(key, y, pool)
        run(partials.data_ptr(), pool.data_ptr(), y.data_ptr())
        return y

    def shrink_expand(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        pool: torch.Tensor,
        first_target: int,
        slice_sizes: tuple[int, ...],
        unit: int,
    ) -> torch.Tensor:
        """expand(y, shrink(x, ...), ...) in one pass: each task keeps its tokens' shrinks for its
        own expand (where no tensor-parallel exchange comes between)."""
        key = (
            "shrink_expand", first_target, slice_sizes, x.shape[1], unit, x.stride(), y.stride(), 1,
            x.dtype, y.dtype, pool.dtype,
        )  # fmt: skip
        run = self._calls.get(key) or self._prepare(key, x, y, pool)
        run(x.data_ptr(), pool.data_ptr(), y.data_ptr())
        return y

    def linear(
        self,
        x: torch.Tensor,
        panels: torch.Tensor,
        out: int,
        bias: torch.Tensor | None,
        pool: torch.Tensor,
        first_target: int,
        slice_sizes: tuple[int, ...],
        unit: int,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """shrink_expand(CpuLinear()(x, panels, out, bias, scale), x, pool, ...) in one call, bit
        for bit: y [tokens, out] = x W^T + b (int8 W: (x W^T) * scale + b), then each slice's
        adapter products added (where CpuLora.runs_linear).
        x [tokens, in] rows contiguous; panels [ceil(out / columns), in, columns], of x's dtype, or
        int8 with scale [out], or NF4 codes (CpuLinear.pack_nf4's, uint8) with their absmax as
        scale, under fp32 or bf16 x."""
        tokens, inputs = x.shape
        key = (
            "linear", first_target, slice_sizes, inputs, unit, x.stride(), (out, 1), 1, x.dtype,
            panels.dtype, pool.dtype, None if bias is None else bias.dtype, panels.shape, panels.stride(),
            tokens,
        )  # fmt: skip
        run = self._calls.get(key) or self._prepare_linear(key, x, panels, out, bias, pool, scale)
        y = x.new_empty(tokens, out)  # [tokens, out]
        b = None if bias is None else bias.data_ptr()
        scales = () if scale is None else (scale.data_ptr(),)  # the call's own: its layer's
        run(x.data_ptr(), panels.data_ptr(), b, pool.data_ptr(), y.data_ptr(), *scales)
        return y

    def _prepare_linear(
        self,
        key: tuple,
        x: torch.Tensor,
        panels: torch.Tensor,
        out: int,
        bias: torch.Tensor | None,
        pool: torch.Tensor,
        scale: torch.Tensor | None,
    ) -> Callable[..., None]:
        """linear's call of `key`, once its tensors are checked as CpuLinear's call checks them."""
        assert self._kernel.runs_linear(panels, x.dtype)
        shape = linear_shape(x, panels, out, bias, self._kernel.columns, scale)
        lora = self._shape(key, x, pool)
        run = partial(
            self._kernel.functions["linear", panels.dtype, x.dtype], ctypes.byref(shape), ctypes.byref(lora)
        )
        self._calls[key] = run  # the partial holds the shapes, and their byrefs the structs
        return run

    def _prepare(self, key: tuple, *tensors: torch.Tensor) -> Callable[..., None]:
        """The call of `key` (function, the _Lora fields, x's and y's strides, the tensors'
        dtypes), taking the tensors' pointers, once `tensors` are checked as every call of `key`
        would be."""
        shape = self._shape(key, *tensors)
        run = partial(self._kernel.functions[key[0], tensors[0].dtype], ctypes.byref(shape))
        self._calls[key] = run  # the partial holds the shape, and its byref the struct
        return run

    def _shape(self, key: tuple, *tensors: torch.Tensor) -> _Lora:
        """The _Lora of `key`'s call, once `tensors` are checked: on the CPU, rows contiguous, of
        one dtype."""
        _, first_target, slice_sizes, in_features, unit, x_strides, y_strides, gathered, *_ = key
        assert all(t.device.type == "cpu" and t.stride(-1) == 1 for t in tensors)
        assert len({t.dtype for t in tensors}) == 1
        strides = x_strides[0], y_strides[0]
        return _lora(self.table, first_target, slice_sizes, in_features, unit, *strides, gathered)


def _lora(
    table: SegmentTable,
    first_target: int,
    slice_sizes: tuple[int, ...],
    in_features: int,
    unit: int,
    x_stride: int,
    y_stride: int,
    gathered: int,
) -> _Lora:
    assert len(slice_sizes) <= MAX_SLICES
    padded = (*slice_sizes, *(0,) * (MAX_SLICES - len(slice_sizes)))
    offsets = [sum(padded[:s]) for s in range(MAX_SLICES)]
    return _Lora(
        table.lengths.numel(), table.pages.shape[2], first_target, len(slice_sizes), in_features, unit,
        x_stride, y_stride, table.max_rank, gathered,
        (ctypes.c_int64 * MAX_SLICES)(*offsets), (ctypes.c_int64 * MAX_SLICES)(*padded),
        *(getattr(table, name).data_ptr() for name in _TABLE),
    )  # fmt: skip
