"""The NaN fill of tests/kernels/poisoned_loads.py still reaches the interpreter's masked loads:
if a Triton upgrade routed them elsewhere, every kernel test would silently lose it."""

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(not triton.knobs.runtime.interpret, reason="the fill is the interpreter's")


@triton.jit
def _copy_first(src_ptr, dst_ptr, n, ZERO_FILL: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=i < n, other=0.0 if ZERO_FILL else None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_masked_off_lanes_without_other_read_nan(dtype):
    src = torch.arange(1, 5, dtype=dtype)
    for zero_fill, tail in ((False, float("nan")), (True, 0.0)):
        dst = torch.empty_like(src)
        _copy_first[(1,)](src, dst, 2, ZERO_FILL=zero_fill, BLOCK=4)
        expected = torch.tensor([1, 2, tail, tail], dtype=dtype)
        torch.testing.assert_close(dst, expected, equal_nan=True, atol=0, rtol=0)
