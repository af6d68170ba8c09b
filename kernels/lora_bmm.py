"""lora_bmm: one target's LoRA product for the tokens of adapters with the same page count on
the CPU, one batched matmul pair over chunks of their tokens."""

from collections.abc import Callable, Mapping

import torch

from kernels.lora_batch import PAGE_RANK, AdapterPages, PageChunks, page_rows, page_views


def lora_bmm(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    unit: int,
    work: PageChunks,
    gathered: int = 1,
    exchange: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Semantics: y[i] += B_t^T A_t x[i] for every token i of `work`'s chunks, where A_t [r, in]
    and B_t^T [r, out] are its adapter's pages' rows stacked in rank order (lora_ref).

    y: [tokens, out] (one slice's columns: a view is fine; updated in place and returned);
    x: [tokens, in], plus one zero row after them when work.gather is set (padding reads it);
    pool: one layer's [units*unit]. Each chunk is one matrix of a batched matmul pair whose inner
    dimension is its adapter's pages' ranks: the cost follows the ranks the step's adapters have,
    and no rank past an adapter's own pages is read.

    A fully sharded adapter's part on a tensor-parallel rank: `exchange` takes the shrink
    [chunks, rank, rows] to what the rank's B rows read: the ranks' shrinks gathered, page after
    page ([chunks, gathered * rank, rows], each page's B^T holding `gathered` blocks of rows), or
    summed.
    """
    in_features, out_features = x.shape[1], y.shape[1]
    chunks, rank, rows = work.chunks, work.pages * PAGE_RANK, work.rows
    a_rows, b_rows = page_rows(pool, unit, in_features, out_features, gathered)
    a = a_rows.index_select(0, work.units).view(chunks, rank, in_features)  # [chunks, rank, in]
    b = b_rows.index_select(0, work.units).view(
        chunks, gathered * rank, out_features
    )  # [chunks, g*rank, out]
    if work.gather is None:
        x_rows = x[work.first : work.first + chunks * rows].view(chunks, rows, in_features)
    else:
        x_rows = x.index_select(0, work.gather).view(chunks, rows, in_features)  # [chunks, rows, in]
    # A @ x^T streams each chunk's A row by row: faster than x @ A^T once A is out of cache
    shrunk = torch.bmm(a, x_rows.transpose(1, 2))  # [chunks, rank, rows]
    if exchange is not None:
        shrunk = exchange(shrunk)  # [chunks, gathered * rank, rows]
    delta = torch.bmm(shrunk.transpose(1, 2), b).view(-1, out_features)  # [chunks*rows, out]
    if work.scatter is None:
        y[work.first : work.first + chunks * rows] += delta
        return y
    return y.index_add_(0, work.scatter, delta)


def lora_ref(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    unit: int,
    token_slots: list[int],
    adapters: Mapping[int, AdapterPages],
    target: int,
) -> torch.Tensor:
    """Plain per-token loop in fp64: the definition lora_bmm is checked against. The adapter's
    lora_A output is rounded to x's dtype, as PEFT's is; y's new value is returned in fp64, unrounded."""
    out = y.double().clone()
    a, b = page_views(pool, unit, x.shape[1], y.shape[1])
    for i, slot in enumerate(token_slots):
        if slot < 0 or not adapters[slot].ranks[target]:
            continue
        pages = list(adapters[slot].pages[target])
        rank = adapters[slot].ranks[target]
        a_rows = a[pages].reshape(-1, x.shape[1])[:rank].double()  # [r, in]
        b_rows = b[pages].reshape(-1, y.shape[1])[:rank].double()  # [r, out]
        out[i] += (a_rows @ x[i].double()).to(x.dtype).double() @ b_rows
    return out
