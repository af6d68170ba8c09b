"""lora_expand: add every token's shrunk activations times its adapter's B into the output."""

import torch
import triton
import triton.language as tl

from kernels.lora_batch import TILE_ROWS, LoraBatch, PaddedLayout
from kernels.triton_dot import dot, dot_in_fp32


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, b: tuple[torch.Tensor, ...], batch: LoraBatch
) -> torch.Tensor:
    """Semantics: y[i, off_s:off_s+n_s] += buf[i, s, :r] @ B_s[slot_i, :r] for every token i
    with slot_i >= 0 and every output slice s, where r = batch.rank(slot_i) and slice s covers
    n_s = B_s.shape[2] columns right after slice s-1; rows with slot -1 are left as they are.
    Scaling is already merged into B.

    y: [tokens, out] (updated in place and returned); buf: [tokens, slices, rank];
    b: one [max_loras, rank, n_s] per slice (each slot's B transposed, so a decode step streams
    it row by row). The CPU paths (a GPU runs lora_expand_triton): with batch.padded, one batched
    matmul per slice over the slot-major padded rows (expand_padded), added back in one gather;
    otherwise one addmm per (slot, slice).
    """
    if batch.padded is not None:
        r = min(batch.padded.rank, buf.shape[2])
        return expand_padded(y, batch.padded.from_tokens(buf[:, :, :r]), b, batch.padded)
    if batch.order is not None:
        return _expand_scattered(y, buf, b, batch)
    for seg in batch.segments:
        rows, r = slice(seg.start, seg.end), batch.rank(seg.slot)
        for s, (offset, b_s) in enumerate(_with_offsets(b)):
            y[rows, offset : offset + b_s.shape[2]].addmm_(buf[rows, s, :r], b_s[seg.slot, :r])
    return y


def _with_offsets(b: tuple[torch.Tensor, ...]) -> list[tuple[int, torch.Tensor]]:
    offsets, start = [], 0
    for b_s in b:
        offsets.append((start, b_s))
        start += b_s.shape[2]
    return offsets


def expand_padded(
    y: torch.Tensor, padded: torch.Tensor, b: tuple[torch.Tensor, ...], layout: PaddedLayout
) -> torch.Tensor:
    """lora_expand from the padded layout: padded is [num_slots, r*slices, rows] (rank major), r
    the layout's largest rank (shrink_padded's output); B's ranks past r are never read."""
    rank = padded.shape[1] // len(b)
    by_slice = padded.view(layout.num_slots, rank, len(b), layout.rows)  # [n, r, slices, rows]
    padded_rows = layout.num_slots * layout.rows
    slots = slice(layout.first_slot, layout.first_slot + layout.num_slots)
    delta = y.new_empty(padded_rows + 1, y.shape[1])  # [padded_rows + 1, out]
    delta[padded_rows].zero_()  # the row slot -1 tokens read
    delta_slots = delta[:padded_rows].view(layout.num_slots, layout.rows, -1)  # [n, rows, out]
    for s, (offset, b_s) in enumerate(_with_offsets(b)):
        buf_s = by_slice[:, :, s].transpose(1, 2)  # [n, rows, r]
        if len(b) == 1:
            torch.bmm(buf_s, b_s[slots, :rank], out=delta_slots)
        else:  # bmm(out=) of a strided slice would fall back to one mm per slot
            delta_slots[:, :, offset : offset + b_s.shape[2]].copy_(torch.bmm(buf_s, b_s[slots, :rank]))
    return y.add_(delta.index_select(0, layout.scatter))


def _expand_scattered(y, buf, b, batch: LoraBatch) -> torch.Tensor:
    grouped_buf = buf[batch.order]  # [tokens, slices, rank]
    for seg in batch.segments:
        index, r = batch.order[seg.start : seg.end], batch.rank(seg.slot)  # [seg_tokens]
        for s, (offset, b_s) in enumerate(_with_offsets(b)):
            delta = grouped_buf[seg.start : seg.end, s, :r] @ b_s[seg.slot, :r]  # [seg_tokens, n_s]
            y[:, offset : offset + b_s.shape[2]].index_add_(0, index, delta)
    return y


MAX_SLICES = 3  # q/k/v; the kernel takes one B pointer per slice
BLOCK_N = 64


