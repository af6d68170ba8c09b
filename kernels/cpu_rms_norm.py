"""cpu_rms_norm: RMSNorm on the CPU in one call for every row (kernels/cpu_rms_norm.cpp).

The torch path (inference_service/model/model.py's RMSNorm) takes six to eight kernels a call (the
upcast, the squares, their mean, the epsilon, the reciprocal square root, two products and the
downcast): at decode sizes each is a few microseconds of dispatch for a few thousand elements, and
a layer has two norms. This kernel rounds where those ops do. The C++ source is compiled once per
machine (kernels/cpu_library.py); where it cannot be, `CpuRmsNorm.load` says why and returns None,
and the torch path runs.
"""

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, dtype_functions


class _Norm(ctypes.Structure):  # Norm in the source
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "size", "x_stride", "out_stride")]
    _fields_ += [("eps", ctypes.c_float)]


class CpuRmsNorm(CompiledKernel):
    """The compiled kernel of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")

    def __init__(self, library: ctypes.CDLL):
        self._functions = dtype_functions(library, "rms_norm", 4)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Semantics: out[r] = weight * to_dtype(x[r] / sqrt(mean(x[r]^2) + eps)), computed in fp32
        for each row r of x [rows, size] (rows contiguous), weight [size] of x's dtype."""
        rows, size = x.shape
        x_stride, step = x.stride()
        assert step == 1 and x.is_cpu and weight.dtype == x.dtype and weight.shape == (size,)
        assert weight.is_contiguous()
        out = x.new_empty(rows, size)  # [rows, size]
        shape = _Norm(rows, size, x_stride, size, eps)
        self._functions[x.dtype](ctypes.byref(shape), x.data_ptr(), weight.data_ptr(), out.data_ptr())
        return out
