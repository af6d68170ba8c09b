"""prefill_attention against its plain loop reference: small shapes in Triton's interpreter on
CPU (every run), Llama-3-8B shapes on a GPU (marker gpu)."""

import pytest
import torch
import triton

from kernels.prefill_attention import (
    BLOCK_M,
    BLOCK_N,
    prefill_attention,
    prefill_attention_ref,
    prefill_tiles,
)
from tests.kernels.paged_cache import paged_cache
from tests.kernels.rounding import assert_within, attention_bound

# Queries of std 4 peak the softmax as trained models' do: a near-uniform average over thousands of
# keys is so small that a wrong result could hide within the tolerance.
Q_STD = 4.0
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (new tokens, context) per chunk: a whole prompt, chunks after cached positions, one token,
# and a chunk of two query tiles
CHUNKS = [(5, 5), (7, 20), (1, 13), (BLOCK_M + 6, BLOCK_M + 26), (3, 40)]


def _case(chunks, group, block_size, dtype, kv_heads=1, head_dim=16, device="cpu"):
    query_lens, contexts = [n for n, _ in chunks], [c for _, c in chunks]
    k_cache, v_cache, tables = paged_cache(contexts, block_size, kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(query_lens), kv_heads * group, head_dim, device=device, dtype=dtype) * Q_STD
    starts = [sum(query_lens[:i]) for i in range(len(chunks))]
    lens = [torch.tensor(x, dtype=torch.int32, device=device) for x in (starts, query_lens, contexts)]
    return q, k_cache, v_cache, tables, lens, prefill_tiles(query_lens, contexts, device)


def _check(got, q, k_cache, v_cache, tables, lens, scale, window):
    """got against the reference within softmax_average_bound: a row sums at most its chunk's
    context, and its tile walks at most that many keys, in tiles of BLOCK_N, rescaling its sums
    once per tile after the first."""
    exact = prefill_attention_ref(q, k_cache, v_cache, tables, *lens, scale, window)
    magnitude = prefill_attention_ref(q, k_cache, v_cache.abs(), tables, *lens, scale, window)
    keys = int(lens[2].max())
    rescales = triton.cdiv(keys, BLOCK_N)
    bound = attention_bound(
        magnitude, q, k_cache, v_cache, scale, keys=keys, rescales=rescales, device=got.device
    )
    assert_within(got, exact, bound)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(group, block_size, window, dtype):
    q, k_cache, v_cache, tables, lens, tiles = _case(CHUNKS, group, block_size, dtype)
    scale = q.shape[-1] ** -0.5
    out = prefill_attention(q, k_cache, v_cache, tables, *lens, tiles, scale, window)
    assert out.shape == q.shape and out.dtype == dtype
    _check(out, q, k_cache, v_cache, tables, lens, scale, window)


def test_tiles_cover_every_query_once_heaviest_first():
    tiles = prefill_tiles([3, 2 * BLOCK_M + 1, 1], [40, 2 * BLOCK_M + 1, 1], "cpu").tolist()
    assert sorted(tiles) == [[0, 0], [1, 0], [1, BLOCK_M], [1, 2 * BLOCK_M], [2, 0]]
    assert tiles[:2] == [[1, 2 * BLOCK_M], [1, BLOCK_M]]


def test_several_kv_heads_and_a_head_dim_that_is_not_a_power_of_two():
    q, k_cache, v_cache, tables, lens, tiles = _case(
        [(9, 30), (4, 4)], 3, 4, torch.float32, kv_heads=2, head_dim=24
    )
    out = prefill_attention(q, k_cache, v_cache, tables, *lens, tiles, 0.2, None)
    _check(out, q, k_cache, v_cache, tables, lens, 0.2, None)


# Llama-3-8B: 32 query heads on 8 kv heads of 128, blocks of 16 positions, bf16.
@pytest.mark.gpu
@pytest.mark.parametrize("chunks", [[(1024, 1024)], [(256, 8192), (512, 1000), (7, 4097), (1500, 1500)]])
@pytest.mark.parametrize("window", [None, 4096])
def test_prefill_full_size_on_gpu(chunks, window):
    q, k_cache, v_cache, tables, lens, tiles = _case(chunks, 4, 16, torch.bfloat16, 8, 128, "cuda")
    out = prefill_attention(q, k_cache, v_cache, tables, *lens, tiles, 128**-0.5, window)
    _check(out, q, k_cache, v_cache, tables, lens, 128**-0.5, window)
