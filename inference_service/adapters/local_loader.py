"""LocalAdapterLoader: adapters from PEFT folders on this machine."""

from pathlib import Path

import torch

from inference_service.adapters.host_tier import ReadyAdapter
from shared.errors import NotFound
from shared.model_config import ModelConfig
from shared.peft_checkpoint import load_peft_adapter


class LocalAdapterLoader:
    def __init__(self, model: ModelConfig, max_rank: int, dtype: torch.dtype):
        self._model, self._max_rank, self._dtype = model, max_rank, dtype
        self._folders: dict[str, Path] = {}

    def register(self, name: str, folder: str | Path) -> None:
        self._folders[name] = Path(folder)

    def unregister(self, name: str) -> None:
        self._folders.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._folders

    def load(self, name: str) -> ReadyAdapter:
        folder = self._folders.get(name)
        if folder is None:
            raise NotFound(f"adapter {name!r} is not registered")
        return self.read(name, folder)

    def read(self, name: str, folder: str | Path) -> ReadyAdapter:
        """Validate and optimize the PEFT checkpoint in `folder` as adapter `name`, without
        registering it."""
        weights = load_peft_adapter(name, folder, self._model, self._max_rank, self._dtype)
        return ReadyAdapter.of(name, weights, self._model, self._dtype)
