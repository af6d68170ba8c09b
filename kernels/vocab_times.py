"""vocab_times: each row of a step times its adapter's vocabulary-side part, transposed: the head's
logits of an adapter's own head, LoRA's shrink and its expand over the whole vocabulary on the
head, and LoRA's expand on the embedding."""

import torch
import triton
import triton.language as tl

from kernels.lora_batch import TILE_ROWS
from kernels.triton_dot import dot, dot_in_fp32
from kernels.vocab_segments import VocabSegments, part_matrix

BLOCK_N, BLOCK_K = 64, 32


def vocab_times_triton(
    y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, table: VocabSegments, accumulate: bool
) -> torch.Tensor:
    """Semantics: y[i, :R_g] = (y[i, :R_g] if accumulate else 0) + x[i, :C_g] @ M_g^T for every
    row i of segment g, M_g [R_g, C_g] being the segment's part spread over the layers of `pool`
    (vocab_segments.py); y's other columns and other rows are left as they are. The products are
    summed in fp32 and rounded to y's dtype once.

    y: [rows, >= every R_g], updated in place and returned; x: [rows, >= every C_g] in the pool's
    dtype; pool: adapter memory [layers, width]. A program per (tile of one segment's rows, block
    of M's rows), which walks the segment's columns; programs past a segment's R_g do nothing."""
    assert y.stride(1) == 1 and x.stride(1) == 1 and pool.stride(1) == 1
    grid = (table.num_tiles, triton.cdiv(table.max_part_rows, BLOCK_N))
    _times_kernel[grid](
        y, x, pool, table.rows, table.starts, table.lengths, table.base, table.part_rows, table.cols,
        table.per_layer, table.tile_segments, table.tile_rows, y.stride(0), x.stride(0), pool.stride(0),
        ACCUMULATE=accumulate, BLOCK_M=TILE_ROWS, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return y


@triton.jit
def _times_kernel(
    y_ptr, x_ptr, pool_ptr, rows_ptr, starts_ptr, lengths_ptr, base_ptr, part_rows_ptr, cols_ptr,
    per_layer_ptr, tile_segments_ptr, tile_rows_ptr, y_stride, x_stride, layer_stride,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile, n_block = tl.program_id(0), tl.program_id(1)
    segment = tl.load(tile_segments_ptr + tile)
    part_rows = tl.load(part_rows_ptr + segment)
    if n_block * BLOCK_N < part_rows:
        first_row, length = tl.load(tile_rows_ptr + tile), tl.load(lengths_ptr + segment)
        m = first_row + tl.arange(0, BLOCK_M)
        m_ok = m < length
        rows = tl.load(rows_ptr + tl.load(starts_ptr + segment) + m, mask=m_ok, other=0).to(tl.int64)
        cols, per_layer = tl.load(cols_ptr + segment), tl.load(per_layer_ptr + segment)
        n = n_block * BLOCK_N + tl.arange(0, BLOCK_N)  # rows of M: columns of y
        n_ok = n < part_rows
        m_rows = (
            (n // per_layer).to(tl.int64) * layer_stride
            + tl.load(base_ptr + segment)
            + (n % per_layer) * cols
        )
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, cols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < cols
            xs = tl.load(
                x_ptr + rows[:, None] * x_stride + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
            )
            ms = tl.load(
                pool_ptr + m_rows[None, :] + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0
            )
            acc += dot(xs, ms, DOT_FP32)  # [M, N]
        ys = y_ptr + rows[:, None] * y_stride + n[None, :]
        keep = m_ok[:, None] & n_ok[None, :]
        if ACCUMULATE:
            acc += tl.load(ys, mask=keep, other=0.0).to(tl.float32)
        tl.store(ys, acc.to(y_ptr.dtype.element_ty), mask=keep)


def vocab_times_ref(
    y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, table: VocabSegments, accumulate: bool
) -> torch.Tensor:
    """Plain per-row loop in fp64: the definition the paths are checked against; returns y's new
    value in fp64, unrounded."""
    out = y.double().clone()
    for rows, part in zip(table.segment_rows(), table.parts, strict=True):
        matrix = part_matrix(pool, part).double()  # [R, C]
        for i in rows:
            start = out[i, : part.rows] if accumulate else torch.zeros(part.rows, dtype=torch.float64)
            out[i, : part.rows] = start + matrix @ x[i, : part.cols].double()
    return out
