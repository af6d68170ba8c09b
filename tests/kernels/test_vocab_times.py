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


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "store"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", SPREADS)
def test_every_row_times_its_adapters_part(spread, dtype, accumulate):
    pool, parts, _ = spread_parts(dtype)
    table = segments(spread, TOKENS, parts)
    gen = torch.Generator().manual_seed(3)
    width_x, width_y = max(c for _, c in SHAPES), max(r for r, _ in SHAPES)
    x = torch.full((TOKENS, width_x), float("nan"), dtype=dtype)
    for rows, part in zip(table.segment_rows(), table.parts, strict=True):
        x[rows, : part.cols] = torch.randn(len(rows), part.cols, generator=gen).to(dtype)
    y = torch.randn(TOKENS, width_y, generator=gen).to(dtype)
    got = vocab_times_triton(y.clone(), x, pool, table, accumulate)
    exact = vocab_times_ref(y, x, pool, table, accumulate)
    magnitude = vocab_times_ref(y.abs(), x.abs(), pool.abs(), table, accumulate)
    bound = gamma((max(c for _, c in SHAPES) + 1) * fp32_error(got.device) + cast_error(dtype))
    assert_within(got, exact, bound * magnitude)
    in_segments = torch.zeros_like(y, dtype=torch.bool)
    for rows, part in zip(table.segment_rows(), table.parts, strict=True):
        in_segments[rows, : part.rows] = True
    assert torch.equal(got[~in_segments], y[~in_segments])  # the rest of y as it was
