"""nf4_linear against bitsandbytes, the reference for the format: the same packed codes and absmax
from the same weight, the same dequantized weight (double quantization included) and outputs."""

import pytest
import torch

from kernels.nf4_linear import (
    BLOCK,
    NF4_CODE,
    dequantize_nested_absmax,
    dequantize_nf4,
    nf4_linear,
    nf4_linear_triton,
    quantize_nf4,
)
from tests.kernels.rounding import assert_within, cast_error, fp32_error, gamma

bnb = pytest.importorskip("bitsandbytes.functional")

SHAPES = [(1, 64, 32), (5, 128, 96), (17, 256, 64)]  # (tokens, in, out)


def weight_of(out_features: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    w = torch.randn(out_features, in_features) * 0.05
    w[0, :BLOCK] = 0.0  # an all-zero block
    w[1, 7] = -0.8  # an outlier sets its block's absmax
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("tokens", "in_features", "out_features"), SHAPES)
def test_quantization_dequantization_and_linear_equal_bitsandbytes(dtype, tokens, in_features, out_features):
    torch.manual_seed(tokens)
    weight = weight_of(out_features, in_features, dtype)
    x = torch.randn(tokens, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    packed_ref, state = bnb.quantize_4bit(
        weight, blocksize=BLOCK, quant_type="nf4", compress_statistics=False
    )

    packed, absmax = quantize_nf4(weight)

    assert torch.equal(packed, packed_ref.flatten()) and torch.equal(absmax, state.absmax)
    dequantized = dequantize_nf4(packed, absmax, (out_features, in_features), dtype)
    assert torch.equal(dequantized, bnb.dequantize_4bit(packed_ref, state))
    expected = torch.nn.functional.linear(x, bnb.dequantize_4bit(packed_ref, state).to(dtype), bias)
    assert torch.equal(nf4_linear(x, packed, absmax, out_features, bias), expected)


def test_double_quantized_absmax_loads_as_bitsandbytes_computes_it():
    torch.manual_seed(3)
    weight = weight_of(160, 512, torch.float32)  # 1280 blocks: 5 nested blocks of 256
    packed_ref, state = bnb.quantize_4bit(weight, blocksize=BLOCK, quant_type="nf4", compress_statistics=True)
    nested = state.state2

    absmax = dequantize_nested_absmax(
        state.absmax, nested.absmax, nested.code, float(state.offset), nested.blocksize
    )

    assert torch.equal(dequantize_nf4(packed_ref.flatten(), absmax, (160, 512), torch.float32),
                       bnb.dequantize_4bit(packed_ref, state))  # fmt: skip


def test_each_value_is_the_nearest_code_times_its_blocks_absmax():
    torch.manual_seed(1)
    weight = weight_of(8, 128, torch.float32)
    packed, absmax = quantize_nf4(weight)
    dequantized = dequantize_nf4(packed, absmax, (8, 128), torch.float32).reshape(-1, BLOCK)
    blocks = weight.reshape(-1, BLOCK)
    code = torch.tensor(NF4_CODE)
    candidates = code[None, None, :] * absmax[:, None, None]  # [blocks, 1, 16]
    best = (candidates - blocks[..., None]).abs().amin(dim=-1)  # [blocks, 64]
    assert torch.allclose((dequantized - blocks).abs(), best, rtol=0, atol=1e-7)


def flat_block_dequantize(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The format as bitsandbytes' quantize and CUDA dequantize lay it out, plainly: value i of the
    row-major flattened weight is NF4_CODE[code i] * absmax[i // 64], code i in byte i // 2 (the
    high nibble for even i). A block of 64 runs on into the next row where a row is shorter."""
    rows, cols = shape
    values = []
    for i in range(rows * cols):
        byte = int(packed[i // 2])
        code = byte >> 4 if i % 2 == 0 else byte & 0xF
        values.append(NF4_CODE[code] * float(absmax[i // BLOCK]))  # exact in float64, rounded once
    return torch.tensor(values, dtype=torch.float32).reshape(rows, cols)


# in_features a multiple of 16 but not of 64: blocks straddle two rows, where bitsandbytes' own CPU
# dequantize reads other values than its quantize wrote (README, quantized base weights).
@pytest.mark.parametrize("shape", [(2, 96), (4, 160), (8, 48)])
def test_blocks_across_rows_dequantize_as_the_flat_block_format_lays_them_out(shape):
    torch.manual_seed(5)
    weight = torch.randn(*shape) * 0.05
    packed_ref, state = bnb.quantize_4bit(
        weight, blocksize=BLOCK, quant_type="nf4", compress_statistics=False
    )

    packed, absmax = quantize_nf4(weight)

    assert torch.equal(packed, packed_ref.flatten()) and torch.equal(absmax, state.absmax)
    dequantized = dequantize_nf4(packed, absmax, shape, torch.float32)
    assert torch.equal(dequantized, flat_block_dequantize(packed, absmax, shape))


@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("tokens", "in_features", "out_features"), [(1, 64, 32), (5, 96, 80), (19, 192, 130)]
)
def test_triton_kernel_is_within_its_rounding_bound(dtype, bias, tokens, in_features, out_features):
    """Masked tails in every dimension, and blocks of 64 that straddle weight rows (in 96)."""
    torch.manual_seed(in_features)
    packed, absmax = quantize_nf4(weight_of(out_features, in_features, torch.float32))
    x = torch.randn(tokens, in_features).to(dtype)
    b = torch.randn(out_features).to(dtype) if bias else None

    got = nf4_linear_triton(x, packed, absmax, out_features, b)

    index = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1, BLOCK).long()
    weight = (torch.tensor(NF4_CODE, dtype=torch.float64)[index] * absmax.double()[:, None]).reshape(
        out_features, in_features
    )  # exact
    terms, size = x.double() @ weight.T, x.double().abs() @ weight.abs().T
    if b is not None:
        terms, size = terms + b.double(), size + b.double().abs()
    # per term: the dequantized value and its cast, its product, in_features - 1 additions, the
    # bias, the cast of the result
    narrow = 2 * cast_error(dtype) if dtype != torch.float32 else 0
    s = (in_features + 2) * fp32_error(x.device) + narrow
    assert got.dtype == dtype
    assert_within(got, terms, gamma(s) * size)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_kernel_at_a_3b_models_shape_on_a_gpu(dtype):
    """Compiled, at Llama-3.2-3B's MLP width (3072 -> 8192), within the same derived bound."""
    torch.manual_seed(0)
    packed, absmax = quantize_nf4(torch.randn(8192, 3072, device="cuda") * 0.02)
    x = torch.randn(64, 3072, device="cuda").to(dtype)
    got = nf4_linear_triton(x, packed, absmax, 8192, None)
    weight = dequantize_nf4(packed, absmax, (8192, 3072), torch.float64)
    exact, size = x.double() @ weight.T, x.double().abs() @ weight.abs().T
    s = 3074 * fp32_error(x.device) + (2 * cast_error(dtype) if dtype != torch.float32 else 0)
    assert_within(got, exact.cpu(), (gamma(s) * size).cpu())
