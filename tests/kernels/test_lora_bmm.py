"""The CPU LoRA path against its plain loop reference: every target of a packed module, adapters
of mixed ranks (ranks ending inside a page, targets an adapter leaves), pages out of order, and
every element of the pool outside the adapters' pages NaN, so a read of another page shows."""

import pytest
import torch

from kernels.lora_batch import PAGE_RANK, LoraBatch, page_views
from kernels.lora_bmm import lora_bmm, lora_ref
from tests.kernels.paged_adapters import RANKS, UNIT, paged_adapters
from tests.kernels.slot_spread import SPREADS, token_slots

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SLICES = {"qkv": (0, (40, 16, 16)), "o": (3, (40,)), "gate_up": (4, (48, 48))}  # first target, sizes


def _memory(first_target: int, in_features: int, sizes: tuple[int, ...], dtype: torch.dtype):
    """paged_adapters with the rows past each rank in a last page zeroed, as ModelRunner leaves
    them (lora_bmm reads whole pages); everything else outside the pages stays NaN."""
    pool, adapters = paged_adapters(first_target, in_features, sizes, dtype)
    for pages in adapters.values():
        for s, size in enumerate(sizes):
            rank, units = pages.ranks[first_target + s], pages.pages[first_target + s]
            a, b = page_views(pool, UNIT, in_features, size)
            if rank % PAGE_RANK:
                a[units[-1], rank % PAGE_RANK :] = 0
                b[units[-1], rank % PAGE_RANK :] = 0
    return pool, adapters


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("module", sorted(SLICES))
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("tokens", [1, 29])
@pytest.mark.parametrize("grouped", [False, True], ids=["scattered", "grouped"])  # grouped: chunks are ranges
@pytest.mark.parametrize("dtype", sorted(TOLERANCE, key=str), ids=str)
def test_lora_bmm_matches_the_reference(spread, module, base_every, tokens, grouped, dtype):
    first_target, sizes = SLICES[module]
    in_features = 24
    pool, adapters = _memory(first_target, in_features, sizes, dtype)
    slots = token_slots(spread, tokens, len(RANKS), base_every, grouped=grouped, seed=tokens)
    batch = LoraBatch.build(slots, adapters)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, in_features, generator=generator).to(dtype)
    y = torch.randn(tokens, sum(sizes), generator=generator).to(dtype)
    x_padded = torch.cat([x, x.new_zeros(1, in_features)])
    out, offset = y.clone(), 0
    for s, size in enumerate(sizes):
        target = first_target + s
        expected = lora_ref(y[:, offset : offset + size], x, pool, UNIT, slots, adapters, target)
        for work in batch.rows[target] or ():
            lora_bmm(out[:, offset : offset + size], x_padded, pool, UNIT, work)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out[:, offset : offset + size], expected, atol=10 * tol, rtol=tol)
        offset += size


def test_tokens_of_the_base_model_and_of_adapters_that_leave_a_target_are_untouched():
    first_target, sizes = SLICES["qkv"]
    pool, adapters = _memory(first_target, 24, sizes, torch.float32)
    slots = [-1, 1, 1, 3, -1]  # adapter 1 leaves k (rank 0), adapter 3 leaves q and k
    batch = LoraBatch.build(slots, adapters)
    assert batch.rows[first_target + 1] is None  # no token's adapter targets k: k costs nothing
    x, y = torch.randn(5, 24), torch.randn(5, sizes[0])
    out = y.clone()
    for work in batch.rows[first_target]:
        lora_bmm(out, torch.cat([x, x.new_zeros(1, 24)]), pool, UNIT, work)
    assert torch.equal(out[[0, 3, 4]], y[[0, 3, 4]])
    assert not torch.equal(out[[1, 2]], y[[1, 2]])
