"""The paged KV cache: fixed-size blocks of token positions, handed to sequences as they grow."""

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


class BlockAllocator:
    """Free list of cache blocks, handed out and taken back whole."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"KV cache has {len(self._free)} free blocks, {count} needed")
        taken = self._free[len(self._free) - count :]
        del self._free[len(self._free) - count :]
        return taken[::-1]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))
