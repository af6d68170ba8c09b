"""A paged KV cache for the attention kernel tests: each sequence's blocks scattered over the
cache, and NaN in every row that holds none of its positions, so a kernel that reads past a
context, or through a table's padding, returns NaN."""

import torch

PADDING_BLOCK = 0  # all NaN; every table is padded with it, one entry at least


def paged_cache(
    contexts: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, block_tables): caches [blocks, block_size, kv_heads, head_dim] holding
    random K/V at positions 0..contexts[i]-1 of sequence i; block_tables [seqs, max_blocks] int32."""
    torch.manual_seed(len(contexts) + block_size)
    needed = [-(-c // block_size) for c in contexts]
    blocks = (torch.randperm(sum(needed)) + 1).tolist()  # block 0 stays NaN
    tables, width = [], max(needed) + 1
    for n in needed:
        tables.append(blocks[:n] + [PADDING_BLOCK] * (width - n))
        blocks = blocks[n:]
    shape = (sum(needed) + 1, block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    for table, context in zip(tables, contexts, strict=True):
        pos = torch.arange(context, device=device)  # [context]
        rows = torch.tensor(table, device=device)[pos // block_size], pos % block_size
        k_cache[rows] = torch.randn(context, kv_heads, head_dim, device=device, dtype=dtype)
        v_cache[rows] = torch.randn(context, kv_heads, head_dim, device=device, dtype=dtype)
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=device)
