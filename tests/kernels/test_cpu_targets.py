"""Each compiled CPU kernel for each target the tests build: kept, or declined for its torch path
where its build has no AVX-512 and the kernel is AVX512_ONLY (measured slower there), with the
reason in load's answer (a worker logs it)."""

import pytest

from kernels.cpu_kernels import TORCH_PATHS, CpuKernels
from tests.kernels.targets import declined


@pytest.mark.parametrize("name", list(TORCH_PATHS))
def test_a_kernel_is_declined_only_where_its_build_lacks_avx512_and_it_is_slower(name, target):
    kind, _ = TORCH_PATHS[name]
    kernel, why = kind.load(target=target)
    if name in declined(target):
        assert kernel is None and f"declined: without AVX-512 (-march={target})" in why, why
    else:
        assert kernel is not None, why


def test_the_worker_logs_why_a_kernel_was_declined(target):
    kernels, how = CpuKernels.load(target=target)
    for name, (_, instead) in TORCH_PATHS.items():
        loaded = getattr(kernels, name) is not None
        assert loaded == (name not in declined(target))
        assert (f"{name}: {instead} (" in how) == (not loaded), how
