import math

import pytest
import torch

from kernels.lora_batch import LoraBatch
from kernels.lora_expand import lora_expand, lora_expand_ref
from tests.kernels.slot_spread import SPREADS, token_slots

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
SLICE_SIZES = {1: (40,), 2: (48, 48), 3: (64, 24, 24)}  # qkv with GQA has uneven slices


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_matches_reference(spread, rank, slices, base_every, grouped, padded, dtype):
    torch.manual_seed(0)
    tokens, max_loras = 37, 4
    sizes = SLICE_SIZES[slices]
    out_features = sum(sizes)
    slots = token_slots(spread, tokens, max_loras, base_every, grouped, seed=rank * 7 + slices)
    y = torch.randn(tokens, out_features, dtype=dtype)
    buf = torch.randn(tokens, slices, rank, dtype=dtype)
    b = tuple(torch.randn(max_loras, rank, size, dtype=dtype) for size in sizes)
    batch = LoraBatch.build(slots, max_pad_factor=math.inf if padded else 0)
    assert (batch.padded is not None) == padded

    expected = lora_expand_ref(y, buf, b, batch.token_slots)
    base_rows = torch.tensor([s < 0 for s in slots])
    y_base_before = y[base_rows].clone()
    out = lora_expand(y, buf, b, batch)

    assert out is y
    torch.testing.assert_close(
        out.float(), expected.float(), atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]
    )
    assert torch.equal(out[base_rows], y_base_before)
