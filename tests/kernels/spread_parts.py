"""Vocabulary-side parts of several adapters spread over the layers of one pool (the layout of
kernels/vocab_segments.py), NaN wherever no part lies, so a stray read fails a comparison."""

import torch

from kernels.vocab_segments import SpreadPart

LAYERS = 3
# (rows, cols) of each adapter's part: a head-wide B (many rows), a narrow A, an embedding
# block, a few re-trained rows
SHAPES = [(150, 8), (7, 64), (64, 5), (33, 40)]


def spread_parts(
    dtype: torch.dtype, device="cpu", shapes=SHAPES, layers: int = LAYERS
) -> tuple[torch.Tensor, list[SpreadPart], list[torch.Tensor]]:
    """(pool [layers, width], each adapter's part, each part's matrix [rows, cols])."""
    gen = torch.Generator().manual_seed(0)
    parts, matrices, base = [], [], 11  # parts start off any alignment
    for rows, cols in shapes:
        per_layer = -(-rows // layers)
        parts.append(SpreadPart(base, rows, cols, per_layer))
        matrices.append(torch.randn(rows, cols, generator=gen).to(dtype))
        base += per_layer * cols + 5  # gaps of NaN between parts
    pool = torch.full((layers, base + 7), float("nan"), dtype=dtype)
    for part, matrix in zip(parts, matrices, strict=True):
        for k in range(part.rows):
            start = part.base + (k % part.per_layer) * part.cols
            pool[k // part.per_layer, start : start + part.cols] = matrix[k]
    return pool.to(device), parts, matrices
