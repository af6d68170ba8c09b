"""cpu_rope: rotary position embeddings on the CPU, in place on the q and k heads of a qkv
projection's output (kernels/cpu_rope.cpp).

torch's apply_rope (inference_service/model/rope.py) takes five kernels and as many new tensors per
call (a negation, a concatenation, two products and a sum), for q and for k: at decode sizes each is
a few microseconds of dispatch for a few thousand elements, about 1.8 ms of a 30 ms bf16 decode step
on the default model. This kernel makes one call a layer and rounds as those ops do. The C++
source is compiled once per machine (kernels/cpu_library.py); where it cannot be, `CpuRope.load`
says why and returns None, and apply_rope runs.
"""

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, dtype_functions


class _Rope(ctypes.Structure):  # Rope in the source
    _fields_ = [(name, ctypes.c_int64) for name in ("tokens", "heads", "head_dim", "row")]


class CpuRope(CompiledKernel):
    """The compiled kernel of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")

    def __init__(self, library: ctypes.CDLL):
        self._functions = dtype_functions(library, "rope", 4)

    def __call__(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int
    ) -> None:
        """Semantics: for each token t, the first `heads` heads of head_dim elements of qkv[t]
        (q's then k's) become apply_rope's x * cos[t] + rotate_half(x) * sin[t], in place, each
        product and the sum rounded to qkv's dtype.

        qkv: [tokens, row] with row >= heads * head_dim, rows contiguous; cos, sin: [tokens,
        head_dim] contiguous, of qkv's dtype; head_dim even."""
        tokens, row = qkv.shape
        qkv_row, step = qkv.stride()
        assert step == 1 and heads * head_dim <= row and head_dim % 2 == 0 and qkv.is_cpu
        assert cos.dtype == sin.dtype == qkv.dtype and cos.is_contiguous() and sin.is_contiguous()
        assert cos.shape == sin.shape == (tokens, head_dim)
        shape = _Rope(tokens, heads, head_dim, qkv_row)
        self._functions[qkv.dtype](ctypes.byref(shape), qkv.data_ptr(), cos.data_ptr(), sin.data_ptr())
