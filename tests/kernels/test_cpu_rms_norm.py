"""The CPU RMSNorm kernel against the exact float64 norm, within the bound its roundings give, and
against the torch path it replaces."""

import pytest
import torch

from inference_service.model.model import RMSNorm
from kernels.cpu_rms_norm import CpuRmsNorm
from tests.kernels.rounding import assert_within, cast_error, gamma

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32 = 2.0**-24


@pytest.fixture(scope="module")
def kernel(target) -> CpuRmsNorm:
    # the workers' folder: one build (of each target) serves tests and engines
    kernel, why = CpuRmsNorm.load(target=target)
    assert kernel is not None, why
    return kernel


def _bound(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """|got - exact| <= gamma(s) |exact|: the n squares and n - 1 additions of the sum, the
    division, the epsilon, the square root and the reciprocal (each one fp32 rounding; halved by
    the root, counted whole), then the product with x, its cast, the product with the weight and
    its cast; and each cast, where its result is subnormal (fp16's are near 1e-5), errs by up to
    half the subnormals' spacing however small the result."""
    n = x.shape[1]
    s = (2 * n + 6) * FP32 + 2 * cast_error(x.dtype)
    info = torch.finfo(x.dtype)
    underflow = info.tiny * info.eps / 2 * (weight.double().abs() + 1)
    return gamma(s) * _exact(x, weight, eps).abs() + underflow


def _exact(x, weight, eps):
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "size"), [(1, 576), (37, 576), (5, 64), (3, 72), (2, 7)])
@pytest.mark.parametrize("scale", [3.0, 1e-3])  # 1e-3: squares of 1e-6, where eps counts
def test_rms_norm_matches_the_exact_norm(kernel, dtype, rows, size, scale):
    generator = torch.Generator().manual_seed(rows * size)
    x = (torch.randn(rows, size, generator=generator) * scale).to(dtype)
    weight = torch.randn(size, generator=generator).to(dtype)
    got = kernel(x, weight, 1e-5)
    assert_within(got, _exact(x, weight, 1e-5), _bound(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_a_wider_tensor_are_read_at_their_stride(kernel, dtype):
    """The logit rows' hidden states are such a view. In bf16 and fp16 the result is the torch
    path's nearly everywhere (a sum of squares added in another order moves an fp32 rounding, and
    the cast to the dtype hides it but at a tie); in fp32 that rounding shows in a whole row."""
    generator = torch.Generator().manual_seed(7)
    wide = (torch.randn(40, 2 * 576, generator=generator) * 3).to(dtype)
    x = wide[:, :576]
    norm = RMSNorm(576, 1e-6, dtype, "cpu")
    norm.weight.data = torch.randn(576, generator=generator).to(dtype)
    got = kernel(x, norm.weight, 1e-6)
    assert got.is_contiguous()
    assert_within(got, _exact(x, norm.weight, 1e-6), _bound(x, norm.weight, 1e-6))
    if dtype != torch.float32:
        assert (got == norm(x)).float().mean() > 0.99


def test_a_weight_of_another_dtype_is_refused(kernel):
    with pytest.raises(AssertionError):
        kernel(torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(16), 1e-5)
