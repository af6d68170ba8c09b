"""cpu_swiglu: the MLP's activation, silu(gate) * up, on the CPU in one call for every row
(kernels/cpu_swiglu.cpp).

The torch path (inference_service/model/model.py's MLP) takes two kernels and a tensor between
them (F.silu, then the product), each reading and writing the intermediate activations, a few MB
a layer at a prefill chunk. This kernel reads gate and up in place in the gate_up projection's
output and writes the product once, rounding where those ops do; silu's exponential is a
polynomial of about an ulp, so it agrees with torch's within a few fp32 ulps, not bit for bit.
The C++ source is compiled once per machine (kernels/cpu_library.py); where it cannot be,
`CpuSwiglu.load` says why and returns None, and the torch path runs.
"""

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, dtype_functions


class _Swiglu(ctypes.Structure):  # Swiglu in the source
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "size", "x_stride", "out_stride")]


class CpuSwiglu(CompiledKernel):
    """The compiled kernel of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")

    def __init__(self, library: ctypes.CDLL):
        self._functions = dtype_functions(library, "swiglu", 3)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Semantics: F.silu(gate) * up for gate, up = gate_up.chunk(2, -1), silu computed in fp32
        and rounded to gate_up's dtype, the product rounded again. gate_up: [tokens, 2 * size],
        rows contiguous; returns [tokens, size]."""
        tokens, width = gate_up.shape
        row, step = gate_up.stride()
        assert step == 1 and width % 2 == 0 and gate_up.is_cpu
        out = gate_up.new_empty(tokens, width // 2)  # [tokens, size]
        shape = _Swiglu(tokens, width // 2, row, width // 2)
        self._functions[gate_up.dtype](ctypes.byref(shape), gate_up.data_ptr(), out.data_ptr())
        return out
