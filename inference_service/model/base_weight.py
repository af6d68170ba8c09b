"""The base weight of a linear layer, in one of three formats: dense, int8 weight-only (a scale
per output row) or NF4 (blocks of 64 values with an fp32 absmax each). LoRALinear computes its base
output through one of these, then adds the LoRA delta in the activations' dtype; LoRA is never
merged into a quantized weight.

Each format takes the checkpoint's rows slice by slice (q, k and v into one fused weight), so a
fused weight holds exactly what the separate layers of the reference would.
"""

import torch
import torch.nn.functional as F
from torch import nn

from inference_service.model.packed_weight import PackedWeight, PanelWeight, packed
from kernels.cpu_linear import CpuLinear
from kernels.int8_linear import int8_linear, int8_linear_triton, quantize_int8_rows
from kernels.nf4_linear import BLOCK, nf4_linear, nf4_linear_triton, quantize_nf4
from shared.errors import FailedPrecondition, InvalidArgument
from shared.model_config import ModelConfig

QUANTIZATIONS = ("none", "int8", "nf4")


class DenseWeight(nn.Module):
    def __init__(self, out_features: int, in_features: int, slice_sizes, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), False)
        self.packed: PanelWeight | PackedWeight | None = None  # laid out for the CPU, once pack() ran

    def load_rows(self, offset: int, rows: torch.Tensor) -> None:
        self.weight[offset : offset + rows.shape[0]].copy_(rows)

    def pack(self, linear: CpuLinear | None) -> None:
        """Once loaded, on a CPU: the weight laid out for its matmuls (packed_weight.packed), the
        dense copy let go."""
        self.packed = packed(self.weight, linear)
        if self.packed is not None:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            return self.packed.linear(x, bias)  # [tokens, out]
        return F.linear(x, self.weight, bias)  # [tokens, out]


