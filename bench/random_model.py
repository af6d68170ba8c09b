"""A random-weight Llama folder (config.json + model.safetensors), for scaling curves on a model
larger than the default one; written by transformers, so the layout is the one real checkpoints
have. Deterministic, so it is written once per cache and reused."""

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


def larger_llama(models_dir: Path) -> Path:
    """LARGER_LLAMA in `models_dir`, written first if absent."""
    name = f"random-llama-h{LARGER_LLAMA['hidden_size']}-l{LARGER_LLAMA['num_hidden_layers']}"
    target = models_dir / name
    if (target / "model.safetensors").is_file():
        return target
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=models_dir))
    try:
        write_random_llama(staging, **LARGER_LLAMA)
        staging.rename(target)  # readers see the whole folder or none of it
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_random_llama(
    folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu", **shape
) -> Path:
    """A Llama of `shape` (LlamaConfig fields) with transformers' own random initialization, built
    in `dtype` on `device`: a GPU draws an 8B model's weights in seconds, the CPU in minutes."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # the `test` extra, which bench builds on

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**shape), dtype=dtype)
    model.save_pretrained(folder)  # one model.safetensors up to 50 GB
    return folder


def parameters(model_dir: Path) -> int:
    """The parameter count of a safetensors model folder, from its header alone."""
    from safetensors import safe_open

    with safe_open(model_dir / "model.safetensors", "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 - not iterable
