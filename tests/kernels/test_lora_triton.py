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
from tests.kernels.rounding import assert_within, cast_error, fp32_error, gamma
from tests.kernels.slot_spread import SPREADS, token_slots

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# slices -> (first target, slice sizes): o; gate/up; q/k/v, uneven with GQA
SLICES = {1: (3, (40,)), 2: (4, (48, 48)), 3: (0, (72, 24, 24))}


def _case(spread, slices, base_every, dtype, tokens, in_features, sizes, device="cpu", gathered=1):
    first_target = SLICES[slices][0]
    torch.manual_seed(0)
    pool, adapters = paged_adapters(first_target, in_features, sizes, dtype, device, gathered=gathered)
    slots = token_slots(spread, tokens, len(RANKS), base_every, grouped=False, seed=slices)
    table = LoraBatch.build(slots, adapters, device, kernels=True).table
    return slots, pool, adapters, table


def _shrink_close(partials, x, pool, slots, adapters, first_target, slices):
    """The sum of the partials [splits, tokens, slices, max_rank] (fp32, never cast) against the
    reference on the lora rows: each term is one product and at most in_features - 1 fp32
    additions, whichever the split and tile order, so bf16 and fp16 operands are held to fp32's
    bound too (their products are exact in fp32), and lanes past every rank are 0."""
    lora_rows = torch.tensor(slots) >= 0  # rows of base-model tokens are not written
    exact = lora_shrink_ref(x, pool, UNIT, slots, adapters, first_target, slices)[lora_rows]
    magnitude = lora_shrink_ref(x.abs(), pool.abs(), UNIT, slots, adapters, first_target, slices)[lora_rows]
    got = partials.sum(0).cpu()[lora_rows]  # [lora tokens, slices, max_rank]
    rank = exact.shape[2]
    assert_within(got[:, :, :rank], exact, gamma(x.shape[1] * fp32_error(partials.device)) * magnitude)
    assert not got[:, :, rank:].any()


def _expand_close(got, y, partials, pool, slots, adapters, first_target, sizes, in_features, gathered=1):
    """y's new value against the reference on the partials' exact sum: a term of it (one split's
    lane times a B element) goes through the additions of the splits, the cast of their sum to
    the pool's dtype, one product, at most max_rank - 1 additions and the one to y, and the cast
    to y's dtype."""
    splits, _, _, max_rank = partials.shape
    exact_buf, buf_magnitude = partials.cpu().double().sum(0), partials.cpu().double().abs().sum(0)
    y, pool = y.cpu().double(), pool.cpu().double()
    args = (UNIT, slots, adapters, first_target, sizes, in_features, gathered)
    exact = lora_expand_ref(y, exact_buf, pool, *args)
    magnitude = lora_expand_ref(y.abs(), buf_magnitude, pool.abs(), *args)
    bound = gamma((splits + max_rank + 1) * fp32_error(got.device) + 2 * cast_error(got.dtype))
    assert_within(got, exact, bound * magnitude)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_triton_matches_reference(spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = _case(spread, slices, base_every, dtype, 37, 136, sizes)
    x = torch.randn(37, 136, dtype=dtype)
    for splits in (1, 3):  # 136 features in 3 splits of 64, 64 and 8: the last one ragged
        partials = lora_shrink_triton(x, pool, table, first_target, slices, UNIT, splits)
        assert partials.shape == (splits, 37, slices, table.max_rank) and partials.dtype == torch.float32
        _shrink_close(partials, x, pool, slots, adapters, first_target, slices)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_triton_matches_reference(spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = _case(spread, slices, base_every, dtype, 37, 72, sizes)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    partials = torch.randn(1 + slices % 2, 37, slices, table.max_rank)  # lanes past a rank must not count
    y_old = y.clone()
    out = lora_expand_triton(y, partials, pool, table, first_target, sizes, 72, UNIT)
    _expand_close(out, y_old, partials, pool, slots, adapters, first_target, sizes, 72)
    base_rows = torch.tensor(slots) < 0
    assert torch.equal(out[base_rows], y_old[base_rows])


@pytest.mark.parametrize("gathered", [2, 3])
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_triton_reads_every_ranks_shrink_of_a_fully_sharded_layer(gathered, slices, dtype):
    """A fully sharded column layer's part on one of `gathered` ranks: the shrinks of every rank,
    rank after rank, each read by its own block of B^T rows in every page."""
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = _case("uniform", slices, 3, dtype, 37, 72, sizes, gathered=gathered)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    partials = torch.randn(1, 37, slices, gathered * table.max_rank)
    y_old = y.clone()
    out = lora_expand_triton(y, partials, pool, table, first_target, sizes, 72, UNIT, gathered)
    _expand_close(out, y_old, partials, pool, slots, adapters, first_target, sizes, 72, gathered)


def test_a_batch_without_adapters_launches_nothing():
    table = LoraBatch.build([-1] * 5, {}, kernels=True).table
    assert table is None
    x, y, pool = torch.randn(5, 16), torch.randn(5, 8), torch.full((256,), math.nan)
    assert lora_shrink_triton(x, pool, table, 0, 1, UNIT).shape == (1, 5, 1, 0)
    partials = torch.randn(1, 5, 1, 0)
    assert torch.equal(lora_expand_triton(y.clone(), partials, pool, table, 0, (8,), 16, UNIT), y)


# Full sizes on a GPU: a decode batch (one token per sequence, base and LoRA) and prefill segments,
# Llama-7B-like widths.
GPU_SHAPES = [(32, 4096, (4096, 1024, 1024)), (64, 4096, (11008, 11008)), (512, 4096, (4096,))]


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
    _shrink_close(partials, x.cpu(), pool.cpu(), slots, adapters, first_target, slices)
    y = torch.randn(tokens, sum(sizes), device="cuda", dtype=dtype)
    y_old = y.clone()
    got = lora_expand_triton(y, partials, pool, table, first_target, sizes, in_features, UNIT)
    _expand_close(got, y_old, partials, pool, slots, adapters, first_target, sizes, in_features)


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
