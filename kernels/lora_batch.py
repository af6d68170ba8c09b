"""Per-step LoRA metadata: which adapter slot every token of the flattened batch uses."""

from dataclasses import dataclass

import torch

# The padded layout computes up to this many rows per LoRA token before the per-slot loop wins:
# on 2 CPU cores a batched matmul replaces ~8 small ones per slot and costs ~6 us per padded row
# of a SmolLM2 layer, against ~180 us of dispatch per slot in the loop.
MAX_PAD_FACTOR = 4.0
FULL_RANK = 1 << 30  # a segment rank meaning "every rank the buffers hold"
TILE_ROWS = 16  # tokens per Triton program: the smallest M tl.dot takes


@dataclass(frozen=True)
class Segment:
    """Rows [start, end) of the slot-grouped batch all use adapter `slot`."""

    slot: int
    start: int
    end: int


@dataclass(frozen=True)
class PaddedLayout:
    """Slot-major padded rows, so one batched matmul covers every slot of the step.

    Slots first_slot .. first_slot+num_slots-1 each own `rows` consecutive padded rows;
    padded row r holds token gather[r] (padding repeats a token; its result is never read).
    scatter[i] is token i's padded row, or num_slots*rows (one extra zero row) for slot -1.
    """

    first_slot: int
    num_slots: int
    rows: int
    rank: int  # the largest adapter rank among these slots (FULL_RANK: unknown); ranks past it are never read
    gather: torch.Tensor  # [num_slots*rows] int64
    scatter: torch.Tensor  # [tokens] int64

    def from_tokens(self, buf: torch.Tensor) -> torch.Tensor:
        """[tokens, slices, rank] in token order -> [num_slots, rank*slices, rows] padded (rank
        major, as a slot's A holds its rows)."""
        tokens, slices, rank = buf.shape
        padded = buf.transpose(1, 2).reshape(tokens, rank * slices).index_select(0, self.gather)
        return padded.view(self.num_slots, self.rows, rank * slices).transpose(1, 2)  # [n, r*s, rows]

    def to_tokens(self, padded: torch.Tensor, slices: int) -> torch.Tensor:
        """[num_slots, rank*slices, rows] padded -> [tokens, slices, rank], zero for slot -1."""
        padded_rows = self.num_slots * self.rows
        out = padded.new_empty(padded_rows + 1, padded.shape[1])  # [n*rows + 1, s*r]
        out[padded_rows].zero_()  # the row slot -1 tokens read
        out[:padded_rows].view(self.num_slots, self.rows, -1).copy_(padded.transpose(1, 2))
        return out.index_select(0, self.scatter).view(self.scatter.shape[0], -1, slices).transpose(1, 2)


