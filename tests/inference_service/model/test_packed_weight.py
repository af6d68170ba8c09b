"""packed(), the CPU's layouts for linear weights, against F.linear in float64: fp32 in the
compiled kernel's panels, or in oneDNN's blocks where it is missing, both summing each output in
blocks of SUM_BLOCK inputs as MKL does; bf16 in the kernel's panels or oneDNN's layout, one fp32
sum rounded once."""

import pytest
import torch
import torch.nn.functional as F

from inference_service.model.packed_weight import SUM_BLOCK, PackedWeight, PanelWeight, packed
from kernels.cpu_linear import CpuLinear


@pytest.fixture(scope="module")
def linear() -> CpuLinear:
    kernel, why = CpuLinear.load()
    assert kernel is not None, why
    return kernel


@pytest.fixture(params=["panels", "onednn"])
def fp32_layout(request, linear) -> CpuLinear | None:
    """The kernel packed() is given: the compiled one, or none (a machine without a compiler)."""
    return linear if request.param == "panels" else None


def worst_case_error(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bound on the rounding error of each output's fp32 sum of in_features products and a bias,
    in any order: gamma_n * (sum |x_k w_k| + |b|), n = in_features + 1 (Higham, 3.1)."""
    u = torch.finfo(torch.float32).eps / 2
    n = x.shape[1] + 1
    magnitude = x.abs().double() @ weight.abs().double().T  # [tokens, out]
    if bias is not None:
        magnitude += bias.abs().double()
    return n * u / (1 - n * u) * magnitude  # [tokens, out]


def test_each_dtype_gets_its_layout(linear):
    weight = torch.randn(96, 64)
    assert isinstance(packed(weight, linear), PanelWeight)
    onednn = packed(weight, None)
    assert isinstance(onednn, PackedWeight) and onednn.spans == ((0, 64),)
    assert packed(weight.half(), linear) is None  # fp16: F.linear
    if linear.runs(weight.bfloat16()):
        assert isinstance(packed(weight.bfloat16(), linear), PanelWeight)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert isinstance(packed(weight.bfloat16(), None), PackedWeight)
        assert isinstance(packed(weight[:, :63].bfloat16(), linear), PackedWeight)  # odd inputs


@pytest.mark.parametrize("in_features", [64, SUM_BLOCK, 576, 1536, 1000])
@pytest.mark.parametrize("tokens", [1, 32, 77])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_matches_linear(fp32_layout, in_features, tokens, bias):
    gen = torch.Generator().manual_seed(in_features * 100 + tokens)
    x = torch.randn(tokens, in_features, generator=gen)
    weight = torch.randn(96, in_features, generator=gen) / in_features**0.5
    b = torch.randn(96, generator=gen) if bias else None
    weights = packed(weight, fp32_layout)
    expected = F.linear(x.double(), weight.double(), None if b is None else b.double())
    error = (weights.linear(x, b).double() - expected).abs()
    assert (error <= worst_case_error(x, weight, b)).all()
    assert weights.nbytes() >= weight.numel() * 4


@pytest.mark.parametrize("tokens", [1, 9])
def test_fp32_sums_each_block_of_inputs_apart(fp32_layout, tokens):
    """Each output is 2^24 + 575 halves. Summed in one pass every half is lost to rounding (2^24 +
    0.5 rounds back to 2^24); summed in blocks of 192, the first block's halves are, but the next
    two blocks' sums (96 each) are added whole: 2^24 + 192, as MKL's sgemm computes it."""
    x = torch.ones(tokens, 3 * SUM_BLOCK)
    weight = torch.full((100, 3 * SUM_BLOCK), 0.5)  # 100 outputs: a partial last panel too
    weight[:, 0] = 2.0**24
    y = packed(weight, fp32_layout).linear(x, None)
    assert (y == 2.0**24 + 2 * SUM_BLOCK / 2).all(), y.unique()


@pytest.mark.parametrize("layout", ["panels", "onednn"])
def test_bf16_is_one_block_rounded_once(linear, layout):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1536, generator=gen).bfloat16()
    weight = (torch.randn(64, 1536, generator=gen) / 40).bfloat16()
    weights = packed(weight, linear if layout == "panels" else None)
    if weights is None or (layout == "panels") != isinstance(weights, PanelWeight):
        pytest.skip(f"no bf16 {layout} on this CPU")
    assert layout == "panels" or weights.spans == ((0, 1536),)
    y = weights.linear(x, None)
    exact = F.linear(x.double(), weight.double())
    # an fp32 sum rounded once to bf16: within half a bf16 ulp of the exact sum, plus fp32's error
    bound = exact.abs() * torch.finfo(torch.bfloat16).eps / 2 + worst_case_error(x, weight, None)
    assert y.dtype == torch.bfloat16
    assert ((y.double() - exact).abs() <= bound * (1 + 1e-6)).all()
