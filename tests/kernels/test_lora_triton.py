"""The Triton kernels on paged adapter memory against the plain loop references: small shapes in
Triton's interpreter on CPU (every run), full sizes and CUDA-graph replay on a GPU (marker gpu).
The pool holds NaN wherever a kernel must not read (rows past an adapter's rank, pages of other
targets, unused units), so a stray read fails the comparison."""

import math

import pytest
import torch

from kernels.lora_batch import LoraBatch
from kernels.lora_expand import lora_expand_triton
from kernels.lora_shrink import lora_shrink_triton
from tests.kernels.lora_checks import DTYPES, SLICES, case, expand_close, shrink_close
from tests.kernels.paged_adapters import UNIT
from tests.kernels.slot_spread import SPREADS


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_triton_matches_reference(spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = case(spread, slices, base_every, dtype, 37, 136, sizes)
    x = torch.randn(37, 136, dtype=dtype)
    for splits in (1, 3):  # 136 features in 3 splits of 64, 64 and 8: the last one ragged
        partials = lora_shrink_triton(x, pool, table, first_target, slices, UNIT, splits)
        assert partials.shape == (splits, 37, slices, table.max_rank) and partials.dtype == torch.float32
        shrink_close(partials, x, pool, slots, adapters, first_target, slices)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_triton_matches_reference(spread, slices, base_every, dtype):
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = case(spread, slices, base_every, dtype, 37, 72, sizes)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    partials = torch.randn(1 + slices % 2, 37, slices, table.max_rank)  # lanes past a rank must not count
    y_old = y.clone()
    out = lora_expand_triton(y, partials, pool, table, first_target, sizes, 72, UNIT)
    expand_close(out, y_old, partials, pool, slots, adapters, first_target, sizes, 72)
    base_rows = torch.tensor(slots) < 0
    assert torch.equal(out[base_rows], y_old[base_rows])


@pytest.mark.parametrize("gathered", [2, 3])
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_triton_reads_every_ranks_shrink_of_a_fully_sharded_layer(gathered, slices, dtype):
    """A fully sharded column layer's part on one of `gathered` ranks: the shrinks of every rank,
    rank after rank, each read by its own block of B^T rows in every page."""
    first_target, sizes = SLICES[slices]
    slots, pool, adapters, table = case("uniform", slices, 3, dtype, 37, 72, sizes, gathered=gathered)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    partials = torch.randn(1, 37, slices, gathered * table.max_rank)
    y_old = y.clone()
    out = lora_expand_triton(y, partials, pool, table, first_target, sizes, 72, UNIT, gathered)
    expand_close(out, y_old, partials, pool, slots, adapters, first_target, sizes, 72, gathered)


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
    slots, pool, adapters, table = case(spread, slices, 3, dtype, tokens, in_features, sizes, "cuda")
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
    partials = lora_shrink_triton(x, pool, table, first_target, slices, UNIT)
    shrink_close(partials, x.cpu(), pool.cpu(), slots, adapters, first_target, slices)
    y = torch.randn(tokens, sum(sizes), device="cuda", dtype=dtype)
    y_old = y.clone()
    got = lora_expand_triton(y, partials, pool, table, first_target, sizes, in_features, UNIT)
    expand_close(got, y_old, partials, pool, slots, adapters, first_target, sizes, in_features)


@pytest.mark.gpu
def test_triton_kernels_replay_in_a_cuda_graph():
    _, pool, _, table = case("uniform", 3, 3, torch.bfloat16, 64, 512, (512, 128, 128), "cuda")
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
