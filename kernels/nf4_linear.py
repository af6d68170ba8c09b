"""nf4_linear: a linear layer whose weight is 4-bit NormalFloat (QLoRA's NF4, as bitsandbytes
stores it): the flattened weight in blocks of 64, each an fp32 absmax times 16 code values,
two codes a byte (the first in the high nibble). The weight is dequantized and multiplied in the
activations' dtype, as bitsandbytes' CPU path does."""

import torch
import torch.nn.functional as F

BLOCK = 64
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


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype):
    """packed [n / 2] uint8, absmax [n / 64] -> the weight [out, in] in `dtype`; the product is
    taken in fp32 and rounded to `dtype` once, as bitsandbytes does."""
    index = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1, BLOCK).long()  # [blocks, 64]
    values = nf4_code(packed.device)[index] * absmax[:, None]  # [blocks, 64] fp32
    return values.reshape(shape).to(dtype)


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
