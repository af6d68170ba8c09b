"""Collectives: what the ranks of a tensor-parallel model exchange inside one forward, over a
process group of their own (gloo on the CPU, NCCL on CUDA), plus a gloo group rank 0 sends each
step's commands over. At one rank there is nothing to exchange: every call returns its input as
it is.

The groups are made from a TCPStore rank 0 serves on loopback, not from torch.distributed's
process-wide default group, so a process may hold more than one engine (tests do)."""

import datetime
import json
import time

import torch
import torch.distributed as dist

from inference_service.model.shard import Shard

IDLE_FOREVER = datetime.timedelta(days=36500)


class Collectives:
    def __init__(
        self,
        shard: Shard | None = None,
        group: dist.ProcessGroup | None = None,
        meta: dist.ProcessGroup | None = None,
        store: dist.Store | None = None,
    ):
        self.shard, self._group, self._meta = shard or Shard(), group, meta or group
        self._store = store  # the groups' rendezvous: they live as long as it
        self.seconds = 0.0  # host time spent in collectives so far

    @classmethod
    def connect(cls, shard: Shard, port: int, device: torch.device, timeout_s: float) -> "Collectives":
        """Join the group of `shard.size` ranks whose rank 0 serves a TCPStore on loopback `port`
        (rank 0 starts it). A collective of the model waits `timeout_s` for the others, then
        fails; a rank waiting for rank 0's next command waits without end."""
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, shard.size, shard.rank == 0, timeout=timeout)
        # The other ranks wait for rank 0's next command as long as the worker sits idle.
        meta = dist.ProcessGroupGloo(dist.PrefixStore("meta", store), shard.rank, shard.size, IDLE_FOREVER)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            tensors = dist.ProcessGroupNCCL(
                dist.PrefixStore("tensors", store), shard.rank, shard.size, options
            )
        else:
            tensors = dist.ProcessGroupGloo(
                dist.PrefixStore("tensors", store), shard.rank, shard.size, timeout
            )
        return cls(shard, tensors, meta, store)

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x summed, on every rank (in place)."""
        if self.size > 1:
            start = time.perf_counter()
            self._group.allreduce([x]).wait()
            self.seconds += time.perf_counter() - start
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order, on every rank."""
        if self.size == 1:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._group.allgather([parts], [x.contiguous()]).wait()
        self.seconds += time.perf_counter() - start
        return torch.cat(parts, dim)

    def agree_min(self, value: int) -> int:
        """The least of every rank's `value` (sizes the ranks must share, e.g. KV cache blocks)."""
        if self.size == 1:
            return value
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        t = torch.tensor([value], dtype=torch.int64)
        self._meta.allreduce([t], options).wait()
        return int(t.item())

    def broadcast_json(self, value=None):
        """Rank 0's `value` (plain JSON data: a command), on every rank, over the gloo group. JSON,
        not pickle: what arrives over a socket is never code."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        data = json.dumps(value).encode() if self.shard.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._meta.broadcast([size], options).wait()
        if self.shard.rank == 0:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        self._meta.broadcast([buffer], options).wait()
        return value if self.shard.rank == 0 else json.loads(buffer.numpy().tobytes())

    def close(self) -> None:
        """Leave the groups (their sockets and threads end with them)."""
        self._group = self._meta = None
        self._store = None
