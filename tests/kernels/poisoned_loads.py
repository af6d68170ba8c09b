"""Masked loads that return NaN where a GPU returns garbage.

A `tl.load` with a mask and no `other=` leaves its masked-off lanes undefined on a GPU, and
undefined * 0 can be NaN; Triton's interpreter fills them with zeros, so a kernel missing an
`other=` passes every CPU test. With this fixture on, the interpreter fills those lanes of a
floating-point load with NaN instead, so such a lane that reaches a result shows there. Integer
loads keep their zeros: NaN has no integer form, and the kernels' integer loads only index.
"""

import numpy as np
import pytest
import triton.language as tl
from triton.runtime.interpreter import InterpreterBuilder, TensorHandle


@pytest.fixture(autouse=True)
def poisoned_masked_loads(monkeypatch):
    """Autouse in every test module that imports it (tests/kernels/conftest.py does)."""
    zero_filled = InterpreterBuilder.create_masked_load

    def nan_filled(self, ptrs, mask, other, cache_policy, is_volatile):
        dtype = ptrs.get_element_ty()
        if other is None and dtype.is_floating():
            nan = TensorHandle(np.full(ptrs.data.shape, np.nan, np.float32), tl.float32)
            other = self.cast_impl(nan, dtype)  # bf16 is stored as uint16 bit patterns there
        return zero_filled(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", nan_filled)
