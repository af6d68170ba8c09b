"""paged_decode_attention against its plain loop reference: small shapes in Triton's interpreter
on CPU (every run), Llama-3-8B shapes on a GPU (marker gpu)."""

import pytest
import torch
import triton

from kernels.paged_decode_attention import BLOCK_N, paged_decode_attention, paged_decode_attention_ref
from tests.kernels.paged_cache import paged_cache
from tests.kernels.rounding import assert_within, attention_bound

# Queries of std 4 peak the softmax as trained models' do: a near-uniform average over thousands of
# keys is so small that a wrong result could hide within the tolerance.
Q_STD = 4.0
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CONTEXTS = [1, 7, 33, 150]  # 150: three tiles of keys, so up to three splits


def _case(contexts, group, block_size, dtype, kv_heads=1, head_dim=16, device="cpu"):
    k_cache, v_cache, tables = paged_cache(contexts, block_size, kv_heads, head_dim, dtype, device)
    q = torch.randn(len(contexts), kv_heads * group, head_dim, device=device, dtype=dtype) * Q_STD
    return q, k_cache, v_cache, tables, torch.tensor(contexts, dtype=torch.int32, device=device)


def _check(got, q, k_cache, v_cache, tables, contexts, scale, window):
    """got against the reference within softmax_average_bound: a row sums at most its context's
    keys, in tiles of BLOCK_N from its window's start, and rescales its sums once per tile after
    the first and once to merge its splits."""
    exact = paged_decode_attention_ref(q, k_cache, v_cache, tables, contexts, scale, window)
    magnitude = paged_decode_attention_ref(q, k_cache, v_cache.abs(), tables, contexts, scale, window)
    keys = int(contexts.max()) if window is None else min(int(contexts.max()), window)
    rescales = triton.cdiv(keys, BLOCK_N)
    bound = attention_bound(
        magnitude, q, k_cache, v_cache, scale, keys=keys, rescales=rescales, device=got.device
    )
    assert_within(got, exact, bound)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(group, block_size, window, dtype):
    q, k_cache, v_cache, tables, contexts = _case(CONTEXTS, group, block_size, dtype)
    scale = q.shape[-1] ** -0.5
    for splits in (1, 3):
        out = paged_decode_attention(q, k_cache, v_cache, tables, contexts, scale, window, splits)
        assert out.shape == q.shape and out.dtype == dtype
        _check(out, q, k_cache, v_cache, tables, contexts, scale, window)


def test_several_kv_heads_and_a_head_dim_that_is_not_a_power_of_two():
    q, k_cache, v_cache, tables, contexts = _case([9, 70], 3, 4, torch.float32, kv_heads=2, head_dim=24)
    out = paged_decode_attention(q, k_cache, v_cache, tables, contexts, 0.2, None, 2)
    _check(out, q, k_cache, v_cache, tables, contexts, 0.2, None)


def test_no_decodes_launches_nothing():
    q, k_cache, v_cache, _, _ = _case([5], 1, 4, torch.float32)
    empty = torch.empty(0, 1, dtype=torch.int32)
    out = paged_decode_attention(q[:0], k_cache, v_cache, empty, empty[:, 0], 0.25, None)
    assert out.shape == (0, *q.shape[1:])


# Llama-3-8B: 32 query heads on 8 kv heads of 128, blocks of 16 positions, bf16.
@pytest.mark.gpu
@pytest.mark.parametrize(
    "contexts", [[8192], [1000, 2048, 4097, 8000] * 2, [1024 + 7 * i for i in range(64)]]
)
@pytest.mark.parametrize("window", [None, 4096])
def test_decode_full_size_on_gpu(contexts, window):
    q, k_cache, v_cache, tables, lens = _case(contexts, 4, 16, torch.bfloat16, 8, 128, "cuda")
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, 128**-0.5, window)
    _check(out, q, k_cache, v_cache, tables, lens, 128**-0.5, window)
