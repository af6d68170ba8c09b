"""VocabLayout: where an adapter's vocabulary-side parts lie in adapter memory.

Adapter memory is one pool per layer, the same unit offsets in every layer (kernels/lora_batch.py).
The vocabulary side belongs to no layer, so an adapter's parts take one run of units and spread
over the layers: in each layer the run holds `width` elements, and each part (a matrix of `rows`
x `cols`) keeps `per_layer` = ceil(rows / layers) of its rows there, at `offset`. Row i of a part
lies in layer i // per_layer, row i % per_layer of that layer's block: a part reads as a view
[layers, per_layer, cols] of the pool, with no copy, so a token's row is one gather and a product
with all rows one batched matmul over the layers.

Parts are held in the orientation their use reads by rows:
    embed_tokens.lora_a    [vocab, r]      A^T: a token's rank values are its row
    embed_tokens.lora_b_t  [hidden, r]     B (scaled): delta = s @ B^T
    lm_head.lora_a         [r, hidden]     A: s = h @ A^T
    lm_head.lora_b_t       [vocab, r]      B (scaled): logits += s @ B^T
    embed_tokens.weight, lm_head.weight [vocab, hidden]; *.token_rows [k, hidden]
"""

from dataclasses import dataclass
from functools import cached_property

import torch

from shared.adapter_weights import VocabWeights

TRANSPOSED = ("embed_tokens.lora_a", "embed_tokens.lora_b_t", "lm_head.lora_b_t")
ALIGN = 64  # elements: each part starts on a 256-byte boundary in fp32


@dataclass(frozen=True)
class VocabPart:
    offset: int  # elements into each layer's share of the run
    rows: int
    cols: int
    per_layer: int  # rows each layer holds (the last layers' may be padding)

    def view(self, run: torch.Tensor) -> torch.Tensor:
        """This part of `run` [layers, width] as [layers, per_layer, cols] (a view)."""
        block = run[:, self.offset : self.offset + self.per_layer * self.cols]
        return block.unflatten(1, (self.per_layer, self.cols))


@dataclass(frozen=True)
class VocabLayout:
    parts: dict[str, VocabPart]  # by the blob's tensor name (vocab_blob.py)
    width: int  # elements of the run in each layer
    embed_rows: tuple[int, ...]  # token ids whose embedding rows the adapter replaces
    head_rows: tuple[int, ...]  # token ids whose head rows (logits) it replaces

    @cached_property
    def modules(self) -> frozenset[str]:
        """The sides it has parts on: "embed_tokens", "lm_head" (asked of every token a step)."""
        return frozenset(name.split(".")[0] for name in self.parts)

    @classmethod
    def of(cls, vocab: VocabWeights, layers: int) -> "VocabLayout | None":
        """The layout of `vocab`'s parts over `layers` layers; None when it has none."""
        parts, offset = {}, 0
        for name, tensor in vocab.tensors.items():
            rows, cols = tensor.shape[::-1] if name in TRANSPOSED else tensor.shape
            per_layer = -(-rows // layers)
            parts[name] = VocabPart(offset, rows, cols, per_layer)
            offset += -(-per_layer * cols // ALIGN) * ALIGN
        if not parts:
            return None
        rows = vocab.token_indices
        return cls(parts, offset, tuple(rows.get("embed_tokens", ())), tuple(rows.get("lm_head", ())))

    def sizes(self, dtype: torch.dtype) -> str:
        """Each part's shape and bytes, for messages."""
        return "; ".join(
            f"{name} [{part.rows}, {part.cols}] {part.rows * part.cols * dtype.itemsize:,} bytes"
            for name, part in self.parts.items()
        )

    def units(self, unit: int) -> int:
        """Units of adapter memory the run takes (`unit` elements per layer each)."""
        return -(-self.width // unit)

    def image(self, vocab: VocabWeights, layers: int, unit: int, dtype: torch.dtype) -> torch.Tensor:
        """The run's content as pages of one unit each, [units, layers, unit] in `dtype`: the
        image adapter memory copies in unit by unit (padding zero)."""
        run = torch.zeros(layers, self.units(unit) * unit, dtype=dtype)  # [layers, units * unit]
        for name, tensor in vocab.tensors.items():
            part = self.parts[name]
            rows = tensor.T if name in TRANSPOSED else tensor  # [rows, cols]
            padded = torch.zeros(layers * part.per_layer, part.cols, dtype=dtype)
            padded[: part.rows] = rows
            part.view(run).copy_(padded.view(layers, part.per_layer, part.cols))
        return run.unflatten(1, (-1, unit)).transpose(0, 1).contiguous()  # [units, layers, unit]
