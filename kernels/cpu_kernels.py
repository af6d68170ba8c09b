"""cpu_kernels: the compiled CPU kernels one process runs with (kernels/cpu_library.py builds them)."""

from dataclasses import dataclass
from pathlib import Path

from kernels.cpu_decode_attention import CpuDecodeAttention
from kernels.cpu_library import NATIVE
from kernels.cpu_linear import CpuLinear
from kernels.cpu_lora import CpuLora
from kernels.cpu_prefill_attention import CpuPrefillAttention
from kernels.cpu_rms_norm import CpuRmsNorm
from kernels.cpu_rope import CpuRope
from kernels.cpu_swiglu import CpuSwiglu
from kernels.cpu_token_mask import CpuTokenMask


@dataclass(frozen=True)
class CpuKernels:
    """Each kernel, or None where it could not be built: then its torch path runs (decodes and
    prefill chunks gather their blocks for SDPA; LoRA gathers pages for batched matmuls; rotary
    embeddings, RMSNorm and SwiGLU take torch's elementwise ops; linear layers take oneDNN's
    matmuls; grammars' token masks are unpacked and filled by torch ops).
    `linear` is bound into the weights when the model packs them, not chosen step by step."""

    decode_attention: CpuDecodeAttention | None = None
    prefill_attention: CpuPrefillAttention | None = None
    lora: CpuLora | None = None
    rope: CpuRope | None = None
    rms_norm: CpuRmsNorm | None = None
    swiglu: CpuSwiglu | None = None
    linear: CpuLinear | None = None
    token_mask: CpuTokenMask | None = None

    @classmethod
    def load(cls, directory: Path | None = None, target: str = NATIVE) -> "tuple[CpuKernels, str]":
        """The kernels built for `target` (-march), and how each was had (built where, or why not
        and what runs instead)."""
        kernels, said = {}, []
        for name, (kind, instead) in TORCH_PATHS.items():
            kernels[name], how = kind.load(directory, target)
            said.append(f"{name}: {how if kernels[name] else f'{instead} ({how})'}")
        return cls(**kernels), "; ".join(said)


# each kernel's class, and what runs without it
TORCH_PATHS = {
    "decode_attention": (CpuDecodeAttention, "gathering blocks for SDPA"),
    "prefill_attention": (CpuPrefillAttention, "gathering blocks for SDPA"),
    "lora": (CpuLora, "gathering pages for batched matmuls"),
    "rope": (CpuRope, "torch ops"),
    "rms_norm": (CpuRmsNorm, "torch ops"),
    "swiglu": (CpuSwiglu, "torch ops"),
    "linear": (CpuLinear, "oneDNN's matmuls, in blocks of inputs for fp32"),
    "token_mask": (CpuTokenMask, "torch ops"),
}
