"""EngineConfig: the one configuration of an inference worker process."""

from dataclasses import dataclass

import torch

from inference_service.model.base_weight import QUANTIZATIONS
from shared.dtypes import DTYPES
from shared.errors import InvalidArgument


@dataclass(frozen=True)
class EngineConfig:
    model: str  # HF model folder
    device: str = "cpu"
    dtype: str = "float32"
    # Base weights of the linear layers: "none" (dense in dtype), "int8" (weight-only, a scale per
    # row) or "nf4" (QLoRA's 4-bit NormalFloat), quantized as the checkpoint loads.
    quantization: str = "none"
    max_loras: int = 4  # the default adapter memory holds this many adapters of max_lora_rank on every module
    max_lora_rank: int = 16
    adapter_memory: int = 0  # bytes of device memory for adapter pages (0: as max_loras says)
    max_cpu_loras: int = 8  # ready adapters kept in host memory (pinned ones come on top; 0: until admitted)
    max_num_seqs: int = 32  # running sequences
    max_num_batched_tokens: int = 512  # tokens in one step: decode tokens plus prefill chunks
    max_model_len: int = 4096  # prompt + generated tokens of one sequence (the model's limit caps it)
    kv_cache_tokens: int = 0  # capacity of the paged KV cache in token positions; 0: sized from memory
    kv_cache_memory: int = 1 << 30  # on a CPU, the KV cache's bytes when kv_cache_tokens is 0
    gpu_memory_utilization: float = 0.9  # on CUDA, the share of the GPU weights, activations and cache take
    block_size: int = 16  # token positions per KV cache block
    prefix_caching: bool = True  # full KV blocks are reused by later requests with the same prefix
    step_timeout_s: float = 60.0  # a step running longer is a hung engine: every request fails
    # A request waits this long at most for its output constraint to compile (engine/grammars.py)
    grammar_compile_timeout_s: float = 10.0
    # A chat reply's constraint holds the whole reply, a thinking model's reasoning block included
    # (vLLM's enable_in_reasoning); False: it holds what follows the block, the block's text free.
    constrain_reasoning: bool = False
    cuda_graphs: bool = True  # on a GPU, decode steps replay CUDA graphs; False runs every step eagerly
    # Ranks the model is split over (model/shard.py): this process is rank 0, it starts the others
    # (one process each; on CUDA rank r runs on cuda:r).
    tensor_parallel_size: int = 1
    # Adapters split S-LoRA's way over the ranks (model/shard.py): each holds about 1/N of every
    # adapter, for an exchange of each layer's shrink; False: vLLM's default, a layer's LoRA split
    # as its base weight is, with no exchange of its own.
    fully_sharded_loras: bool = False

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise InvalidArgument(
                f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
            )
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgument(f"device {self.device!r} is neither 'cpu' nor 'cuda[:N]'")
        if self.tensor_parallel_size > 1 and self.device not in ("cpu", "cuda"):
            raise InvalidArgument(
                f"device {self.device!r}: tensor-parallel ranks run on cuda:0, cuda:1, ...; say 'cuda'"
            )
        positive = (
            "tensor_parallel_size",
            "max_lora_rank",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "kv_cache_memory",
            "block_size",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise InvalidArgument(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("step_timeout_s", "grammar_compile_timeout_s"):
            if not getattr(self, name) > 0:
                got = getattr(self, name)
                raise InvalidArgument(f"{name} must be a positive number of seconds, got {got}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidArgument(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        for name in ("max_loras", "max_cpu_loras", "adapter_memory", "kv_cache_tokens"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name} must not be negative, got {getattr(self, name)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
