"""PackedWeight, the CPU's oneDNN matmul, against F.linear in float64: any input width (blocks of
SUM_BLOCK and a shorter last one), with and without bias, fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

from inference_service.model.packed_weight import SUM_BLOCK, PackedWeight, packs


def worst_case_error(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bound on the rounding error of each output's fp32 sum of in_features products and a bias,
    in any order: gamma_n * (sum |x_k w_k| + |b|), n = in_features + 1 (Higham, 3.1)."""
    u = torch.finfo(torch.float32).eps / 2
    n = x.shape[1] + 1
    magnitude = x.abs().double() @ weight.abs().double().T  # [tokens, out]
    if bias is not None:
        magnitude += bias.abs().double()
    return n * u / (1 - n * u) * magnitude  # [tokens, out]


@pytest.mark.parametrize("in_features", [64, SUM_BLOCK, 576, 1536, 1000])
@pytest.mark.parametrize("tokens", [1, 32, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_linear(in_features, tokens, bias):
    gen = torch.Generator().manual_seed(in_features * 100 + tokens)
    x = torch.randn(tokens, in_features, generator=gen)
    weight = torch.randn(96, in_features, generator=gen) / in_features**0.5
    b = torch.randn(96, generator=gen) if bias else None
    assert packs(weight)
    packed = PackedWeight.of(weight)
    assert [a for a, _ in packed.spans] == list(range(0, in_features, SUM_BLOCK))
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    error = (packed.linear(x, b).double() - expected).abs()
    assert (error <= worst_case_error(x, weight, b)).all()
    assert packed.nbytes() >= weight.numel() * 4


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bf16 instructions")
def test_bf16_is_one_block_rounded_once():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1536, generator=gen).bfloat16()
    weight = (torch.randn(64, 1536, generator=gen) / 40).bfloat16()
    packed = PackedWeight.of(weight)
    assert packed.spans == ((0, 1536),)
    y = packed.linear(x, None)
    exact = F.linear(x.double(), weight.double())
    # an fp32 sum rounded once to bf16: within half a bf16 ulp of the exact sum, plus fp32's error
    bound = exact.abs() * torch.finfo(torch.bfloat16).eps / 2 + worst_case_error(x, weight, None)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-6)).all()
