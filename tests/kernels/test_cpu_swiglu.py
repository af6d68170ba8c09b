"""The CPU SwiGLU kernel against the exact silu(gate) * up, within the bound its roundings give,
and against the torch path it replaces."""

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_swiglu import CpuSwiglu
from tests.kernels.rounding import assert_within, cast_error, gamma

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32 = 2.0**-24
# gates past where e^-g over- or underflows fp32 (silu is 0 or g there), and zero
EDGES = [0.0, 30.0, 100.0, -30.0, -100.0, -200.0]


@pytest.fixture(scope="module")
def kernel(target) -> CpuSwiglu:
    # the workers' folder: one build (of each target) serves tests and engines
    kernel, why = CpuSwiglu.load(target=target)
    assert kernel is not None, why
    return kernel


def _exact(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


def _bound(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(g) = g / (1 + e^-g) with e^-g = 2^(g * -log2 e): the product's rounding moves the
    exponent by |g log2 e| fp32 ulps at 1, which moves e^-g by |g| ulps relative (times ln 2);
    the polynomial errs by up to two more, 1 + e^-g and the division round once each, and silu's
    relative error is at most e^-g's. Then its cast to the dtype, the product with up (one fp32
    rounding) and its cast. A cast whose result is subnormal errs by up to half the subnormals'
    spacing however small the result, the first one multiplied by |up|. Where e^-g overflows fp32
    (g below about -88), silu comes out 0, as torch's does: it errs by all of its exact value."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    s = (gate.abs() + 8) * FP32 + 2 * cast_error(gate_up.dtype) + FP32
    info = torch.finfo(gate_up.dtype)
    underflow = info.tiny * info.eps / 2 * (up.abs() + 1)
    exact = _exact(gate_up).abs()
    overflow = torch.where(gate * -math.log2(math.e) >= 127, exact, 0)
    return gamma(s) * exact + underflow + overflow


def _gate_up(rows: int, size: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * size, generator=generator)
    gate_up[:, :size] *= 4
    edges = torch.tensor(EDGES)[: min(size, len(EDGES))]
    gate_up[0, : len(edges)] = edges
    return gate_up.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "size"), [(1, 1536), (33, 1536), (7, 16), (3, 17), (2, 5)])
def test_swiglu_matches_the_exact_product(kernel, dtype, rows, size):
    gate_up = _gate_up(rows, size, dtype, rows * size)
    got = kernel(gate_up)
    assert got.shape == (rows, size) and got.dtype == dtype
    assert_within(got, _exact(gate_up), _bound(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_of_a_wider_tensor_are_read_at_their_stride(kernel, dtype):
    """In bf16 and fp16 the result is the torch path's nearly everywhere (an fp32 ulp of silu
    moves the cast only at a tie)."""
    wide = torch.full((40, 3 * 96), float("nan"), dtype=dtype)
    gate_up = wide[:, 20 : 20 + 2 * 96]
    gate_up.copy_(_gate_up(40, 96, dtype, 3))
    got = kernel(gate_up)
    assert_within(got, _exact(gate_up), _bound(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    if dtype != torch.float32:
        assert (got == F.silu(gate) * up).float().mean() > 0.99
