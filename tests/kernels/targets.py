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
    return [NATIVE, BASELINE] if flags >= BASELINE_FLAGS and "avx512f" in flags else [NATIVE]
