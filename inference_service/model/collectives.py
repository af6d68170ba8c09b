"""Collectives: what the ranks of a tensor-parallel model exchange inside one forward, over a
torch.distributed group (gloo on the CPU, NCCL on CUDA). At one rank there is nothing to
exchange: every call returns its input as it is."""

import time

import torch
import torch.distributed as dist

from inference_service.model.shard import Shard


class Collectives:
    def __init__(self, shard: Shard | None = None, group: dist.ProcessGroup | None = None):
        self.shard, self._group = shard or Shard(), group
        self.seconds = 0.0  # host time spent in collectives so far

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x summed, on every rank (in place)."""
        if self.size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, group=self._group)
            self.seconds += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order, on every rank."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self._group)
        self.seconds += time.perf_counter() - start
        return torch.cat(parts, dim)

    def agree_min(self, value: int) -> int:
        """The least of every rank's `value` (sizes the ranks must share, e.g. KV cache blocks)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self._group)
        return int(t.item())
