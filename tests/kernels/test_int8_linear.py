"""int8_linear against torchao, the reference for the format: the same integers and scales from the
same weight, and the same outputs from them."""

import pytest
import torch

from kernels.int8_linear import dequantize_int8_rows, int8_linear, int8_linear_triton, quantize_int8_rows
from tests.kernels.rounding import assert_within, cast_error, fp32_error, gamma

torchao_int8 = pytest.importorskip("torchao.quantization.quantize_.workflows.int8.int8_tensor")
PerRow = pytest.importorskip("torchao.quantization").PerRow

SHAPES = [(1, 64, 32), (7, 96, 160), (33, 256, 64)]  # (tokens, in, out)


def weight_of(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(out_features, in_features) * 0.05
    w[0] = 0.0  # an all-zero row: the scale falls back to eps
    w[1, 3] = 0.9  # an outlier sets its row's scale
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "in_features", "out_features"), SHAPES)
def test_quantization_and_linear_equal_torchaos(dtype, tokens, in_features, out_features):
    torch.manual_seed(tokens)
    weight = weight_of(out_features, in_features, dtype)
    x = torch.randn(tokens, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    reference = torchao_int8.Int8Tensor.from_hp(weight, granularity=PerRow())

    q, scale = quantize_int8_rows(weight)

    assert torch.equal(q, reference.qdata)
    assert torch.equal(scale, reference.scale.flatten())
    assert torch.equal(int8_linear(x, q, scale, bias), torch.nn.functional.linear(x, reference, bias))


def test_dequantized_rows_are_within_half_a_step_of_the_weight():
    torch.manual_seed(0)
    weight = weight_of(64, 128, torch.float32)
    q, scale = quantize_int8_rows(weight)
    error = (dequantize_int8_rows(q, scale, torch.float32) - weight).abs()  # [out, in]
    # A row's peak is 127.5 steps: clipped to 127, half a step off, plus 127.5 times the fp32
    # rounding of its scale (at most 2**-24 relative; 2**-23 allows the product's rounding too).
    assert (error <= scale[:, None] * (0.5 + 128 * 2**-23)).all()


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "in_features", "out_features"), [(1, 64, 32), (5, 96, 80), (19, 200, 130)]
)
def test_triton_kernel_is_within_its_rounding_bound(dtype, bias, tokens, in_features, out_features):
    """Masked tails in every dimension (80 and 130 columns, 96 and 200 inputs, 19 tokens)."""
    torch.manual_seed(in_features)
    q, scale = quantize_int8_rows(weight_of(out_features, in_features, torch.float32))
    x = torch.randn(tokens, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None

    got = int8_linear_triton(x, q, scale, b)

    terms = x.double() @ q.double().T * scale.double()  # [tokens, out], exact
    size = x.double().abs() @ q.double().abs().T * scale.double()
    if b is not None:
        terms, size = terms + b.double(), size + b.double().abs()
    # per term: its product, in_features - 1 additions, the scale, the bias, the cast to dtype
    s = (in_features + 2) * fp32_error(x.device) + (cast_error(dtype) if dtype != torch.float32 else 0)
    assert got.dtype == dtype
    assert_within(got, terms, gamma(s) * size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_at_a_3b_models_shape_on_a_gpu(dtype):
    """Compiled, at Llama-3.2-3B's MLP width (3072 -> 8192), within the same derived bound."""
    torch.manual_seed(0)
    q, scale = quantize_int8_rows(torch.randn(8192, 3072, device="cuda") * 0.02)
    x = torch.randn(64, 3072, device="cuda").to(dtype)
    got = int8_linear_triton(x, q, scale, None)
    exact = x.double() @ q.double().T * scale.double()
    size = x.double().abs() @ q.double().abs().T * scale.double()
    s = 3074 * fp32_error(x.device) + (cast_error(dtype) if dtype != torch.float32 else 0)
    assert_within(got, exact.cpu(), (gamma(s) * size).cpu())
