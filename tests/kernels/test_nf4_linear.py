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
    quantize_nf4,
)

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
