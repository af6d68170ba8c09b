"""BlockManager: the KV cache's blocks, handed to sequences as they grow, and the prefix cache.

A full block (block_size computed positions) is named by a hash chained over every token before
it and the content of the adapter that computed it (the base model's key apart), so two requests
share a block only when the same adapter weights saw the same tokens: a re-registered adapter
name has a new digest and never meets its old blocks. A block keeps its hash after its
sequences end, in a free queue ordered least recently used first; a later request whose prefix
hashes the same takes it back instead of computing it again, and a block is rewritten only when
it leaves the front of the queue for a new one.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

ROOT = bytes(32)  # the parent of a sequence's first block
BASE_MODEL = b"base"  # the adapter key of the base model; an adapter's is b"lora" + its digest


def adapter_key(digest: str | None) -> bytes:
    """The adapter part of a block's hash: the base model, or the adapter's content digest,
    each under its own tag (a digest is never empty, so no adapter key equals the base's)."""
    return BASE_MODEL if digest is None else b"lora" + digest.encode()


def block_hash(parent: bytes, adapter: bytes, tokens: Sequence[int]) -> bytes:
    """sha256 over the parent's 32-byte hash, the adapter key with its length before it, and
    the token ids as 8-byte integers: every field is fixed-size or length-prefixed, so two
    different (parent, adapter, tokens) never hash the same bytes."""
    h = hashlib.sha256(parent)
    h.update(len(adapter).to_bytes(4, "little") + adapter)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def chain(tokens: Sequence[int], block_size: int, adapter: bytes, start: list[bytes]) -> list[bytes]:
    """The hashes of every full block of `tokens`, extending `start` (the hashes of the first
    len(start) blocks, already known)."""
    hashes = list(start)
    for b in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else ROOT
        hashes.append(block_hash(parent, adapter, tokens[b * block_size : (b + 1) * block_size]))
    return hashes


class BlockManager:
    """Reference-counted blocks. `free` lists every block no sequence holds, cached ones among
    them; taking a new block evicts the least recently used one's hash. With prefix caching off,
    no block is ever named and nothing is shared."""

    def __init__(self, num_blocks: int, prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> the block holding it
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.num_cached_free = 0  # free blocks that still hold a hash

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included (a new block may evict one)."""
        return len(self._free)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest cached run of `hashes` from the first, held or free."""
        if not self.prefix_caching:
            return []
        blocks = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` no sequence holds (taking them leaves fewer free)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Hold cached blocks (a prefix hit)."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
                self.num_cached_free -= 1
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int]:
        """`count` new blocks, each held once, evicting the least recently used cached ones."""
        if count > len(self._free):
            raise MemoryError(f"KV cache has {len(self._free)} free blocks, {count} needed")
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block in blocks:
            if self._hash[block] is not None:
                self.num_cached_free -= 1
                self._forget(block)
            self._refs[block] = 1
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Let go of a sequence's blocks. They join the free queue's back last one first, so its
        first blocks (the prefix other requests share most) are kept longest; blocks without a
        hash are worth nothing and go to the front."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            self._free[block] = None
            if self._hash[block] is None:
                self._free.move_to_end(block, last=False)
            else:
                self.num_cached_free += 1

    def name(self, block: int, h: bytes) -> None:
        """`block` now holds the full block that hashes to `h`. If another block holds it
        already (two requests computed one prefix at once), that one stays the cached copy."""
        if self.prefix_caching and h not in self._cached:
            self._cached[h] = block
            self._hash[block] = h

    def forget(self, blocks: Sequence[int]) -> list[int]:
        """Drop the hashes of held `blocks` (a failed sequence's: NaN or Inf may fill them);
        returns those no other sequence holds, for the caller to wipe."""
        for block in blocks:
            self._forget(block)
        return [block for block in blocks if self._refs[block] <= 1]

    def _forget(self, block: int) -> None:
        h = self._hash[block]
        if h is not None:
            del self._cached[h]
            self._hash[block] = None
