"""An adapter's weights as they are served: per (layer, module) LoRA in the kernels' layout
(scaling merged into B), and the parts on the vocabulary side: LoRA on the embedding and on the
head, the adapter's own embedding or head (PEFT's modules_to_save), and re-trained token rows
(PEFT's trainable tokens)."""

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class ModuleLora:
    """One module's LoRA in the kernels' layout: y += b_t^T (a x); an MoE layer's experts hold
    one per expert, stacked (an expert's tokens use its own). On the embedding x is a token's
    one-hot vector over the vocabulary: a [rank, vocab], and a token reads its column."""

    a: torch.Tensor  # [rank, in], or [experts, rank, in]
    b_t: torch.Tensor  # [rank, out] (or [experts, rank, out]): PEFT's lora_B transposed, scaling merged

    @property
    def rank(self) -> int:
        return self.a.shape[-2]


@dataclass(frozen=True)
class TokenRows:
    """Rows of the embedding (or head) an adapter replaces: row `indices[i]` becomes `rows[i]`."""

    indices: tuple[int, ...]  # distinct token ids
    rows: torch.Tensor  # [len(indices), hidden]


@dataclass(frozen=True)
class VocabWeights:
    """An adapter's parts where tokens become vectors (embed_*) and vectors become logits
    (head_*): at most one kind on each side."""

    embed_lora: ModuleLora | None = None  # a [rank, vocab], b_t [rank, hidden]
    head_lora: ModuleLora | None = None  # a [rank, hidden], b_t [rank, vocab]
    embed: torch.Tensor | None = None  # [vocab, hidden]: the adapter's own embedding
    head: torch.Tensor | None = None  # [vocab, hidden]: the adapter's own head
    embed_rows: TokenRows | None = None
    head_rows: TokenRows | None = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, by its name in the adapter blob."""
        named = {}
        for module, lora in (("embed_tokens", self.embed_lora), ("lm_head", self.head_lora)):
            if lora is not None:
                named[f"{module}.lora_a"], named[f"{module}.lora_b_t"] = lora.a, lora.b_t
        for module, weight in (("embed_tokens", self.embed), ("lm_head", self.head)):
            if weight is not None:
                named[f"{module}.weight"] = weight
        for module, rows in (("embed_tokens", self.embed_rows), ("lm_head", self.head_rows)):
            if rows is not None:
                named[f"{module}.token_rows"] = rows.rows
        return named

    @property
    def token_indices(self) -> dict[str, list[int]]:
        """The re-trained rows' token ids, by module: the blob keeps them in its metadata."""
        sides = (("embed_tokens", self.embed_rows), ("lm_head", self.head_rows))
        return {module: list(rows.indices) for module, rows in sides if rows is not None}

    @property
    def lora_targets(self) -> tuple[str, ...]:
        """The vocabulary-side modules LoRA targets."""
        sides = (("embed_tokens", self.embed_lora), ("lm_head", self.head_lora))
        return tuple(module for module, lora in sides if lora is not None)

    def __bool__(self) -> bool:
        return bool(self.tensors)


@dataclass(frozen=True)
class AdapterWeights:
    rank: int  # the largest module rank, vocabulary-side LoRA included
    alpha: float
    # modules with LoRA weights, e.g. ("q_proj", "v_proj"), "embed_tokens" and "lm_head" included
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], ModuleLora]  # (layer, PEFT module name) -> weights
    vocab: VocabWeights = field(default_factory=VocabWeights)

    @cached_property
    def module_ranks(self) -> dict[str, int]:
        """PEFT module name -> the largest rank of its weights over layers."""
        ranks: dict[str, int] = {}
        for (_, module), m in self.modules.items():
            ranks[module] = max(ranks.get(module, 0), m.rank)
        return ranks
