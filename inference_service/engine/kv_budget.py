"""How many KV cache blocks a worker gets: what --kv-cache-tokens says, or else what memory allows
(a byte budget on the CPU, a fraction of the GPU after a profiled step on CUDA)."""

import torch

from inference_service.engine.config import EngineConfig
from shared.errors import InvalidArgument
from shared.model_config import ModelConfig


def bytes_per_block(model: ModelConfig, config: EngineConfig) -> int:
    """K and V of every layer for block_size positions."""
    itemsize = config.torch_dtype.itemsize
    return 2 * model.num_layers * config.block_size * model.num_kv_heads * model.head_dim * itemsize


def cpu_blocks(model: ModelConfig, config: EngineConfig, max_model_len: int) -> int:
    """config.kv_cache_memory bytes of blocks, but no more than max_num_seqs sequences of
    max_model_len fill: on a CPU the cache is zeroed at start, and a tiny model would otherwise
    zero gigabytes it can never use."""
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    return min(config.kv_cache_memory // bytes_per_block(model, config), useful)


def cuda_blocks(total: int, free: int, reserved: int, peak: int, utilization: float, per_block: int) -> int:
    """Blocks in `utilization` of the GPU's `total` bytes, less what other processes and the CUDA
    context hold (total - free - reserved, reserved being torch's) and this process's peak during
    a profiled step at max_num_batched_tokens (the weights, adapter memory and activations)."""
    others = total - free - reserved
    return max(0, int(utilization * total) - others - peak) // per_block


def check_fits(num_blocks: int, config: EngineConfig, max_model_len: int, sized_by: str) -> None:
    """Refuse to start with a cache one max_model_len request cannot fill: it would wait forever."""
    need = -(-max_model_len // config.block_size)
    if num_blocks < need:
        raise InvalidArgument(
            f"the KV cache holds {num_blocks * config.block_size} token positions ({sized_by}), fewer "
            f"than one request of max_model_len {max_model_len} needs ({need * config.block_size}): "
            f"give the cache more memory or lower max_model_len"
        )


def sized_by(config: EngineConfig, device: torch.device) -> str:
    """The setting that sized the cache, as an error message names it."""
    if config.kv_cache_tokens:
        return f"--kv-cache-tokens {config.kv_cache_tokens}"
    if device.type == "cuda":
        return f"--gpu-memory-utilization {config.gpu_memory_utilization:g}"
    return f"--kv-cache-memory {config.kv_cache_memory}"
