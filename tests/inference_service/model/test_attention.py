"""attend on the Triton kernels' path (in Triton's interpreter on CPU) and on the SDPA path, for
one mixed step (whole prompts, prefill chunks after cached positions and decodes, with GQA): both
write the cache alike and both agree with the SDPA path run in float64, within the rounding bound
of attention in their dtype (tests/kernels/rounding.py)."""

import random

import pytest
import torch

from inference_service.model.attention import (
    PIECE_ROWS,
    AttentionMetadata,
    KernelPath,
    SdpaPath,
    SequenceChunk,
    attend,
)
from inference_service.model.kv_cache import KVCache
from tests.kernels.rounding import assert_within, attention_bound

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 16, 4
SCALE = HEAD_DIM**-0.5
# (cached, new tokens) per sequence, in batch order
STEP = [(0, 9), (5, 1), (12, 7), (0, 1), (30, 1), (3, 2), (0, 17)]


def _chunks() -> tuple[list[SequenceChunk], int]:
    """The step's chunks, each table scattered over the cache with a spare block past its context."""
    sizes = [-(-(cached + new) // BLOCK_SIZE) + 1 for cached, new in STEP]
    blocks = list(range(sum(sizes)))
    random.Random(0).shuffle(blocks)
    chunks, start = [], 0
    for (cached, new), size in zip(STEP, sizes, strict=True):
        chunks.append(SequenceChunk(blocks[:size], cached, new, start))
        blocks, start = blocks[size:], start + new
    return chunks, sum(sizes)


def test_the_device_chooses_the_path():
    chunks, _ = _chunks()
    assert isinstance(AttentionMetadata.build(chunks, BLOCK_SIZE, None, "cpu").path, SdpaPath)
    assert isinstance(AttentionMetadata.build(chunks, BLOCK_SIZE, None, "cpu", kernels=True).path, KernelPath)


def _inputs(num_blocks: int, dtype: torch.dtype, device="cpu"):
    """q, k, v of the step's new tokens, and random stale values for every cache row."""
    torch.manual_seed(0)
    tokens = sum(new for _, new in STEP)
    q = torch.randn(tokens, HEADS, HEAD_DIM, dtype=dtype, device=device)
    k, v = (torch.randn(tokens, KV_HEADS, HEAD_DIM, dtype=dtype, device=device) for _ in range(2))
    stale = torch.randn(2, 1, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    return q, k, v, stale


def _cache(stale: torch.Tensor) -> KVCache:
    cache = KVCache(1, stale.shape[2], BLOCK_SIZE, KV_HEADS, HEAD_DIM, stale.dtype, stale.device)
    cache.k.copy_(stale[0])
    cache.v.copy_(stale[1])
    return cache


def _sdpa_in_float64(q, k, v, stale, chunks, window) -> tuple[torch.Tensor, KVCache]:
    meta = AttentionMetadata.build(chunks, BLOCK_SIZE, window, "cpu")
    cache = _cache(stale.double())
    return attend(q.double(), k.double(), v.double(), cache, 0, meta, SCALE), cache


def _bound(q, k, v, stale, chunks, window) -> torch.Tensor:
    """How far attention in q's dtype may land from its float64 value, in any tiling of the keys
    (a row rescaled once per key at most)."""
    magnitude, _ = _sdpa_in_float64(q, k, v.abs(), torch.stack([stale[0], stale[1].abs()]), chunks, window)
    _, cache = _sdpa_in_float64(q, k, v, stale, chunks, window)  # the cache the step's rows see
    keys = max(cached + new for cached, new in STEP)
    return attention_bound(
        magnitude, q, cache.k[0], cache.v[0], SCALE, keys=keys, rescales=keys, device=q.device
    )


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_kernel_path_matches_sdpa_path(window, dtype):
    chunks, num_blocks = _chunks()
    q, k, v, stale = _inputs(num_blocks, dtype)
    exact, _ = _sdpa_in_float64(q, k, v, stale, chunks, window)
    bound = _bound(q, k, v, stale, chunks, window)
    caches = []
    for kernels in (False, True):
        cache = _cache(stale)
        meta = AttentionMetadata.build(chunks, BLOCK_SIZE, window, "cpu", kernels=kernels)
        assert_within(attend(q, k, v, cache, 0, meta, SCALE), exact, bound)
        caches.append(cache)
    for c in chunks:
        for row, p in enumerate(range(c.cached, c.cached + c.num_tokens), start=c.token_start):
            block, offset = c.block_table[p // BLOCK_SIZE], p % BLOCK_SIZE
            assert torch.equal(caches[1].k[0, block, offset], k[row])
            assert torch.equal(caches[1].v[0, block, offset], v[row])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


def _dense_attention(q, keys, values, positions, window) -> torch.Tensor:
    """q [new, heads, hd] at `positions` over a whole sequence's keys and values [context,
    kv_heads, hd]: each query's softmax over the keys it sees, one head at a time, in float64."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, position in enumerate(positions):
        first = 0 if window is None else max(0, position - window + 1)
        for head in range(q.shape[1]):
            k = keys[first : position + 1, head // group].double()  # [seen, hd]
            v = values[first : position + 1, head // group].double()
            weights = torch.softmax(k @ q[row, head].double() * SCALE, dim=0)  # [seen]
            out[row, head] = weights @ v
    return out


@pytest.mark.parametrize("window", [None, PIECE_ROWS // 2 + 3, 3 * PIECE_ROWS])
@pytest.mark.parametrize("cached", [0, PIECE_ROWS + 5])
def test_a_long_chunk_attends_in_pieces_as_one_causal_softmax(cached, window):
    """A chunk of 2.5 pieces after `cached` positions: every query sees exactly its own causal
    (windowed) keys, across the pieces' edges."""
    torch.manual_seed(0)
    new = PIECE_ROWS * 5 // 2
    context = cached + new
    blocks = list(range(-(-context // BLOCK_SIZE)))
    random.Random(1).shuffle(blocks)
    keys, values = (torch.randn(context, KV_HEADS, HEAD_DIM, dtype=torch.float64) for _ in range(2))
    q = torch.randn(new, HEADS, HEAD_DIM, dtype=torch.float64)
    cache = KVCache(1, len(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float64, "cpu")
    for position in range(cached):  # the cached positions, as earlier steps wrote them
        cache.k[0, blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = keys[position]
        cache.v[0, blocks[position // BLOCK_SIZE], position % BLOCK_SIZE] = values[position]
    meta = AttentionMetadata.build([SequenceChunk(blocks, cached, new, 0)], BLOCK_SIZE, window, "cpu")
    assert len(meta.path.prefills[0].pieces) == 3
    out = attend(q, keys[cached:], values[cached:], cache, 0, meta, SCALE)
    expected = _dense_attention(q, keys, values, range(cached, context), window)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_kernel_path_replays_in_a_cuda_graph():
    chunks, num_blocks = _chunks()
    q, k, v, stale = _inputs(num_blocks, torch.bfloat16, "cuda")
    meta = AttentionMetadata.build(chunks, BLOCK_SIZE, 6, "cuda")
    assert isinstance(meta.path, KernelPath)
    cache = _cache(stale)
    expected = attend(q, k, v, cache, 0, meta, SCALE)  # compiles the kernels before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q, k, v, cache, 0, meta, SCALE)
    cache.k.copy_(stale[0])
    cache.v.copy_(stale[1])
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
