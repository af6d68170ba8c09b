"""Adapters on the vocabulary side, applied per token: where tokens become vectors (the adapter's
own embedding rows, its re-trained rows, or LoRA on the embedding) and where vectors become logits
(its own head, its re-trained head rows, or LoRA on the head). The step's mapping of tokens to
adapters is built once (VocabBatch) and read by both; the parts are read in place from adapter
memory (vocab_layout.py gives the layout).

Under tensor parallelism a rank holds the vocabulary rows [start, stop) of the embedding and
head, and each adapter's part of its vocabulary-side tensors on those rows (its re-trained rows
whole, named by their ids less start): the terms below are computed for the tokens (and logit
columns) of the rank's rows, before the ranks' parts meet."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from inference_service.model.vocab_layout import VocabLayout, VocabPart


@dataclass(frozen=True)
class VocabPages:
    """A resident adapter's vocabulary-side parts: the first unit of their run, and their layout."""

    start: int
    layout: VocabLayout


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

    @classmethod
    def build(
        cls,
        token_ids: list[int],
        token_slots: list[int],
        logit_rows: list[int],
        adapters: Mapping[int, VocabPages],
        vocab_range: tuple[int, int],
        device,
    ) -> "VocabBatch | None":
        """adapters: the resident adapters with vocabulary-side parts, by slot; vocab_range: the
        rows [start, stop) of the vocabulary this rank holds. None when no token uses one."""
        if not adapters or not any(s in adapters for s in token_slots):
            return None
        start, stop = vocab_range
        by_slot: dict[int, list[int]] = {}
        for pos, slot in enumerate(token_slots):
            if slot in adapters and start <= token_ids[pos] < stop:
                by_slot.setdefault(slot, []).append(pos)
        embed = tuple(
            _embed_tokens(adapters[slot], positions, token_ids, start, device)
            for slot, positions in by_slot.items()
            if _has(adapters[slot].layout, "embed_tokens")
        )
        heads: dict[int, list[int]] = {}
        for row, pos in enumerate(logit_rows):
            if token_slots[pos] in adapters and _has(adapters[token_slots[pos]].layout, "lm_head"):
                heads.setdefault(token_slots[pos], []).append(row)
        head = tuple(_head_rows(adapters[slot], rows, stop - start, device) for slot, rows in heads.items())
        return cls(embed, head) if embed or head else None


def _has(layout: VocabLayout, module: str) -> bool:
    return any(name.startswith(module + ".") for name in layout.parts)


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


class VocabParts:
    """Reads an adapter's parts from the layer pools `pool` [layers, units * unit]."""

    def __init__(self, pool: torch.Tensor, unit: int):
        self.pool, self.unit = pool, unit

    def view(self, pages: VocabPages, name: str) -> tuple[torch.Tensor, VocabPart]:
        part = pages.layout.parts[name]
        run = self.pool[:, pages.start * self.unit : pages.start * self.unit + pages.layout.width]
        return part.view(run), part  # [layers, per_layer, cols]

    def rows(self, pages: VocabPages, name: str, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` [n] of part `name`: [n, cols]."""
        view, part = self.view(pages, name)
        return view[index // part.per_layer, index % part.per_layer]

    def times(self, x: torch.Tensor, pages: VocabPages, name: str) -> torch.Tensor:
        """x [n, cols] times part `name` transposed: [n, rows]."""
        view, part = self.view(pages, name)
        out = torch.matmul(x, view.mT)  # [layers, n, per_layer]
        return out.permute(1, 0, 2).reshape(x.shape[0], -1)[:, : part.rows]


def add_embedding_terms(
    x: torch.Tensor, local_ids: torch.Tensor, batch: VocabBatch, parts: VocabParts
) -> None:
    """x [tokens, hidden]: the base embedding of this rank's tokens; each adapter's tokens take its
    own rows, its re-trained rows, or gain its LoRA term B A[:, token], in place. local_ids
    [tokens]: the token ids less this rank's first row."""
    for share in batch.embed:
        pages, rows = share.pages, share.rows
        names = pages.layout.parts
        if "embed_tokens.weight" in names:
            x[rows] = parts.rows(pages, "embed_tokens.weight", local_ids[rows])
        elif "embed_tokens.lora_a" in names:
            s = parts.rows(pages, "embed_tokens.lora_a", local_ids[rows])  # [n, r]
            x[rows] += parts.times(s, pages, "embed_tokens.lora_b_t")  # [n, hidden]
        if share.replaced is not None:
            x[share.replaced] = parts.rows(pages, "embed_tokens.token_rows", share.replacement)


def add_head_terms(logits: torch.Tensor, h: torch.Tensor, batch: VocabBatch, parts: VocabParts) -> None:
    """logits [rows, vocab rows of this rank] of the base head, h [rows, hidden] the vectors they
    came from: each adapter's rows take its own head's logits, its re-trained rows' logits, or
    gain its LoRA term, in place."""
    for share in batch.head:
        pages, rows = share.pages, share.rows
        names = pages.layout.parts
        hr = h[rows]  # [n, hidden]
        if "lm_head.weight" in names:
            logits[rows] = parts.times(hr, pages, "lm_head.weight")
        elif "lm_head.lora_a" in names:
            s = parts.times(hr, pages, "lm_head.lora_a")  # [n, r]
            logits[rows] += parts.times(s, pages, "lm_head.lora_b_t")  # [n, vocab rows]
        elif share.replaced is not None:  # re-trained rows, on this rank's columns
            delta = parts.rows(pages, "lm_head.token_rows", share.replacement)  # [m, hidden]
            logits[rows[:, None], share.replaced[None, :]] = hr @ delta.T  # [n, m]
