"""The targets the compiled CPU kernels' tests build them for on this machine: its own CPU, as a
worker builds them, and the AVX2 baseline where this CPU runs it and has AVX-512 besides, so that
the paths an AVX2-only CPU takes (8-lane registers, bf16 without pair products) are checked here
too. Where the CPU has no AVX-512, its own build takes those paths already."""

from bench.provenance import cpuinfo
from kernels.cpu_library import BASELINE, NATIVE

# what -march=x86-64-v3 may emit, past the x86-64 every such CPU has
BASELINE_FLAGS = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "xsave"}


def kernel_targets() -> list[str]:
    flags = set(cpuinfo().get("flags", "").split())
    return [NATIVE, BASELINE] if flags >= BASELINE_FLAGS and has_avx512(NATIVE) else [NATIVE]


def has_avx512(target: str) -> bool:
    """Whether a build for `target` on this CPU has AVX-512."""
    return target == NATIVE and "avx512f" in cpuinfo().get("flags", "").split()


def declined(target: str) -> set[str]:
    """The CpuKernels a build for `target` declines for their torch paths: none with AVX-512; the
    attention kernels without it, measured slower than SDPA there (kernels/cpu_library.py's
    AVX512_ONLY)."""
    return set() if has_avx512(target) else {"decode_attention", "prefill_attention"}
