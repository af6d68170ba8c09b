"""ModelRunner: the model, its KV cache and its adapter slots on one device; runs one
flattened batch per call and samples from it."""

from dataclasses import dataclass

import torch

from inference_service.engine.config import EngineConfig
from inference_service.engine.sampler import SampleResult, SamplingBatch, sample
from inference_service.engine.scheduler import ScheduledChunk
from inference_service.engine.sequence import Sequence
from inference_service.model.forward_batch import ForwardBatch, SequenceInput
from inference_service.model.kv_cache import KVCache
from inference_service.model.model import LlamaModel
from inference_service.model.weights import load_weights
from shared.model_config import PACKED_MODULES, ModelConfig
from shared.peft_checkpoint import AdapterWeights


@dataclass(frozen=True)
class StepOutput:
    computed: list[ScheduledChunk]  # the chunks whose K/V are now in the cache
    sampled: list[Sequence]  # the sequences that drew a token, in `result` order
    result: SampleResult
    non_finite: list[Sequence]  # logits held NaN or Inf: nothing drawn, KV blocks zeroed


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.device = torch.device(config.device)
        self.model = LlamaModel(
            self.model_config, config.max_loras, config.max_lora_rank, config.torch_dtype, self.device
        )
        load_weights(self.model, config.model)
        self.cache = KVCache(
            self.model_config.num_layers,
            -(-config.kv_cache_tokens // config.block_size),
            config.block_size,
            self.model_config.num_kv_heads,
            self.model_config.head_dim,
            config.torch_dtype,
            self.device,
        )
        self._linears = self.model.lora_linears()
        self._slot_ranks = [0] * config.max_loras  # rank of the adapter in each slot

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> StepOutput:
        """Forward one step's chunks, then draw a token for each chunk that reaches its prompt's
        end. A row whose logits hold NaN or Inf (weights that overflow in the serving dtype)
        draws nothing, and its sequence's KV blocks are zeroed before anyone else gets them:
        attention multiplies masked positions by 0, and 0 x NaN is NaN."""
        logits = self.forward([_input(c) for c in chunks])  # [chunks, vocab]
        finite = torch.isfinite(logits).all(dim=-1).tolist()  # [chunks]
        non_finite = [c.seq for c, ok in zip(chunks, finite, strict=True) if not ok]
        for seq in non_finite:
            self.cache.zero_blocks(seq.block_table)
        rows = [i for i, c in enumerate(chunks) if finite[i] and c.samples]
        sampled = [chunks[i].seq for i in rows]
        result = _sample(sampled, logits[rows]) if rows else SampleResult([], [])
        computed = [c for c, ok in zip(chunks, finite, strict=True) if ok]
        return StepOutput(computed, sampled, result, non_finite)

    @torch.inference_mode()
    def forward(
        self, seqs: list[SequenceInput], all_logits: bool = False, kernels: bool | None = None
    ) -> torch.Tensor:
        """Logits [sequences, vocab] for each sequence's last new token ([tokens, vocab] with
        all_logits), in fp32. kernels: the Triton kernels' path (default: on CUDA; on the CPU it
        runs in Triton's interpreter, for tests)."""
        batch = ForwardBatch.build(
            seqs,
            self.config.block_size,
            self.model_config.sliding_window,
            self.device,
            all_logits,
            self._slot_ranks,
            kernels,
        )
        return self.model(batch, self.cache)

    @torch.inference_mode()
    def load_slot(self, slot: int, adapter: AdapterWeights) -> None:
        """Copy an adapter into device slot `slot`; modules it does not target stay zero."""
        self.clear_slot(slot)
        self._slot_ranks[slot] = adapter.rank
        for (layer, module), weights in adapter.modules.items():
            packed, slice_index = PACKED_MODULES[module]
            self._linears[(layer, packed)].set_slice(slot, slice_index, weights.a, weights.b_t)

    @torch.inference_mode()
    def clear_slot(self, slot: int) -> None:
        self._slot_ranks[slot] = 0
        for linear in self._linears.values():
            linear.clear_slot(slot)


def _input(chunk: ScheduledChunk) -> SequenceInput:
    seq = chunk.seq
    tokens = seq.token_ids[seq.num_computed : seq.num_computed + chunk.num_tokens]
    return SequenceInput(tokens, seq.num_computed, seq.block_table, seq.slot)


def _sample(seqs: list[Sequence], logits: torch.Tensor) -> SampleResult:
    """One token per sequence from its row of `logits` [seqs, vocab]."""
    # Only penalized rows read their history; building it costs O(length) per row.
    histories = [s.token_ids if s.params.repetition_penalty != 1 else [] for s in seqs]
    batch = SamplingBatch.build(
        [s.params for s in seqs], [s.generator for s in seqs], histories, logits.device
    )
    return sample(logits, batch)
