"""lora_expand: add every token's shrunk activations times its adapter's B pages into the output."""

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from kernels.lora_batch import PAGE_RANK, TILE_ROWS, AdapterPages, SegmentTable
from kernels.triton_dot import dot, dot_in_fp32

MAX_SLICES = 3  # q/k/v
BLOCK_N = 64


def lora_expand_triton(
    y: torch.Tensor,
    partials: torch.Tensor,
    pool: torch.Tensor,
    table: SegmentTable | None,
    first_target: int,
    slice_sizes: tuple[int, ...],
    in_features: int,
    unit: int,
    gathered: int = 1,
) -> torch.Tensor:
    """Semantics: y[i, off_s : off_s + n_s] += buf[i, s, :r] @ B_t[:r] for every token i whose
    adapter has rank r on target t = first_target + s, where buf is the sum of `partials` over
    its first axis rounded to the pool's dtype (PEFT's lora_A output is in it), B_t[j] is row
    j % PAGE_RANK of the B^T of the adapter's page j // PAGE_RANK of target t (scaling merged
    in), and slice s covers n_s = slice_sizes[s] columns right after slice s-1. Rows of
    base-model tokens are left as they are.

    y: [tokens, sum(slice_sizes)], updated in place and returned; partials: lora_shrink_triton's
    fp32 [splits, tokens, slices, table.max_rank]; pool: one layer's adapter memory [units*unit],
    whose pages of these targets have A rows of in_features. One launch for every slice, a
    program per (tile of one segment's tokens, column block of one slice): the column blocks of
    all slices are numbered in one axis, so the narrow k/v slices of a GQA qkv launch no idle
    programs. Each (token, column) has one owner, so the read-add-write of y needs no atomics,
    and the splits are added in order. table None: nothing is launched.

    A fully sharded column layer's part on a tensor-parallel rank (`gathered` ranks): partials
    [1, tokens, slices, gathered * table.max_rank] hold every rank's shrink, rank after rank, and
    lane k * max_rank + j reads row k * PAGE_RANK + j % PAGE_RANK of the B^T of page
    j // PAGE_RANK (which holds `gathered` blocks of PAGE_RANK rows).
    """
    if table is None or table.max_rank == 0:
        return y
    splits, tokens, slices, lanes = partials.shape
    assert slices == len(slice_sizes) <= MAX_SLICES and lanes == gathered * table.max_rank
    assert y.stride(1) == 1 and partials.is_contiguous() and pool.dim() == 1 and pool.stride(0) == 1
    sizes = [*slice_sizes, *[0] * (MAX_SLICES - slices)]
    offsets = [sum(sizes[:s]) for s in range(MAX_SLICES)]
    column_blocks = [triton.cdiv(n, BLOCK_N) for n in sizes]
    _expand_kernel[(table.num_tiles, sum(column_blocks))](
        y, partials, pool, *offsets, *sizes, column_blocks[0], column_blocks[1],
        table.tokens, table.starts, table.lengths, table.ranks, table.pages,
        table.tile_segments, table.tile_rows,
        table.ranks.stride(0), table.ranks.stride(1),
        table.pages.stride(0), table.pages.stride(1), table.pages.stride(2),
        first_target, unit, in_features, y.stride(0), slices, table.max_rank, tokens, splits,
        PAGE_RANK=PAGE_RANK, BLOCK_M=TILE_ROWS, BLOCK_R=max(16, triton.next_power_of_2(lanes)),
        BLOCK_N=BLOCK_N, GATHERED=gathered, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return y


@triton.jit
def _expand_kernel(
    y_ptr, partials_ptr, pool_ptr, off0, off1, off2, n0, n1, n2, blocks0, blocks1,
    tokens_ptr, starts_ptr, lengths_ptr, ranks_ptr, pages_ptr, tile_segments_ptr, tile_rows_ptr,
    ranks_stride_t, ranks_stride_seg, pages_stride_t, pages_stride_seg, pages_stride_page,
    first_target, unit, in_features, y_stride, num_slices, max_rank, num_tokens, splits,
    PAGE_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    GATHERED: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile, column_block = tl.program_id(0), tl.program_id(1)
    s = (column_block >= blocks0).to(tl.int32) + (column_block >= blocks0 + blocks1).to(tl.int32)
    first_block = tl.where(s == 0, 0, tl.where(s == 1, blocks0, blocks0 + blocks1))
    size = tl.where(s == 0, n0, tl.where(s == 1, n1, n2))
    offset = tl.where(s == 0, off0, tl.where(s == 1, off1, off2))
    segment = tl.load(tile_segments_ptr + tile)
    first_row, length = tl.load(tile_rows_ptr + tile), tl.load(lengths_ptr + segment)
    target = first_target + s
    rank = tl.load(ranks_ptr + target * ranks_stride_t + segment * ranks_stride_seg)
    # A spare tile of a CUDA graph's static table, or a target the adapter leaves, does nothing.
    if (first_row < length) & (rank > 0):
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        tokens = tl.load(tokens_ptr + tl.load(starts_ptr + segment) + rows, mask=row_ok, other=0)
        r = tl.arange(0, BLOCK_R)  # lane: (gathered rank, rank row of its part)
        held, j = r // max_rank, r % max_rank
        # lanes past the adapter's rank are never read
        r_ok = (j < tl.minimum(rank, max_rank)) & (held < GATHERED)
        page_ptrs = pages_ptr + target * pages_stride_t + segment * pages_stride_seg
        page = tl.load(page_ptrs + (j // PAGE_RANK) * pages_stride_page, mask=r_ok, other=0)  # [R]
        b_row = held * PAGE_RANK + j % PAGE_RANK
        b_rows = pool_ptr + page.to(tl.int64) * unit + PAGE_RANK * in_features + b_row * size  # [R]
        n = (column_block - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < size
        lanes = GATHERED * max_rank
        buf_ptrs = partials_ptr + (tokens[:, None] * num_slices + s) * lanes + r[None, :]
        buf = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(0, splits):  # in order: the same sum whatever ran first
            buf += tl.load(
                buf_ptrs + split * num_tokens * num_slices * lanes,
                mask=row_ok[:, None] & r_ok[None, :],
                other=0.0,
            )
        b = tl.load(b_rows[:, None] + n[None, :], mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [R, N]
        delta = dot(buf.to(pool_ptr.dtype.element_ty), b, DOT_FP32)  # [M, N]
        y = y_ptr + tokens[:, None] * y_stride + offset + n[None, :]
        keep = row_ok[:, None] & n_ok[None, :]
        y_old = tl.load(y, mask=keep, other=0.0).to(tl.float32)  # [M, N]
        tl.store(y, (y_old + delta).to(y_ptr.dtype.element_ty), mask=keep)


def lora_expand_ref(
    y: torch.Tensor,
    buf: torch.Tensor,
    pool: torch.Tensor,
    unit: int,
    token_slots: list[int],
    adapters: Mapping[int, AdapterPages],
    first_target: int,
    slice_sizes: tuple[int, ...],
    in_features: int,
    gathered: int = 1,
) -> torch.Tensor:
    """Plain per-token loop in fp64: the definition the LoRA expand paths are checked against.
    buf: [tokens, slices, gathered * lanes], lanes >= every adapter's rank on these targets (each
    of `gathered` ranks' shrinks, rank after rank, read by that rank's block of B^T rows in each
    page); returns y's new value in fp64, unrounded."""
    out = y.double().clone()
    lanes = buf.shape[2] // gathered
    for i, slot in enumerate(token_slots):
        if slot < 0:
            continue
        offset = 0
        for s, size in enumerate(slice_sizes):
            t = first_target + s
            for k in range(gathered):
                for j in range(adapters[slot].ranks[t]):
                    page = adapters[slot].pages[t][j // PAGE_RANK]
                    start = page * unit + PAGE_RANK * in_features + (k * PAGE_RANK + j % PAGE_RANK) * size
                    row = pool[start : start + size].double()
                    out[i, offset : offset + size] += buf[i, s, k * lanes + j].double() * row
            offset += size
    return out