@dataclass(frozen=True)
class SegmentTable:
    """The segments as device tensors for the Triton kernels, cut into tiles of at most
    TILE_ROWS tokens of one segment (SGMV-style; a decode step's segments hold a few tokens
    each, BGMV-style). The kernels run one program per tile, never one per segment times the
    longest segment, so no program is launched with nothing to do."""

    tokens: torch.Tensor  # [tokens] int32: token indices grouped by slot
    slots: torch.Tensor  # [segments] int32
    starts: torch.Tensor  # [segments] int32: where each segment starts in `tokens`
    lengths: torch.Tensor  # [segments] int32
    ranks: torch.Tensor  # [segments] int32: the rank of each segment's adapter
    tile_segments: torch.Tensor  # [tiles] int32: the segment each tile belongs to
    tile_rows: torch.Tensor  # [tiles] int32: the tile's first row within its segment
    num_tiles: int

    @classmethod
    def build(
        cls, segments: tuple[Segment, ...], order: list[int], ranks: list[int] | None, device
    ) -> "SegmentTable":
        def tensor(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        tiles = [(i, row) for i, s in enumerate(segments) for row in range(0, s.end - s.start, TILE_ROWS)]
        return cls(
            tensor(order),
            tensor([s.slot for s in segments]),
            tensor([s.start for s in segments]),
            tensor([s.end - s.start for s in segments]),
            tensor([ranks[s.slot] if ranks else FULL_RANK for s in segments]),
            tensor([segment for segment, _ in tiles]),
            tensor([row for _, row in tiles]),
            len(tiles),
        )


@dataclass(frozen=True)
class LoraBatch:
    """Built once per step from the token->slot mapping and reused by every LoRA layer.

    Semantics: token i of the flattened batch uses adapter slot token_slots[i]; slot -1 means
    the base model alone. `order` lists token indices grouped by slot (None when the batch
    already holds each slot's tokens in one contiguous run, as the engine arranges it);
    `segments` are the runs of that grouped order, slot -1 runs left out. `padded` is set when
    the slot-major padded layout wastes at most max_pad_factor x the LoRA rows (decode steps);
    the CPU kernels then use it instead of looping over segments. `table` is set on the Triton
    kernels' path (`kernels`, by default on CUDA) when a token uses an adapter. `slot_ranks[s]`
    is the rank of the adapter in slot s (None: every slot at full rank): no path reads a rank of
    A or B past the largest rank of the step's slots, so a step costs what its adapters' ranks
    cost, not max_lora_rank. Ranks of a slot past its own must hold zeros (a cleared slot): the
    padded layout reads every slot up to the step's largest rank.
    """

    token_slots: torch.Tensor  # [tokens] int64
    order: torch.Tensor | None  # [tokens] int64, or None when already grouped
    segments: tuple[Segment, ...]
    padded: PaddedLayout | None
    table: SegmentTable | None
    slot_ranks: tuple[int, ...] | None = None

    def rank(self, slot: int) -> int:
        """How many ranks of `slot`'s A and B hold its adapter (FULL_RANK: all of them)."""
        return self.slot_ranks[slot] if self.slot_ranks else FULL_RANK

    @classmethod
    def build(
        cls,
        token_slots: list[int],
        device: torch.device | str = "cpu",
        max_pad_factor: float = MAX_PAD_FACTOR,
        slot_ranks: list[int] | None = None,
        kernels: bool | None = None,
    ) -> "LoraBatch":
        """kernels: take the Triton kernels' path (default: on CUDA) rather than the torch one."""
        slots = torch.tensor(token_slots, dtype=torch.int64, device=device)  # [tokens]
        if kernels is None:
            kernels = torch.device(device).type == "cuda"
        ranks = tuple(slot_ranks) if slot_ranks else None
        padded = None if kernels else _padded_layout(token_slots, max_pad_factor, ranks, device)
        runs = _runs(token_slots)
        lora_runs = tuple(r for r in runs if r.slot >= 0)
        if len(lora_runs) == len({r.slot for r in lora_runs}):
            order, order_t = list(range(len(token_slots))), None
        else:
            order = sorted(range(len(token_slots)), key=token_slots.__getitem__)
            lora_runs = tuple(r for r in _runs([token_slots[i] for i in order]) if r.slot >= 0)
            order_t = torch.tensor(order, dtype=torch.int64, device=device)  # [tokens]
        table = SegmentTable.build(lora_runs, order, slot_ranks, device) if kernels and lora_runs else None
        return cls(slots, order_t, lora_runs, padded, table, ranks)


def _runs(slots: list[int]) -> list[Segment]:
    runs: list[Segment] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            runs.append(Segment(slots[start], start, i))
            start = i
    return runs


def _padded_layout(
    token_slots: list[int], max_pad_factor: float, ranks: tuple[int, ...] | None, device: torch.device | str
) -> PaddedLayout | None:
    tokens_of: dict[int, list[int]] = {}
    for token, slot in enumerate(token_slots):
        if slot >= 0:
            tokens_of.setdefault(slot, []).append(token)
    if not tokens_of:
        return None
    first, last = min(tokens_of), max(tokens_of)
    rows = max(len(t) for t in tokens_of.values())
    num_slots = last - first + 1
    lora_tokens = sum(len(t) for t in tokens_of.values())
    if not num_slots * rows <= max_pad_factor * lora_tokens:
        return None
    gather = [0] * (num_slots * rows)
    scatter = [num_slots * rows] * len(token_slots)
    for slot, tokens in tokens_of.items():
        start = (slot - first) * rows
        for j in range(rows):
            gather[start + j] = tokens[min(j, len(tokens) - 1)]
        for j, token in enumerate(tokens):
            scatter[token] = start + j
    return PaddedLayout(
        first,
        num_slots,
        rows,
        max(ranks[slot] for slot in tokens_of) if ranks else FULL_RANK,
        torch.tensor(gather, dtype=torch.int64, device=device),  # [num_slots*rows]
        torch.tensor(scatter, dtype=torch.int64, device=device),  # [tokens]
    )
