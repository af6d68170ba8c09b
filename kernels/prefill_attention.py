"""prefill_attention: every prefill chunk of a step attends causally to its context in the paged KV
cache, all chunks in one varlen launch."""

import torch
import triton
import triton.language as tl

from kernels.paged_decode_attention import LOG2E, NO_WINDOW
from kernels.triton_dot import dot, dot_in_fp32

BLOCK_M = 64  # queries per tile: a program's rows
BLOCK_N = 64  # keys per tile


def prefill_tiles(query_lens: list[int], context_lens: list[int], device) -> torch.Tensor:
    """The work list of prefill_attention, [tiles, 2] int32: (chunk, first query row) of every
    tile of BLOCK_M queries of a chunk, so no program is launched with nothing to do; tiles that
    see the most keys come first, so the longest programs start first and short ones fill in."""
    tiles = [(i, row) for i, n in enumerate(query_lens) for row in range(0, n, BLOCK_M)]
    # by the position of the tile's first query: the later it sits, the more keys the tile sees
    tiles.sort(key=lambda t: context_lens[t[0]] - query_lens[t[0]] + t[1], reverse=True)
    return torch.tensor(tiles, dtype=torch.int32, device=device).view(-1, 2)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    tiles: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Semantics: out[t, h] = softmax(scale * K @ q[t, h]) @ V for row t = query_starts[i] + j of
    chunk i (j < query_lens[i]), the query at position p = context_lens[i] - query_lens[i] + j,
    where K, V hold kv head h // (heads / kv_heads) of chunk i's positions p' with
    p - w < p' <= p (w = sliding_window or unbounded), position p' being row p' % block_size of
    block block_tables[i, p' // block_size].

    q: [tokens, heads, head_dim]; the chunk's own K/V are already in the cache with its earlier
    positions (chunked prefill); k_cache, v_cache: [blocks, block_size, kv_heads, head_dim];
    block_tables: [chunks, max_blocks] int32; query_starts, query_lens, context_lens: [chunks]
    int32; tiles: prefill_tiles(query_lens, context_lens). Returns [tokens, heads, head_dim] in
    q's dtype; rows of q outside every chunk are left unwritten.

    A program per (tile, query head) walks BLOCK_N keys at a time through the block table, from
    its first query's window start to its last query's position (flash attention, fp32 online
    softmax); positions past a chunk's context are never read.
    """
    _, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if tiles.shape[0] == 0:
        return out
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
    _prefill_kernel[(tiles.shape[0], heads)](
        q, k_cache, v_cache, out, block_tables, query_starts, query_lens, context_lens, tiles,
        scale * LOG2E, NO_WINDOW if sliding_window is None else sliding_window,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), head_dim,
        GROUP=heads // kv_heads, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, lens_ptr, context_ptr, tiles_ptr,
    qk_scale, window, q_stride_t, q_stride_h, out_stride_t, out_stride_h,
    kv_stride_block, kv_stride_row, kv_stride_head, table_stride, head_dim,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile, head = tl.program_id(0), tl.program_id(1)
    chunk, first_row = tl.load(tiles_ptr + 2 * tile), tl.load(tiles_ptr + 2 * tile + 1)
    query_len, context = tl.load(lens_ptr + chunk), tl.load(context_ptr + chunk)
    rows = first_row + tl.arange(0, BLOCK_M)
    row_ok = rows < query_len
    # Rows past the chunk's end stand in for its last query, so every row sees a key.
    query_pos = context - query_len + tl.minimum(rows, query_len - 1)  # [M]
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    tokens = tl.load(starts_ptr + chunk) + rows
    q = tl.load(
        q_ptr + tokens[:, None] * q_stride_t + head * q_stride_h + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [M, D]
    row_max = tl.full((BLOCK_M,), -1e30, tl.float32)  # finite: a row's first tile may hide all its keys
    row_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    table = tables_ptr + chunk * table_stride
    kv_head = head // GROUP
    end = tl.max(query_pos, 0) + 1
    for k0 in range(tl.maximum(tl.min(query_pos, 0) - window + 1, 0), end, BLOCK_N):
        pos = k0 + tl.arange(0, BLOCK_N)
        ok = pos < end  # loads masked by position: nothing past the context is read
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        kv_rows = block * kv_stride_block + (pos % BLOCK_SIZE) * kv_stride_row + kv_head * kv_stride_head
        k = tl.load(k_ptr + kv_rows[None, :] + d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        visible = (pos[None, :] <= query_pos[:, None]) & (pos[None, :] > query_pos[:, None] - window)
        s = tl.where(visible, dot(q, k, DOT_FP32) * qk_scale, float("-inf"))  # [M, N]
        m_new = tl.maximum(row_max, tl.max(s, 1))
        alpha = tl.exp2(row_max - m_new)
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        v = tl.load(v_ptr + kv_rows[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32)  # [M, D]
        row_sum = row_sum * alpha + tl.sum(p, 1)
        row_max = m_new
    out = out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + d[None, :]
    tl.store(out, (acc / row_sum[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def prefill_attention_ref(
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
    """Plain per-chunk loop in fp64: the definition prefill_attention is checked against. Returns
    fp64, unrounded; rows of q outside every chunk are zero."""
    q, k_cache, v_cache, block_tables = q.cpu(), k_cache.cpu(), v_cache.cpu(), block_tables.cpu().long()
    _, block_size, kv_heads, _ = k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, (start, n, context) in enumerate(
        zip(query_starts.tolist(), query_lens.tolist(), context_lens.tolist(), strict=True)
    ):
        pos = torch.arange(context)  # [keys]
        blocks = block_tables[i, pos // block_size]  # [keys]
        k = k_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)  # [keys, heads, hd]
        v = v_cache[blocks, pos % block_size].double().repeat_interleave(group, 1)
        query_pos = torch.arange(context - n, context)[:, None]  # [queries, 1]
        visible = pos[None, :] <= query_pos  # [queries, keys]
        if sliding_window is not None:
            visible &= pos[None, :] > query_pos - sliding_window
        scores = torch.einsum("qhd,khd->hqk", q[start : start + n].double(), k) * scale
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # [heads, queries, keys]
        out[start : start + n] = torch.einsum("hqk,khd->qhd", probs, v)
    return out
