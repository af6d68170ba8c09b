"""lora_shrink: project every token onto the A matrices of its own adapter slot."""

import torch
import triton
import triton.language as tl

from kernels.lora_batch import TILE_ROWS, LoraBatch, PaddedLayout
from kernels.triton_dot import dot, dot_in_fp32


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """Semantics: out[i, s, :r] = A[slot_i, :r, s] @ x[i] for every token i with slot_i >= 0,
    where r = batch.rank(slot_i); every other entry is 0.

    x: [tokens, in]; a: [max_loras, rank, slices, in]; returns [tokens, slices, rank]. The CPU
    paths (a GPU runs lora_shrink_triton): with batch.padded, one batched matmul over the
    slot-major padded rows (shrink_padded); otherwise one matmul per distinct slot over its
    contiguous run of tokens. Either way all slices of a slot go at once, and only its own
    ranks are read (a slot's first r ranks are one block of A: a view, no copy).
    """
    tokens = x.shape[0]
    _, rank, slices, in_features = a.shape
    if batch.padded is not None:
        trimmed = batch.padded.to_tokens(shrink_padded(x, a, batch.padded), slices)  # [tokens, slices, r]
        if trimmed.shape[2] == rank:
            return trimmed
        return torch.cat([trimmed, trimmed.new_zeros(tokens, slices, rank - trimmed.shape[2])], dim=2)
    grouped_x = x if batch.order is None else x[batch.order]  # [tokens, in]
    grouped_out = x.new_zeros(tokens, slices, rank)  # [tokens, slices, rank]
    for seg in batch.segments:
        r = min(batch.rank(seg.slot), rank)
        a_slot = a[seg.slot, :r].view(r * slices, in_features)  # [r*slices, in]
        out_seg = grouped_x[seg.start : seg.end] @ a_slot.t()  # [seg_tokens, r*slices]
        grouped_out[seg.start : seg.end, :, :r] = out_seg.view(-1, r, slices).transpose(1, 2)
    if batch.order is None:
        return grouped_out
    return torch.empty_like(grouped_out).index_copy_(0, batch.order, grouped_out)


def shrink_padded(x: torch.Tensor, a: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """lora_shrink in the padded layout: returns [num_slots, r*slices, rows] (rank major), r =
    the layout's largest rank (the slots' ranks past it are never read)."""
    _, rank, slices, in_features = a.shape
    r = min(layout.rank, rank)
    a_slots = a[layout.first_slot : layout.first_slot + layout.num_slots, :r]  # [n, r, slices, in]
    a_slots = a_slots.view(layout.num_slots, r * slices, in_features)  # [n, r*slices, in], a view
    x_padded = x.index_select(0, layout.gather).view(layout.num_slots, layout.rows, in_features)
    # A @ x^T streams each slot's A row by row: faster than x @ A^T once A is out of cache
    return torch.bmm(a_slots, x_padded.transpose(1, 2))  # [n, r*slices, rows]


BLOCK_K = 64
MIN_SPLIT_K = 256  # input features per program at least: fewer and the partials cost more than they save
TARGET_PROGRAMS = 512  # enough to keep every SM of a large GPU busy (132 on an H100) several times over


def lora_shrink_triton(
    x: torch.Tensor, a: torch.Tensor, batch: LoraBatch, splits: int | None = None
) -> torch.Tensor:
    """lora_shrink as one Triton launch, split over the input features (split-K).

    Returns fp32 partial sums [splits, tokens, slices, rank]: lora_shrink(x, a, batch) equals
    their sum over the first axis (lora_expand_triton adds them up as it reads them, so the
    split costs no extra launch and no atomics: the result does not depend on scheduling).
    Rows of slot -1 tokens are not written. A program per (tile of one segment's tokens,
    slice, split); `splits` (default: enough programs to fill the GPU, at least MIN_SPLIT_K
    features each) is how many ranges the input features are cut into.
    """
    _, rank, slices, in_features = a.shape
    table = batch.table
    splits, k_per_split = _split_k(in_features, (table.num_tiles if table else 0) * slices, splits)
    partials = x.new_empty(splits, x.shape[0], slices, rank, dtype=torch.float32)
    if table is None:
        return partials
    assert x.stride(1) == 1 and a.is_contiguous()
    _shrink_kernel[(table.num_tiles, slices, splits)](
        x, a, partials, table.tokens, table.slots, table.starts, table.lengths, table.ranks,
        table.tile_segments, table.tile_rows,
        in_features, x.stride(0), a.stride(0), a.stride(1), a.stride(2), rank, x.shape[0], k_per_split,
        BLOCK_M=TILE_ROWS, BLOCK_R=max(16, triton.next_power_of_2(rank)), BLOCK_K=BLOCK_K,
        DOT_FP32=dot_in_fp32(),
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
    x_ptr, a_ptr, partials_ptr, tokens_ptr, slots_ptr, starts_ptr, lengths_ptr, ranks_ptr,
    tile_segments_ptr, tile_rows_ptr,
    in_features, x_stride, a_stride_slot, a_stride_rank, a_stride_slice, max_rank, num_tokens, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
):  # fmt: skip
    tile, s, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    segment = tl.load(tile_segments_ptr + tile)
    first_row, length = tl.load(tile_rows_ptr + tile), tl.load(lengths_ptr + segment)
    if first_row < length:  # a spare tile of a CUDA graph's static table does nothing
        rows = first_row + tl.arange(0, BLOCK_M)
        row_ok = rows < length
        tokens = tl.load(tokens_ptr + tl.load(starts_ptr + segment) + rows, mask=row_ok, other=0)
        slot = tl.load(slots_ptr + segment)
        r = tl.arange(0, BLOCK_R)
        # Ranks past the adapter's own are never read: padding costs no memory traffic.
        r_ok = r < tl.minimum(tl.load(ranks_ptr + segment), max_rank)
        a_rows = a_ptr + slot * a_stride_slot + r * a_stride_rank + s * a_stride_slice
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        k_start = split * k_per_split
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < in_features
            x = tl.load(x_ptr + tokens[:, None] * x_stride + k[None, :], mask=row_ok[:, None] & k_ok[None, :])
            a = tl.load(a_rows[None, :] + k[:, None], mask=r_ok[None, :] & k_ok[:, None])  # [K, R]
            acc += dot(x, a, DOT_FP32)  # [M, R]
        num_slices = tl.num_programs(1)
        out = partials_ptr + ((split * num_tokens + tokens[:, None]) * num_slices + s) * max_rank + r[None, :]
        tl.store(out, acc, mask=row_ok[:, None] & (r[None, :] < max_rank))


def lora_shrink_ref(
    x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor, slot_ranks: list[int] | None = None
) -> torch.Tensor:
    """Plain per-token loop in fp64: the definition lora_shrink is checked against."""
    tokens = x.shape[0]
    _, rank, slices, _ = a.shape
    out = torch.zeros(tokens, slices, rank, dtype=torch.float64)
    for i, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        r = slot_ranks[slot] if slot_ranks else rank
        for s in range(slices):
            out[i, s, :r] = a[slot, :r, s].double() @ x[i].double()  # [r]
    return out.to(x.dtype)