def lora_expand_triton(
    y: torch.Tensor, partials: torch.Tensor, b: tuple[torch.Tensor, ...], batch: LoraBatch
) -> torch.Tensor:
    """lora_expand as one Triton launch for every slice, from lora_shrink_triton's fp32 partial
    sums [splits, tokens, slices, rank]: each program adds them up for its tokens, rounds the sum
    to the serving dtype (PEFT's lora_A output is in it) and adds that times B to y in place.

    A program per (tile of one segment's tokens, column block of one slice): the column blocks
    of all slices are numbered in one axis, so the narrow k/v slices of a GQA qkv launch no idle
    programs. Each (token, column) has one owner, so the read-add-write of y needs no atomics.
    """
    table = batch.table
    if table is None:
        return y
    assert len(b) <= MAX_SLICES and y.stride(1) == 1 and partials.is_contiguous()
    assert all(b_s.is_contiguous() for b_s in b)
    splits, tokens, slices, rank = partials.shape
    sizes = [b_s.shape[2] for b_s in b] + [0] * (MAX_SLICES - len(b))
    offsets = [sum(sizes[:s]) for s in range(MAX_SLICES)]
    column_blocks = [triton.cdiv(n, BLOCK_N) for n in sizes]
    b_ptrs = [*b, *[b[0]] * (MAX_SLICES - len(b))]
    _expand_kernel[(table.num_tiles, sum(column_blocks))](
        y, partials, *b_ptrs, *offsets, *sizes, column_blocks[0], column_blocks[1],
        table.tokens, table.slots, table.starts, table.lengths, table.ranks,
        table.tile_segments, table.tile_rows,
        y.stride(0), slices, rank, tokens, splits,
        BLOCK_M=TILE_ROWS, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_N=BLOCK_N,
        DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return y


@triton.jit
def _expand_kernel(
    y_ptr, partials_ptr, b0_ptr, b1_ptr, b2_ptr, off0, off1, off2, n0, n1, n2, blocks0, blocks1,
    tokens_ptr, slots_ptr, starts_ptr, lengths_ptr, ranks_ptr, tile_segments_ptr, tile_rows_ptr,
    y_stride, num_slices, max_rank, num_tokens, splits,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile, column_block = tl.program_id(0), tl.program_id(1)
    s = (column_block >= blocks0).to(tl.int32) + (column_block >= blocks0 + blocks1).to(tl.int32)
    first_block = tl.where(s == 0, 0, tl.where(s == 1, blocks0, blocks0 + blocks1))
    size = tl.where(s == 0, n0, tl.where(s == 1, n1, n2))
    offset = tl.where(s == 0, off0, tl.where(s == 1, off1, off2))
    b_ptr = tl.where(s == 0, b0_ptr, tl.where(s == 1, b1_ptr, b2_ptr))
    segment = tl.load(tile_segments_ptr + tile)
    first_row, length = tl.load(tile_rows_ptr + tile), tl.load(lengths_ptr + segment)
    if first_row < length:  # a spare tile of a CUDA graph's static table does nothing
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        tokens = tl.load(tokens_ptr + tl.load(starts_ptr + segment) + rows, mask=row_ok, other=0)
        slot = tl.load(slots_ptr + segment)
        r = tl.arange(0, BLOCK_R)
        r_ok = r < tl.minimum(tl.load(ranks_ptr + segment), max_rank)  # padded ranks are never read
        n = (column_block - first_block) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < size
        buf_ptrs = partials_ptr + (tokens[:, None] * num_slices + s) * max_rank + r[None, :]
        buf = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(0, splits):  # in order: the same sum whatever ran first
            buf += tl.load(
                buf_ptrs + split * num_tokens * num_slices * max_rank, mask=row_ok[:, None] & r_ok[None, :]
            )
        b = tl.load(
            b_ptr + slot * (max_rank * size) + r[:, None] * size + n[None, :],
            mask=r_ok[:, None] & n_ok[None, :],
        )
        delta = dot(buf.to(b_ptr.dtype.element_ty), b, DOT_FP32)  # [M, N]
        y = y_ptr + tokens[:, None] * y_stride + offset + n[None, :]
        keep = row_ok[:, None] & n_ok[None, :]
        tl.store(y, (tl.load(y, mask=keep).to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=keep)


def lora_expand_ref(
    y: torch.Tensor,
    buf: torch.Tensor,
    b: tuple[torch.Tensor, ...],
    token_slots: torch.Tensor,
    slot_ranks: list[int] | None = None,
) -> torch.Tensor:
    """Plain per-token loop in fp64: the definition lora_expand is checked against."""
    out = y.double().clone()
    for i, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        offset, r = 0, slot_ranks[slot] if slot_ranks else buf.shape[2]
        for s, b_s in enumerate(b):
            size = b_s.shape[2]
            out[i, offset : offset + size] += buf[i, s, :r].double() @ b_s[slot, :r].double()
            offset += size
    return out.to(y.dtype)
