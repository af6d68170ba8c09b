"""lora_expand: add every token's shrunk activations times its adapter's B into the output."""

import torch

from kernels.lora_batch import LoraBatch, PaddedLayout


def lora_expand(
    y: torch.Tensor, buf: torch.Tensor, b: tuple[torch.Tensor, ...], batch: LoraBatch
) -> torch.Tensor:
    """Semantics: y[i, off_s:off_s+n_s] += buf[i, s] @ B_s[slot_i] for every token i with
    slot_i >= 0 and every output slice s, where slice s covers n_s = B_s.shape[2] columns right
    after slice s-1; rows with slot -1 are left as they are. Scaling is already merged into B.

    y: [tokens, out] (updated in place and returned); buf: [tokens, slices, rank];
    b: one [max_loras, rank, n_s] per slice (each slot's B transposed, so a decode step streams
    it row by row). CPU paths: with batch.padded, one batched matmul per slice over the
    slot-major padded rows (expand_padded), added back in one gather; otherwise one addmm per (slot, slice).
    """
    if batch.padded is not None:
        return expand_padded(y, batch.padded.from_tokens(buf), b, batch.padded)
    if batch.order is not None:
        return _expand_scattered(y, buf, b, batch)
    for seg in batch.segments:
        rows = slice(seg.start, seg.end)
        for s, (offset, b_s) in enumerate(_with_offsets(b)):
            y[rows, offset : offset + b_s.shape[2]].addmm_(buf[rows, s], b_s[seg.slot])
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
    """lora_expand from the padded layout: padded is [num_slots, slices*rank, rows]."""
    rank = b[0].shape[1]
    padded_rows = layout.num_slots * layout.rows
    slots = slice(layout.first_slot, layout.first_slot + layout.num_slots)
    delta = y.new_empty(padded_rows + 1, y.shape[1])  # [padded_rows + 1, out]
    delta[padded_rows].zero_()  # the row slot -1 tokens read
    delta_slots = delta[:padded_rows].view(layout.num_slots, layout.rows, -1)  # [n, rows, out]
    for s, (offset, b_s) in enumerate(_with_offsets(b)):
        buf_s = padded[:, s * rank : (s + 1) * rank].transpose(1, 2)  # [n, rows, rank]
        if len(b) == 1:
            torch.bmm(buf_s, b_s[slots], out=delta_slots)
        else:  # bmm(out=) of a strided slice would fall back to one mm per slot
            delta_slots[:, :, offset : offset + b_s.shape[2]].copy_(torch.bmm(buf_s, b_s[slots]))
    return y.add_(delta.index_select(0, layout.scatter))


def _expand_scattered(y, buf, b, batch: LoraBatch) -> torch.Tensor:
    grouped_buf = buf[batch.order]  # [tokens, slices, rank]
    for seg in batch.segments:
        index = batch.order[seg.start : seg.end]  # [seg_tokens]
        for s, (offset, b_s) in enumerate(_with_offsets(b)):
            delta = grouped_buf[seg.start : seg.end, s] @ b_s[seg.slot]  # [seg_tokens, n_s]
            y[:, offset : offset + b_s.shape[2]].index_add_(0, index, delta)
    return y


def lora_expand_ref(
    y: torch.Tensor, buf: torch.Tensor, b: tuple[torch.Tensor, ...], token_slots: torch.Tensor
) -> torch.Tensor:
    """Plain per-token loop in fp32: the definition lora_expand is checked against."""
    out = y.float().clone()
    for i, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        offset = 0
        for s, b_s in enumerate(b):
            size = b_s.shape[2]
            out[i, offset : offset + size] += buf[i, s].float() @ b_s[slot].float()
            offset += size
    return out.to(y.dtype)
