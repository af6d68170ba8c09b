"""int8_linear: a linear layer whose weight is int8 with one scale per output row (weight-only:
activations stay in their own dtype), as torchao's Int8WeightOnlyConfig quantizes and computes it."""

import torch

QMIN, QMAX = -128, 127


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
