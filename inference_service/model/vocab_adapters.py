"""Adapters on the vocabulary side, applied per token: where tokens become vectors (the adapter's
own embedding rows, its re-trained rows, or LoRA on the embedding) and where vectors become logits
(its own head, its re-trained head rows, or LoRA on the head). The step's work is a VocabBatch
(vocab_batch.py), read by both; the parts are read in place from adapter memory (vocab_layout.py
gives the layout): by the Triton kernels vocab_rows and vocab_times, one launch per part for
every adapter of the step (on CUDA), or by torch, adapter by adapter."""

import torch

from inference_service.model.vocab_batch import VocabBatch, VocabPages
from inference_service.model.vocab_layout import VocabPart
from kernels.vocab_rows import vocab_rows_triton
from kernels.vocab_times import vocab_times_triton


class VocabParts:
    """Reads an adapter's parts from the layer pools `pool` [layers, units * unit]."""

    def __init__(self, pool: torch.Tensor):
        self.pool = pool

    def view(self, pages: VocabPages, name: str) -> tuple[torch.Tensor, VocabPart]:
        part = pages.layout.parts[name]
        run = self.pool[:, pages.base : pages.base + pages.layout.width]
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
    if batch.tables is not None:
        _embedding_kernels(x, local_ids, batch, parts.pool)
    for share in batch.embed:
        pages, rows = share.pages, share.rows
        names = pages.layout.parts
        if batch.tables is None and "embed_tokens.weight" in names:
            x[rows] = parts.rows(pages, "embed_tokens.weight", local_ids[rows])
        elif batch.tables is None and "embed_tokens.lora_a" in names:
            s = parts.rows(pages, "embed_tokens.lora_a", local_ids[rows])  # [n, r]
            x[rows] += parts.times(s, pages, "embed_tokens.lora_b_t")  # [n, hidden]
        if share.replaced is not None:
            x[share.replaced] = parts.rows(pages, "embed_tokens.token_rows", share.replacement)


def add_head_terms(logits: torch.Tensor, h: torch.Tensor, batch: VocabBatch, parts: VocabParts) -> None:
    """logits [rows, vocab rows of this rank] of the base head, h [rows, hidden] the vectors they
    came from: each adapter's rows take its own head's logits, its re-trained rows' logits, or
    gain its LoRA term, in place."""
    if batch.tables is not None:
        _head_kernels(logits, h, batch, parts.pool)
    for share in batch.head:
        pages, rows = share.pages, share.rows
        names = pages.layout.parts
        if batch.tables is None and "lm_head.weight" in names:
            logits[rows] = parts.times(h[rows], pages, "lm_head.weight")
        elif batch.tables is None and "lm_head.lora_a" in names:
            s = parts.times(h[rows], pages, "lm_head.lora_a")  # [n, r]
            logits[rows] += parts.times(s, pages, "lm_head.lora_b_t")  # [n, vocab rows]
        if share.replaced is not None:  # re-trained rows, on this rank's columns
            delta = parts.rows(pages, "lm_head.token_rows", share.replacement)  # [m, hidden]
            logits[rows[:, None], share.replaced[None, :]] = h[rows] @ delta.T  # [n, m]


def _embedding_kernels(
    x: torch.Tensor, local_ids: torch.Tensor, batch: VocabBatch, pool: torch.Tensor
) -> None:
    tables = batch.tables
    if "embed_tokens.weight" in tables:
        vocab_rows_triton(x, local_ids, pool, tables["embed_tokens.weight"])
    if "embed_tokens.lora_a" in tables:
        expand = tables["embed_tokens.lora_b_t"]
        s = x.new_zeros(x.shape[0], expand.max_cols)  # [tokens, rank]
        vocab_rows_triton(s, local_ids, pool, tables["embed_tokens.lora_a"])
        vocab_times_triton(x, s, pool, expand, accumulate=True)


def _head_kernels(logits: torch.Tensor, h: torch.Tensor, batch: VocabBatch, pool: torch.Tensor) -> None:
    tables = batch.tables
    if "lm_head.weight" in tables:
        vocab_times_triton(logits, h, pool, tables["lm_head.weight"], accumulate=False)
    if "lm_head.lora_a" in tables:
        shrink = tables["lm_head.lora_a"]
        s = h.new_zeros(h.shape[0], shrink.max_part_rows)  # [rows, rank]
        vocab_times_triton(s, h, pool, shrink, accumulate=False)
        vocab_times_triton(logits, s, pool, tables["lm_head.lora_b_t"], accumulate=True)
