"""VocabBatch: a step's vocabulary-side work, built once and read by the embedding and the head
(vocab_adapters.py): which adapter owns which token positions and logit rows, and what their
re-trained rows replace; on the Triton kernels' path also a table of segments for each part the
step's adapters read (kernels/vocab_segments.py).

Under tensor parallelism a rank holds the vocabulary rows [start, stop) of the embedding and
head, and each adapter's part of its vocabulary-side tensors on those rows (its re-trained rows
whole, named by their ids less start): a rank's batch holds the tokens (and logit columns) of its
rows."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from inference_service.model.vocab_layout import VocabLayout
from kernels.vocab_segments import SpreadPart, VocabSegments

# The parts the kernels read in place, by side; re-trained rows stay torch's (a few rows each).
KERNEL_PARTS = {
    "embed_tokens": ("embed_tokens.weight", "embed_tokens.lora_a", "embed_tokens.lora_b_t"),
    "lm_head": ("lm_head.weight", "lm_head.lora_a", "lm_head.lora_b_t"),
}


@dataclass(frozen=True)
class VocabPages:
    """A resident adapter's vocabulary-side parts: the element of each layer's row of adapter
    memory their run starts at, and their layout."""

    base: int
    layout: VocabLayout

    def spread(self, name: str) -> SpreadPart:
        part = self.layout.parts[name]
        return SpreadPart(self.base + part.offset, part.rows, part.cols, part.per_layer)


@dataclass(frozen=True)
class AdapterTokens:
    """One adapter's share of a step on one side: its rows (token positions on the embedding side,
    logit rows on the head side), and what its re-trained rows replace: on the embedding side the
    rows `replaced` (some of its positions), on the head side the columns `replaced` (this rank's
    ids of them) of every row, each by the adapter's row `replacement`."""

    pages: VocabPages
    rows: torch.Tensor  # [n] int64
    replaced: torch.Tensor | None  # [m] int64: embedding rows (or head columns) the adapter replaces
    replacement: torch.Tensor | None  # [m] int64: the adapter's row each takes


@dataclass(frozen=True)
class VocabBatch:
    embed: tuple[AdapterTokens, ...]  # adapters with an embedding-side part among the step's tokens
    head: tuple[AdapterTokens, ...]  # adapters with a head-side part among the logit rows
    tables: dict[str, VocabSegments] | None = None  # the kernels' path: by part name

    @classmethod
    def build(
        cls,
        token_ids: list[int],
        token_slots: list[int],
        logit_rows: list[int],
        adapters: Mapping[int, VocabPages],
        vocab_range: tuple[int, int],
        device,
        kernels: bool = False,
    ) -> "VocabBatch | None":
        """adapters: the resident adapters with vocabulary-side parts, by slot; vocab_range: the
        rows [start, stop) of the vocabulary this rank holds; kernels: build the Triton kernels'
        tables too. None when no token uses such an adapter."""
        if not adapters or not any(s in adapters for s in token_slots):
            return None
        start, stop = vocab_range
        positions: dict[int, list[int]] = {}
        for pos, slot in enumerate(token_slots):
            if (
                slot in adapters
                and start <= token_ids[pos] < stop
                and "embed_tokens" in adapters[slot].layout.modules
            ):
                positions.setdefault(slot, []).append(pos)
        rows: dict[int, list[int]] = {}
        for row, pos in enumerate(logit_rows):
            if token_slots[pos] in adapters and "lm_head" in adapters[token_slots[pos]].layout.modules:
                rows.setdefault(token_slots[pos], []).append(row)
        if not positions and not rows:
            return None
        embed = tuple(_embed_tokens(adapters[s], p, token_ids, start, device) for s, p in positions.items())
        head = tuple(_head_rows(adapters[s], r, stop - start, device) for s, r in rows.items())
        tables = _tables(adapters, positions, rows, device) if kernels else None
        return cls(embed, head, tables)


def _tables(adapters, positions: dict, rows: dict, device) -> dict[str, VocabSegments]:
    """Per part the kernels read: a segment per adapter that has it, over its positions (the
    embedding's parts) or logit rows (the head's)."""
    tables = {}
    for module, owned in (("embed_tokens", positions), ("lm_head", rows)):
        for name in KERNEL_PARTS[module]:
            segments = [
                (r, adapters[s].spread(name)) for s, r in owned.items() if name in adapters[s].layout.parts
            ]
            if segments:
                tables[name] = VocabSegments.build(segments, device)
    return tables


def _embed_tokens(pages: VocabPages, positions: list[int], token_ids: list[int], start: int, device):
    rows = {token: i for i, token in enumerate(pages.layout.embed_rows)}  # by the rank's own ids
    replaced = [p for p in positions if token_ids[p] - start in rows]
    return _share(pages, positions, replaced, [rows[token_ids[p] - start] for p in replaced], device)


def _head_rows(pages: VocabPages, rows: list[int], columns: int, device) -> AdapterTokens:
    """`columns`: this rank's logit columns; the re-trained rows among them replace theirs."""
    ids = [(i, n) for n, i in enumerate(pages.layout.head_rows) if 0 <= i < columns]
    return _share(pages, rows, [i for i, _ in ids], [n for _, n in ids], device)


def _share(pages: VocabPages, rows: list[int], replaced: list[int], replacement: list[int], device):
    if not replaced:
        return AdapterTokens(pages, _tensor(rows, device), None, None)
    return AdapterTokens(
        pages, _tensor(rows, device), _tensor(replaced, device), _tensor(replacement, device)
    )


def _tensor(values: list[int], device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
