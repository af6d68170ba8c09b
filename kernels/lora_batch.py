"""Per-step LoRA metadata: which adapter every token of the flattened batch uses, and where that
adapter's pages lie in the adapter memory.

Adapter memory is one flat pool per layer, in pages of rank rows, for adapters only: S-LoRA's
unified paging puts adapters and KV cache in one pool, here the KV cache has its own blocks.
An adapter of rank r on target t (q, k, v, o, gate, up, down: the model's lora_targets) holds
ceil(r / PAGE_RANK) pages there; its page g holds ranks PAGE_RANK*g .. PAGE_RANK*g + 7 of that
target, as A rows then B^T rows (scaling merged into B), at a unit offset u of the pool:

    pool[u*unit : u*unit + PAGE_RANK*in]                        A  [PAGE_RANK, in]
    pool[u*unit + PAGE_RANK*in : u*unit + PAGE_RANK*(in + out)]  B^T [PAGE_RANK, out]

Rank rows past the adapter's own rank in its last page hold zeros. The pages of one adapter need
not be adjacent, and the pool's unit divides every target's page, so memory is never lost to
padding: a rank-8 adapter takes an eighth of a rank-64 one, and an adapter on q and v nothing of
the other targets. Every layer uses the same unit offsets.
"""

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kernels.cpu_lora import CpuLora, CpuLoraStep

PAGE_RANK = 8  # rank rows per page
TILE_ROWS = 16  # tokens per Triton program: the smallest M tl.dot takes
# On the torch path, a run of this many tokens of one adapter is its own chunk, read in place: more
# than gathering, padding and scattering them would cost beside other adapters' few tokens
RUN_ROWS = 64


def page_width(in_features: int, out_features: int, gathered: int = 1) -> int:
    """Elements of one page of a target (of one expert's block of it): PAGE_RANK rows of A, then
    PAGE_RANK rows of B^T for each of the `gathered` tensor-parallel ranks whose shrinks it
    reads (a fully sharded column layer's), rank after rank."""
    return PAGE_RANK * (in_features + gathered * out_features)


@dataclass(frozen=True)
class AdapterPages:
    """Where one resident adapter lies in adapter memory, per target: its rank there (0: the
    adapter does not target it) and the first unit of each of its pages, in rank order."""

    ranks: tuple[int, ...]  # [targets]
    pages: tuple[tuple[int, ...], ...]  # [targets][ceil(rank / PAGE_RANK)]

    def of_expert(self, expert: int, shifts: tuple[int, ...]) -> "AdapterPages":
        """The adapter as one expert sees it: on each target with a shift, the pages' blocks of
        `expert` (expert * shift units in); the other targets left out (rank 0)."""
        return AdapterPages(
            tuple(rank if shift else 0 for rank, shift in zip(self.ranks, shifts, strict=True)),
            tuple(
                tuple(u + expert * shift for u in units) if shift else ()
                for units, shift in zip(self.pages, shifts, strict=True)
            ),
        )


