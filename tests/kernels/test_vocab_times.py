"""vocab_times against its plain fp64 loop reference in Triton's interpreter (on a GPU, compiled):
every row times its adapter's part transposed, stored or added, over the popularity shapes punica
tests; within the bound of its fp32 sums (tests/kernels/rounding.py); nothing read past a part
or past a segment's columns of x (NaN there), nothing written past a segment's columns of y."""

import pytest
import torch

from kernels.vocab_times import vocab_times_ref, vocab_times_triton
from tests.kernels.rounding import assert_within, cast_error, fp32_error, gamma
from tests.kernels.slot_spread import SPREADS
from tests.kernels.spread_parts import SHAPES, spread_parts
from tests.kernels.test_vocab_rows import segments

TOKENS = 37


# SmolLM2's head: LoRA's B over the vocabulary and its A, an adapter's own head; 30 layers
FULL_SHAPES = [(49152, 16), (16, 576), (49152, 576), (49152, 64)]


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "store"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", SPREADS)
def test_every_row_times_its_adapters_part(spread, dtype, accumulate):
    _check(spread, dtype, accumulate, TOKENS, SHAPES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_size_parts_compiled(dtype):
    _check("uniform", dtype, True, 64, FULL_SHAPES, layers=30, device="cuda")


def _check(spread, dtype, accumulate, tokens, shapes, layers=3, device="cpu"):
    pool, parts, _ = spread_parts(dtype, device, shapes, layers)
    table = segments(spread, tokens, parts, device)
    gen = torch.Generator().manual_seed(3)
    width_x, width_y = max(c for _, c in shapes), max(r for r, _ in shapes)
    x = torch.full((tokens, width_x), float("nan"), dtype=dtype)
    for rows, part in zip(table.segment_rows(), table.parts, strict=True):
        x[rows, : part.cols] = torch.randn(len(rows), part.cols, generator=gen).to(dtype)
    y = torch.randn(tokens, width_y, generator=gen).to(dtype)
    got = vocab_times_triton(y.clone().to(device), x.to(device), pool, table, accumulate).cpu()
    pool = pool.cpu()
    exact = vocab_times_ref(y, x, pool, table, accumulate)
    magnitude = vocab_times_ref(y.abs(), x.abs(), pool.abs(), table, accumulate)
    bound = gamma((width_x + 1) * fp32_error(torch.device(device)) + cast_error(dtype))
    assert_within(got, exact, bound * magnitude)
    in_segments = torch.zeros_like(y, dtype=torch.bool)
    for rows, part in zip(table.segment_rows(), table.parts, strict=True):
        in_segments[rows, : part.rows] = True
    assert torch.equal(got[~in_segments], y[~in_segments])  # the rest of y as it was
