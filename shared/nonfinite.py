"""Which of many tensors, or which rows of a matrix, hold NaN or Inf, at the cost of one sum each.

torch.isfinite on the CPU runs at a fraction of memory speed: an adapter has a hundred-odd
matrices to check on every load, and a step's logits (a vocabulary per row) are checked on every
step, where isfinite took 1.7 ms (32 rows of 49,152) against 0.05 for the sums. NaN or Inf in
any addend makes the sum NaN or Inf whatever the order of addition, so a finite sum proves the
tensor finite; only a tensor whose sum is not finite (NaN or Inf inside, or finite values
summing past float32) gets the exact check."""

from collections.abc import Mapping

import torch


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor (in mapping order) holding NaN or Inf, or None."""
    if not tensors:
        return None
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors.values()])  # [tensors]
    suspects = (item for item, ok in zip(tensors.items(), sums.isfinite().tolist(), strict=True) if not ok)
    return next((name for name, t in suspects if not torch.isfinite(t).all()), None)


def finite_rows(matrix: torch.Tensor) -> list[bool]:
    """Whether each row of `matrix` [rows, cols] holds only finite values."""
    finite = matrix.sum(dim=-1, dtype=torch.float32).isfinite().tolist()  # [rows]
    return [ok or bool(matrix[i].isfinite().all()) for i, ok in enumerate(finite)]