class Int8Weight(nn.Module):
    """torchao's Int8WeightOnlyConfig: rows quantized symmetrically to int8, one fp32 scale each.
    On a CPU, fp32 activations (and bf16 ones, with AVX512-BF16) multiply them in
    kernels/cpu_linear.py's panels once pack() ran."""

    def __init__(self, out_features: int, in_features: int, slice_sizes, dtype, device):
        super().__init__()
        self.dtype = dtype  # the activations'
        self.register_buffer("q", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.zeros(out_features, dtype=torch.float32, device=device))
        self.linear: CpuLinear | None = None  # multiplies q, in its panels, once pack() ran

    def load_rows(self, offset: int, rows: torch.Tensor, columns: tuple[int, int] | None = None) -> None:
        """Whole rows, quantized with a scale each; under tensor parallelism a row-parallel rank
        keeps `columns` of them (its scales still those of the whole rows, as one device's)."""
        q, scale = quantize_int8_rows(rows.to(self.q.device))
        self.load_quantized(offset, q if columns is None else q[:, columns[0] : columns[1]], scale)

    def load_quantized(self, offset: int, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Rows from offset on, already int8: q [rows, in], scale [rows] fp32."""
        self.q[offset : offset + q.shape[0]] = q
        self.scale[offset : offset + q.shape[0]] = scale

    def pack(self, linear: CpuLinear | None) -> None:
        """Once loaded, on a CPU with fp32 activations (or bf16 where it has AVX512-BF16): q laid
        out in `linear`'s panels, each weight widened as the kernel reads it (torch's path casts all
        of q at every call)."""
        if linear is not None and linear.runs(self.q, self.dtype):
            self.q, self.linear = linear.pack(self.q), linear  # [panels, in, columns]

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.linear is not None:
            x = x if x.stride(1) == 1 else x.contiguous()
            return self.linear(x, self.q, self.scale.shape[0], bias, self.scale)  # [tokens, out]
        if x.is_cuda:  # one launch, the int8 tiles cast as they load
            return int8_linear_triton(x, self.q, self.scale, bias)  # [tokens, out]
        return int8_linear(x, self.q, self.scale, bias)  # [tokens, out]


class Nf4Weight(nn.Module):
    """bitsandbytes' NF4 (without double quantization: the absmax stays fp32). Each slice is
    quantized alone, as the reference's separate layers are, so its blocks must not straddle the
    next slice: every slice's size times in_features is a multiple of 64. On a CPU, fp32
    activations (and bf16 ones, with AVX512-BF16) multiply the codes in kernels/cpu_linear.py's
    panels once pack() ran."""

    def __init__(self, out_features: int, in_features: int, slice_sizes, dtype, device):
        super().__init__()
        for size in slice_sizes:
            if size * in_features % BLOCK:
                raise InvalidArgument(
                    f"NF4 needs every weight's element count to be a multiple of {BLOCK}; "
                    f"a [{size}, {in_features}] weight is not"
                )
        self.in_features, self.out_features = in_features, out_features
        n = out_features * in_features
        self.register_buffer("packed", torch.zeros(n // 2, dtype=torch.uint8, device=device))
        self.register_buffer("absmax", torch.zeros(n // BLOCK, dtype=torch.float32, device=device))
        self.dtype = dtype  # the activations'
        self.linear: CpuLinear | None = None  # multiplies the codes, in its panels, once pack() ran

    def load_rows(self, offset: int, rows: torch.Tensor) -> None:
        self.load_quantized(offset, *quantize_nf4(rows.to(self.packed.device)))

    def load_quantized(self, offset: int, packed: torch.Tensor, absmax: torch.Tensor) -> None:
        """Rows from offset on, already NF4: packed [rows * in / 2] uint8, absmax [rows * in / 64]."""
        start = offset * self.in_features
        self.packed[start // 2 : start // 2 + packed.numel()] = packed
        self.absmax[start // BLOCK : start // BLOCK + absmax.numel()] = absmax

    def pack(self, linear: CpuLinear | None) -> None:
        """Once loaded, on a CPU with fp32 activations (or bf16 where it has AVX512-BF16): the
        codes and absmax laid out in `linear`'s panels, each weight looked up as the kernel reads it
        (torch's path dequantizes the whole weight at every call)."""
        if linear is not None and linear.runs_nf4(self.packed, self.in_features, self.dtype):
            self.packed, self.absmax = linear.pack_nf4(self.packed, self.absmax, self.out_features)
            self.linear = linear

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.linear is not None:
            x = x if x.stride(1) == 1 else x.contiguous()
            return self.linear(x, self.packed, self.out_features, bias, self.absmax)  # [tokens, out]
        if x.is_cuda:  # one launch, dequantizing each weight tile as it loads
            return nf4_linear_triton(x, self.packed, self.absmax, self.out_features, bias)  # [tokens, out]
        return nf4_linear(x, self.packed, self.absmax, self.out_features, bias)  # [tokens, out]


FORMATS = {"none": DenseWeight, "int8": Int8Weight, "nf4": Nf4Weight}


def base_weight(
    quantization: str, in_features: int, slice_sizes: tuple[int, ...], dtype, device
) -> DenseWeight | Int8Weight | Nf4Weight:
    if quantization not in FORMATS:
        raise InvalidArgument(f"quantization {quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
    return FORMATS[quantization](sum(slice_sizes), in_features, slice_sizes, dtype, device)


def weight_bytes(module: nn.Module) -> int:
    """Bytes the base weights of every linear layer under `module` hold, in whatever format."""
    formats = tuple(FORMATS.values())
    return sum(
        t.numel() * t.element_size()
        for m in module.modules()
        if isinstance(m, formats)
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
    )


def serving_format(model: ModelConfig, asked: str, model_dir: str) -> str:
    """The linear layers' base format: the checkpoint's own when it is pre-quantized, else
    `asked` (--quantization)."""
    stored = model.checkpoint_quantization
    if model.moe and (stored, asked) != ("none", "none"):
        raise FailedPrecondition(
            f"model folder {model_dir}: quantized bases are supported for dense models only, "
            f"not {model.model_type}"
        )
    if stored == "none":
        return asked
    if asked not in ("none", stored):
        raise InvalidArgument(
            f"model folder {model_dir} holds {stored} weights, not {asked} ones (--quantization)"
        )
    return stored
