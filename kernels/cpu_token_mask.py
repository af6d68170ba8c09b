"""cpu_token_mask: a grammar's token masks applied to the logits on the CPU, one call for every
constrained row (kernels/cpu_token_mask.cpp).

The torch path (engine/grammars.py's masked_by_torch) unpacks each row's bitmask into a bool per
token and fills the logits where it is false: several tensors of a row's vocabulary (the default
model's 49,152 tokens) each, about 1.2 ms a step for 16 constrained rows on one thread. This
kernel reads the bits in place and writes -inf where a bit is clear, skipping words whose tokens
are all allowed; it is the same fill, bit for bit. The C++ source is compiled once per machine
(kernels/cpu_library.py); where it cannot be, `CpuTokenMask.load` says why and returns None, and
the torch path runs.
"""

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, taking_pointers


class _TokenMask(ctypes.Structure):  # TokenMask in the source
    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "vocab", "words", "logits_stride")]


class CpuTokenMask(CompiledKernel):
    """The compiled kernel of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")

    def __init__(self, library: ctypes.CDLL):
        self._function = taking_pointers({"float32": library.token_mask_float32}, 4)["float32"]

    def __call__(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
        """Semantics: logits[rows[j], t] = -inf for every token t whose bit (t % 32 of word
        t // 32) is clear in bitmask[j], in place. logits: [n, vocab] fp32, rows contiguous;
        bitmask: [len(rows), ceil(vocab / 32)] int32, contiguous; rows: [c] int64, each below n."""
        vocab = logits.shape[1]
        assert logits.dtype == torch.float32 and logits.stride(1) == 1 and logits.is_cpu
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous()
        assert bitmask.shape == (len(rows), -(-vocab // 32)) and rows.dtype == torch.int64
        assert rows.is_contiguous()
        shape = _TokenMask(len(rows), vocab, bitmask.shape[1], logits.stride(0))
        self._function(ctypes.byref(shape), bitmask.data_ptr(), rows.data_ptr(), logits.data_ptr())
