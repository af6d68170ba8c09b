"""lora_shrink: project every token onto the A matrices of its own adapter slot."""

import torch

from kernels.lora_batch import LoraBatch, PaddedLayout


def lora_shrink(x: torch.Tensor, a: torch.Tensor, batch: LoraBatch) -> torch.Tensor:
    """Semantics: out[i, s] = A[slot_i, s] @ x[i] for every token i with slot_i >= 0, else 0.

    x: [tokens, in]; a: [max_loras, slices, rank, in]; returns [tokens, slices, rank].
    CPU paths: with batch.padded, one batched matmul over the slot-major padded rows
    (shrink_padded); otherwise one matmul per distinct slot over its contiguous run of tokens.
    Either way all slices go at once (A of one slot viewed as [slices * rank, in]).
    """
    if batch.padded is not None:
        return batch.padded.to_tokens(shrink_padded(x, a, batch.padded), a.shape[1])
    tokens = x.shape[0]
    _, slices, rank, in_features = a.shape
    grouped_x = x if batch.order is None else x[batch.order]  # [tokens, in]
    grouped_out = x.new_zeros(tokens, slices * rank)  # [tokens, slices*rank]
    for seg in batch.segments:
        a_slot = a[seg.slot].view(slices * rank, in_features)  # [slices*rank, in]
        torch.mm(grouped_x[seg.start : seg.end], a_slot.t(), out=grouped_out[seg.start : seg.end])
    if batch.order is None:
        return grouped_out.view(tokens, slices, rank)
    out = torch.empty_like(grouped_out).index_copy_(0, batch.order, grouped_out)
    return out.view(tokens, slices, rank)


def shrink_padded(x: torch.Tensor, a: torch.Tensor, layout: PaddedLayout) -> torch.Tensor:
    """lora_shrink in the padded layout: returns [num_slots, slices*rank, rows]."""
    _, slices, rank, in_features = a.shape
    a_slots = a[layout.first_slot : layout.first_slot + layout.num_slots]  # [n, slices, rank, in]
    a_slots = a_slots.view(layout.num_slots, slices * rank, in_features)  # [n, slices*rank, in]
    x_padded = x.index_select(0, layout.gather).view(layout.num_slots, layout.rows, in_features)
    # A @ x^T streams each slot's A row by row: faster than x @ A^T once A is out of cache
    return torch.bmm(a_slots, x_padded.transpose(1, 2))  # [n, slices*rank, rows]


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """Plain per-token loop in fp32: the definition lora_shrink is checked against."""
    tokens = x.shape[0]
    _, slices, rank, _ = a.shape
    out = torch.zeros(tokens, slices, rank, dtype=torch.float32)
    for i, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for s in range(slices):
            out[i, s] = a[slot, s].float() @ x[i].float()  # [rank]
    return out.to(x.dtype)
