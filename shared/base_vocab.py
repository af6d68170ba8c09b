"""BaseVocab: the base model's embedding and head weights, read from its checkpoint only when an
adapter's saved copy of one must be checked against them."""

from pathlib import Path

import torch
from safetensors import safe_open

from shared.checkpoint_files import checkpoint_files
from shared.model_config import ModelConfig

TENSORS = {"embed_tokens": "model.embed_tokens.weight", "lm_head": "lm_head.weight"}


class BaseVocab:
    def __init__(self, model_dir: str | Path, model: ModelConfig):
        self.model_dir, self.model = Path(model_dir), model

    def weight(self, module: str) -> torch.Tensor:
        """`module`'s weight [vocab, hidden] ("embed_tokens" or "lm_head"; a tied head is the
        embedding)."""
        if module == "lm_head" and self.model.tie_word_embeddings:
            module = "embed_tokens"
        name = TENSORS[module]
        for path in checkpoint_files(self.model_dir):
            with safe_open(path, framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                    return f.get_tensor(name)
        raise FileNotFoundError(f"model folder {self.model_dir} holds no {name}")
