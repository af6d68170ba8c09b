"""paged_decode_attention: one new token per sequence attends to its context in the paged KV cache."""

import math

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_in_fp32

BLOCK_N = 64  # keys per tile
MIN_SPLIT_KEYS = 256  # keys per program at least: fewer and the partials cost more than they save
TARGET_PROGRAMS = 512  # enough to keep every SM of a large GPU busy (132 on an H100) several times over
NO_WINDOW = 1 << 30  # a window wider than any context
LOG2E = math.log2(math.e)  # the kernels take exp2 of scores scaled by log2(e)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    splits: int | None = None,
) -> torch.Tensor:
    """Semantics: out[i, h] = softmax(scale * K_i @ q[i, h]) @ V_i, where K_i, V_i hold kv head
    h // (heads / kv_heads) of sequence i's positions p with c - w <= p < c (c = context_lens[i],
    w = sliding_window or unbounded), position p being row p % block_size of block
    block_tables[i, p // block_size].

    q: [decodes, heads, head_dim], the token at position c - 1 of each sequence, whose K/V are
    already in the cache; k_cache, v_cache: [blocks, block_size, kv_heads, head_dim];
    block_tables: [decodes, max_blocks] int32; context_lens: [decodes] int32, at least 1.
    Returns [decodes, heads, head_dim] in q's dtype.

    A program per (sequence, kv head, split) reads the K/V of its range of positions once for all
    the query heads that share them, straight from the cache through the block table; entries of
    a table past a sequence's context are never read. `splits` (default: enough programs to fill
    the GPU, at least MIN_SPLIT_KEYS keys each, from the table width, never from the lengths, so
    the launch needs no device sync) cuts the positions into ranges whose partial softmax sums a
    second launch merges (flash-decoding).
    """
    decodes, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if decodes == 0:
        return out
    window = NO_WINDOW if sliding_window is None else sliding_window
    most_keys = min(block_tables.shape[1] * block_size, window)
    splits, split_keys = _split_keys(most_keys, decodes * kv_heads, splits)
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
    partial_acc = q.new_empty(decodes, heads, splits, head_dim, dtype=torch.float32)
    partial_max = q.new_empty(decodes, heads, splits, dtype=torch.float32)
    partial_sum = torch.empty_like(partial_max)
    _decode_kernel[(decodes, kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, partial_acc, partial_max, partial_sum,
        scale * LOG2E, window, split_keys, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), head_dim,
        GROUP=heads // kv_heads, BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
        ONE_SPLIT=splits == 1, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(decodes, heads)](
            partial_acc, partial_max, partial_sum, out, splits, head_dim, out.stride(0), out.stride(1),
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim),
        )  # fmt: skip
    return out


def _split_keys(most_keys: int, programs: int, splits: int | None) -> tuple[int, int]:
    """(splits, keys per split): a multiple of BLOCK_N each, no split past the longest context."""
    tiles = triton.cdiv(max(most_keys, 1), BLOCK_N)
    if splits is None:
        splits = min(max(1, TARGET_PROGRAMS // programs), triton.cdiv(most_keys, MIN_SPLIT_KEYS))
    split_keys = triton.cdiv(tiles, max(1, min(splits, tiles))) * BLOCK_N
    return triton.cdiv(tiles * BLOCK_N, split_keys), split_keys


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, context_ptr, out_ptr, acc_ptr, max_ptr, sum_ptr,
    qk_scale, window, split_keys, q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    kv_stride_block, kv_stride_row, kv_stride_head, table_stride, head_dim,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ONE_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = tl.load(context_ptr + seq)
    start = tl.maximum(context - window, 0) + split * split_keys
    end = tl.minimum(start + split_keys, context)
    heads = kv_head * GROUP + tl.arange(0, BLOCK_H)
    head_ok = tl.arange(0, BLOCK_H) < GROUP  # the group padded to the rows tl.dot needs
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(
        q_ptr + seq * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=head_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [H, D]
    # A finite floor, not -inf: an empty split then merges with weight 0 and no inf - inf.
    row_max = tl.full((BLOCK_H,), -1e30, tl.float32)
    row_sum = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    table = tables_ptr + seq * table_stride
    for k0 in range(start, end, BLOCK_N):
        pos = k0 + tl.arange(0, BLOCK_N)
        ok = pos < end  # loads masked by position: nothing past the context is read
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        rows = block * kv_stride_block + (pos % BLOCK_SIZE) * kv_stride_row + kv_head * kv_stride_head
        k = tl.load(k_ptr + rows[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.where(ok[None, :], dot(q, k, DOT_FP32) * qk_scale, float("-inf"))  # [H, N]
        m_new = tl.maximum(row_max, tl.max(s, 1))
        alpha = tl.exp2(row_max - m_new)
        p = tl.exp2(s - m_new[:, None])  # [H, N]
        v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32)  # [H, D]
        row_sum = row_sum * alpha + tl.sum(p, 1)
        row_max = m_new
    if ONE_SPLIT:
        out = out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + d[None, :]
        tl.store(
            out, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :]
        )
    else:
        splits = tl.num_programs(2)
        at = (seq * GROUP * tl.num_programs(1) + heads) * splits + split  # [H] into [decodes, heads, splits]
        tl.store(max_ptr + at, row_max, mask=head_ok)
        tl.store(sum_ptr + at, row_sum, mask=head_ok)
        tl.store(acc_ptr + at[:, None] * head_dim + d[None, :], acc, mask=head_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_kernel(
    acc_ptr, max_ptr, sum_ptr, out_ptr, splits, head_dim, out_stride_t, out_stride_h,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    at = (seq * tl.num_programs(1) + head) * splits + s  # [S]
    split_max = tl.load(max_ptr + at, mask=s_ok, other=-1e30)
    weight = tl.exp2(split_max - tl.max(split_max, 0))  # [S]: 0 for splits that saw no key
    total = tl.sum(tl.load(sum_ptr + at, mask=s_ok, other=0.0) * weight, 0)
    acc = tl.load(
        acc_ptr + at[:, None] * head_dim + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )
    out = tl.sum(acc * weight[:, None], 0) / total  # [D]
    tl.store(
        out_ptr + seq * out_stride_t + head * out_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d_ok
    )


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Plain per-sequence loop in fp64: the definition paged_decode_attention is checked against.
    Returns fp64, unrounded."""
    q, k_cache, v_cache, block_tables = q.cpu(), k_cache.cpu(), v_cache.cpu(), block_tables.cpu().long()
    _, block_size, kv_heads, _ = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, context in enumerate(context_lens.tolist()):
        first = 0 if sliding_window is None else max(0, context - sliding_window)
        pos = torch.arange(first, context)  # [keys]
        blocks = block_tables[i, pos // block_size]  # [keys]
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)  # [keys, heads, hd]
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,khd->hk", q[i].double(), k) * scale  # [heads, keys]
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v)
    return out
