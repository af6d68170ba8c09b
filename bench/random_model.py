"""Random-weight model folders (config.json + model.safetensors): a Llama larger than the default
model for scaling curves, a small mixture-of-experts model for bench.moe; written by transformers,
so the layout is the one real checkpoints have. Deterministic, so each is written once per cache
and reused."""

import math
import shutil
import tempfile
from pathlib import Path

import torch

# A Llama about twice the default model's size, wider (hidden 1536 against 576) and shallower.
LARGER_LLAMA = dict(
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=8,
    num_attention_heads=24,
    num_key_value_heads=8,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=2048,
    rope_theta=100000.0,
)


# Granite-3.0-1B-A400M's layer shape (hidden 1024, 32 experts of 512, top-8) as a Qwen3-MoE, with
# 8 of its 24 layers: a small MoE whose decode steps run in a second on 2 cores.
SMALL_MOE = dict(
    hidden_size=1024,
    intermediate_size=4096,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=49155,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)


def larger_llama(models_dir: Path) -> Path:
    """LARGER_LLAMA in `models_dir`, written first if absent."""
    name = f"random-llama-h{LARGER_LLAMA['hidden_size']}-l{LARGER_LLAMA['num_hidden_layers']}"
    return _cached(models_dir / name, lambda folder: write_random_llama(folder, **LARGER_LLAMA))


def small_moe(models_dir: Path) -> Path:
    """SMALL_MOE in `models_dir`, written first if absent."""
    shape = SMALL_MOE
    name = f"random-qwen3moe-h{shape['hidden_size']}-e{shape['num_experts']}-l{shape['num_hidden_layers']}"
    return _cached(models_dir / name, lambda folder: write_random_model(folder, "qwen3_moe", **SMALL_MOE))


def _cached(target: Path, write) -> Path:
    if (target / "model.safetensors").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(staging)
        staging.rename(target)  # readers see the whole folder or none of it
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_random_llama(
    folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **shape
) -> Path:
    """A Llama of `shape` (LlamaConfig fields) with transformers' own random initialization, built
    in `dtype` on `device`: a GPU draws an 8B model's weights in seconds, the CPU in minutes."""
    return write_random_model(folder, "llama", seed, dtype, device, **shape)


def write_random_model(
    folder: Path,
    model_type: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **shape,
) -> Path:
    """A `model_type` model of `shape` (its config's fields) with transformers' own random
    initialization, built in `dtype` on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM  # the `test` extra, which bench builds on

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape), dtype=dtype)
    model.save_pretrained(folder)  # one model.safetensors up to 50 GB
    return folder


def parameters(model_dir: Path) -> int:
    """The parameter count of a safetensors model folder, from its header alone."""
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 - not iterable
