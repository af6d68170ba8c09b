"""RankGroup: rank 0's hold on the other ranks of a tensor-parallel engine.

The engine's process is rank 0: gRPC, the scheduler, the host tier and sampling stay there. It
starts ranks 1..N-1 itself, one process each (rank_follower.py), which run only the model: each
builds its part of it (model/shard.py), then does what rank 0 sends before each of its own model
calls (a command: a forward, an adapter to place in given pages or to drop, KV blocks to zero),
their forwards exchanging with rank 0's inside every layer. No weights cross: a rank reads
an adapter's blob from the digest-named file rank 0 points it to and takes its own part.

On the CPU the ranks share its cores (torch_threads.per_rank); more ranks than cores start with a
warning (torch_threads.crowding).

Faults: a rank that cannot start fails the engine's start with that rank's error. One that dies
fails rank 0's next collective at once (the group's sockets close), one that hangs fails it at
the step timeout (the engine's watchdog); either way the engine dies and the worker exits. Ranks
never outlive rank 0: each holds a pipe from it and exits at its end of file.
"""

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from inference_service.engine.config import EngineConfig
from inference_service.model.collectives import Collectives
from inference_service.model.forward_batch import SequenceInput
from inference_service.model.shard import Shard
from inference_service.torch_threads import crowding
from shared.errors import Unavailable

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a rank building a large model on a slow disk


@dataclass(frozen=True)
class RankReport:
    """What a rank holds once started, in bytes."""

    rank: int
    weight_bytes: int
    adapter_memory_bytes: int
    kv_cache_bytes: int


class RankGroup:
    """Ranks 1..N-1 of `config`, started and joined to rank 0's groups (`parallel`)."""

    def __init__(self, config: EngineConfig):
        size, port = config.tensor_parallel_size, _free_port()
        if config.device == "cpu" and (why := crowding(size)):
            log.warning("%s", why)
        self._processes = [_spawn(config, rank, port) for rank in range(1, size)]
        self._closer = weakref.finalize(self, _end, self._processes)  # an engine never stopped
        shard = Shard(0, size, config.fully_sharded_loras)
        self.parallel = self._connect(shard, port, torch.device(config.device), config.step_timeout_s)
        self.reports: list[RankReport] = []

    def _connect(self, shard: Shard, port: int, device: torch.device, timeout_s: float) -> Collectives:
        """Rank 0's side of the groups, once every rank has joined; a rank that ends before it
        joins fails this at once (the join itself would wait out its timeout)."""
        joined: list = []
        thread = threading.Thread(target=_join, args=(joined, shard, port, device, timeout_s), daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            if any(process.poll() is not None for process in self._processes):
                raise self.start_failure(RuntimeError("a rank ended before it joined"))
        if isinstance(joined[0], Exception):
            raise self.start_failure(joined[0]) from joined[0]
        return joined[0]

    def start_failure(self, error: Exception) -> Unavailable:
        """The error to fail the engine's start with: the first rank's own, or how the first
        rank that ended ended, else `error`."""
        _end(self._processes)
        ranks = list(enumerate(self._processes, start=1))
        for rank, process in ranks:
            message = _last_message(process)
            if "error" in message:
                return Unavailable(f"tensor-parallel rank {rank} failed to start: {message['error']}")
        for rank, process in ranks:
            if process.returncode:
                return Unavailable(f"tensor-parallel rank {rank} failed to start: {_how_it_ended(process)}")
        return Unavailable(f"tensor-parallel ranks failed to start: {error}")

    def wait_ready(self) -> None:
        """Each rank's report once it has built its part of the model; the first rank's error
        if one could not."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, process in enumerate(self._processes, start=1):
            message = _read_message(process, deadline)
            if "ready" not in message:
                error = message.get("error") or _how_it_ended(process)
                _end(self._processes)
                raise Unavailable(f"tensor-parallel rank {rank} failed to start: {error}")
            self.reports.append(RankReport(rank, **message["ready"]))

    def forward(self, seqs: list[SequenceInput], all_logits: bool, kernels: bool | None) -> None:
        rows = [[s.token_ids, s.cached, s.block_table, s.slot] for s in seqs]
        self._send({"op": "forward", "seqs": rows, "all_logits": all_logits, "kernels": kernels})

    def load(self, slot: int, name: str, digest: str, blob: Path, pages: tuple[tuple[int, ...], ...]) -> None:
        self._send(
            {"op": "load", "slot": slot, "name": name, "digest": digest, "blob": str(blob), "pages": pages}
        )

    def clear(self, slot: int) -> None:
        self._send({"op": "clear", "slot": slot})

    def zero_blocks(self, blocks: list[int]) -> None:
        self._send({"op": "zero", "blocks": blocks})

    def stop(self) -> None:
        """Every rank ends: its pipe from rank 0 closed (it exits at the end of file), then waited
        for, and killed if it does not end in time (a hung rank reads no pipe)."""
        self._closer()
        self.parallel.close()

    def kill(self) -> None:
        """End every rank at once (the engine died: a rank stuck in a collective would wait on)."""
        for process in self._processes:
            process.kill()
        self._closer()

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [process.pid for process in self._processes]

    def _send(self, command: dict) -> None:
        self.parallel.broadcast_json(command)


def _join(joined: list, shard: Shard, port: int, device: torch.device, timeout_s: float) -> None:
    try:
        joined.append(Collectives.connect(shard, port, device, timeout_s))
    except Exception as e:
        joined.append(e)


def _spawn(config: EngineConfig, rank: int, port: int) -> subprocess.Popen:
    """Rank `rank` as a process of its own: its stdin a pipe it exits at the end of, its stdout
    the lines it reports on (JSON), its stderr this process's."""
    args = ["--rank", str(rank), "--port", str(port), "--config", json.dumps(asdict(config))]
    return subprocess.Popen(
        [sys.executable, "-m", "inference_service.engine.rank_follower", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _read_message(process: subprocess.Popen, deadline: float) -> dict:
    """The next line the rank reports, as JSON; {} once it exited or the deadline passed."""
    while time.monotonic() < deadline:
        readable, _, _ = select.select([process.stdout], [], [], min(1.0, deadline - time.monotonic()))
        if readable:
            line = process.stdout.readline()
            return json.loads(line) if line.strip() else {}
        if process.poll() is not None:
            return {}
    return {"error": f"not ready after {START_TIMEOUT_S:g} s"}


def _how_it_ended(process: subprocess.Popen) -> str:
    code = process.poll()
    if code is not None and code < 0:
        return f"it was killed by {signal.Signals(-code).name} before it was ready (out of memory?)"
    return f"it exited with code {code} before it was ready"


def _last_message(process: subprocess.Popen) -> dict:
    """The last line an ended rank reported ({} if none)."""
    lines = [line for line in process.stdout.read().splitlines() if line.strip()] if process.stdout else []
    return json.loads(lines[-1]) if lines else {}


def _end(processes: list[subprocess.Popen]) -> None:
    """Close every rank's pipe (it exits at its end), then wait, then kill what is left."""
    for process in processes:
        if process.stdin and not process.stdin.closed:
            process.stdin.close()
    for process in processes:
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
