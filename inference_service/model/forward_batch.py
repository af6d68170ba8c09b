"""The flattened token batch of one step, with all per-step metadata built once."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from inference_service.model.attention import AttentionMetadata, SequenceChunk
from inference_service.model.vocab_batch import VocabBatch, VocabPages
from kernels.cpu_kernels import CpuKernels
from kernels.cpu_rms_norm import CpuRmsNorm
from kernels.cpu_rope import CpuRope
from kernels.cpu_swiglu import CpuSwiglu
from kernels.lora_batch import AdapterPages, LoraBatch


@dataclass(frozen=True)
class SequenceInput:
    """One sequence's part of a step: its new tokens, how many it already has in the KV cache,
    the cache blocks that hold (and will hold) its positions, and the resident adapter its
    tokens use (a handle of the adapter memory; -1 = base model)."""

    token_ids: list[int]
    cached: int
    block_table: list[int]
    slot: int = -1


@dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    attention: AttentionMetadata
    lora: LoraBatch | None  # None when no token uses an adapter
    logit_rows: torch.Tensor  # [rows] which hidden rows get logits (last token per sequence, or all)
    kernels: bool = True  # the Triton kernels' path (attention, LoRA, experts)
    vocab: VocabBatch | None = None  # None when no token's adapter has vocabulary-side parts
    rope: CpuRope | None = None  # the compiled CPU kernel for rotary embeddings (None: torch's ops)
    norm: CpuRmsNorm | None = None  # and for the hidden states' RMSNorm
    swiglu: CpuSwiglu | None = None  # and for the MLP's silu(gate) * up

    @classmethod
    def build(
        cls,
        seqs: list[SequenceInput],
        block_size: int,
        sliding_window: int | None,
        device: torch.device | str,
        all_logits: bool = False,
        adapters: Mapping[int, AdapterPages] | None = None,
        kernels: bool | None = None,
        vocab_adapters: Mapping[int, VocabPages] | None = None,
        vocab_range: tuple[int, int] = (0, 1 << 62),
        cpu: CpuKernels | None = None,
    ) -> "ForwardBatch":
        """adapters[s]: where the adapter of handle s lies in adapter memory (every handle the
        sequences use); vocab_adapters[s]: its vocabulary-side parts, if it has any, of the rows
        [start, stop) `vocab_range` of the vocabulary this rank holds. kernels: attention and
        LoRA take the Triton kernels' path (default: on CUDA); off it, the compiled `cpu` kernels
        (those given) decode and run LoRA."""
        if kernels is None:
            kernels = torch.device(device).type == "cuda"
        chunks, token_ids, slots, start = [], [], [], 0
        for s in seqs:
            chunks.append(SequenceChunk(s.block_table, s.cached, len(s.token_ids), start))
            token_ids += s.token_ids
            slots += [s.slot] * len(s.token_ids)
            start += len(s.token_ids)
        cpu = cpu or CpuKernels()
        attention = AttentionMetadata.build(
            chunks, block_size, sliding_window, device, kernels, cpu.decode_attention, cpu.prefill_attention
        )
        last_rows = [c.token_start + c.num_tokens - 1 for c in chunks]
        rows = list(range(start)) if all_logits else last_rows
        lora = None
        if any(slot >= 0 for slot in slots):
            lora = LoraBatch.build(slots, adapters, device, kernels, cpu.lora)
        return cls(
            token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=attention.positions,
            attention=attention,
            lora=lora,
            logit_rows=torch.arange(start, device=device)
            if all_logits
            else torch.tensor(last_rows, dtype=torch.int64, device=device),
            kernels=kernels,
            vocab=VocabBatch.build(
                token_ids, slots, rows, vocab_adapters or {}, vocab_range, device, kernels
            ),
            rope=None if kernels else cpu.rope,
            norm=None if kernels else cpu.rms_norm,
            swiglu=None if kernels else cpu.swiglu,
        )
