"""lora_expand: add every token's shrunk activations times its adapter's B into the output."""

import torch

from kernels.lora_batch import LoraBatch


def lora_expand(
    y: torch.Tensor,
    buf: torch.Tensor,
    b: torch.Tensor,
    slices: tuple[tuple[int, int], ...],
    batch: LoraBatch,
) -> torch.Tensor:
    """Semantics: y[i, off_s:off_s+n_s] += B[slot_i, off_s:off_s+n_s] @ buf[i, s] for every
    token i with slot_i >= 0 and every output slice s = (off_s, n_s); rows with slot -1 are
    left as they are. Scaling is already merged into B.

    y: [tokens, out] (updated in place and returned); buf: [tokens, slices, rank];
    b: [max_loras, out, rank]. CPU path: one addmm per (distinct slot, slice).
    """
    if batch.order is not None:
        return _expand_scattered(y, buf, b, slices, batch)
    for seg in batch.segments:
        rows = slice(seg.start, seg.end)
        for s, (offset, size) in enumerate(slices):
            b_slice = b[seg.slot, offset : offset + size]  # [size, rank]
            y[rows, offset : offset + size].addmm_(buf[rows, s], b_slice.t())
    return y


def _expand_scattered(y, buf, b, slices, batch: LoraBatch) -> torch.Tensor:
    grouped_buf = buf[batch.order]  # [tokens, slices, rank]
    for seg in batch.segments:
        index = batch.order[seg.start : seg.end]  # [seg_tokens]
        for s, (offset, size) in enumerate(slices):
            delta = grouped_buf[seg.start : seg.end, s] @ b[seg.slot, offset : offset + size].t()
            y[:, offset : offset + size].index_add_(0, index, delta)  # delta: [seg_tokens, size]
    return y


def lora_expand_ref(
    y: torch.Tensor,
    buf: torch.Tensor,
    b: torch.Tensor,
    slices: tuple[tuple[int, int], ...],
    token_slots: torch.Tensor,
) -> torch.Tensor:
    """Plain per-token loop in fp32: the definition lora_expand is checked against."""
    out = y.float().clone()
    for i, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s, (offset, size) in enumerate(slices):
            out[i, offset : offset + size] += b[slot, offset : offset + size].float() @ buf[i, s].float()
    return out.to(y.dtype)
