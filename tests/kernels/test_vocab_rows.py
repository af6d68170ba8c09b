"""vocab_rows against its plain loop reference in Triton's interpreter (on a GPU, compiled): every
row reads its token's row of its adapter's part, over the popularity shapes punica tests, and
nothing else is read (NaN everywhere else in the pool) or written."""

import pytest
import torch

from kernels.vocab_rows import vocab_rows_ref, vocab_rows_triton
from kernels.vocab_segments import VocabSegments
from tests.kernels.slot_spread import SPREADS, token_slots
from tests.kernels.spread_parts import SHAPES, spread_parts


def segments(spread: str, tokens: int, parts, device="cpu") -> VocabSegments:
    slots = token_slots(spread, tokens, len(parts), base_every=5, grouped=False, seed=1)
    used = sorted({s for s in slots if s >= 0})
    return VocabSegments.build([([i for i, s in enumerate(slots) if s == g], parts[g]) for g in used], device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spread", SPREADS)
def test_every_row_reads_its_tokens_row_of_its_adapters_part(spread, dtype):
    pool, parts, matrices = spread_parts(dtype)
    table = segments(spread, 37, parts)
    gen = torch.Generator().manual_seed(2)
    ids = torch.zeros(37, dtype=torch.int64)
    for rows, part in zip(table.segment_rows(), table.parts, strict=True):
        ids[rows] = torch.randint(0, part.rows, (len(rows),), generator=gen)
    out = torch.full((37, max(c for _, c in SHAPES)), -7.0, dtype=dtype)
    expected = vocab_rows_ref(out, ids, pool, table)
    got = vocab_rows_triton(out.clone(), ids, pool, table)
    assert torch.equal(got, expected)
    assert not got.isnan().any()
    rows, part = table.segment_rows()[0], table.parts[0]  # and the reference reads the matrix
    assert torch.equal(got[rows[0], : part.cols], matrices[parts.index(part)][ids[rows[0]]])
