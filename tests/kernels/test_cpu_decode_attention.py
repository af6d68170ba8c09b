"""CpuDecodeAttention, the compiled CPU kernel, against its plain loop reference in float64: every
dtype, group size, block size and window, on a cache whose unwritten rows are NaN (a read past a
context or through a table's padding shows); and what load says where it cannot build."""

import pytest
import torch

from kernels.cpu_decode_attention import CpuDecodeAttention, cpu_decode_attention_ref
from tests.kernels.guard_pages import guarded, in_child
from tests.kernels.paged_cache import paged_cache
from tests.kernels.rounding import assert_within, attention_bound
from tests.kernels.targets import declined

Q_STD = 4.0  # peaks the softmax as trained models' do (tests/kernels/test_paged_decode_attention.py)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CONTEXTS = [1, 7, 33, 150, 64]


@pytest.fixture(scope="module")
def kernel(target) -> CpuDecodeAttention:
    # the workers' folder: one build (of each target) serves tests and engines
    kernel, why = CpuDecodeAttention.load(target=target)
    if "decode_attention" in declined(target):  # as tests/kernels/test_cpu_targets.py asserts
        pytest.skip(why)
    assert kernel is not None, why  # this machine has a compiler: make test's set-up needs one
    return kernel


def _case(contexts, group, block_size, dtype, kv_heads=1, head_dim=16):
    k_cache, v_cache, tables = paged_cache(contexts, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(len(contexts), kv_heads * group, head_dim, dtype=dtype) * Q_STD
    return q, k_cache, v_cache, tables.long(), torch.tensor(contexts, dtype=torch.int64)


def _check(got, q, k_cache, v_cache, tables, contexts, scale, window):
    """Within softmax_average_bound: a row sums at most its window's keys, in one pass (the
    kernel's softmax over all of them, after their maximum: no rescaling)."""
    exact = cpu_decode_attention_ref(q, k_cache, v_cache, tables, contexts, scale, window)
    magnitude = cpu_decode_attention_ref(q, k_cache, v_cache.abs(), tables, contexts, scale, window)
    keys = int(contexts.max()) if window is None else min(int(contexts.max()), window)
    bound = attention_bound(magnitude, q, k_cache, v_cache, scale, keys=keys, rescales=1, device=q.device)
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_within(got, exact, bound)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_matches_reference(kernel, group, block_size, window, dtype):
    q, k_cache, v_cache, tables, contexts = _case(CONTEXTS, group, block_size, dtype)
    scale = q.shape[-1] ** -0.5
    _check(
        kernel(q, k_cache, v_cache, tables, contexts, scale, window),
        q,
        k_cache,
        v_cache,
        tables,
        contexts,
        scale,
        window,
    )


@pytest.mark.parametrize("head_dim", [24, 64, 80])  # past, at and between the kernel's vector widths
def test_several_kv_heads_and_head_dims(kernel, head_dim):
    q, k_cache, v_cache, tables, contexts = _case(
        [9, 70, 1], 3, 4, torch.float32, kv_heads=2, head_dim=head_dim
    )
    _check(
        kernel(q, k_cache, v_cache, tables, contexts, 0.2, None),
        q,
        k_cache,
        v_cache,
        tables,
        contexts,
        0.2,
        None,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_queries_are_read_where_the_qkv_projection_left_them(kernel, dtype):
    """q a view into wider rows (each decode's row of qkv, k and v after its heads)."""
    q, k_cache, v_cache, tables, contexts = _case([9, 70, 1], 3, 4, dtype, kv_heads=2, head_dim=24)
    decodes, heads, head_dim = q.shape
    rows = torch.full((decodes, (heads + 4) * head_dim), float("nan"), dtype=dtype)
    rows[:, : heads * head_dim] = q.flatten(1)
    view = rows[:, : heads * head_dim].view(decodes, heads, head_dim)
    got = kernel(view, k_cache, v_cache, tables, contexts, 0.2, None)
    _check(got, q, k_cache, v_cache, tables, contexts, 0.2, None)


def test_no_decodes_returns_nothing(kernel):
    q, k_cache, v_cache, tables, contexts = _case([5], 1, 4, torch.float32)
    out = kernel(q[:0], k_cache, v_cache, tables[:0], contexts[:0], 0.25, None)
    assert out.shape == (0, *q.shape[1:])


def test_without_a_compiler_load_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    kernel, why = CpuDecodeAttention.load(tmp_path)
    assert kernel is None and "no C++ compiler" in why


def test_where_the_library_cannot_be_written_load_says_why(tmp_path):
    occupied = tmp_path / "file"
    occupied.write_text("not a folder")
    kernel, why = CpuDecodeAttention.load(occupied)
    assert kernel is None and "cannot build or load" in why and str(occupied) in why


def test_a_failed_build_says_why(monkeypatch, tmp_path):
    compiler = tmp_path / "c++"
    compiler.write_text("#!/bin/sh\necho 'no such flag' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    kernel, why = CpuDecodeAttention.load(tmp_path / "kernels")
    assert kernel is None and "failed to build" in why and "no such flag" in why


def test_a_build_that_fails_halfway_leaves_no_library_to_load(monkeypatch, tmp_path):
    """Processes may build at once and a compiler may die mid-write: a library appears whole or not at all."""
    compiler = tmp_path / "bin" / "c++"
    compiler.parent.mkdir()
    compiler.write_text(
        '#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && echo half > "$2"; shift; done\nexit 1\n'
    )
    compiler.chmod(0o755)
    monkeypatch.setenv("PATH", str(compiler.parent))
    folder = tmp_path / "kernels"
    kernel, why = CpuDecodeAttention.load(folder)
    assert kernel is None and "failed to build" in why
    assert list(folder.rglob("*.so")) == []


def test_tables_of_another_dtype_are_refused(kernel):
    q, k_cache, v_cache, tables, contexts = _case([5], 1, 4, torch.float32)
    with pytest.raises(AssertionError):
        kernel(q, k_cache, v_cache, tables.int(), contexts, 0.25, None)


def test_queries_off_the_cpu_are_refused(kernel):
    """The library dereferences q's pointer: one on another device (here "meta", none) is refused."""
    q, k_cache, v_cache, tables, contexts = _case([5], 1, 4, torch.float32)
    with pytest.raises(AssertionError):
        kernel(q.to("meta"), k_cache, v_cache, tables, contexts, 0.25, None)


def test_queries_of_another_dtype_are_refused(kernel):
    """The library reads q as the cache's dtype: fp32 queries over a bf16 cache would be misread."""
    q, k_cache, v_cache, tables, contexts = _case([5], 1, 4, torch.bfloat16)
    with pytest.raises(AssertionError):
        kernel(q.float(), k_cache, v_cache, tables, contexts, 0.25, None)


def reads_within_the_cache_and_the_table(target: str) -> None:
    """In a child (guard_pages.in_child), the kernel built for `target`: blocks of 4 rows, fewer
    than a group of 16 keys, the last sequence's last block the cache's last, and its context a
    whole table row. A key read past its block (past a partial group), or a table entry read past
    the row (for the prefetch of a block past the context), reads the page after the cache or the
    table and faults."""
    kernel, why = CpuDecodeAttention.load(target=target)
    assert kernel is not None, why
    block_size, kv_heads, head_dim, contexts = 4, 1, 16, [7, 8]
    tables = guarded((2, 2), torch.int64)  # [decodes, max_blocks]
    tables.copy_(torch.tensor([[1, 2], [3, 4]]))  # block 0 padding; block 4 the cache's last
    for dtype in DTYPES:
        k_cache, v_cache = (guarded((5, block_size, kv_heads, head_dim), dtype) for _ in range(2))
        for cache in (k_cache, v_cache):
            cache.copy_(torch.randn(cache.shape))
        q = torch.randn(2, 3, head_dim, dtype=dtype) * Q_STD
        contexts_t = torch.tensor(contexts)
        out = kernel(q, k_cache, v_cache, tables, contexts_t, 0.25, None)
        _check(out, q, k_cache, v_cache, tables, contexts_t, 0.25, None)


def test_reads_nothing_past_the_cache_or_the_table(kernel, target):  # kernel: skipped where declined
    child = in_child(__name__, reads_within_the_cache_and_the_table.__name__, target)
    assert child.returncode == 0, f"return code {child.returncode}: {child.stderr[-2000:]}"
