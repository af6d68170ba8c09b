"""cpu_decode_attention: on the CPU, one new token per sequence attends to its context, reading K and
V in place in the paged cache (kernels/cpu_decode_attention.cpp).

Torch ships no CPU attention that reads a paged cache, and gathering every sequence's blocks into
one padded tensor for SDPA copies each K and V once more per layer before SDPA reads them again:
at 512-token contexts the gather and SDPA were half of an fp32 decode step. The C++ source is
compiled once per machine (kernels/cpu_library.py); where it cannot be, or where the CPU has no
AVX-512 (below), `CpuDecodeAttention.load` says why and returns None, and attention gathers as
before.
"""

import ctypes
from pathlib import Path

import torch

from kernels.cpu_library import CompiledKernel, dtype_functions

_SIZES = ("decodes", "kv_heads", "group", "head_dim", "block_size", "table_width", "window", "q_stride")


class _Shape(ctypes.Structure):  # Shape in the source
    _fields_ = [(name, ctypes.c_int64) for name in _SIZES] + [("scale", ctypes.c_float)]


class CpuDecodeAttention(CompiledKernel):
    """The compiled kernels of one process."""

    SOURCE = Path(__file__).with_suffix(".cpp")
    # Built for AVX2 alone (x86-64-v3 on a 2-core AMD EPYC, torch and oneDNN held to AVX2 too), an
    # fp32 decode step of 16 requests at 256-token contexts took 80.5 ms with it and 63.5 ms
    # gathering for SDPA (one engine each, alternating, 4 rounds; 79.3 and 69.9 ms in 2 more).
    AVX512_ONLY = True

    def __init__(self, library: ctypes.CDLL):
        self._functions = dtype_functions(library, "decode_attention", 7)

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        contexts: torch.Tensor,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """Semantics: out[i, h] = softmax(scale * K_i @ q[i, h]) @ V_i, K_i and V_i holding kv head
        h // (heads / kv_heads) of sequence i's positions p with c - w <= p < c (c = contexts[i],
        w = sliding_window or unbounded), position p being row p % block_size of block
        block_tables[i, p // block_size].

        q: [decodes, heads, head_dim] of the cache's dtype, each decode's heads contiguous (a view
        into the qkv projection's rows is fine); k_cache, v_cache: [blocks, block_size, kv_heads,
        head_dim], contiguous, fp32, bf16 or fp16; block_tables: [decodes, max_blocks] int64; contexts:
        [decodes] int64, each at least 1 and at most max_blocks * block_size. Returns [decodes,
        heads, head_dim] in q's dtype; scores, softmax and sums are fp32, in one call.
        """
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
        assert block_tables.dtype == contexts.dtype == torch.int64 and block_tables.is_contiguous()
        decodes, heads, head_dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        q_row, q_head, step = q.stride()
        assert q.dtype == k_cache.dtype and step == 1 and q_head == head_dim and q.is_cpu
        shape = _Shape(
            decodes, kv_heads, heads // kv_heads, head_dim, block_size, block_tables.shape[1],
            sliding_window or 0, q_row, scale,
        )  # fmt: skip
        contexts = contexts.contiguous()
        out = q.new_empty(decodes, heads, head_dim)  # [decodes, heads, hd]
        tensors = (q, k_cache, v_cache, block_tables, contexts, out)
        self._functions[q.dtype](ctypes.byref(shape), *[t.data_ptr() for t in tensors])
        return out


def cpu_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    contexts: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Plain per-sequence, per-head loop in float64: the definition the kernel is checked against."""
    decodes, heads, _ = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(decodes):
        context = int(contexts[i])
        first = max(0, context - sliding_window) if sliding_window else 0
        positions = torch.arange(first, context)
        blocks = block_tables[i][positions // block_size]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            k = k_cache[blocks, positions % block_size, kv].double()  # [seen, hd]
            v = v_cache[blocks, positions % block_size, kv].double()
            out[i, h] = torch.softmax(k @ q[i, h].double() * scale, dim=0) @ v
    return out
