"""The paged KV cache tensors: fixed-size blocks of token positions; engine/block_manager.py hands
them to sequences as they grow."""

import torch


class KVCache:
    """k and v of every layer, [layers, blocks, block_size, kv_heads, head_dim] each.

    A sequence's positions live in the blocks of its block table, in order; position p is
    row p % block_size of block table[p // block_size].
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_layers, num_blocks, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def zero_blocks(self, blocks: list[int]) -> None:
        """Wipe blocks a failed sequence may have filled with NaN or Inf: attention reads stale
        positions of a sequence's blocks under a mask, and a masked NaN still poisons the output."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.k.device)
        self.k.index_fill_(1, index, 0)
        self.v.index_fill_(1, index, 0)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]
