"""ModelRunner: the model, its KV cache and its adapter slots on one device; runs one
flattened batch per call."""

import torch

from inference_service.engine.config import EngineConfig
from inference_service.model.forward_batch import ForwardBatch, SequenceInput
from inference_service.model.kv_cache import KVCache
from inference_service.model.model import LlamaModel
from inference_service.model.weights import load_weights
from shared.model_config import PACKED_MODULES, ModelConfig
from shared.peft_checkpoint import AdapterWeights


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
    def forward(self, seqs: list[SequenceInput], all_logits: bool = False) -> torch.Tensor:
        """Logits [sequences, vocab] for each sequence's last new token ([tokens, vocab] with
        all_logits), in fp32."""
        batch = ForwardBatch.build(
            seqs,
            self.config.block_size,
            self.model_config.sliding_window,
            self.device,
            all_logits,
            self._slot_ranks,
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
    def clear_blocks(self, block_table: list[int]) -> None:
        """Zero a failed sequence's KV blocks before they are handed out again."""
        self.cache.zero_blocks(block_table)

    @torch.inference_mode()
    def clear_slot(self, slot: int) -> None:
        self._slot_ranks[slot] = 0
        for linear in self._linears.values():
            linear.clear_slot(slot)
