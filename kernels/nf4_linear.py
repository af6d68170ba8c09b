"""nf4_linear: a linear layer whose weight is 4-bit NormalFloat (QLoRA's NF4, as bitsandbytes
stores it): the flattened weight in blocks of 64, each an fp32 absmax times 16 code values,
two codes a byte (the first in the high nibble). The weight is dequantized and multiplied in the
activations' dtype, as bitsandbytes' CPU path does. On a CPU with fp32 activations the compiled
linear kernel takes the codes instead (kernels/cpu_linear.py's pack_nf4): it looks each one up as
its tiles read it, giving the same weights, and never writes the dequantized weight."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_in_fp32

BLOCK = 64
TILE_M, TILE_N, TILE_K = 16, 64, 64
# The 16 NF4 values: quantiles of N(0, 1) normalized to [-1, 1] with an exact 0 (Dettmers et al.,
# QLoRA, 2023, appendix E), as float32.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip
TINY = 1e-38  # an all-zero block keeps absmax 0 but divides by this instead


def nf4_code(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)  # [16]


def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: per block b of 64 consecutive values of weight.flatten(), absmax[b] = max |w|;
    each value w becomes the index of the NF4 value nearest w / absmax[b] (ties to the upper one,
    as bitsandbytes' bucketize over midpoints decides them).

    weight: [out, in] with out * in a multiple of 64 -> (packed [out * in / 2] uint8, absmax
    [out * in / 64] float32)."""
    flat = weight.reshape(-1, BLOCK).float()  # [blocks, 64]
    absmax = flat.abs().amax(dim=1)  # [blocks]
    scaled = torch.clamp(flat * (1.0 / absmax.clamp(min=TINY)[:, None]), -1, 1).reshape(-1)
    code = nf4_code(weight.device)
    index = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    return (index[::2] << 4) | index[1::2], absmax


def nf4_pairs(device: torch.device | str = "cpu") -> torch.Tensor:
    """The two values each byte of packed codes holds: [256, 2] fp32, the high nibble's first."""
    code, byte = nf4_code(device), torch.arange(256, device=device)
    return torch.stack((code[byte >> 4], code[byte & 0xF]), dim=1)  # [256, 2]


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
    """packed [n / 2] uint8, absmax [n / 64] -> the weight [out, in] in `dtype`; the product is
    taken in fp32 and rounded to `dtype` once, as bitsandbytes does. Each byte is looked up once
    for both its values (half the time of a lookup per code with int64 indices, on the CPU)."""
    values = F.embedding(packed.int(), nf4_pairs(packed.device)).view(-1, BLOCK)  # [blocks, 64] fp32
    return values.mul_(absmax[:, None]).view(shape).to(dtype)


def nf4_linear(
    x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """Semantics: y = x @ dequantize(W)^T + bias, in x's dtype.

    x: [tokens, in]; packed: [out * in / 2] uint8; absmax: [out * in / 64] -> [tokens, out]."""
    weight = dequantize_nf4(packed, absmax, (out_features, x.shape[-1]), x.dtype)  # [out, in]
    return F.linear(x, weight, bias)


def dequantize_nested_absmax(
    codes: torch.Tensor, scales: torch.Tensor, code_map: torch.Tensor, offset: float, block: int
) -> torch.Tensor:
    """Double quantization as bitsandbytes stores it: absmax[b] = code_map[codes[b]] *
    scales[b // block] + offset, in fp32. A checkpoint saved with it loads into plain fp32 absmax
    equal to what bitsandbytes computes at every forward.

    codes: [blocks] uint8; scales: [ceil(blocks / block)] fp32; code_map: [256] fp32 -> [blocks]."""
    values = code_map.float()[codes.long()]  # [blocks]
    per_block = scales.float().repeat_interleave(block)[: values.numel()]  # [blocks]
    return values * per_block + offset


def nf4_linear_triton(
    x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, out_features: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """nf4_linear's semantics in one launch, never materializing the weight: a program per
    [TILE_M, TILE_N] tile of y reads the packed codes of each [TILE_N, TILE_K] weight tile, looks
    them up in the 16-value table, multiplies by their block's absmax in fp32 and rounds to x's
    dtype (the dequantized weight the reference multiplies), then accumulates in fp32.

    x: [tokens, in]; packed: [out * in / 2] uint8; absmax: [out * in / 64] -> [tokens, out]."""
    tokens, in_features = x.shape
    assert x.stride(1) == 1 and packed.is_contiguous() and absmax.is_contiguous()
    y = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(tokens, TILE_M), triton.cdiv(out_features, TILE_N))
    _nf4_kernel[grid](
        x, packed, absmax, nf4_code(x.device), bias if bias is not None else absmax, y,
        tokens, out_features, in_features, x.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        QBLOCK=BLOCK, BLOCK_M=TILE_M, BLOCK_N=TILE_N, BLOCK_K=TILE_K, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return y


@triton.jit
def _nf4_kernel(
    x_ptr, packed_ptr, absmax_ptr, code_ptr, bias_ptr, y_ptr, tokens, out_features, in_features,
    x_stride, y_stride, HAS_BIAS: tl.constexpr, QBLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # [K]
        x = tl.load(
            x_ptr + rows[:, None] * x_stride + ks[None, :],
            mask=(rows[:, None] < tokens) & (ks[None, :] < in_features),
            other=0.0,
        )  # [M, K]
        inside = (cols[None, :] < out_features) & (ks[:, None] < in_features)  # [K, N]
        element = cols[None, :].to(tl.int64) * in_features + ks[:, None]  # [K, N]: index in the flat weight
        byte = tl.load(packed_ptr + element // 2, mask=inside, other=0).to(tl.int32)
        nibble = tl.where(element % 2 == 0, byte >> 4, byte & 15)  # the first value is the high nibble
        value = tl.load(code_ptr + nibble, mask=inside, other=0.0)  # [K, N] fp32
        scale = tl.load(absmax_ptr + element // QBLOCK, mask=inside, other=0.0)
        acc += dot(x, (value * scale).to(x.dtype), DOT_FP32)
    y = acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < out_features, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < tokens) & (cols[None, :] < out_features)
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
