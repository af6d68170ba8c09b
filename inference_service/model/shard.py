"""Shard: the part of a tensor-parallel model one rank holds (Megatron's layout).

q/k/v, gate/up (an MoE layer's experts' too, and Qwen2-MoE's shared expert's) are column-parallel:
each rank holds the output rows of its heads or its slice of the intermediate dimension. o and
down are row-parallel: each rank holds the input columns matching them, and the ranks' partial
outputs are summed (one all-reduce per layer each). The router and the shared expert's output
gate are small and replicated. Embeddings and the head are split by vocabulary rows. When the
ranks outnumber the KV heads, each rank holds the one KV head its query heads read.

A rank's model is the same decoder over `config(cfg)`, a ModelConfig of its own shapes (its
heads, its part of the intermediate dimension), so attention, the MLP and the KV cache need no
parallel variant. LoRA follows the base layer by default (vLLM's): a column layer's adapter
keeps A whole and takes B's rows of its outputs, a row layer's takes A's columns of its inputs
and keeps B whole, its partial sums riding the layer's own all-reduce. Fully sharded (S-LoRA's,
`fully_sharded`), every part of an adapter is split: a column layer's A by rank rows (each rank
holds ceil(r / N) of them and every rank's B rows for its outputs, and the ranks' shrinks are
gathered), a row layer's A by input columns and B by output rows (the ranks' shrinks are summed,
and each adds its output columns before the layer's all-reduce).
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels.nf4_linear import BLOCK as NF4_BLOCK
from shared.adapter_weights import AdapterWeights, ModuleLora, TokenRows, VocabWeights
from shared.errors import InvalidArgument
from shared.model_config import COLUMN_PARALLEL, ROW_PARALLEL, ModelConfig

COLUMN, ROW = COLUMN_PARALLEL, ROW_PARALLEL
REPLICATED = ("router", "shared_expert_gate")


@dataclass(frozen=True)
class Shard:
    rank: int = 0
    size: int = 1
    fully_sharded: bool = False  # LoRA split S-LoRA's way (module docstring)

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise InvalidArgument(f"tensor-parallel rank {self.rank} of {self.size} ranks does not exist")

    def check(self, cfg: ModelConfig) -> None:
        """Refuse a model these ranks cannot split evenly, naming the numbers."""
        n, heads, kv = self.size, cfg.num_heads, cfg.num_kv_heads
        if heads % n:
            raise InvalidArgument(
                f"tensor_parallel_size {n} does not divide the model's {heads} attention heads"
            )
        if kv % n and n % kv:
            raise InvalidArgument(
                f"tensor_parallel_size {n} neither divides the model's {kv} KV heads nor is a multiple "
                "of them (each rank holds whole KV heads, replicated when the ranks outnumber them)"
            )
        for name, size in self._split_sizes(cfg).items():
            if size % n:
                raise InvalidArgument(f"tensor_parallel_size {n} does not divide the model's {name} {size}")
        if self.fully_sharded and cfg.hidden_size % n:
            raise InvalidArgument(
                f"tensor_parallel_size {n} does not divide the model's hidden size {cfg.hidden_size}, "
                "which fully sharded adapters split"
            )
        if cfg.qk_norm == "full" and n > kv:
            raise InvalidArgument(
                f"{cfg.model_type} normalizes all of k at once: its {kv} KV heads cannot be replicated "
                f"over {n} ranks"
            )

    def check_quantized(self, cfg: ModelConfig, quantization: str) -> None:
        """Refuse an NF4 base whose parts would split a block of 64 values (NF4's blocks run over
        a weight's rows, flattened), naming the layer: every rank's part must be whole blocks."""
        if self.size == 1 or quantization != "nf4":
            return
        for target, shape in cfg.linear_shapes().items():
            for rank in range(self.size):
                part = Shard(rank, self.size)
                if target in ROW:
                    start, stop = part.in_part(cfg, target)
                    ends, width = (start, stop, shape.in_features), "columns"
                elif target in COLUMN:
                    start, stop = part.out_part(cfg, target)
                    ends, width = (start * shape.in_features, stop * shape.in_features), "rows"
                else:
                    continue
                if any(end % NF4_BLOCK for end in ends):
                    raise InvalidArgument(
                        f"an NF4 base over {self.size} tensor-parallel ranks: rank {rank}'s {width} "
                        f"{start}..{stop} of {target} ({shape.out_features} x {shape.in_features}) would "
                        f"split a block of {NF4_BLOCK} values; serve it on fewer ranks, or in int8"
                    )

    def config(self, cfg: ModelConfig) -> ModelConfig:
        """The model as this rank holds it: its heads, its part of every intermediate dimension
        (the vocabulary stays whole: VocabShard splits it)."""
        self.check(cfg)
        n = self.size
        moe = cfg.moe and replace(
            cfg.moe,
            intermediate_size=cfg.moe.intermediate_size // n,
            shared_intermediate_size=cfg.moe.shared_intermediate_size // n,
        )
        return replace(
            cfg,
            num_heads=cfg.num_heads // n,
            num_kv_heads=max(1, cfg.num_kv_heads // n),
            intermediate_size=cfg.intermediate_size // n,
            moe=moe,
            lora_ranks=n if self.fully_sharded else 1,
        )

    def adapter(self, weights: AdapterWeights, cfg: ModelConfig) -> AdapterWeights:
        """This rank's part of an adapter on the whole model `cfg`: B's rows of a column layer's
        outputs, A's columns of a row layer's inputs; the ranks are unchanged, so every rank
        holds an adapter in the same pages."""
        if self.size == 1:
            return weights
        ranks = weights.module_ranks
        modules = {
            key: self._module(lora, cfg, key[1], ranks[key[1]]) for key, lora in weights.modules.items()
        }
        return replace(weights, modules=modules, vocab=self._vocab_part(weights.vocab, cfg.vocab_size))

    def _vocab_part(self, vocab: VocabWeights, vocab_size: int) -> VocabWeights:
        """The vocabulary side on this rank's rows of the embedding and head (vocab()): their rows
        of the adapter's own matrices and of A (embedding) or B (head), zeros past the vocabulary.
        Re-trained rows stay whole, named by their ids less the rank's first row: every rank's
        part is then shaped alike, and takes the same adapter memory as rank 0's."""
        start, stop = self.vocab(vocab_size)

        def rows(t: torch.Tensor | None) -> torch.Tensor | None:  # [vocab, n] -> [stop - start, n]
            return None if t is None else F.pad(t[start:stop], (0, 0, 0, stop - min(stop, vocab_size)))

        def token_rows(tr: TokenRows | None) -> TokenRows | None:
            return tr and TokenRows(tuple(i - start for i in tr.indices), tr.rows)

        embed_lora, head_lora = vocab.embed_lora, vocab.head_lora
        return VocabWeights(
            embed_lora=embed_lora and ModuleLora(rows(embed_lora.a.T).T, embed_lora.b_t),
            head_lora=head_lora and ModuleLora(head_lora.a, rows(head_lora.b_t.T).T),
            embed=rows(vocab.embed),
            head=rows(vocab.head),
            embed_rows=token_rows(vocab.embed_rows),
            head_rows=token_rows(vocab.head_rows),
        )

    def _module(self, lora: ModuleLora, cfg: ModelConfig, target: str, rank: int) -> ModuleLora:
        """This rank's part of one module's LoRA; `rank`: the target's largest over layers."""
        if target in COLUMN:
            start, stop = self.out_part(cfg, target)
            if self.fully_sharded:
                return self._rank_rows(lora.a, lora.b_t[..., start:stop], math.ceil(rank / self.size))
            return ModuleLora(lora.a, lora.b_t[..., start:stop])
        if target in ROW:
            start, stop = self.in_part(cfg, target)
            if self.fully_sharded:
                first, last = self.even(cfg.linear_shapes()[target].out_features)
                return ModuleLora(lora.a[..., start:stop], lora.b_t[..., first:last])
            return ModuleLora(lora.a[..., start:stop], lora.b_t)
        return lora

    def _rank_rows(self, a: torch.Tensor, b_t: torch.Tensor, rows: int) -> ModuleLora:
        """A's rank rows [rank * rows, (rank + 1) * rows) (zeros past the module's rank), and B^T's
        rows of every rank, rank after rank, as the ranks' gathered shrinks come."""
        pad = (0, 0, 0, self.size * rows - a.shape[-2])
        a, b_t = F.pad(a, pad), F.pad(b_t, pad)  # [..., N * rows, in], [..., N * rows, out]
        return ModuleLora(a[..., self.rank * rows : (self.rank + 1) * rows, :], b_t)

    def out_part(self, cfg: ModelConfig, target: str) -> tuple[int, int]:
        """The output rows [start, stop) of a column-parallel target (or of a replicated one:
        all of them) this rank holds, in the full layer's numbering."""
        full = cfg.linear_shapes()[target].out_features
        if target in REPLICATED:
            return 0, full
        if target in ("k_proj", "v_proj"):
            return self._kv_rows(cfg)
        return self.even(full)

    def in_part(self, cfg: ModelConfig, target: str) -> tuple[int, int]:
        """The input columns [start, stop) of a row-parallel target this rank holds."""
        return self.even(cfg.linear_shapes()[target].in_features)

    def even(self, size: int) -> tuple[int, int]:
        """This rank's equal part of `size`."""
        part = size // self.size
        return self.rank * part, (self.rank + 1) * part

    def vocab(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows [start, stop) of the embedding and the head: ceil(V / N) each, the
        last rank's running past V (rows no token id reaches, their logits dropped)."""
        part = -(-vocab_size // self.size)
        return self.rank * part, (self.rank + 1) * part

    def _kv_rows(self, cfg: ModelConfig) -> tuple[int, int]:
        """The rows of k (or v) of this rank's KV heads: its equal share, or, when the ranks
        outnumber the KV heads, the one head its query heads read."""
        kv, hd = cfg.num_kv_heads, cfg.head_dim
        if kv >= self.size:
            return self.even(kv * hd)
        head = self.rank * kv // self.size
        return head * hd, (head + 1) * hd

    def _split_sizes(self, cfg: ModelConfig) -> dict[str, int]:
        """The intermediate dimensions the MLPs split."""
        if not cfg.moe:
            return {"intermediate_size": cfg.intermediate_size}
        sizes = {"expert intermediate size": cfg.moe.intermediate_size}
        if cfg.moe.shared_intermediate_size:
            sizes["shared expert intermediate size"] = cfg.moe.shared_intermediate_size
        return sizes
