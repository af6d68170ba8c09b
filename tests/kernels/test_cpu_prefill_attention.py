"""The CPU prefill attention kernel against prefill_attention's plain loop reference, on the cases
the Triton kernel is checked on (tests/kernels/test_prefill_attention.py): chunks after cached
positions, one-token chunks, chunks of several query tiles, windows, GQA groups, several KV heads
and head sizes that are no multiple of the vector's sixteen lanes. The cache's unwritten rows are
NaN, so a read past a context shows."""

import pytest
import torch

from kernels.cpu_prefill_attention import CpuPrefillAttention
from kernels.prefill_attention import prefill_attention_ref
from tests.kernels.rounding import assert_within, attention_bound
from tests.kernels.targets import declined
from tests.kernels.test_prefill_attention import CHUNKS, DTYPES, _case

KEYS = 64  # keys per online softmax step: kKeys in the source
LONG = [(40, 40), (100, 300), (3, 90)]  # tasks of 16 rows, keys in several steps


@pytest.fixture(scope="module")
def kernel(target) -> CpuPrefillAttention:
    # the workers' folder: one build (of each target) serves tests and engines
    kernel, why = CpuPrefillAttention.load(target=target)
    if "prefill_attention" in declined(target):  # as tests/kernels/test_cpu_targets.py asserts
        pytest.skip(why)
    assert kernel is not None, why
    return kernel


def _check(got, q, k_cache, v_cache, tables, lens, scale, window):
    """Within softmax_average_bound: a row sums at most its chunk's context, in steps of KEYS keys,
    rescaling its sums once per step after the first."""
    exact = prefill_attention_ref(q, k_cache, v_cache, tables, *lens, scale, window)
    magnitude = prefill_attention_ref(q, k_cache, v_cache.abs(), tables, *lens, scale, window)
    keys = int(lens[2].max())
    bound = attention_bound(
        magnitude, q, k_cache, v_cache, scale, keys=keys, rescales=-(-keys // KEYS), device=got.device
    )
    rows = torch.zeros(q.shape[0], dtype=torch.bool)
    for start, n in zip(lens[0].tolist(), lens[1].tolist(), strict=True):
        rows[start : start + n] = True
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_within(got[rows], exact[rows], bound if bound.dim() == 0 else bound[rows])


@pytest.mark.parametrize("chunks", [CHUNKS, LONG], ids=["short", "long"])
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_matches_reference(kernel, chunks, group, block_size, window, dtype):
    q, k_cache, v_cache, tables, lens, _ = _case(chunks, group, block_size, dtype)
    scale = q.shape[-1] ** -0.5
    got = kernel(q, k_cache, v_cache, tables, *lens, scale, window)
    _check(got, q, k_cache, v_cache, tables, lens, scale, window)


@pytest.mark.parametrize("head_dim", [24, 64, 80])
def test_several_kv_heads_and_head_dims(kernel, head_dim):
    q, k_cache, v_cache, tables, lens, _ = _case(LONG, 3, 16, torch.float32, kv_heads=2, head_dim=head_dim)
    got = kernel(q, k_cache, v_cache, tables, *lens, 0.2, None)
    _check(got, q, k_cache, v_cache, tables, lens, 0.2, None)


def test_queries_are_read_where_the_qkv_projection_left_them(kernel):
    q, k_cache, v_cache, tables, lens, _ = _case(LONG, 3, 16, torch.bfloat16, kv_heads=2, head_dim=24)
    tokens, heads, head_dim = q.shape
    rows = torch.full((tokens, (heads + 4) * head_dim), float("nan"), dtype=q.dtype)
    rows[:, : heads * head_dim] = q.flatten(1)
    view = rows[:, : heads * head_dim].view(tokens, heads, head_dim)
    got = kernel(view, k_cache, v_cache, tables, *lens, 0.2, None)
    _check(got, q, k_cache, v_cache, tables, lens, 0.2, None)


def test_tables_of_another_dtype_are_refused(kernel):
    """The library reads the metadata as int32: int64 tables would name other blocks, not fail."""
    q, k_cache, v_cache, tables, lens, _ = _case(LONG, 1, 16, torch.float32)
    with pytest.raises(AssertionError):
        kernel(q, k_cache, v_cache, tables.long(), *lens, 0.2, None)
