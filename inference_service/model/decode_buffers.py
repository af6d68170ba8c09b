"""DecodeBuffers: the inputs of decode-only steps on the Triton kernels' path, in tensors
allocated once and refilled in place, so a CUDA graph captured over them serves every later step.

Every field is a view of one int64 and one int32 device tensor; a step's values are written into
page-locked host twins of those two tensors and copied over in two async copies. `batch(rows)`
is the ForwardBatch of the first `rows` rows, built once per batch-size bucket. Rows past the
step's sequences are padding: token 0 at position 0 of the scratch block, which no sequence owns,
so their K/V writes and reads touch nobody's cache, and no LoRA tile names them.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from inference_service.model.attention import AttentionMetadata, KernelPath
from inference_service.model.forward_batch import ForwardBatch, SequenceInput
from kernels.lora_batch import TILE_ROWS, AdapterPages, LoraBatch, SegmentTable

SPARE_TILE_ROW = np.iinfo(np.int32).max  # a tile starting past every segment: the kernels skip it
# the int32 fields and their axes: a decode step has at most one segment and one tile per row
INT32_FIELDS = {
    "contexts": ("rows",),
    "tables": ("rows", "blocks"),
    "tokens": ("rows",),
    "starts": ("rows",),
    "lengths": ("rows",),
    "ranks": ("targets", "rows"),
    "pages": ("targets", "rows", "pages"),
    "tile_segments": ("rows",),
    "tile_rows": ("rows",),
}


@dataclass(frozen=True)
class _Layout:
    sizes: dict[str, int]  # axis name -> its length

    def shape(self, field: str) -> tuple[int, ...]:
        return tuple(self.sizes[axis] for axis in INT32_FIELDS[field])

    def size(self, field: str) -> int:
        return math.prod(self.shape(field))

    def views(self, flat: torch.Tensor | np.ndarray) -> dict:
        out, start = {}, 0
        for field in INT32_FIELDS:
            out[field] = flat[start : start + self.size(field)].reshape(self.shape(field))
            start += self.size(field)
        return out


class DecodeBuffers:
    def __init__(
        self,
        max_rows: int,
        blocks_per_seq: int,
        block_size: int,
        scratch_block: int,
        sliding_window: int | None,
        targets: int,
        max_pages: int,
        device: torch.device,
    ):
        """targets: LoRA targets of the adapter memory; max_pages: pages of the largest rank an
        adapter may have on one target."""
        self.max_rows, self.block_size, self.scratch_block = max_rows, block_size, scratch_block
        self._window = sliding_window
        self._layout = _Layout(dict(rows=max_rows, blocks=blocks_per_seq, targets=targets, pages=max_pages))
        pinned = device.type == "cuda"
        size32 = sum(self._layout.size(f) for f in INT32_FIELDS)
        # token ids, positions, cache slots
        self._i64 = torch.zeros(3, max_rows, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(size32, dtype=torch.int32, device=device)
        self._i64_host = torch.zeros(3, max_rows, dtype=torch.int64, pin_memory=pinned)
        self._i32_host = torch.zeros(size32, dtype=torch.int32, pin_memory=pinned)
        self._fields = self._layout.views(self._i32)
        self._host_fields = self._layout.views(self._i32_host.numpy())
        self._arange = torch.arange(max_rows, device=device)  # decode rows, logit rows
        self._empty = torch.zeros(0, dtype=torch.int32, device=device)

    def fill(self, seqs: list[SequenceInput], adapters: Mapping[int, AdapterPages]) -> None:
        """Write one decode step (one new token per sequence) into the buffers; adapters[s]:
        where the adapter of handle s lies in adapter memory (every handle the sequences use)."""
        assert len(seqs) <= self.max_rows and all(len(s.token_ids) == 1 for s in seqs)
        ids, positions, cache_slots = self._i64_host.numpy()
        f = self._host_fields
        scratch = self.scratch_block * self.block_size
        ids[:], positions[:], cache_slots[:] = 0, 0, scratch
        f["contexts"][:], f["tables"][:] = 1, self.scratch_block
        for i, s in enumerate(seqs):
            ids[i], positions[i], f["contexts"][i] = s.token_ids[0], s.cached, s.cached + 1
            cache_slots[i] = (
                s.block_table[s.cached // self.block_size] * self.block_size + s.cached % self.block_size
            )
            f["tables"][i, : len(s.block_table)] = s.block_table
        self._fill_lora([s.slot for s in seqs], adapters)
        self._i64.copy_(self._i64_host, non_blocking=True)
        self._i32.copy_(self._i32_host, non_blocking=True)

    def _fill_lora(self, token_slots: list[int], adapters: Mapping[int, AdapterPages]) -> None:
        """Segments of the rows grouped by adapter, their ranks and pages, and their tiles;
        spare tiles are skipped."""
        f = self._host_fields
        order = sorted((i for i, slot in enumerate(token_slots) if slot >= 0), key=token_slots.__getitem__)
        f["tokens"][: len(order)] = order
        f["tile_segments"][:], f["tile_rows"][:] = 0, SPARE_TILE_ROW
        segment, tile, start = 0, 0, 0
        while start < len(order):
            slot = token_slots[order[start]]
            end = start
            while end < len(order) and token_slots[order[end]] == slot:
                end += 1
            f["starts"][segment], f["lengths"][segment] = start, end - start
            self._fill_pages(segment, adapters[slot])
            for row in range(0, end - start, TILE_ROWS):
                f["tile_segments"][tile], f["tile_rows"][tile] = segment, row
                tile += 1
            segment, start = segment + 1, end

    def _fill_pages(self, segment: int, adapter: AdapterPages) -> None:
        """The segment's rank and pages on every target; lanes past its pages name unit 0 (the
        kernels never read a lane past the segment's rank)."""
        ranks, pages = self._host_fields["ranks"], self._host_fields["pages"]
        assert len(adapter.ranks) == ranks.shape[0]
        ranks[:, segment], pages[:, segment] = adapter.ranks, 0
        for t, units in enumerate(adapter.pages):
            assert len(units) <= pages.shape[2], "an adapter past the buffers' max_pages"
            pages[t, segment, : len(units)] = units

    def batch(self, rows: int) -> ForwardBatch:
        """The ForwardBatch over the first `rows` rows: views, so every later fill shows in it."""
        v = {name: t.narrow(INT32_FIELDS[name].index("rows"), 0, rows) for name, t in self._fields.items()}
        attention = AttentionMetadata(
            positions=self._i64[1, :rows],
            cache_slots=self._i64[2, :rows],
            decode_tokens=self._arange[:rows],
            path=KernelPath(
                decode_tables=v["tables"],
                decode_contexts=v["contexts"],
                prefill_tables=self._empty.view(0, 1),
                query_starts=self._empty,
                query_lens=self._empty,
                prefill_contexts=self._empty,
                tiles=self._empty.view(0, 2),
                sliding_window=self._window,
            ),
        )
        # At most one tile per row: the grid every LoRA kernel launches with, whatever the step.
        table = SegmentTable(
            tokens=v["tokens"],
            starts=v["starts"],
            lengths=v["lengths"],
            ranks=v["ranks"],
            pages=v["pages"],
            tile_segments=v["tile_segments"],
            tile_rows=v["tile_rows"],
            num_tiles=rows,
        )
        lora = LoraBatch(rows=None, table=table)
        return ForwardBatch(self._i64[0, :rows], attention.positions, attention, lora, self._arange[:rows])
