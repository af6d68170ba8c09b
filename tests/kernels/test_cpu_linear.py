"""The CPU's linear kernel against F.linear in float64, within the bound of the sums it makes
(fp32 and int8 weights: blocked; bf16: one fp32 sum rounded once): every row tile (8 rows, and 1
to 7 left), input blocks whole and cut short, panels whole and the last one partial, with and
without bias, x read at its row stride. NF4 weights against the fp32 tiles on their dequantized
values (which bitsandbytes' are checked against in test_nf4_linear.py), bit for bit; int8 ones
under bf16 rows against the bf16 tiles' sums rounded as int8_linear rounds them, bit for bit. That fp32
sums in blocks (and not in one pass) is asserted in
tests/inference_service/model/test_packed_weight.py."""

import pytest
import torch
import torch.nn.functional as F

from kernels.cpu_linear import SUM_BLOCK, CpuLinear
from kernels.int8_linear import quantize_int8_rows
from kernels.nf4_linear import dequantize_nf4, quantize_nf4
from tests.kernels.rounding import assert_within, cast_error, gamma

FP32 = 2.0**-24


@pytest.fixture(scope="module")
def kernel(target) -> CpuLinear:
    # the workers' folder: one build (of each target) serves tests and engines
    kernel, why = CpuLinear.load(target=target)
    assert kernel is not None, why
    return kernel


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=str)
def dtype(request, kernel) -> torch.dtype:
    if not kernel.runs(torch.empty(1, 2, dtype=request.param)):
        pytest.skip(f"this build of the kernel has no {request.param} path (no AVX512-BF16)")
    return request.param


