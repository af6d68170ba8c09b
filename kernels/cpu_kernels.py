"""cpu_kernels: the compiled CPU kernels one process runs with (kernels/cpu_library.py builds them)."""

from dataclasses import dataclass
from pathlib import Path

from kernels.cpu_decode_attention import CpuDecodeAttention
from kernels.cpu_lora import CpuLora


@dataclass(frozen=True)
class CpuKernels:
    """Each kernel, or None where it could not be built: then its torch path runs (decodes gather
    their blocks for SDPA; LoRA gathers pages for batched matmuls)."""

    decode_attention: CpuDecodeAttention | None = None
    lora: CpuLora | None = None

    @classmethod
    def load(cls, directory: Path | None = None) -> "tuple[CpuKernels, str]":
        """The kernels, and how each was had (built where, or why not)."""
        attention, attention_how = CpuDecodeAttention.load(directory)
        lora, lora_how = CpuLora.load(directory)
        how = f"decode attention: {_said(attention, attention_how, 'gathering blocks for SDPA')}; "
        how += f"LoRA: {_said(lora, lora_how, 'gathering pages for batched matmuls')}"
        return cls(attention, lora), how


def _said(kernel: object | None, how: str, instead: str) -> str:
    return how if kernel else f"{instead} ({how})"
