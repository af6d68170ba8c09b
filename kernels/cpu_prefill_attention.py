"""cpu_prefill_attention: on the CPU, every prefill chunk of a step attends to its context, reading K
and V in place in the paged cache (kernels/cpu_prefill_attention.cpp); prefill_attention's
semantics (kernels/prefill_attention.py), whose reference loop checks it.

Torch's CPU flash kernel wants each chunk's blocks gathered into one tensor, and skips no work under
its causal mask at these lengths, so the torch path attends in pieces of 64 queries; this kernel
walks only the keys each tile of queries sees. The C++ source is compiled once per machine
(kernels/cpu_library.py); where it cannot be, or where the CPU has no AVX-512 (below),
`CpuPrefillAttention.load` says why and returns None, and prefill chunks take torch's SDPA.
"""

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, dtype_functions

_SIZES = (
    "chunks", "kv_heads", "group", "head_dim", "block_size", "table_width", "q_stride", "out_stride",
    "window",
)  # fmt: skip


class _Prefill(ctypes.Structure):  # Prefill in the source
    _fields_ = [
        *((name, ctypes.c_int64) for name in _SIZES),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("tables", "starts", "lens", "contexts")),
    ]


class CpuPrefillAttention(CompiledKernel):
    """The compiled kernel of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")
    # Built for AVX2 alone (x86-64-v3 on a 2-core AMD EPYC, torch and oneDNN held to AVX2 too),
    # its tiles went through the stack: 8 prompts of 512 tokens took 20.3 s to prefill with it
    # (14.5 s in it) and 6.3 s on torch's SDPA.
    AVX512_ONLY = True

    def __init__(self, library: ctypes.CDLL):
        self._functions = dtype_functions(library, "prefill_attention", 5)

    def step(
        self, tables: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, contexts: torch.Tensor
    ) -> "CpuPrefillStep":
        """The kernel on one step's prefill chunks: their block tables (cut to each context's
        blocks), first rows, new tokens and contexts, int32 on the CPU."""
        return CpuPrefillStep(self, tables, starts, lens, contexts)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_starts: torch.Tensor,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """prefill_attention's semantics and arguments (but its tiles): q [tokens, heads,
        head_dim] with each token's heads contiguous (a view into qkv is fine), of the cache's
        dtype; block_tables [chunks, max_blocks] and the rest int32, contiguous. Returns [tokens,
        heads, head_dim] in q's dtype; rows outside every chunk are left unwritten. Scores,
        softmax and sums are fp32; bf16, on CPUs with AVX512-BF16, multiplies in bf16 pairs and
        rounds the softmax's weights to bf16 before they weigh V, as torch's CPU flash attention
        and the Triton kernel do."""
        _, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        out = torch.empty(q.shape, dtype=q.dtype)  # [tokens, heads, hd]
        chunks = query_lens.numel()
        if chunks == 0:
            return out
        metadata = (block_tables, query_starts, query_lens, context_lens)
        assert all(t.dtype == torch.int32 and t.is_contiguous() for t in metadata)
        assert q.dtype == k_cache.dtype == v_cache.dtype and q.stride(2) == 1 and q.stride(1) == head_dim
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.device.type == "cpu"
        shape = _Prefill(
            chunks, kv_heads, heads // kv_heads, head_dim, block_size, block_tables.shape[1],
            q.stride(0), out.stride(0), sliding_window or 0, scale, *(t.data_ptr() for t in metadata),
        )  # fmt: skip
        self._functions[q.dtype](ctypes.byref(shape), *[t.data_ptr() for t in (q, k_cache, v_cache, out)])
        return out


@dataclass(frozen=True)
class CpuPrefillStep:
    """A step's prefill chunks for the kernel, built once and used by every layer."""

    kernel: CpuPrefillAttention
    tables: torch.Tensor  # [prefills, max_blocks] int32
    starts: torch.Tensor  # [prefills] int32: each chunk's first row of the flattened batch
    lens: torch.Tensor  # [prefills] int32
    contexts: torch.Tensor  # [prefills] int32: cached + new tokens

    def attend(self, q, k_cache, v_cache, scale: float, window: int | None) -> torch.Tensor:
        inputs = (self.tables, self.starts, self.lens, self.contexts)
        return self.kernel(q, k_cache, v_cache, *inputs, scale, window)
