"""vocab_rows: each row of a step reads the row of its adapter's vocabulary-side part that its token
names (an embedding row, or a token's column of LoRA's A on the embedding)."""

import torch
import triton
import triton.language as tl

from kernels.lora_batch import TILE_ROWS
from kernels.vocab_segments import VocabSegments, part_matrix

BLOCK_C = 64


def vocab_rows_triton(
    out: torch.Tensor, ids: torch.Tensor, pool: torch.Tensor, table: VocabSegments
) -> torch.Tensor:
    """Semantics: out[i, :C_g] = M_g[ids[i]] for every row i of segment g, M_g [R_g, C_g] being
    the segment's part spread over the layers of `pool` (vocab_segments.py); out's other
    columns and other rows are left as they are.

    out: [rows, >= every C_g], updated in place and returned; ids: [rows] int64, each in
    [0, R_g) for its segment's rows; pool: adapter memory [layers, width]. A program per (tile of
    one segment's rows, block of columns)."""
    assert out.stride(1) == 1 and pool.stride(1) == 1
    grid = (table.num_tiles, triton.cdiv(table.max_cols, BLOCK_C))
    _rows_kernel[grid](
        out, ids, pool, table.rows, table.starts, table.lengths, table.base, table.cols,
        table.per_layer, table.tile_segments, table.tile_rows, out.stride(0), pool.stride(0),
        BLOCK_M=TILE_ROWS, BLOCK_C=BLOCK_C,
    )  # fmt: skip
    return out


@triton.jit
def _rows_kernel(
    out_ptr, ids_ptr, pool_ptr, rows_ptr, starts_ptr, lengths_ptr, base_ptr, cols_ptr, per_layer_ptr,
    tile_segments_ptr, tile_rows_ptr, out_stride, layer_stride, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    tile, column_block = tl.program_id(0), tl.program_id(1)
    segment = tl.load(tile_segments_ptr + tile)
    cols = tl.load(cols_ptr + segment)
    if column_block * BLOCK_C < cols:
        first_row, length = tl.load(tile_rows_ptr + tile), tl.load(lengths_ptr + segment)
        m = first_row + tl.arange(0, BLOCK_M)
        m_ok = m < length
        rows = tl.load(rows_ptr + tl.load(starts_ptr + segment) + m, mask=m_ok, other=0)
        k = tl.load(ids_ptr + rows, mask=m_ok, other=0)  # [M]: the part's row each reads
        per_layer = tl.load(per_layer_ptr + segment)
        start = (k // per_layer) * layer_stride + tl.load(base_ptr + segment) + (k % per_layer) * cols
        c = column_block * BLOCK_C + tl.arange(0, BLOCK_C)
        keep = m_ok[:, None] & (c < cols)[None, :]
        values = tl.load(pool_ptr + start[:, None] + c[None, :], mask=keep, other=0.0)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + c[None, :], values, mask=keep)


def vocab_rows_ref(
    out: torch.Tensor, ids: torch.Tensor, pool: torch.Tensor, table: VocabSegments
) -> torch.Tensor:
    """Plain per-row loop: the definition the path is checked against; returns out's new value."""
    out = out.clone()
    for rows, part in zip(table.segment_rows(), table.parts, strict=True):
        matrix = part_matrix(pool, part)
        for i in rows:
            out[i, : part.cols] = matrix[int(ids[i])]
    return out
