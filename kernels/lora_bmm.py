"""lora_bmm: one target's LoRA product for every token on the CPU, one batched matmul pair over
the adapters' pages."""

from collections.abc import Mapping

import torch

from kernels.lora_batch import AdapterPages, PageRows, page_views


def lora_bmm(
    y: torch.Tensor, x_padded: torch.Tensor, pool: torch.Tensor, unit: int, rows: PageRows
) -> torch.Tensor:
    """Semantics: y[i] += B_t^T A_t x[i] for every token i whose adapter targets t, where A_t
    [r, in] and B_t^T [r, out] are its pages' rows stacked in rank order (lora_ref).

    y: [tokens, out] (one slice's columns: a view is fine; updated in place and returned);
    x_padded: [tokens + 1, in], the tokens then one zero row (padding reads it); pool: one
    layer's [units*unit]. Every page is an independent rank-PAGE_RANK term, so each element of
    `rows` (one page, its chunk of tokens) is one matrix of a batched matmul, and index_add
    sums an adapter's pages into its tokens: the cost follows the ranks the step's adapters
    have, and no rank past an adapter's own pages is read.
    """
    in_features, out_features = x_padded.shape[1], y.shape[1]
    a, b = page_views(pool, unit, in_features, out_features)
    a_pages = a.index_select(0, rows.units)  # [elements, PAGE_RANK, in]
    b_pages = b.index_select(0, rows.units)  # [elements, PAGE_RANK, out]
    x_rows = x_padded.index_select(0, rows.gather).view(-1, rows.rows, in_features)  # [elements, rows, in]
    # A @ x^T streams each page's A row by row: faster than x @ A^T once A is out of cache
    shrunk = torch.bmm(a_pages, x_rows.transpose(1, 2))  # [elements, PAGE_RANK, rows]
    delta = torch.bmm(shrunk.transpose(1, 2), b_pages)  # [elements, rows, out]
    return y.index_add_(0, rows.scatter, delta.view(-1, out_features))


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
    lora_A output is rounded to the serving dtype, as PEFT's is."""
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
    return out.to(y.dtype)
