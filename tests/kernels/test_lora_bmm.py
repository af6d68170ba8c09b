"""The CPU LoRA path against its plain loop reference: every target of a packed module, adapters
of mixed ranks (ranks ending inside a page, targets an adapter leaves), pages out of order, and
every element of the pool outside the adapters' pages NaN, so a read of another page shows."""

import pytest
import torch

from kernels.lora_batch import RUN_ROWS, LoraBatch
from kernels.lora_bmm import lora_bmm, lora_ref
from tests.kernels.lora_checks import lora_bound, whole_pages
from tests.kernels.paged_adapters import RANKS, UNIT
from tests.kernels.rounding import assert_within
from tests.kernels.slot_spread import SPREADS, token_slots

DTYPES = [torch.float32, torch.bfloat16]
SLICES = {"qkv": (0, (40, 16, 16)), "o": (3, (40,)), "gate_up": (4, (48, 48))}  # first target, sizes


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("module", sorted(SLICES))
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("tokens", [1, 29])
@pytest.mark.parametrize("grouped", [False, True], ids=["scattered", "grouped"])  # grouped: chunks are ranges
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lora_bmm_matches_the_reference(spread, module, base_every, tokens, grouped, dtype):
    first_target, sizes = SLICES[module]
    in_features = 24
    pool, adapters = whole_pages(first_target, in_features, sizes, dtype)
    slots = token_slots(spread, tokens, len(RANKS), base_every, grouped=grouped, seed=tokens)
    batch = LoraBatch.build(slots, adapters)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, in_features, generator=generator).to(dtype)
    y = torch.randn(tokens, sum(sizes), generator=generator).to(dtype)
    x_padded = torch.cat([x, x.new_zeros(1, in_features)])
    out, offset = y.clone(), 0
    for s, size in enumerate(sizes):
        target = first_target + s
        columns = slice(offset, offset + size)
        # on fp64 operands lora_ref rounds nothing: lora_A's output is cast to fp64
        exact = lora_ref(y[:, columns].double(), x.double(), pool.double(), UNIT, slots, adapters, target)
        for work in batch.rows[target] or ():
            lora_bmm(out[:, columns], x_padded, pool, UNIT, work)
        assert_within(out[:, columns], exact, lora_bound(y[:, columns], x, pool, slots, adapters, target))
        offset += size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_prefill_runs_beside_decodes_match_the_reference(dtype):
    """A step as the engine mixes them: decodes of several adapters, one adapter's prefill chunk of
    RUN_ROWS + 5 tokens (read in place), another's cut short by a base-model token (padded)."""
    first_target, sizes = SLICES["gate_up"]
    pool, adapters = whole_pages(first_target, 24, sizes, dtype)
    slots = [1, 2, -1, *[0] * (RUN_ROWS + 5), 3, *[2] * (RUN_ROWS - 1), -1, 2, 1]
    batch = LoraBatch.build(slots, adapters)
    assert any(work.gather is None and work.rows == RUN_ROWS + 5 for work in batch.rows[first_target])
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(len(slots), 24, generator=generator).to(dtype)
    y = torch.randn(len(slots), sum(sizes), generator=generator).to(dtype)
    out, offset = y.clone(), 0
    for s, size in enumerate(sizes):
        target, columns = first_target + s, slice(offset, offset + size)
        exact = lora_ref(y[:, columns].double(), x.double(), pool.double(), UNIT, slots, adapters, target)
        for work in batch.rows[target]:
            lora_bmm(out[:, columns], torch.cat([x, x.new_zeros(1, 24)]), pool, UNIT, work)
        assert_within(out[:, columns], exact, lora_bound(y[:, columns], x, pool, slots, adapters, target))
        offset += size


def test_tokens_of_the_base_model_and_of_adapters_that_leave_a_target_are_untouched():
    first_target, sizes = SLICES["qkv"]
    pool, adapters = whole_pages(first_target, 24, sizes, torch.float32)
    slots = [-1, 1, 1, 3, -1]  # adapter 1 leaves k (rank 0), adapter 3 leaves q and k
    batch = LoraBatch.build(slots, adapters)
    assert batch.rows[first_target + 1] is None  # no token's adapter targets k: k costs nothing
    x, y = torch.randn(5, 24), torch.randn(5, sizes[0])
    out = y.clone()
    for work in batch.rows[first_target]:
        lora_bmm(out, torch.cat([x, x.new_zeros(1, 24)]), pool, UNIT, work)
    assert torch.equal(out[[0, 3, 4]], y[[0, 3, 4]])
    assert not torch.equal(out[[1, 2]], y[[1, 2]])
