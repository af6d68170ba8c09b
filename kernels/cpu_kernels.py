"""cpu_kernels: the compiled CPU kernels one process runs with (kernels/cpu_library.py builds them)."""

from dataclasses import dataclass
from pathlib import Path

from kernels.cpu_decode_attention import CpuDecodeAttention
from kernels.cpu_lora import CpuLora
from kernels.cpu_rms_norm import CpuRmsNorm
from kernels.cpu_rope import CpuRope


@dataclass(frozen=True)
class CpuKernels:
    """Each kernel, or None where it could not be built: then its torch path runs (decodes gather
    their blocks for SDPA; LoRA gathers pages for batched matmuls; rotary embeddings and RMSNorm
    take torch's elementwise ops)."""

    decode_attention: CpuDecodeAttention | None = None
    lora: CpuLora | None = None
    rope: CpuRope | None = None
    rms_norm: CpuRmsNorm | None = None

    @classmethod
    def load(cls, directory: Path | None = None) -> "tuple[CpuKernels, str]":
        """The kernels, and how each was had (built where, or why not)."""
        attention, attention_how = CpuDecodeAttention.load(directory)
        lora, lora_how = CpuLora.load(directory)
        rope, rope_how = CpuRope.load(directory)
        norm, norm_how = CpuRmsNorm.load(directory)
        how = f"decode attention: {_said(attention, attention_how, 'gathering blocks for SDPA')}; "
        how += f"LoRA: {_said(lora, lora_how, 'gathering pages for batched matmuls')}; "
        how += f"rotary embeddings: {_said(rope, rope_how, 'torch ops')}; "
        how += f"RMSNorm: {_said(norm, norm_how, 'torch ops')}"
        return cls(attention, lora, rope, norm), how


def _said(kernel: object | None, how: str, instead: str) -> str:
    return how if kernel else f"{instead} ({how})"
