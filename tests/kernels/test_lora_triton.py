"""The Triton kernels against the plain loop references: small shapes in Triton's interpreter on
CPU (every run), full sizes and CUDA-graph replay on a GPU (marker gpu)."""

import math

import pytest
import torch

from kernels.lora_batch import LoraBatch
from kernels.lora_expand import lora_expand_ref, lora_expand_triton
from kernels.lora_shrink import lora_shrink_ref, lora_shrink_triton
from tests.kernels.slot_spread import SPREADS, token_slots

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SLICE_SIZES = {1: (40,), 2: (48, 48), 3: (72, 24, 24)}  # qkv with GQA has uneven slices
MAX_LORAS = 4
# max rank of the buffers, and each slot's adapter rank (None: every slot at the max)
RANKS = {"r8": (8, None), "r16-mixed": (16, [16, 3, 8, 1]), "r32-mixed": (32, [32, 5, 17, 1])}


def _case(spread, slices, base_every, ranks, dtype, tokens, in_features, sizes, device="cpu"):
    torch.manual_seed(0)
    max_rank, ranks = RANKS[ranks]
    slots = token_slots(spread, tokens, MAX_LORAS, base_every, grouped=False, seed=slices)
    batch = LoraBatch.build(slots, device, slot_ranks=ranks, kernels=True)
    a = torch.randn(MAX_LORAS, max_rank, slices, in_features, device=device, dtype=dtype)
    b = tuple(torch.randn(MAX_LORAS, max_rank, n, device=device, dtype=dtype) for n in sizes)
    for slot, rank in enumerate(ranks or []):  # slot buffers hold zeros past an adapter's rank
        a[slot, rank:] = 0
        for b_s in b:
            b_s[slot, rank:] = 0
    return batch, a, b


def _close(got, expected, dtype, in_features=64):
    """Within the dtype's tolerance, scaled with the sqrt of the features summed over: rounding
    errors of a sum grow like that (the references sum in fp64)."""
    tol = TOLERANCE[dtype] * math.sqrt(in_features / 64)
    torch.testing.assert_close(got.float().cpu(), expected.float().cpu(), atol=tol * 10, rtol=tol)


def _split(buf: torch.Tensor, splits: int) -> torch.Tensor:
    """fp32 partial sums [splits, *buf.shape] that add up to buf, as lora_shrink_triton returns."""
    parts = torch.randn(splits, *buf.shape, device=buf.device)
    parts[0] = buf.float() - parts[1:].sum(0)
    return parts


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shrink_triton_matches_reference(spread, slices, base_every, ranks, dtype):
    batch, a, _ = _case(spread, slices, base_every, ranks, dtype, 37, 136, SLICE_SIZES[slices])
    x = torch.randn(37, 136, dtype=dtype)
    lora_rows = batch.token_slots >= 0  # rows of slot -1 tokens are not written
    expected = lora_shrink_ref(x, a, batch.token_slots)[lora_rows]
    for splits in (1, 3):  # 136 features in 3 splits of 64, 64 and 8: the last one ragged
        partials = lora_shrink_triton(x, a, batch, splits)
        assert partials.shape == (splits, 37, slices, a.shape[1]) and partials.dtype == torch.float32
        _close(partials.sum(0)[lora_rows], expected, dtype, 136)


@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("slices", [1, 2, 3])
@pytest.mark.parametrize("base_every", [0, 3])
@pytest.mark.parametrize("ranks", sorted(RANKS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_expand_triton_matches_reference(spread, slices, base_every, ranks, dtype):
    sizes = SLICE_SIZES[slices]
    batch, _, b = _case(spread, slices, base_every, ranks, dtype, 37, 72, sizes)
    y = torch.randn(37, sum(sizes), dtype=dtype)
    buf = torch.randn(37, slices, b[0].shape[1], dtype=dtype)
    expected = lora_expand_ref(y, buf, b, batch.token_slots)
    base_rows = batch.token_slots < 0
    y_base = y[base_rows].clone()
    out = lora_expand_triton(y, _split(buf, 1 + slices % 2), b, batch)
    _close(out, expected, dtype)
    assert torch.equal(out[base_rows], y_base)


def test_a_batch_without_adapters_launches_nothing():
    batch = LoraBatch.build([-1] * 5, kernels=True)
    x, y = torch.randn(5, 16), torch.randn(5, 8)
    assert lora_shrink_triton(x, torch.randn(2, 4, 1, 16), batch).shape == (1, 5, 1, 4)
    assert torch.equal(
        lora_expand_triton(y.clone(), torch.randn(1, 5, 1, 4), (torch.randn(2, 4, 8),), batch), y
    )


# Full sizes on a GPU: decode (one token per sequence) and prefill segments, Llama-7B-like widths.
GPU_SHAPES = [(1, 4096, (4096, 1024, 1024)), (64, 4096, (11008, 11008)), (512, 4096, (4096,))]


@pytest.mark.gpu
@pytest.mark.parametrize(("tokens", "in_features", "sizes"), GPU_SHAPES)
@pytest.mark.parametrize("spread", SPREADS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_full_size_on_gpu(tokens, in_features, sizes, spread, dtype):
    slices = len(sizes)
    batch, a, b = _case(spread, slices, 3, "r16-mixed", dtype, tokens, in_features, sizes, "cuda")
    x = torch.randn(tokens, in_features, device="cuda", dtype=dtype)
    partials = lora_shrink_triton(x, a, batch)
    lora_rows = batch.token_slots.cpu() >= 0
    buf = torch.where(lora_rows[:, None, None], partials.sum(0).to(dtype).cpu(), 0)  # [tokens, slices, rank]
    expected = lora_shrink_ref(x.cpu(), a.cpu(), batch.token_slots.cpu())
    _close(buf[lora_rows], expected[lora_rows], dtype, in_features)
    y = torch.randn(tokens, sum(sizes), device="cuda", dtype=dtype)
    expected = lora_expand_ref(y.cpu(), buf, tuple(t.cpu() for t in b), batch.token_slots.cpu())
    _close(lora_expand_triton(y, partials, b, batch), expected, dtype, a.shape[1])


@pytest.mark.gpu
def test_triton_kernels_replay_in_a_cuda_graph():
    batch, a, b = _case("uniform", 3, 3, "r16-mixed", torch.bfloat16, 64, 512, (512, 128, 128), "cuda")
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn(64, 768, device="cuda", dtype=torch.bfloat16)
    y = y0.clone()
    lora_expand_triton(y, lora_shrink_triton(x, a, batch), b, batch)  # compile before capture
    expected = lora_expand_triton(y0.clone(), lora_shrink_triton(x, a, batch), b, batch)
    graph = torch.cuda.CUDAGraph()
    y.copy_(y0)
    with torch.cuda.graph(graph):
        lora_expand_triton(y, lora_shrink_triton(x, a, batch), b, batch)
    y.copy_(y0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, expected)
