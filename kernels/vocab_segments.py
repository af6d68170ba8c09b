"""Per-step metadata of the vocabulary-side kernels (vocab_rows.py, vocab_times.py): which rows of
a step each adapter owns, and where that adapter's part lies in adapter memory.

An adapter's vocabulary-side part is a matrix M [rows, cols] spread over the layers of adapter
memory (inference_service/model/vocab_layout.py): each layer's row of the pool [layers, width]
holds per_layer consecutive rows of M from element `base` on, so row k of M lies in layer
k // per_layer at base + (k % per_layer) * cols.
"""

import itertools
from dataclasses import dataclass

import torch

from kernels.lora_batch import TILE_ROWS


@dataclass(frozen=True)
class SpreadPart:
    """Where one adapter's part lies: its first element in each layer's row of the pool."""

    base: int
    rows: int
    cols: int
    per_layer: int


@dataclass(frozen=True)
class VocabSegments:
    """Segment g: the step's rows rows[starts[g] : starts[g] + lengths[g]] (token positions, or
    logit rows), all of one adapter, whose part is M_g of parts[g]; tiles of at most TILE_ROWS
    rows of one segment, a program each (as SegmentTable's)."""

    rows: torch.Tensor  # [rows] int32, grouped by segment
    starts: torch.Tensor  # [segments] int32
    lengths: torch.Tensor  # [segments] int32
    base: torch.Tensor  # [segments] int64
    part_rows: torch.Tensor  # [segments] int32
    cols: torch.Tensor  # [segments] int32
    per_layer: torch.Tensor  # [segments] int32
    tile_segments: torch.Tensor  # [tiles] int32
    tile_rows: torch.Tensor  # [tiles] int32
    num_tiles: int
    max_part_rows: int
    max_cols: int
    parts: tuple[SpreadPart, ...]  # [segments], for the references

    @classmethod
    def build(cls, segments: list[tuple[list[int], SpreadPart]], device) -> "VocabSegments":
        def tensor(values, dtype=torch.int32):
            return torch.tensor(values, dtype=dtype, device=device)

        lengths = [len(rows) for rows, _ in segments]
        parts = [part for _, part in segments]
        tiles = [(g, row) for g, n in enumerate(lengths) for row in range(0, n, TILE_ROWS)]
        return cls(
            tensor([row for rows, _ in segments for row in rows]),
            tensor([0, *itertools.accumulate(lengths)][:-1]),
            tensor(lengths),
            tensor([p.base for p in parts], torch.int64),
            tensor([p.rows for p in parts]),
            tensor([p.cols for p in parts]),
            tensor([p.per_layer for p in parts]),
            tensor([g for g, _ in tiles]),
            tensor([row for _, row in tiles]),
            len(tiles),
            max(p.rows for p in parts),
            max(p.cols for p in parts),
            tuple(parts),
        )

    def segment_rows(self) -> list[list[int]]:
        """Each segment's rows, for the references."""
        rows, starts, lengths = self.rows.tolist(), self.starts.tolist(), self.lengths.tolist()
        return [rows[s : s + n] for s, n in zip(starts, lengths, strict=True)]


def part_matrix(pool: torch.Tensor, part: SpreadPart) -> torch.Tensor:
    """M [rows, cols] of `part` read row by row from `pool` [layers, width]: the layout's
    definition, a plain loop."""
    return torch.stack(
        [
            pool[k // part.per_layer, part.base + (k % part.per_layer) * part.cols :][: part.cols]
            for k in range(part.rows)
        ]
    )
