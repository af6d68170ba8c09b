import pytest
import torch

from kernels.lora_batch import LoraBatch
from kernels.lora_expand import lora_expand, lora_expand_ref
from tests.kernels.slot_spread import SPREADS, token_slots

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
SLICE_SIZES = {1: (40,), 2: (48, 48), 3: (64, 24, 24)}  # qkv with GQA has uneven slices


def _offsets(sizes):
    offsets, start = [], 0
    for size in sizes:
        offsets.append((start, size))
        start += size
    return tuple(offsets)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("rank", [1, 8, 16])
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_matches_reference(spread, rank, slices, base_every, grouped, dtype):
    torch.manual_seed(0)
    tokens, max_loras = 37, 4
    sizes = SLICE_SIZES[slices]
    out_features = sum(sizes)
    slots = token_slots(spread, tokens, max_loras, base_every, grouped, seed=rank * 7 + slices)
    y = torch.randn(tokens, out_features, dtype=dtype)
    buf = torch.randn(tokens, slices, rank, dtype=dtype)
    b = torch.randn(max_loras, out_features, rank, dtype=dtype)
    batch = LoraBatch.build(slots)

    expected = lora_expand_ref(y, buf, b, _offsets(sizes), batch.token_slots)
    base_rows = torch.tensor([s < 0 for s in slots])
    y_base_before = y[base_rows].clone()
    out = lora_expand(y, buf, b, _offsets(sizes), batch)

    assert out is y
    torch.testing.assert_close(
        out.float(), expected.float(), atol=TOLERANCE[dtype] * 10, rtol=TOLERANCE[dtype]
    )
    assert torch.equal(out[base_rows], y_base_before)
