"""The Triton kernels on paged adapter memory against the plain loop references: small shapes in
Triton's interpreter on CPU (every run), full sizes and CUDA-graph replay on a GPU (marker gpu).
The pool holds NaN wherever a kernel must not read (rows past an adapter's rank, pages of other
targets, unused units), so a stray read fails the comparison."""

import math

import pytest
import torch

from kernels.lora_batch import LoraBatch
from kernels.lora_expand import lora_expand_ref, lora_expand_triton
from kernels.lora_shrink import lora_shrink_ref, lora_shrink_triton
from tests.kernels.paged_adapters import RANKS, UNIT, paged_adapters
from tests.kernels.slot_spread import SPREADS, token_slots

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# slices -> (first target, slice sizes): o; gate/up; q/k/v, uneven with GQA
SLICES = {1: (3, (40,)), 2: (4, (48, 48)), 3: (0, (72, 24, 24))}


def _case(spread, slices, base_every, dtype, tokens, in_features, sizes, device="cpu"):
    first_target = SLICES[slices][0]
    torch.manual_seed(0)
    pool, adapters = paged_adapters(first_target, in_features, sizes, dtype, device)
    slots = token_slots(spread, tokens, len(RANKS), base_every, grouped=False, seed=slices)
    table = LoraBatch.build(slots, adapters, device, kernels=True).table
    return slots, pool, adapters, table


def _close(got, expected, dtype, in_features=64):
    """Within the dtype's tolerance, scaled with the sqrt of the features summed over: rounding
    errors of a sum grow like that (the references sum in fp64)."""
    tol = TOLERANCE[dtype] * math.sqrt(in_features / 64)
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), atol=tol * 10, rtol=tol)


def _split(buf: torch.Tensor, splits: int) -> torch.Tensor:
    """fp32 partial sums [splits, *buf.shape] that add up to buf, as lora_shrink_triton returns."""
    parts = torch.randn(splits, *buf.shape, device=buf.device)
    parts[0] = buf.float() - parts[1:].sum(0)
    return parts


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_triton_matches_reference(spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = _case(spread, slices, base_every, dtype, 37, 136, sizes)
    x = torch.randn(37, 136, dtype=dtype)
    lora_rows = torch.tensor(slots) >= 0  # rows of base-model tokens are not written
    expected = lora_shrink_ref(x, pool, UNIT, slots, adapters, first_target, slices)[lora_rows]
    rank = expected.shape[2]
    for splits in (1, 3):  # 136 features in 3 splits of 64, 64 and 8: the last one ragged
        partials = lora_shrink_triton(x, pool, table, first_target, slices, UNIT, splits)
        assert partials.shape == (splits, 37, slices, table.max_rank) and partials.dtype == torch.float32
        got = partials.sum(0)[lora_rows]  # [lora tokens, slices, max_rank]
        _close(got[:, :, :rank], expected, dtype, 136)
        assert not got[:, :, rank:].any()


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_triton_matches_reference(spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = _case(spread, slices, base_every, dtype, 37, 72, sizes)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    buf = torch.randn(37, slices, table.max_rank, dtype=dtype)  # lanes past a rank must not count
    expected = lora_expand_ref(y, buf, pool, UNIT, slots, adapters, first_target, sizes, 72)
    base_rows = torch.tensor(slots) < 0
    y_base = y[base_rows].clone()
    out = lora_expand_triton(y, _split(buf, 1 + slices % 2), pool, table, first_target, sizes, 72, UNIT)
    _close(out, expected, dtype)
    assert torch.equal(out[base_rows], y_base)


def test_a_batch_without_adapters_launches_nothing():
    table = LoraBatch.build([-1] * 5, {}, kernels=True).table
    assert table is None
    x, y, pool = torch.randn(5, 16), torch.randn(5, 8), torch.full((256,), math.nan)
    assert lora_shrink_triton(x, pool, table, 0, 1, UNIT).shape == (1, 5, 1, 0)
    partials = torch.randn(1, 5, 1, 0)
    assert torch.equal(lora_expand_triton(y.clone(), partials, pool, table, 0, (8,), 16, UNIT), y)


# Full sizes on a GPU: decode (one token per sequence) and prefill segments, Llama-7B-like widths.
GPU_SHAPES = [(1, 4096, (4096, 1024, 1024)), (64, 4096, (11008, 11008)), (512, 4096, (4096,))]


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "in_features", "sizes"), GPU_SHAPES)
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_full_size_on_gpu(tokens, in_features, sizes, spread, dtype):
    slices = len(sizes)
    first_target = SLICES[slices][0]
    slots, pool, adapters, table = _case(spread, slices, 3, dtype, tokens, in_features, sizes, "cuda")
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
    partials = lora_shrink_triton(x, pool, table, first_target, slices, UNIT)
    lora_rows = torch.tensor(slots) >= 0
    buf = partials.sum(0).to(dtype).cpu()  # [tokens, slices, max_rank]
    buf = torch.where(lora_rows[:, None, None], buf, 0)  # base-model rows are not written
    pool_cpu = pool.cpu()
    expected = lora_shrink_ref(x.cpu(), pool_cpu, UNIT, slots, adapters, first_target, slices)
    rank = expected.shape[2]
    _close(buf[lora_rows, :, :rank], expected[lora_rows], dtype, in_features)
    y = torch.randn(tokens, sum(sizes), device="cuda", dtype=dtype)
    expected = lora_expand_ref(
        y.cpu(), buf, pool_cpu, UNIT, slots, adapters, first_target, sizes, in_features
    )
    got = lora_expand_triton(y, partials, pool, table, first_target, sizes, in_features, UNIT)
    _close(got, expected, dtype, rank)


@pytest.mark.gpu
def test_triton_kernels_replay_in_a_cuda_graph():
    _, pool, _, table = _case("uniform", 3, 3, torch.bfloat16, 64, 512, (512, 128, 128), "cuda")
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    y = y0.clone()

    def step():
        partials = lora_shrink_triton(x, pool, table, 0, 3, UNIT)
        lora_expand_triton(y, partials, pool, table, 0, (512, 128, 128), 512, UNIT)

    step()  # compile before capture
    expected = y.clone()
    graph = torch.cuda.CUDAGraph()
    y.copy_(y0)
    with torch.cuda.graph(graph):
        step()
    y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected)
