"""DecodeBuffers: the inputs of decode-only steps on the Triton kernels' path, in tensors
allocated once and refilled in place, so a CUDA graph captured over them serves every later step.

Every field is a view of one int64 and one int32 device tensor; a step's values are written into
page-locked host twins of those two tensors and copied over in two async copies. `batch(rows)`
is the ForwardBatch of the first `rows` rows, built once per batch-size bucket. Rows past the
step's sequences are padding: token 0 at position 0 of the scratch block, which no sequence owns,
so their K/V writes and reads touch nobody's cache, and no LoRA tile names them.
"""

from dataclasses import dataclass

import numpy as np
import torch

from inference_service.model.attention import AttentionMetadata, KernelPath
from inference_service.model.forward_batch import ForwardBatch, SequenceInput
from kernels.lora_batch import FULL_RANK, TILE_ROWS, LoraBatch, SegmentTable

SPARE_TILE_ROW = np.iinfo(np.int32).max  # a tile starting past every segment: the kernels skip it
# the int32 fields, each [rows] but the block tables [rows, blocks per sequence]
INT32_FIELDS = (
    "contexts",
    "tables",
    "tokens",
    "slots",
    "starts",
    "lengths",
    "ranks",
    "tile_segments",
    "tile_rows",
)


@dataclass(frozen=True)
class _Layout:
    rows: int
    blocks_per_seq: int

    def size(self, field: str) -> int:
        return self.rows * (self.blocks_per_seq if field == "tables" else 1)

    def views(self, flat: torch.Tensor | np.ndarray) -> dict:
        out, start = {}, 0
        for field in INT32_FIELDS:
            view = flat[start : start + self.size(field)]
            out[field] = view.reshape(self.rows, self.blocks_per_seq) if field == "tables" else view
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
        device: torch.device,
    ):
        self.max_rows, self.block_size, self.scratch_block = max_rows, block_size, scratch_block
        self._window = sliding_window
        self._layout = _Layout(max_rows, blocks_per_seq)
        pinned = device.type == "cuda"
        size32 = sum(self._layout.size(f) for f in INT32_FIELDS)
        # token ids, positions, cache slots, adapter slots
        self._i64 = torch.zeros(4, max_rows, dtype=torch.int64, device=device)
        self._i32 = torch.zeros(size32, dtype=torch.int32, device=device)
        self._i64_host = torch.zeros(4, max_rows, dtype=torch.int64, pin_memory=pinned)
        self._i32_host = torch.zeros(size32, dtype=torch.int32, pin_memory=pinned)
        self._fields = self._layout.views(self._i32)
        self._host_fields = self._layout.views(self._i32_host.numpy())
        self._arange = torch.arange(max_rows, device=device)  # decode rows, logit rows
        self._empty = torch.zeros(0, dtype=torch.int32, device=device)

    def fill(self, seqs: list[SequenceInput], slot_ranks: list[int]) -> None:
        """Write one decode step (one new token per sequence) into the buffers."""
        assert len(seqs) <= self.max_rows and all(len(s.token_ids) == 1 for s in seqs)
        ids, positions, cache_slots, token_slots = self._i64_host.numpy()
        f = self._host_fields
        scratch = self.scratch_block * self.block_size
        ids[:], positions[:], cache_slots[:], token_slots[:] = 0, 0, scratch, -1
        f["contexts"][:], f["tables"][:] = 1, self.scratch_block
        for i, s in enumerate(seqs):
            ids[i], positions[i], f["contexts"][i] = s.token_ids[0], s.cached, s.cached + 1
            cache_slots[i] = (
                s.block_table[s.cached // self.block_size] * self.block_size + s.cached % self.block_size
            )
            f["tables"][i, : len(s.block_table)] = s.block_table
            token_slots[i] = s.slot
        self._fill_lora([s.slot for s in seqs], slot_ranks)
        self._i64.copy_(self._i64_host, non_blocking=True)
        self._i32.copy_(self._i32_host, non_blocking=True)

    def _fill_lora(self, token_slots: list[int], slot_ranks: list[int]) -> None:
        """Segments of the rows grouped by adapter slot, and their tiles; spare tiles are skipped."""
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
            f["slots"][segment], f["starts"][segment], f["lengths"][segment] = slot, start, end - start
            f["ranks"][segment] = slot_ranks[slot] if slot_ranks else FULL_RANK
            for row in range(0, end - start, TILE_ROWS):
                f["tile_segments"][tile], f["tile_rows"][tile] = segment, row
                tile += 1
            segment, start = segment + 1, end

    def batch(self, rows: int) -> ForwardBatch:
        """The ForwardBatch over the first `rows` rows: views, so every later fill shows in it."""
        v = {name: t[:rows] for name, t in self._fields.items()}
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
            v["tokens"],
            v["slots"],
            v["starts"],
            v["lengths"],
            v["ranks"],
            v["tile_segments"],
            v["tile_rows"],
            rows,
        )
        lora = LoraBatch(self._i64[3, :rows], None, (), None, table)
        return ForwardBatch(self._i64[0, :rows], attention.positions, attention, lora, self._arange[:rows])