def _bound(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A product (exact in fp32, of fp32 or bf16 operands under a fused multiply-add) goes through
    at most one rounding per input of its block's sum, then the additions of the bias and of every
    block's sum (fp32: blocks of SUM_BLOCK; bf16: one block), then the cast to bf16: gamma(s) *
    sum |t|."""
    inputs = x.shape[1]
    block = SUM_BLOCK if x.dtype == torch.float32 else inputs
    s = (min(inputs, block) + -(-inputs // block) + 1) * FP32
    s += 0 if x.dtype == torch.float32 else cast_error(x.dtype)
    absolute = None if bias is None else bias.abs().double()
    magnitude = F.linear(x.abs().double(), weight.abs().double(), absolute)  # [tokens, out]
    return gamma(s) * magnitude


def _case(tokens: int, inputs: int, out: int, bias: bool, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, inputs, generator=gen).to(dtype)
    weight = (torch.randn(out, inputs, generator=gen) / inputs**0.5).to(dtype)
    return x, weight, torch.randn(out, generator=gen).to(dtype) if bias else None


@pytest.mark.parametrize("tokens", [1, 8, 13, 77])
@pytest.mark.parametrize("inputs", [18, SUM_BLOCK, SUM_BLOCK + 2, 1536])
@pytest.mark.parametrize("out", [48, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_the_exact_product(kernel, dtype, tokens, inputs, out, bias):
    x, weight, b = _case(tokens, inputs, out, bias, tokens * inputs + out, dtype)
    y = kernel(x, kernel.pack(weight), out, b)
    assert y.shape == (tokens, out) and y.dtype == dtype
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert_within(y, exact, _bound(x, weight, b))


@pytest.mark.parametrize("tokens", range(1, 18))
def test_every_count_of_rows_past_the_last_whole_tile(kernel, dtype, tokens):
    x, weight, b = _case(tokens, 40, 50, True, tokens, dtype)
    exact = F.linear(x.double(), weight.double(), b.double())
    assert_within(kernel(x, kernel.pack(weight), 50, b), exact, _bound(x, weight, b))


def test_rows_of_later_blocks_are_summed_as_a_row_alone_is(kernel, dtype):
    """Blocks of block_rows rows each meet every panel in turn; each row's sums are the same,
    bit for bit, as a call of that row alone gives, the last block partial."""
    rows = 2 * kernel.block_rows + 37
    x, weight, b = _case(rows, 100, 150, True, 5, dtype)
    panels = kernel.pack(weight)
    y = kernel(x, panels, 150, b)
    alone = torch.cat([kernel(x[i : i + 1], panels, 150, b) for i in range(rows)])
    assert torch.equal(y, alone)
    assert_within(y, F.linear(x.double(), weight.double(), b.double()), _bound(x, weight, b))


def test_rows_of_a_wider_tensor_are_read_at_their_stride(kernel, dtype):
    x, weight, b = _case(11, 200, 60, True, 7, dtype)
    wide = torch.full((11, 300), float("nan"), dtype=dtype)
    wide[:, 50:250] = x
    y = kernel(wide[:, 50:250], kernel.pack(weight), 60, b)
    exact = F.linear(x.double(), weight.double(), b.double())
    assert_within(y, exact, _bound(x, weight, b))


def test_pack_pads_the_last_panel_with_zero_rows(kernel, dtype):
    weight = torch.randn(100, 30).to(dtype)
    panels = kernel.pack(weight)  # [3, 30, 48]
    assert panels.shape == (-(-100 // kernel.columns), 30, kernel.columns)
    step = 1 if dtype == torch.float32 else 2  # bf16: inputs in pairs
    rows = panels.view(panels.shape[0], 30 // step, kernel.columns, step).transpose(1, 2).reshape(-1, 30)
    assert torch.equal(rows[:100], weight)
    assert not rows[100:].any()


def test_other_dtypes_and_shapes_are_refused(kernel):
    x, weight, _ = _case(4, 64, 48, False, 3)
    panels = kernel.pack(weight)
    with pytest.raises(AssertionError):
        kernel(x.bfloat16(), panels, 48, None)  # x of another dtype than the weight's
    with pytest.raises(AssertionError):
        kernel(x, panels, 96, None)  # panels of 48 outputs, not 96
    with pytest.raises(AssertionError):
        kernel(x, panels, 48, torch.zeros(48, dtype=torch.bfloat16))
    assert not kernel.runs(torch.zeros(4, 63, dtype=torch.bfloat16))  # inputs not in pairs
    assert not kernel.runs(torch.zeros(4, 64, dtype=torch.float16))


def _int8_bound(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8 weights are exact in fp32: the sums err as fp32's do (_bound), then the product by the
    scale and the addition of the bias round once each: gamma(s) * (|x| |q|^T |scale| + |bias|)."""
    inputs = x.shape[1]
    s = (min(inputs, SUM_BLOCK) + -(-inputs // SUM_BLOCK) + 2) * FP32
    magnitude = (
        x.double().abs() @ q.double().abs().t()
    ) * scale.double()  # [tokens, out]; int8 -128 has no abs
    return gamma(s) * (magnitude + (0 if bias is None else bias.abs().double()))


@pytest.mark.parametrize("tokens", [1, 7, 8, 13, 77])
@pytest.mark.parametrize("inputs", [18, SUM_BLOCK + 2, 1536])
@pytest.mark.parametrize("out", [48, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weights_match_the_exact_scaled_product(kernel, tokens, inputs, out, bias):
    x, weight, b = _case(tokens, inputs, out, bias, tokens * inputs + out)
    q, scale = quantize_int8_rows(weight)
    y = kernel(x, kernel.pack(q), out, b, scale)
    assert y.shape == (tokens, out) and y.dtype == torch.float32
    exact = (x.double() @ q.double().t()) * scale.double() + (0 if b is None else b.double())
    assert_within(y, exact, _int8_bound(x, q, scale, b))


def test_int8_weights_are_packed_as_fp32_ones_and_need_their_scales(kernel):
    x, weight, _ = _case(4, 30, 100, False, 5)
    q, scale = quantize_int8_rows(weight)
    panels = kernel.pack(q)  # [3, 30, 48] int8
    assert panels.dtype == torch.int8
    assert torch.equal(panels.view(torch.uint8), kernel.pack(q.view(torch.uint8).float()).to(torch.uint8))
    with pytest.raises(AssertionError):
        kernel(x, panels, 100, None)  # without its scales
    with pytest.raises(AssertionError):
        kernel(x.half(), panels, 100, None, scale)  # int8 weights take fp32 or bf16 rows
    assert not kernel.runs(q, torch.float16)
    assert not kernel.runs(torch.zeros(4, 63, dtype=torch.int8), torch.bfloat16)  # inputs not in pairs


@pytest.mark.parametrize("tokens", [1, 7, 8, 13, 77, 300])  # 300: panels looked up once for 3 blocks
@pytest.mark.parametrize("inputs", [18, SUM_BLOCK + 2, 1536])
@pytest.mark.parametrize("out", [48, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_weights_under_bf16_rows_round_as_int8_linear_does_the_bf16_tiles_sums(
    kernel, tokens, inputs, out, bias
):
    """bf16 rows on int8 weights, where the CPU has AVX512-BF16: the bf16 tiles' sums of the
    weights widened to bf16 (exact), each rounded to bf16, times its scale rounded to bf16,
    rounded, plus the bias, rounded: kernels/int8_linear.py's ops on those sums, bit for bit (the
    sums themselves are held to their bound by test_linear_matches_the_exact_product)."""
    if not kernel.runs(torch.zeros(1, 2, dtype=torch.int8), torch.bfloat16):
        pytest.skip("no int8 kernel for bf16 rows in this build (no AVX512-BF16)")
    x, weight, b = _case(tokens, inputs, out, bias, tokens * inputs + out, torch.bfloat16)
    q, scale = quantize_int8_rows(weight.float())
    y = kernel(x, kernel.pack(q), out, b, scale)
    assert y.shape == (tokens, out) and y.dtype == torch.bfloat16
    sums = kernel(x, kernel.pack(q.bfloat16()), out, None)  # [tokens, out] bf16
    expected = sums * scale.bfloat16() + (0 if b is None else b)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("tokens", [1, 7, 8, 13, 77, 300])  # 300: panels looked up once for 3 blocks
@pytest.mark.parametrize("inputs", [64, SUM_BLOCK, SUM_BLOCK + 64, 1536])
@pytest.mark.parametrize("out", [48, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_nf4_weights_are_the_dense_tiles_on_their_dequantized_values(
    kernel, dtype, tokens, inputs, out, bias
):
    """Each code looked up and times its block's absmax as dequantize_nf4 computes it (rounded to
    bf16 for bf16 rows, as it rounds them), then summed as the rows' dtype sums dense weights: the
    same bits as the dense kernel on the dequantized weight."""
    if not kernel.runs_nf4(torch.zeros(1, dtype=torch.uint8), inputs, dtype):
        pytest.skip(f"this build of the kernel has no NF4 path for {dtype} rows")
    x, weight, b = _case(tokens, inputs, out, bias, tokens * inputs + out, dtype)
    codes, absmax = quantize_nf4(weight.float())
    panels, blocks = kernel.pack_nf4(codes, absmax, out)
    assert panels.dtype == torch.uint8
    assert panels.shape == (-(-out // kernel.columns), inputs // 2, kernel.columns)
    y = kernel(x, panels, out, b, blocks)
    dequantized = dequantize_nf4(codes, absmax, (out, inputs), dtype)
    expected = kernel(x, kernel.pack(dequantized), out, b)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert y.shape == (tokens, out) and torch.equal(y.view(bits), expected.view(bits))


def test_nf4_panels_need_their_absmax_and_whole_blocks_of_inputs(kernel):
    x, weight, _ = _case(4, 128, 100, False, 6)
    codes, absmax = quantize_nf4(weight)
    panels, blocks = kernel.pack_nf4(codes, absmax, 100)
    with pytest.raises(AssertionError):
        kernel(x, panels, 100, None)  # without its absmax
    with pytest.raises(AssertionError):
        kernel(x, panels, 100, None, absmax)  # absmax not laid out in panels
    with pytest.raises(AssertionError):
        kernel(x.half(), panels, 100, None, blocks)  # NF4 weights take fp32 (or bf16) rows
    assert kernel.runs_nf4(codes, 128, torch.float32) and not kernel.runs_nf4(codes, 128, torch.float16)
    assert not kernel.runs_nf4(codes, 96, torch.float32)  # blocks would straddle rows
    assert not kernel.runs(codes)  # codes are not a dense uint8 weight
