"""int8_linear: a linear layer whose weight is int8 with one scale per output row (weight-only:
activations stay in their own dtype), as torchao's Int8WeightOnlyConfig quantizes and computes it."""

import torch
import triton
import triton.language as tl

from kernels.triton_dot import dot, dot_in_fp32

QMIN, QMAX = -128, 127
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


def quantize_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics: scale[o] = max_i |weight[o, i]| / 127.5 (computed in weight's dtype, at least fp32
    eps), q[o, i] = clamp(round(weight[o, i] * (1 / scale[o])), -128, 127): torchao's symmetric
    per-row scheme, so a checkpoint quantized here holds the values torchao's would.

    weight: [out, in] float -> (q [out, in] int8, scale [out] float32)."""
    peak = torch.maximum(-weight.amin(dim=1).clamp(max=0), weight.amax(dim=1).clamp(min=0))  # [out]
    scale = (peak / ((QMAX - QMIN) / 2)).clamp(min=torch.finfo(torch.float32).eps).to(torch.float32)  # [out]
    q = torch.clamp(torch.round(weight * (1.0 / scale[:, None])), QMIN, QMAX).to(torch.int8)  # [out, in]
    return q, scale


def dequantize_int8_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [out, in] int8, scale [out] -> the weight it stands for, [out, in] in `dtype`."""
    return (q.to(torch.float32) * scale[:, None]).to(dtype)


def int8_linear(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Semantics: y = (x @ q^T) * scale + bias, the matmul in x's dtype on q's integers, then the
    per-row scale: the order torchao's weight-only linear uses, so outputs match it bit for bit on
    the same hardware path.

    x: [tokens, in]; q: [out, in] int8; scale: [out]; bias: [out] or None -> [tokens, out]."""
    y = torch.mm(x, q.t().to(x.dtype)) * scale.to(x.dtype)  # [tokens, out]
    return y + bias if bias is not None else y


def int8_linear_triton(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8_linear's semantics in one launch: a program per [BLOCK_M, BLOCK_N] tile of y loads
    int8 tiles of q, casts them to x's dtype (exact: |q| <= 128) and accumulates x @ q^T in fp32,
    then scales each column and adds the bias before the one rounding to x's dtype.

    x: [tokens, in]; q: [out, in] int8; scale: [out] fp32; bias: [out] or None -> [tokens, out]."""
    tokens, in_features = x.shape
    out_features = q.shape[0]
    assert x.stride(1) == 1 and q.is_contiguous() and scale.is_contiguous()
    y = torch.empty(tokens, out_features, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(tokens, BLOCK_M), triton.cdiv(out_features, BLOCK_N))
    _int8_kernel[grid](
        x, q, scale, bias if bias is not None else scale, y, tokens, out_features, in_features,
        x.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=dot_in_fp32(),
    )  # fmt: skip
    return y


@triton.jit
def _int8_kernel(
    x_ptr, q_ptr, scale_ptr, bias_ptr, y_ptr, tokens, out_features, in_features, x_stride, y_stride,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,
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
        w = tl.load(
            q_ptr + cols[None, :] * in_features + ks[:, None],
            mask=(cols[None, :] < out_features) & (ks[:, None] < in_features),
            other=0,
        )  # [K, N] int8
        # through fp32: exact either way (|q| <= 128), and Triton's interpreter casts int8 to bf16 wrongly
        acc += dot(x, w.to(tl.float32).to(x.dtype), DOT_FP32)
    scale = tl.load(scale_ptr + cols, mask=cols < out_features, other=0.0)  # [N]
    y = acc * scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < out_features, other=0.0).to(tl.float32)[None, :]
    mask = (rows[:, None] < tokens) & (cols[None, :] < out_features)
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)