def page_rows(
    pool: torch.Tensor, unit: int, in_features: int, out_features: int, gathered: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [windows, PAGE_RANK*in] and B^T [windows, gathered*PAGE_RANK*out] of the page starting at
    each unit of one layer's pool [units*unit], each page's rows flat, as overlapping views (no
    copy): index u is the page at unit u, for every u where a page of this target ends inside the
    pool."""
    windows = max(0, (pool.numel() - page_width(in_features, out_features, gathered)) // unit + 1)
    base = pool.storage_offset()
    a = pool.as_strided((windows, PAGE_RANK * in_features), (unit, 1), base)
    b_width = gathered * PAGE_RANK * out_features
    b = pool.as_strided((windows, b_width), (unit, 1), base + PAGE_RANK * in_features)
    return a, b


def page_views(
    pool: torch.Tensor, unit: int, in_features: int, out_features: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """page_rows as A [windows, PAGE_RANK, in] and B^T [windows, PAGE_RANK, out]."""
    a, b = page_rows(pool, unit, in_features, out_features)
    return a.unflatten(1, (PAGE_RANK, in_features)), b.unflatten(1, (PAGE_RANK, out_features))


@dataclass(frozen=True)
class PageChunks:
    """Part of one target's LoRA work of a step on the CPU: the adapters with `pages` pages on
    it, their tokens cut into chunks of `rows`. A chunk's A is its adapter's pages' A rows stacked
    [pages*PAGE_RANK, in] (B^T likewise), so one batched matmul pair covers every chunk at its
    adapter's whole rank. units [chunks*pages]: the first unit of each chunk's pages, rank order.
    gather [chunks*rows]: the token each row reads, padding the zero row `tokens` (one past the
    last token); scatter: the token its result is added to (padding adds its zero to a token of
    the same adapter, so even non-finite weights touch no one else's row). Both are None when
    the rows are the tokens first .. first + chunks*rows in order: a view, no copy."""

    pages: int
    rows: int
    units: torch.Tensor  # [chunks*pages] int64
    gather: torch.Tensor | None  # [chunks*rows] int64
    scatter: torch.Tensor | None  # [chunks*rows] int64
    first: int

    @property
    def chunks(self) -> int:
        return self.units.numel() // self.pages


@dataclass(frozen=True)
class SegmentTable:
    """The step for the Triton kernels: token indices grouped by adapter into segments, each
    segment's rank and pages per target, and tiles of at most TILE_ROWS tokens of one segment
    (SGMV-style; a decode step's segments hold a few tokens each, BGMV-style). The kernels run
    one program per tile, never one per segment times the longest segment. Rank lane r of a
    segment reads page pages[t, segment, r // PAGE_RANK]; lanes at or past ranks[t, segment]
    read nothing, so a step costs what its adapters' ranks cost."""

    tokens: torch.Tensor  # [tokens] int32: token indices grouped by adapter
    starts: torch.Tensor  # [segments] int32: where each segment starts in `tokens`
    lengths: torch.Tensor  # [segments] int32
    ranks: torch.Tensor  # [targets, segments] int32
    pages: torch.Tensor  # [targets, segments, max_pages] int32: first unit of each page
    tile_segments: torch.Tensor  # [tiles] int32: the segment each tile belongs to
    tile_rows: torch.Tensor  # [tiles] int32: the tile's first row within its segment
    num_tiles: int

    @property
    def max_rank(self) -> int:
        """Rank lanes the kernels cover: every page a segment may name."""
        return self.pages.shape[2] * PAGE_RANK

    @classmethod
    def build(
        cls, groups: dict[int, list[int]], adapters: Mapping[int, AdapterPages], max_pages: int, device
    ) -> "SegmentTable":
        def tensor(values):
            return torch.tensor(values, dtype=torch.int32, device=device)

        slots = list(groups)
        lengths = [len(groups[s]) for s in slots]
        starts = [0, *itertools.accumulate(lengths)][:-1]
        targets = len(adapters[slots[0]].ranks)
        pages = torch.zeros(targets, len(slots), max_pages, dtype=torch.int32)
        for i, slot in enumerate(slots):
            for t, units in enumerate(adapters[slot].pages):
                pages[t, i, : len(units)] = torch.tensor(units, dtype=torch.int32)
        tiles = [(i, row) for i, n in enumerate(lengths) for row in range(0, n, TILE_ROWS)]
        return cls(
            tensor([token for slot in slots for token in groups[slot]]),
            tensor(starts),
            tensor(lengths),
            tensor([[adapters[slot].ranks[t] for slot in slots] for t in range(targets)]),
            pages.to(device),
            tensor([segment for segment, _ in tiles]),
            tensor([row for _, row in tiles]),
            len(tiles),
        )


@dataclass(frozen=True)
class LoraBatch:
    """Built once per step from the token->adapter mapping and reused by every LoRA layer.

    Semantics: token i of the flattened batch uses the resident adapter `token_slots[i]` (a
    handle of the adapter memory; -1: the base model alone), whose pages `adapters` gives. On
    the Triton kernels' path (`kernels`, by default on CUDA) and on the CPU with the compiled
    kernels (`cpu_lora`), `table` holds the step (None: no token uses an adapter). On the CPU
    without them, `rows[t]` is target t's batched work, one PageChunks per page count among the
    step's adapters, and one per long run of one adapter's tokens (None: no token's adapter
    targets t, and the target costs nothing).
    """

    rows: tuple[tuple[PageChunks, ...] | None, ...] | None
    table: SegmentTable | None
    step: "StepAdapters | None" = None  # what it was built from, for an MoE layer's pairs
    cpu_lora: "CpuLoraStep | None" = None  # runs `table` on the CPU (None: the Triton kernels do)

    @classmethod
    def build(
        cls,
        token_slots: list[int],
        adapters: Mapping[int, AdapterPages],
        device: torch.device | str = "cpu",
        kernels: bool | None = None,
        cpu_lora: "CpuLora | None" = None,
    ) -> "LoraBatch":
        """kernels: take the Triton kernels' path (default: on CUDA) rather than the torch one;
        off it, cpu_lora (if given) runs the step's table."""
        if kernels is None:
            kernels = torch.device(device).type == "cuda"
        cpu_lora = None if kernels else cpu_lora
        groups: dict[int, list[int]] = {}  # adapter -> its tokens, in order
        for token, slot in enumerate(token_slots):
            if slot >= 0:
                groups.setdefault(slot, []).append(token)
        step = StepAdapters(token_slots, frozenset(groups), adapters, device, kernels, cpu_lora)
        if kernels or cpu_lora:  # the Triton kernels, or the compiled CPU ones: every token in the table
            table = _table(groups, adapters, device)
            return cls(None, table, step, cpu_lora.step(table) if cpu_lora and table else None)
        runs = {slot: _consecutive(toks) for slot, toks in groups.items()}  # the same on every target
        targets = len(next(iter(adapters.values())).ranks) if adapters else 0
        rows = tuple(_page_rows(runs, adapters, t, len(token_slots), device) for t in range(targets))
        return cls(rows, None, step)

    def for_experts(
        self, pair_tokens: list[int], pair_experts: list[int], shifts: tuple[int, ...]
    ) -> "LoraBatch | None":
        """The LoRA work of an MoE layer's (token, expert) pairs: row r is token pair_tokens[r] on
        expert pair_experts[r], with that token's adapter on the targets `shifts` marks (the
        experts'), where expert e's block of each page lies e * shifts[t] units past the page's
        start. None when no pair's token uses an adapter with ranks there."""
        on_experts = [t for t, shift in enumerate(shifts) if shift]
        if not any(self.step.adapters[slot].ranks[t] for slot in self.step.used for t in on_experts):
            return None  # attention-only adapters: nothing to do on the experts
        slots, experts_of = [], {}  # (adapter, expert) -> its handle in the pairs' batch
        for token, expert in zip(pair_tokens, pair_experts, strict=True):
            slot = self.step.token_slots[token]
            slots.append(experts_of.setdefault((slot, expert), len(experts_of)) if slot >= 0 else -1)
        if not experts_of:
            return None
        adapters = {
            handle: self.step.of_expert(slot, expert, shifts) for (slot, expert), handle in experts_of.items()
        }
        return LoraBatch.build(slots, adapters, self.step.device, self.step.kernels, self.step.cpu_lora)


@dataclass(frozen=True)
class StepAdapters:
    """Which adapter each token of a step uses, and where those adapters lie."""

    token_slots: list[int]
    used: frozenset[int]  # the adapters some token uses
    adapters: Mapping[int, AdapterPages]
    device: torch.device | str
    kernels: bool
    cpu_lora: "CpuLora | None"
    experts: dict = field(default_factory=dict)  # (slot, expert) -> its pages: the same in every layer

    def of_expert(self, slot: int, expert: int, shifts: tuple[int, ...]) -> AdapterPages:
        """adapters[slot].of_expert(expert, shifts), built once a step."""
        if (slot, expert) not in self.experts:
            self.experts[slot, expert] = self.adapters[slot].of_expert(expert, shifts)
        return self.experts[slot, expert]


def _page_rows(
    runs: dict[int, list[list[int]]], adapters: Mapping[int, AdapterPages], target: int, tokens: int, device
) -> tuple[PageChunks, ...] | None:
    """The adapters targeting `target`, grouped by their page count there; runs[slot]: the
    adapter's tokens in runs of consecutive ones."""
    by_pages: dict[int, list[tuple[list[list[int]], tuple[int, ...]]]] = {}
    for slot, slot_runs in runs.items():
        if adapters[slot].ranks[target]:
            pages = adapters[slot].pages[target]
            by_pages.setdefault(len(pages), []).append((slot_runs, pages))
    if not by_pages:
        return None
    groups_by_pages = [used for _, used in sorted(by_pages.items())]
    return tuple(work for used in groups_by_pages for work in _runs_then_chunks(used, tokens, device))


def _runs_then_chunks(
    used: list[tuple[list[list[int]], tuple[int, ...]]], tokens: int, device
) -> list[PageChunks]:
    """A run of RUN_ROWS or more tokens of one adapter, one after another (a prefill chunk), is
    its own chunk, read and written in place; the other tokens share padded chunks (_chunks). So
    one sequence's long prefill chunk pads no decode token of another adapter to its length, and
    is neither gathered nor scattered."""
    alone, rest = [], []
    for slot_runs, pages in used:
        left = []
        for run in slot_runs:
            if len(run) >= RUN_ROWS:
                alone.append(PageChunks(len(pages), len(run), _int64(pages, device), None, None, run[0]))
            else:
                left += run
        if left:
            rest.append((left, pages))
    return alone + ([_chunks(rest, tokens, device)] if rest else [])


def _table(groups: dict[int, list[int]], adapters: Mapping[int, AdapterPages], device) -> SegmentTable | None:
    """The segment table of `groups` (adapter -> its tokens), None when there are none."""
    if not groups:
        return None
    max_pages = max(len(p) for slot in groups for p in adapters[slot].pages)
    return SegmentTable.build(groups, adapters, max_pages, device)


def _consecutive(toks: list[int]) -> list[list[int]]:
    """toks (ascending) cut where a token is not the one after the last."""
    runs = [[toks[0]]]
    for token in toks[1:]:
        if token == runs[-1][-1] + 1:
            runs[-1].append(token)
        else:
            runs.append([token])
    return runs


def _int64(values: list[int] | tuple[int, ...], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _chunks(used: list[tuple[list[int], tuple[int, ...]]], tokens: int, device) -> PageChunks:
    """Chunks of the mean tokens per adapter (rounded up): an adapter with many tokens takes
    several chunks rather than padding every other one to its length, so padded rows stay under
    twice the tokens."""
    rows = -(-sum(len(toks) for toks, _ in used) // len(used))
    units, gather, scatter = [], [], []
    for toks, pages in used:
        for start in range(0, len(toks), rows):
            chunk = toks[start : start + rows]
            padding = rows - len(chunk)
            units += pages
            gather += chunk + [tokens] * padding
            scatter += chunk + [chunk[0]] * padding
    pages = len(used[0][1])
    in_order = tokens not in gather and gather == list(range(gather[0], gather[0] + len(gather)))
    if in_order:  # and no padding: a view of the tokens
        return PageChunks(pages, rows, _int64(units, device), None, None, gather[0])
    return PageChunks(pages, rows, _int64(units, device), _int64(gather, device), _int64(scatter, device), 0)
