import math

import pytest
import torch

from kernels.lora_batch import LoraBatch
from kernels.lora_shrink import lora_shrink, lora_shrink_ref
from tests.kernels.slot_spread import SPREADS, token_slots

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shrink_matches_reference(spread, rank, slices, base_every, grouped, padded, dtype):
    torch.manual_seed(0)
    tokens, max_loras, in_features = 37, 4, 72
    slots = token_slots(spread, tokens, max_loras, base_every, grouped, seed=rank * 7 + slices)
    x = torch.randn(tokens, in_features, dtype=dtype)
    a = torch.randn(max_loras, rank, slices, in_features, dtype=dtype)
    batch = LoraBatch.build(slots, max_pad_factor=math.inf if padded else 0)
    assert (batch.padded is not None) == padded

    out = lora_shrink(x, a, batch)

    expected = lora_shrink_ref(x, a, batch.token_slots)
    assert out.shape == (tokens, slices, rank)
    torch.testing.assert_close(
        out.float(), expected.float(), atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]
    )
    base_rows = torch.tensor([s < 0 for s in slots])
    assert torch.count_nonzero(out[base_rows]) == 0


def test_shrink_of_all_base_batch_is_zero():
    x = torch.randn(5, 16)
    a = torch.randn(2, 4, 1, 16)
    batch = LoraBatch.build([-1] * 5)
    assert batch.padded is None and not batch.segments
    assert torch.count_nonzero(lora_shrink(x, a, batch)) == 0
