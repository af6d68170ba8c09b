"""lora_shrink: project every token onto the A pages of its own adapter, in paged adapter memory."""

from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from kernels.lora_batch import PAGE_RANK, TILE_ROWS, AdapterPages, SegmentTable
from kernels.triton_dot import dot, dot_in_fp32

BLOCK_K = 64
MIN_SPLIT_K = 256  # input features per program at least: fewer and the partials cost more than they save
TARGET_PROGRAMS = 512  # enough to keep every SM of a large GPU busy (132 on an H100) several times over


def lora_shrink_triton(
    x: torch.Tensor,
    pool: torch.Tensor,
    table: SegmentTable | None,
    first_target: int,
    slices: int,
    unit: int,
    splits: int | None = None,
) -> torch.Tensor:
    """Semantics: out[i, s, j] = A_t[j] @ x[i] for every token i whose adapter has a rank r > j
    on target t = first_target + s, A_t[j] being row j % PAGE_RANK of the A of the adapter's page
    j // PAGE_RANK of target t; every other out[i, s, j] of a token with an adapter is 0.

    x: [tokens, in]; pool: one layer's adapter memory [units*unit], a 1-D view at any offset.
    Returns fp32 partial sums [splits, tokens, slices, table.max_rank] whose sum over the first
    axis is `out` (lora_expand_triton adds them up as it reads them, so the split costs no extra
    launch and no atomics: the result does not depend on scheduling). Rows of base-model tokens
    are not written. One launch, a program per (tile of one segment's tokens, slice, split);
    `splits` (default: enough programs to fill the GPU, at least MIN_SPLIT_K features each) is
    how many ranges the input features are cut into. table None: nothing is launched.
    """
    tokens, in_features = x.shape
    programs = (table.num_tiles if table else 0) * slices
    splits, k_per_split = _split_k(in_features, programs, splits)
    max_rank = table.max_rank if table else 0
    partials = x.new_empty(splits, tokens, slices, max_rank, dtype=torch.float32)
    if table is None or max_rank == 0:
        return partials
    assert x.stride(1) == 1 and pool.dim() == 1 and pool.stride(0) == 1
    _shrink_kernel[(table.num_tiles, slices, splits)](
        x, pool, partials, table.tokens, table.starts, table.lengths, table.ranks, table.pages,
        table.tile_segments, table.tile_rows,
        table.ranks.stride(0), table.ranks.stride(1),
        table.pages.stride(0), table.pages.stride(1), table.pages.stride(2),
        first_target, unit, in_features, x.stride(0), max_rank, tokens, k_per_split,
        PAGE_RANK=PAGE_RANK, BLOCK_M=TILE_ROWS, BLOCK_R=max(16, triton.next_power_of_2(max_rank)),
        BLOCK_K=BLOCK_K, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return partials


def _split_k(in_features: int, programs: int, splits: int | None) -> tuple[int, int]:
    """(splits, features per split): a multiple of BLOCK_K each, no split left empty."""
    blocks = triton.cdiv(in_features, BLOCK_K)
    if splits is None:
        splits = min(max(1, TARGET_PROGRAMS // max(programs, 1)), triton.cdiv(in_features, MIN_SPLIT_K))
    k_per_split = triton.cdiv(blocks, max(1, min(splits, blocks))) * BLOCK_K
    return triton.cdiv(in_features, k_per_split), k_per_split


@triton.jit
def _shrink_kernel(
    x_ptr, pool_ptr, partials_ptr, tokens_ptr, starts_ptr, lengths_ptr, ranks_ptr, pages_ptr,
    tile_segments_ptr, tile_rows_ptr,
    ranks_stride_t, ranks_stride_seg, pages_stride_t, pages_stride_seg, pages_stride_page,
    first_target, unit, in_features, x_stride, max_rank, num_tokens, k_per_split,
    PAGE_RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile, s, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    segment = tl.load(tile_segments_ptr + tile)
    first_row, length = tl.load(tile_rows_ptr + tile), tl.load(lengths_ptr + segment)
    if first_row < length:  # a spare tile of a CUDA graph's static table does nothing
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        tokens = tl.load(tokens_ptr + tl.load(starts_ptr + segment) + rows, mask=row_ok, other=0)
        target = first_target + s
        rank = tl.load(ranks_ptr + target * ranks_stride_t + segment * ranks_stride_seg)
        r = tl.arange(0, BLOCK_R)
        # Lanes past the adapter's own rank are never read: a step costs what its ranks cost.
        r_ok = r < tl.minimum(rank, max_rank)
        page_ptrs = pages_ptr + target * pages_stride_t + segment * pages_stride_seg
        page = tl.load(page_ptrs + (r // PAGE_RANK) * pages_stride_page, mask=r_ok, other=0)  # [R]
        a_rows = pool_ptr + page.to(tl.int64) * unit + (r % PAGE_RANK) * in_features  # [R]
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_start = split * k_per_split
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < in_features
            x_ptrs = x_ptr + tokens[:, None] * x_stride + k[None, :]
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [M, K]
            a = tl.load(a_rows[None, :] + k[:, None], mask=r_ok[None, :] & k_ok[:, None], other=0.0)  # [K, R]
            acc += dot(x, a, DOT_FP32)  # [M, R]
        num_slices = tl.num_programs(1)
        out = partials_ptr + ((split * num_tokens + tokens[:, None]) * num_slices + s) * max_rank + r[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & (r[None, :] < max_rank))


def lora_shrink_ref(
    x: torch.Tensor,
    pool: torch.Tensor,
    unit: int,
    token_slots: list[int],
    adapters: Mapping[int, AdapterPages],
    first_target: int,
    slices: int,
) -> torch.Tensor:
    """Plain per-token loop in fp64: the definition the LoRA shrink paths are checked against. Returns
    [tokens, slices, rank] fp64, unrounded, rank the largest of `adapters` on these slices' targets."""
    in_features = x.shape[1]
    targets = range(first_target, first_target + slices)
    rank = max((p.ranks[t] for p in adapters.values() for t in targets), default=0)
    out = torch.zeros(x.shape[0], slices, rank, dtype=torch.float64)
    for i, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for s, t in enumerate(targets):
            for j in range(adapters[slot].ranks[t]):
                start = adapters[slot].pages[t][j // PAGE_RANK] * unit + (j % PAGE_RANK) * in_features
                out[i, s, j] = pool[start : start + in_features].double() @ x[i].double()
    return out
