"""An adapter costs its own rank, not max_lora_rank: the CPU paths read no rank of A or B past the
largest rank of the step's slots, and stay exact."""

import math

import pytest
import torch

from kernels.lora_batch import LoraBatch
from kernels.lora_expand import lora_expand, lora_expand_ref
from kernels.lora_shrink import lora_shrink, lora_shrink_ref
from tests.kernels.slot_spread import SPREADS, token_slots

MAX_RANK, SLOT_RANKS = 16, [2, 8, 5, 1]  # the step's largest rank is 8
SIZES = (40, 16, 16)


def _weights(in_features: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Slots as ModelRunner leaves them: ranks past a slot's own are zero; ranks past every
    slot's (8..15) are NaN here, so reading one would show in the result."""
    a = torch.randn(len(SLOT_RANKS), MAX_RANK, len(SIZES), in_features)
    b = tuple(torch.randn(len(SLOT_RANKS), MAX_RANK, n) for n in SIZES)
    for slot, rank in enumerate(SLOT_RANKS):
        a[slot, rank:] = 0
        for b_s in b:
            b_s[slot, rank:] = 0
    a[:, max(SLOT_RANKS) :] = math.nan
    for b_s in b:
        b_s[:, max(SLOT_RANKS) :] = math.nan
    return a, b


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("padded", [True, False])
def test_shrink_and_expand_read_only_the_ranks_the_adapters_have(spread, grouped, padded):
    torch.manual_seed(0)
    tokens, in_features = 29, 24
    slots = token_slots(spread, tokens, len(SLOT_RANKS), 4, grouped, seed=3)
    x, y = torch.randn(tokens, in_features), torch.randn(tokens, sum(SIZES))
    a, b = _weights(in_features)
    batch = LoraBatch.build(slots, max_pad_factor=math.inf if padded else 0, slot_ranks=SLOT_RANKS)
    assert (batch.padded is not None) == padded

    buf = lora_shrink(x, a, batch)
    out = lora_expand(y.clone(), buf, b, batch)

    expected_buf = lora_shrink_ref(x, a, batch.token_slots, SLOT_RANKS)
    torch.testing.assert_close(buf, expected_buf, atol=1e-5, rtol=1e-5)
    expected = lora_expand_ref(y, expected_buf, b, batch.token_slots, SLOT_RANKS)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
