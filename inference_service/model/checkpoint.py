"""Checkpoint: every tensor of an HF checkpoint's safetensors files (one, or the shards an index
names), read lazily, a rank's part of one alone; and where each loads in a model: a Target, a
tensor or rows of a fused linear layer's base weight (Rows), all of it or a Part."""

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from shared.errors import InvalidArgument


class Checkpoint:
    """Every tensor of a checkpoint's files, by name, read lazily."""

    def __init__(self, files: list[Path], stack: ExitStack):
        self.file_of: dict[str, Path] = {}
        self._handles = {}
        for path in files:
            handle = stack.enter_context(safe_open(path, framework="pt"))
            for name in handle.keys():  # noqa: SIM118 (a safe_open handle is no dict)
                self.file_of[name] = path
                self._handles[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._handles

    def get(self, name: str, part: "Part | None" = None) -> torch.Tensor:
        """The tensor, or only the part of it this rank loads (read alone from the file)."""
        if name not in self._handles:
            raise InvalidArgument(f"checkpoint lacks tensor {name}")
        if part is None:
            return self._handles[name].get_tensor(name)
        whole = self._handles[name].get_slice(name)
        return whole[(slice(None),) * part.dim + (slice(part.start, part.stop),)]


@dataclass(frozen=True)
class Rows:
    """Rows offset .. offset + shape[0] of a fused linear layer's base weight, in its format."""

    base: nn.Module
    offset: int
    shape: tuple[int, int]

    def copy_(self, src: torch.Tensor) -> None:
        self.base.load_rows(self.offset, src)


@dataclass(frozen=True)
class Part:
    """The part of a checkpoint tensor one rank loads: indices [start, stop) of the `size` along
    `dim`."""

    dim: int
    start: int
    stop: int
    size: int


@dataclass(frozen=True)
class Target:
    """Where a checkpoint tensor loads: all of it (part None) or its `part`; dst None: nothing of
    it on this rank."""

    dst: torch.Tensor | Rows | None
    part: Part | None = None
